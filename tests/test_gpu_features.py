"""Every kernel family's kernels on a CUDA GPU, through the cross-family feature harness.

The feature matrix of tests/test_features.py (every feature alone and combined, odd lengths, Nq != Nk,
fully masked rows) plus longer sequences at the families' default tiles (many K/V blocks per CTA, the
pipelines' steady state, interior and boundary tiles, the head dims of the Hopper backward's split tile),
each family at the device's own arch (the Hopper family at sm_90a on a capability-9.0 device): the
kernels NVRTC compiled for the device, judged against the float64 reference computed on the CPU with
flash-attn's criterion (tests/feature_harness.py). A case whose features a family does not implement is
skipped for it with the family's reason. Marked ``gpu``; skipped without CUDA.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from pydantic import ValidationError

from fagen import KernelSpec
from fagen.families import FamilySpec, family_names, get_family
from feature_harness import CASES, FeatCase, check_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]

#: Longer sequences at the default tiles: several K/V blocks per CTA and several Q blocks per sequence.
LONG = [
    FeatCase("long-causal-d128-fp16", batch=2, heads=4, heads_kv=4, seqlen_q=700, seqlen_k=900, head_dim=128,
             causal=True),
    FeatCase("long-plain-d64-bf16", "bfloat16", batch=2, heads=4, heads_kv=2, seqlen_q=513, seqlen_k=1031, head_dim=64),
    FeatCase("long-d96-dropout-alibi-fp16", batch=1, heads=4, heads_kv=4, seqlen_q=333, seqlen_k=517, head_dim=96,
             dropout_p=0.2, alibi="h"),
    FeatCase("long-varlen-window-softcap-bf16", "bfloat16", heads=4, heads_kv=2, causal=True, window=(128, -1),
             softcap=4.0, q_scale=2.0, head_dim=64, lens=((300, 500), (1, 1), (640, 200), (0, 70), (513, 513))),
    FeatCase("long-varlen-det-dropout-d128-fp16", heads=4, heads_kv=1, head_dim=128, dropout_p=0.15,
             deterministic=True, lens=((250, 260), (129, 700), (64, 64))),
    FeatCase("long-bias-mask-d64-bf16", "bfloat16", batch=2, heads=4, heads_kv=2, seqlen_q=300, seqlen_k=450,
             head_dim=64, bias=(1, 4, 300, 450), mask=(2, 1, 300, 450)),
    FeatCase("long-bias-d128-causal-fp16", batch=1, heads=2, heads_kv=2, seqlen_q=257, seqlen_k=384, head_dim=128,
             causal=True, bias=(1, 2, 257, 384)),
    FeatCase("long-det-causal-d192-fp16", batch=1, heads=4, heads_kv=2, seqlen_q=260, seqlen_k=390, head_dim=192,
             causal=True, deterministic=True),
    FeatCase("long-d256-softcap-bf16", "bfloat16", batch=1, heads=2, heads_kv=2, seqlen_q=200, seqlen_k=330,
             head_dim=256, softcap=5.0, q_scale=2.0),
    FeatCase("long-gqa-det-window-d64-fp16", batch=2, heads=8, heads_kv=2, seqlen_q=400, seqlen_k=400, head_dim=64,
             causal=True, window=(100, 0), deterministic=True),
]


def device_arch_for(impl: str) -> str:
    """The arch family ``impl`` compiles for on the current device: the device's own, or its
    architecture-specific variant (sm_90 -> sm_90a) when only that one is taken; skips when neither."""
    from fagen.runtime.gpu import device_arch
    from fagen.spec import ARCH_SMEM_OPTIN

    base = device_arch(torch.cuda.current_device())
    reasons = []
    for arch in (base, base + "a"):
        if arch not in ARCH_SMEM_OPTIN:
            continue
        why = get_family(impl).unsupported_reason(FamilySpec("fwd", 64, "float16", arch))
        if why is None:
            return arch
        reasons.append(why)
    pytest.skip(f"{impl} has no kernels for this device: {'; '.join(reasons)}")


def family_tile(case: FeatCase, impl: str, arch: str) -> FeatCase:
    """The case with its small tile (the CPU emulator's way to many blocks per sequence) where the family
    takes it, else at the family's default tile (the Hopper family's tiles start at 64 Q rows)."""
    if case.tile is None:
        return case
    br, bc, warps = case.tile
    try:
        KernelSpec(direction="fwd", head_dim=64, impl=impl, arch=arch, block_r=br, block_c=bc, num_warps=warps)
    except ValidationError as e:
        if e.errors()[0]["loc"][0] in ("block_r", "block_c", "num_warps"):
            return replace(case, tile=None)
    return case


@pytest.mark.parametrize("impl", list(family_names()))
@pytest.mark.parametrize("case", CASES + LONG, ids=str)
def test_family_on_the_gpu_matches_the_float64_reference(case: FeatCase, impl: str) -> None:
    arch = device_arch_for(impl)
    check_case(family_tile(case, impl, arch), impl, device="cuda", extra={"arch": arch})
