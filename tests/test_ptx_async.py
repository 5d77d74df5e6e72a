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

import re

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
    """The mma forward (sm_80) with one ``cp.async.wait_all`` deleted from the PTX at a time. The one the
    first tile reads depend on is caught: those reads meet copies still in flight. Which of the three it
    is depends on the code shape the spec's codegen knobs give (with Q in registers, the first, before Q's
    fragments are read; without, the second, before the tile loop; the first then serves a negative softmax
    scale only), so each is tried and one must be caught, naming a cp.async and a shared-memory read."""
    spec = KernelSpec(direction="fwd", head_dim=64, dtype="float16", causal=False, impl="mma", arch="sm_80")
    q, k, v = (torch.randn(1, 64, 1, 64, generator=torch.Generator().manual_seed(i)).half() for i in range(3))
    waits = cpu.cpu_module(spec).ptx_text().decode().count("\tcp.async.wait_all;\n")
    assert waits >= 2
    caught = []
    for nth in range(waits):
        mutant = _PtxMutant(spec, "\tcp.async.wait_all;\n", "\n", nth=nth)
        ptx = mutant.mutant_ptx
        monkeypatch.setattr(cpu, "cpu_module", _installed(spec, mutant))
        try:
            with cpu.ptx():
                F.run_forward(spec, q, k, v)
        except PtxHazardError as e:
            assert re.search(r"the destination of the cp.async at PTX line (\d+) \(thread \d+\) still in flight",
                             str(e)), str(e)
            cp_line = int(e.args[0].split("cp.async at PTX line ")[1].split()[0])
            assert ptx.splitlines()[cp_line - 1].strip().startswith("cp.async.cg.shared.global")
            read = ptx.splitlines()[e.ptx_line - 1].strip()
            assert read.startswith(("ld.shared", "ldmatrix")), read
            caught.append(nth)
        monkeypatch.undo()
    assert caught, f"removing any one of the {waits} cp.async.wait_all went unnoticed"


# --------------------------------------------------------------------------- the async proxy
# Thread t writes float(t) to smem[4 t] (st.shared: the generic proxy); thread 0 bulk-stores the 256
# bytes to out. Mode 0: every thread fences (fence.proxy.async) before the barrier, thread 0 waits
# for its bulk group -> clean, out = 0..63. Mode 1: no fence. Mode 2: no bulk wait before ret.
# Mode 3: the store is never committed (nor waited for).
BULK_PTX = """.version 8.0
.target sm_90a
.address_size 64
.extern .shared .align 1024 .b8 smem[];
.visible .entry bst(.param .u64 po, .param .u32 pm)
{
    .reg .pred %p<6>;
    .reg .b32 %r<8>;
    .reg .f32 %f<2>;
    .reg .b64 %rd<2>;
    ld.param.u64 %rd1, [po];
    ld.param.u32 %r1, [pm];
    mov.u32 %r2, %tid.x;
    mov.u32 %r3, smem;
    shl.b32 %r4, %r2, 2;
    add.s32 %r5, %r3, %r4;
    cvt.rn.f32.u32 %f1, %r2;
    st.shared.f32 [%r5], %f1;                                       // the generic-proxy write
    setp.ne.s32 %p1, %r1, 1;
    @%p1 fence.proxy.async.shared::cta;                              // mode 1 skips it
    bar.sync 0;
    setp.ne.s32 %p2, %r2, 0;
    @%p2 bra $DONE;
    cp.async.bulk.global.shared::cta.bulk_group [%rd1], [%r3], 256;  // the async proxy reads smem
    setp.eq.s32 %p4, %r1, 3;
    @%p4 bra $DONE;                                                  // mode 3: never committed
    cp.async.bulk.commit_group;
    setp.eq.s32 %p3, %r1, 2;
    @%p3 bra $DONE;                                                  // mode 2: not drained
    cp.async.bulk.wait_group.read 0;
$DONE:
    ret;
}
"""
BULK_SIG = KernelSig("bst", (("float*", "o"), ("int", "mode")))


def _bulk_launch(mode: int) -> np.ndarray:
    out = np.zeros(64, np.float32)
    build_ptx(BULK_PTX, [BULK_SIG]).launch("bst", 1, 64, 1024, [out, mode])
    return out


def test_fenced_bulk_store_drained_before_exit_runs_clean() -> None:
    np.testing.assert_array_equal(_bulk_launch(0), np.arange(64, dtype=np.float32))


