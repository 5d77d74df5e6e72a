"""PTX-level checks of asynchronous copies (fagen.emulator.ptx): each hazard committed by a
hand-written PTX kernel (and its corrected twin run clean), then by a mutation of a real kernel's
PTX that only the PTX level runs.

* cp.async: a shared-memory access of a destination whose copy has not landed (no
  ``cp.async.wait_group`` / ``wait_all`` of the issuing thread yet), or a read by another thread
  before the barrier that publishes the landed copy -> PtxHazardError naming the PTX line of the
  access and of the cp.async;
* fence.proxy.async: shared memory written through the generic proxy and read by the async proxy
  (a bulk / TMA store's source, a wgmma operand) without the writer's ``fence.proxy.async`` since
  -> PtxHazardError naming the async read's line and the write's;
* bulk groups: a thread that exits with ``cp.async.bulk`` stores not drained by
  ``cp.async.bulk.wait_group`` -> PtxHazardError at the ``ret``, naming the store's line.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import fagen.functional as F
from fagen import KernelSpec
from fagen.emulator import KernelSig
from fagen.emulator.ptx import PtxHazardError, build_ptx
from fagen.runtime import cpu


def _line(ptx: str, needle: str, nth: int = 0) -> int:
    return [i for i, t in enumerate(ptx.splitlines(), 1) if needle in t][nth]


# --------------------------------------------------------------------------- real kernels mutated
class _PtxMutant(cpu.CpuModule):
    """``spec``'s CPU module whose PTX is NVRTC's PTX of the spec with the ``nth`` occurrence of
    ``old`` (every one when None) replaced by ``new``: the PTX level builds and runs the mutated text."""

    def __init__(self, spec: KernelSpec, old: str, new: str, nth: int | None = None) -> None:
        super().__init__(spec)
        text = super().ptx_text().decode()
        parts = text.split(old)
        assert len(parts) > 1, "the mutation site is gone from the PTX"
        if nth is None:
            self.mutant_ptx = new.join(parts)
        else:
            assert nth < len(parts) - 1, f"the PTX has {len(parts) - 1} occurrences"
            self.mutant_ptx = old.join(parts[:nth + 1]) + new + old.join(parts[nth + 1:])

    def ptx_text(self) -> bytes:
        return self.mutant_ptx.encode()


def _installed(spec: KernelSpec, mutant: cpu.CpuModule):
    real = cpu.cpu_module
    return lambda s: mutant if s == spec else real(s)


# --------------------------------------------------------------------------- cp.async
# Thread t copies 16 bytes of x to smem[16 t], then reads its neighbour t ^ 1's copy after the
# barrier. Mode 1 reads its own destination before the wait, mode 2 the neighbour's between the
# wait and the barrier, mode 3 writes its own destination before the wait; mode 0 is the correct
# kernel (out[t] = x[4 (t ^ 1)]).
CP_PTX = """.version 8.0
.target sm_80
.address_size 64
.extern .shared .align 16 .b8 smem[];
.visible .entry cpa(.param .u64 px, .param .u64 po, .param .u32 pm)
{
    .reg .pred %p<4>;
    .reg .b32 %r<12>;
    .reg .f32 %f<4>;
    .reg .b64 %rd<8>;
    ld.param.u64 %rd1, [px];
    ld.param.u64 %rd2, [po];
    ld.param.u32 %r1, [pm];
    mov.u32 %r2, %tid.x;
    mov.u32 %r3, smem;
    shl.b32 %r4, %r2, 4;
    add.s32 %r5, %r3, %r4;
    mul.wide.u32 %rd3, %r2, 16;
    add.s64 %rd4, %rd1, %rd3;
    cp.async.cg.shared.global [%r5], [%rd4], 16;
    cp.async.commit_group;
    setp.eq.s32 %p1, %r1, 1;
    @%p1 ld.shared.f32 %f1, [%r5];              // mode 1: own destination, before the wait
    setp.eq.s32 %p3, %r1, 3;
    @%p3 st.shared.f32 [%r5], %f1;              // mode 3: written before the wait
    cp.async.wait_group 0;
    xor.b32 %r6, %r2, 1;
    shl.b32 %r7, %r6, 4;
    add.s32 %r8, %r3, %r7;
    setp.eq.s32 %p2, %r1, 2;
    @%p2 ld.shared.f32 %f2, [%r8];              // mode 2: the neighbour's, before the barrier
    bar.sync 0;
    ld.shared.f32 %f3, [%r8];
    mul.wide.u32 %rd5, %r2, 4;
    add.s64 %rd6, %rd2, %rd5;
    st.global.f32 [%rd6], %f3;
    ret;
}
"""
CP_SIG = KernelSig("cpa", (("const float*", "x"), ("float*", "o"), ("int", "mode")))


def _cp_launch(mode: int, ptx: str = CP_PTX) -> np.ndarray:
    x, out = np.arange(256, dtype=np.float32), np.zeros(64, np.float32)
    build_ptx(ptx, [CP_SIG]).launch("cpa", 1, 64, 1024, [x, out, mode])
    return out


def test_cp_async_read_after_the_wait_and_barrier_runs_clean() -> None:
    np.testing.assert_array_equal(_cp_launch(0), np.arange(256, dtype=np.float32)[4 * (np.arange(64) ^ 1)])


def test_cp_async_destination_read_before_the_wait_is_a_hazard() -> None:
    cp = _line(CP_PTX, "cp.async.cg")
    with pytest.raises(PtxHazardError) as info:
        _cp_launch(1)
    e = info.value
    assert e.kernel == "cpa" and e.block == (0, 0, 0) and e.ptx_line == _line(CP_PTX, "mode 1")
    assert f"the destination of the cp.async at PTX line {cp} (thread 0) still in flight" in str(e)
    assert "warp 0, thread (0,0,0)" in str(e) and "ld.shared.f32 reads shared offset 0x0" in str(e)


def test_cp_async_destination_written_before_the_wait_is_a_hazard() -> None:
    with pytest.raises(PtxHazardError, match=r"st.shared.f32 writes shared offset 0x0, the destination of the "
                                             r"cp.async at PTX line \d+ \(thread 0\) still in flight") as info:
        _cp_launch(3)
    assert info.value.ptx_line == _line(CP_PTX, "mode 3")


def test_another_threads_landed_copy_read_before_the_barrier_is_a_hazard() -> None:
    """Thread 1 reads thread 0's destination after thread 0's wait but with no barrier between."""
    cp, wait = _line(CP_PTX, "cp.async.cg"), _line(CP_PTX, "cp.async.wait_group")
    with pytest.raises(PtxHazardError) as info:
        _cp_launch(2)
    e = info.value
    assert e.ptx_line == _line(CP_PTX, "mode 2") and "thread (1,0,0)" in str(e)
    assert (f"the destination of the cp.async at PTX line {cp} (thread 0), landed by that thread's wait at PTX "
            f"line {wait} but not yet published to this thread") in str(e)


@pytest.mark.slow
def test_mutation_removing_a_cp_async_wait_from_the_mma_forward_is_caught(monkeypatch) -> None:
    """The mma forward (sm_80) with the ``cp.async.wait_all`` before its tile loop deleted from the
    PTX (the second of three; the first serves a negative softmax scale only): the tile reads that
    follow it meet copies still in flight."""
    spec = KernelSpec(direction="fwd", head_dim=64, dtype="float16", causal=False, impl="mma", arch="sm_80")
    mutant = _PtxMutant(spec, "\tcp.async.wait_all;\n", "\n", nth=1)
    ptx = mutant.mutant_ptx
    monkeypatch.setattr(cpu, "cpu_module", _installed(spec, mutant))
    q, k, v = (torch.randn(1, 64, 1, 64, generator=torch.Generator().manual_seed(i)).half() for i in range(3))
    with cpu.ptx(), pytest.raises(PtxHazardError, match=r"the destination of the cp.async at PTX line (\d+) "
                                                        r"\(thread \d+\) still in flight") as info:
        F.run_forward(spec, q, k, v)
    cp_line = int(info.value.args[0].split("cp.async at PTX line ")[1].split()[0])
    assert ptx.splitlines()[cp_line - 1].strip().startswith("cp.async.cg.shared.global")
    read = ptx.splitlines()[info.value.ptx_line - 1].strip()
    assert read.startswith(("ld.shared", "ldmatrix")), read
