"""Racecheck at the PTX level: ``build_ptx(..., racecheck=True)`` (and ``racecheck()`` inside
``ptx()``) runs the happens-before model of racecheck.h over the translated PTX: every load, store
and atomic of the PTX reports with its PTX line; barriers, cp.async, mbarrier, TMA and wgmma
report through the runtime's events, as at the source level.

* a hand-written PTX kernel that reads its left neighbour's shared-memory word: clean with its
  ``bar.sync``, a read-after-write hazard naming both PTX lines without it;
* the SIMT forward (sm_80) runs clean and bit-identical under ``racecheck()`` inside ``ptx()``,
  and its PTX with one ``bar.sync`` deleted is a hazard naming PTX lines (both slow: a racecheck
  build of a real kernel).
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import fagen.functional as F
from fagen import KernelSpec
from fagen.emulator import EmulatorRaceError, KernelSig
from fagen.emulator.ptx import build_ptx
from fagen.runtime import cpu

SHIFT_PTX = """.version 8.0
.target sm_80
.address_size 64
.extern .shared .align 16 .b8 smem[];
.visible .entry shift(.param .u64 po, .param .u32 ps)
{
    .reg .pred %p<3>;
    .reg .b32 %r<8>;
    .reg .f32 %f<3>;
    .reg .b64 %rd<4>;
    ld.param.u64 %rd1, [po];
    ld.param.u32 %r1, [ps];
    mov.u32 %r2, %tid.x;
    mov.u32 %r3, smem;
    shl.b32 %r4, %r2, 2;
    add.s32 %r5, %r3, %r4;
    cvt.rn.f32.u32 %f1, %r2;
    st.shared.f32 [%r5], %f1;
    setp.eq.s32 %p1, %r1, 0;
    @%p1 bra $NOSYNC;
    bar.sync 0;
$NOSYNC:
    setp.eq.s32 %p2, %r2, 0;
    @%p2 bra $DONE;
    ld.shared.f32 %f2, [%r5+-4];
    mul.wide.u32 %rd2, %r2, 4;
    add.s64 %rd3, %rd1, %rd2;
    st.global.f32 [%rd3], %f2;
$DONE:
    ret;
}
"""
SHIFT_SIG = KernelSig("shift", (("float*", "out"), ("int", "sync")))


def _line(ptx: str, needle: str) -> int:
    return next(i for i, t in enumerate(ptx.splitlines(), 1) if needle in t)


def test_hand_written_ptx_race_is_reported_with_ptx_lines() -> None:
    mod = build_ptx(SHIFT_PTX, [SHIFT_SIG], racecheck=True)
    assert mod.racecheck
    out = np.zeros(64, np.float32)
    mod.launch("shift", 1, 64, 256, [out, 1])  # with its bar.sync: clean
    np.testing.assert_array_equal(out[1:], np.arange(63, dtype=np.float32))
    with pytest.raises(EmulatorRaceError) as info:
        mod.launch("shift", 1, 64, 256, [out, 0], smem_buffers=[("s", 0, 256)])
    e = info.value
    assert (e.kind, e.space, e.buffer, e.offset) == ("read-after-write", "shared", "s", 0)
    st, ld = _line(SHIFT_PTX, "st.shared.f32"), _line(SHIFT_PTX, "ld.shared.f32")
    assert e.lines[0].endswith(f".ptx:{st}") and e.lines[1].endswith(f".ptx:{ld}"), e.lines
    assert "thread (0,0,0) (warp 0, lane 0)" in str(e) and "thread (1,0,0) (warp 0, lane 1)" in str(e)


def test_a_plain_ptx_build_does_not_see_the_race() -> None:
    """What racecheck adds: the plain PTX build runs the barrier-less kernel without a report (the
    fibers run thread 0's store before thread 1's load, so even the values are right)."""
    out = np.zeros(64, np.float32)
    build_ptx(SHIFT_PTX, [SHIFT_SIG]).launch("shift", 1, 64, 256, [out, 0])
    np.testing.assert_array_equal(out[1:], np.arange(63, dtype=np.float32))


SIMT_FWD = KernelSpec(direction="fwd", head_dim=64, dtype="float16", causal=True, impl="simt", arch="sm_80")


def _qkv():
    g = torch.Generator().manual_seed(11)
    return tuple(torch.randn(1, 96, 2, 64, generator=g).half() for _ in range(3))


@pytest.mark.slow
def test_simt_forward_runs_clean_and_identical_under_racecheck_at_the_ptx_level() -> None:
    q, k, v = _qkv()
    with cpu.ptx() as level:
        o, lse = F.run_forward(SIMT_FWD, q, k, v)
    with cpu.ptx() as level_rc, cpu.racecheck() as races:
        o_rc, lse_rc = F.run_forward(SIMT_FWD, q, k, v)
    assert races.launches == level_rc.launches == level.launches
    assert torch.equal(o, o_rc) and torch.equal(lse, lse_rc)


class _PtxMutant(cpu.CpuModule):
    """``spec``'s CPU module whose PTX has the ``nth`` occurrence of ``old`` replaced by ``new``."""

    def __init__(self, spec: KernelSpec, old: str, new: str, nth: int) -> None:
        super().__init__(spec)
        parts = super().ptx_text().decode().split(old)
        assert nth < len(parts) - 1, f"the PTX has {len(parts) - 1} occurrences"
        self.mutant_ptx = old.join(parts[:nth + 1]) + new + old.join(parts[nth + 1:])

    def ptx_text(self) -> bytes:
        return self.mutant_ptx.encode()


@pytest.mark.slow
def test_removing_a_barrier_from_the_simt_forwards_ptx_is_a_race(monkeypatch) -> None:
    """The third ``bar.sync 0`` of the SIMT forward (sm_80) deleted from its PTX (the one between the
    score tile's stores and the softmax pass that reads other warps' rows): racecheck at the PTX
    level reports the hazard with the PTX lines of both accesses. (Deleting any of the five but the
    second is caught; the second serves a negative softmax scale only.)"""
    mutant = _PtxMutant(SIMT_FWD, "\tbar.sync \t0;\n", "\n", nth=2)
    real = cpu.cpu_module
    monkeypatch.setattr(cpu, "cpu_module", lambda s: mutant if s == SIMT_FWD else real(s))
    q, k, v = _qkv()
    with cpu.ptx(), cpu.racecheck(), pytest.raises(EmulatorRaceError) as info:
        F.run_forward(SIMT_FWD, q, k, v)
    e = info.value
    assert e.space == "shared" and e.buffer is not None
    lines = mutant.mutant_ptx.splitlines()
    # the two accesses: "<op> by ... at FILE.ptx:N [after ...], then <op> by ... at FILE.ptx:M"
    accesses = re.findall(r"(?:read|write|atomic) by block \(\d+,\d+,\d+\) thread [^@]*? at ([0-9a-f]+\.ptx):(\d+)", str(e))
    assert len(accesses) == 2, str(e)
    for name, n in accesses:
        assert lines[int(n) - 1].strip().startswith(("ld.shared", "st.shared")), (name, n, lines[int(n) - 1])
    # both of them, not a line of the bracketed barrier history between them
    assert e.lines == tuple(f"{name}:{n}" for name, n in accesses), (e.lines, str(e))