def test_generic_write_read_by_the_async_proxy_without_fence_is_a_hazard() -> None:
    with pytest.raises(PtxHazardError) as info:
        _bulk_launch(1)
    e = info.value
    assert e.ptx_line == _line(BULK_PTX, "cp.async.bulk.global") and "thread (0,0,0)" in str(e)
    assert (f"reads shared offset 0x0 through the async proxy, written through the generic proxy by thread 0 at PTX "
            f"line {_line(BULK_PTX, 'st.shared.f32')} with no fence.proxy.async by that thread since") in str(e)


def test_exit_with_a_bulk_group_not_drained_is_a_hazard() -> None:
    store, ret = _line(BULK_PTX, "cp.async.bulk.global"), _line(BULK_PTX, "ret;")
    with pytest.raises(PtxHazardError) as info:
        _bulk_launch(2)
    assert info.value.ptx_line == ret
    assert (f"exits with 1 bulk store / reduce(s) not waited for: the one at PTX line {store} is in committed bulk "
            f"group 0, which no cp.async.bulk.wait_group drained") in str(info.value)
    with pytest.raises(PtxHazardError, match=rf"the one at PTX line {store} was never committed") as info:
        _bulk_launch(3)
    assert info.value.ptx_line == ret


def _wgmma_backward(mutant: _PtxMutant, spec: KernelSpec, monkeypatch) -> None:
    """The backward of ``spec`` through ``mutant`` at the PTX level (o and lse from the float64
    reference: no forward build)."""
    from fagen import reference as R

    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(1, 128, 1, 64, generator=g).half() for _ in range(4))
    o, lse = R.attention_forward_ref(q, k, v, causal=spec.causal)
    monkeypatch.setattr(cpu, "cpu_module", _installed(spec, mutant))
    with cpu.ptx():
        F.run_backward(spec, do, q, k, v, o.half(), lse.float())


WGMMA_BWD = KernelSpec(direction="bwd", head_dim=64, dtype="float16", causal=False, impl="wgmma", arch="sm_90a")


@pytest.mark.slow
def test_mutation_removing_fence_proxy_async_from_the_wgmma_backward_is_caught(monkeypatch) -> None:
    """The wgmma backward stores dS^T with stmatrix, fences, and a named barrier later the dQ~ gemm
    reads it through its descriptor; with the first ``fence.proxy.async`` deleted from the PTX the
    wgmma reads generic-proxy writes the async proxy need not see."""
    mutant = _PtxMutant(WGMMA_BWD, "\tfence.proxy.async.shared::cta;\n", "\n", nth=0)
    lines = mutant.mutant_ptx.splitlines()
    with pytest.raises(PtxHazardError, match=r"written through the generic proxy by thread \d+ at PTX line (\d+) with "
                                             r"no fence.proxy.async by that thread since") as info:
        _wgmma_backward(mutant, WGMMA_BWD, monkeypatch)
    assert lines[info.value.ptx_line - 1].lstrip().startswith("wgmma.mma_async"), str(info.value)
    writer = int(str(info.value).split("at PTX line ")[-1].split()[0])
    assert lines[writer - 1].lstrip().startswith("stmatrix"), str(info.value)


@pytest.mark.slow
def test_mutation_removing_the_bulk_waits_from_the_wgmma_backward_is_caught(monkeypatch) -> None:
    """The wgmma backward's dQ~ reduce-adds (cp.reduce.async.bulk.tensor) with every
    ``cp.async.bulk.wait_group.read`` deleted from the PTX: the producer thread exits with bulk
    groups not drained."""
    mutant = _PtxMutant(WGMMA_BWD, "\tcp.async.bulk.wait_group.read 0;\n", "\n")
    lines = mutant.mutant_ptx.splitlines()
    with pytest.raises(PtxHazardError, match=r"exits with \d+ bulk store / reduce\(s\) not waited for: the one at PTX "
                                             r"line (\d+) is in committed bulk group") as info:
        _wgmma_backward(mutant, WGMMA_BWD, monkeypatch)
    assert lines[info.value.ptx_line - 1].strip() == "ret;"
    store = int(str(info.value).split("the one at PTX line ")[1].split()[0])
    assert lines[store - 1].lstrip().startswith("cp.reduce.async.bulk.tensor"), str(info.value)
