"""Intra-barrier races: the same kernels in reverse thread order must give the same results.

Within one barrier interval the emulator runs each thread to the barrier in turn; if a
thread reads what another writes in the same interval (or both write), ascending and
descending thread orders resolve it differently. o, lse, dK and dV must agree bit for bit
(no atomics feed them); dQ is accumulated with fp32 atomics whose order changes with the
schedule, so it agrees to rounding.
"""
from __future__ import annotations

import pytest
import torch

import fagen.functional as F
import fagen.settings
from numerics import Case, make_inputs

CASES = [
    Case(2, 2, 45, 61, 32, "float16", causal=True, padding=True, dropout_p=0.2),
    Case(1, 2, 100, 37, 64, "bfloat16", causal=True),  # Q blocks with no visible key
    Case(2, 1, 33, 90, 128, "float32", padding=True),
    Case(1, 1, 17, 17, 96, "float16", dropout_p=0.3),
]


def _run(case: Case, schedule: str):
    fagen.settings.configure(emu_schedule=schedule)
    try:
        q, k, v, do, mask = make_inputs(case)
        kw = dict(causal=case.causal, key_padding_mask=mask, dropout_p=case.dropout_p, seed=4)
        o, lse = F.attention_forward(q, k, v, **kw)
        return (o, lse, *F.attention_backward(do, q, k, v, o, lse, **kw))
    finally:
        fagen.settings.reset()


@pytest.mark.parametrize("case", CASES, ids=str)
def test_reverse_schedule_agrees(case: Case) -> None:
    fwd = _run(case, "forward")
    rev = _run(case, "reverse")
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), fwd, rev):
        if name == "dq":
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
        else:
            assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), name


def test_schedule_detects_a_race() -> None:
    """A kernel where thread t reads smem that thread t+1 writes in the same interval."""
    import numpy as np

    from fagen.emulator import KernelSig, build
    from fagen.renderer import templates_dir

    src = (templates_dir() / "partials" / "primitives.cuh").read_text() + r'''
extern "C" __global__ void racy(float* out) {
    float* s = reinterpret_cast<float*>(fa_smem());
    s[threadIdx.x] = 0.f;
    fa_sync();
    s[threadIdx.x] = (float)threadIdx.x;               // write ...
    out[threadIdx.x] = s[(threadIdx.x + 1) % 64];      // ... and read a neighbour's, no barrier between
}
'''
    sig = [KernelSig("racy", (("float*", "out"),))]
    results = []
    for flags in ((), ("-DFAGEN_EMU_REVERSE_SCHEDULE",)):
        out = np.zeros(64, np.float32)
        build(src, sig, extra_flags=flags).launch("racy", 1, 64, 256, [out])
        results.append(out)
    assert not np.array_equal(results[0], results[1])


@pytest.mark.parametrize("stages", [1, 2])
def test_reverse_schedule_agrees_mma_pipeline(stages: int) -> None:
    """The mma family with small tiles: many cp.async steps per block, an idle warp, shared dQ tiles."""
    from fagen import KernelSpec

    case = Case(1, 2, 61, 45, 40, "bfloat16", causal=True, padding=True, dropout_p=0.2)
    flags = dict(head_dim=40, dtype="bfloat16", causal=True, key_padding=True, dropout=True, impl="mma",
                 block_r=16, block_c=16, num_warps=2, knobs={"stages": stages})

    def run(schedule: str):
        fagen.settings.configure(emu_schedule=schedule)
        try:
            q, k, v, do, mask = make_inputs(case)
            kw = dict(key_padding_mask=mask, dropout_p=case.dropout_p, seed=4)
            o, lse = F.run_forward(KernelSpec(direction="fwd", **flags), q, k, v, **kw)
            return (o, lse, *F.run_backward(KernelSpec(**flags), do, q, k, v, o, lse, **kw))
        finally:
            fagen.settings.reset()

    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), run("forward"), run("reverse")):
        if name == "dq":
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
        else:
            assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), name
