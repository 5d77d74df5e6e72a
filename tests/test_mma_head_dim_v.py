"""The mma family with a v head dim of its own (``head_dim_v``; MLA: d = 192, dv = 128): its smem layout,
tile choice and autotuner candidates count each dim, the source of a spec without one is unchanged, and
the kernels compile without spills (NVRTC, sm_80 / sm_90). Numerics, races and AddressSanitizer:
tests/test_head_dim_v.py (parametrized over simt and mma)."""
from __future__ import annotations

import pytest

from fagen import KernelSpec, compile, sass
from fagen.autotune.candidates import enumerate_candidates
from fagen.families.mma import padded_dim
from fagen.renderer import render, template_context
from fagen.spec import ARCH_SMEM_OPTIN


def _counts(spec: KernelSpec) -> dict[str, int]:
    return {b.name: b.count for b in spec.smem_layout.buffers}


@pytest.mark.parametrize("d, dv", [(192, 128), (128, 64), (64, 128), (40, 24)])
def test_layout_rows_and_decisions_of_each_dim(d: int, dv: int) -> None:
    """V_j and dO_i rows are LD_V = DPAD_V + 8, Q_i and K_j rows LD = DPAD + 8; dK~ / dV~ in smem take
    DPAD / DPAD_V columns. The constants DPAD_V and LD_V are declared only for such a spec."""
    ld, ld_v = padded_dim(d) + 8, padded_dim(dv) + 8
    fwd = KernelSpec(direction="fwd", head_dim=d, head_dim_v=dv, dtype="bfloat16", impl="mma")
    c = _counts(fwd)
    stages = fwd.knob_values["stages"]
    assert c == {"q": fwd.tile.block_r * ld, "k": stages * fwd.tile.block_c * ld, "v": stages * fwd.tile.block_c * ld_v}
    bwd = KernelSpec(direction="bwd", head_dim=d, head_dim_v=dv, dtype="bfloat16", impl="mma", deterministic=True)
    c, ctx = _counts(bwd), template_context(bwd)
    br, bc = bwd.tile.block_r, bwd.tile.block_c
    assert (c["k"], c["v"], c["q"], c["do_"]) == (bc * ld, bc * ld_v, stages * br * ld, stages * br * ld_v)
    assert ctx["strides"]["LD_V"] == ld_v and ctx["DPAD_V"] == padded_dim(dv) and not ctx["BWD_2D"]
    if ctx["ACC_IN_SMEM"]:
        assert (c["dk"], c["dv"]) == (bc * padded_dim(d), bc * padded_dim(dv))
    for spec in (fwd, bwd):
        assert spec.smem_layout.total_bytes <= ARCH_SMEM_OPTIN[spec.arch]
    same = render(KernelSpec(direction="bwd", head_dim=d, dtype="bfloat16", impl="mma", deterministic=True)).source
    assert "DPAD_V" not in same and "LD_V" not in same and "DPAD_V" in render(bwd).source


def test_tiles_and_candidates_count_both_dims() -> None:
    """A tile that fits beside dv = 64 but not dv = d = 128 is taken for the one, refused for the other;
    the autotuner's candidates are the fitting ones of the spec's own layout. The default backward Q block
    is the wider dim's (d = 128: 64 rows, on the 8 warps' 128 keys)."""
    big = dict(direction="bwd", head_dim=128, dtype="float16", impl="mma", arch="sm_90", block_r=128, block_c=128,
               num_warps=8)
    assert KernelSpec(head_dim_v=64, **big).smem_layout.total_bytes <= ARCH_SMEM_OPTIN["sm_90"]
    with pytest.raises(ValueError):
        KernelSpec(**big)
    spec = KernelSpec(direction="bwd", head_dim=128, head_dim_v=64, dtype="float16", arch="sm_90")
    assert spec.impl == "mma" and (spec.tile.block_r, spec.tile.block_c, spec.num_warps) == (64, 128, 8)
    cands = [c for c in enumerate_candidates(spec, sizes=(64, 128), warps=(8,)) if c.impl == "mma"]
    ok = {(c.block_r, c.block_c) for c in cands if c.status != "rejected" and dict(c.knobs)["stages"] == 2}
    assert (128, 128) in ok
    plain = spec.replace(head_dim_v=None)
    ok_plain = {(c.block_r, c.block_c) for c in enumerate_candidates(plain, sizes=(64, 128), warps=(8,))
                if c.impl == "mma" and c.status != "rejected" and dict(c.knobs)["stages"] == 2}
    assert (128, 128) not in ok_plain
    for c in cands:
        if c.spec is not None:  # a candidate kept: its smem is its own spec's layout
            assert c.smem_bytes == c.spec.smem_layout.total_bytes


def test_declined_combinations_name_both_dims() -> None:
    """attn_mask with a score modification in the backward past the register budget is declined with the
    head dims named (impl=None then resolves to simt): the accumulators of d = 128 and dv = 112 take 120
    registers, 146 more the masked step."""
    flags = dict(direction="bwd", head_dim=128, head_dim_v=112, dtype="float16", attn_mask=True, softcap=True)
    with pytest.raises(ValueError, match="head_dim_v=112"):
        KernelSpec(impl="mma", **flags)
    assert KernelSpec(**flags).impl == "simt"


needs_nvdisasm = pytest.mark.skipif(sass.nvdisasm_path() is None, reason="nvdisasm (nvidia-cuda-nvdisasm) not installed")

#: (d, dv, direction, flags): the fast tier compiles the first on sm_90, the rest are slow (an offline
#: sweep of every pair of 32, 64, 96, 128, 192, 256 with seven flag sets on sm_80 / sm_90 found no spill).
SASS_CASES = [
    (192, 128, "bwd", dict(causal=True)),
    (128, 64, "fwd", dict(causal=True)),
    (192, 128, "fwd", dict(causal=True, key_padding=True, dropout=True)),
    (128, 64, "bwd", dict(causal=True, key_padding=True, dropout=True)),
    (64, 128, "fwd", dict(causal=True, window=True)),
    (64, 128, "bwd", dict(causal=True, deterministic=True)),
    (192, 128, "bwd", dict(causal=True, dropout=True, deterministic=True)),
    (128, 64, "bwd", dict(bias=True, bias_grad=True)),
    (64, 192, "bwd", dict(causal=True, key_padding=True, dropout=True)),
    (256, 64, "fwd", dict(softcap=True)),
    (96, 256, "bwd", dict(window=True, varlen=True)),
]


#: The cases also compiled for sm_80 (its smaller shared memory shrinks the tiles; its ptxas spilled
#: d = 64 beside dv = 192 before the accumulators' rule took the wider dim).
SM80_CASES = (0, 3, 8)


def _sass_params():
    return [pytest.param(arch, *case, id=f"{arch}-d{case[0]}dv{case[1]}-{case[2]}-{'-'.join(case[3])}",
                         marks=() if i < 1 and arch == "sm_90" else (pytest.mark.slow,))
            for i, case in enumerate(SASS_CASES) for arch in ("sm_80", "sm_90") if arch == "sm_90" or i in SM80_CASES]


@needs_nvdisasm
@pytest.mark.parametrize("arch, d, dv, direction, flags", _sass_params())
def test_mma_head_dim_v_kernels_compile_without_spills(arch: str, d: int, dv: int, direction: str, flags: dict) -> None:
    """Every role of the default-tile kernels: no spills, no local memory, the main (and dq) kernel on the
    tensor cores."""
    spec = KernelSpec(direction=direction, head_dim=d, head_dim_v=dv, dtype="bfloat16", arch=arch, **flags)
    assert spec.impl == "mma"
    mod = compile(spec)
    mix = sass.instruction_mix(mod.cubin)
    for res in mod.resources:
        assert res.spill_bytes == 0 and res.stack_frame_bytes == 0, (res.kernel, res)
        assert mix[res.kernel].get("LDL", 0) == 0 and mix[res.kernel].get("STL", 0) == 0, res.kernel
    for role in ("main", "dq") if spec.deterministic else ("main",):
        ops = mix[mod.rendered.kernel(role).name]
        assert ops.get("HMMA", 0) > 0 and ops.get("LDSM", 0) > 0, (role, ops)
