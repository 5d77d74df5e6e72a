"""Racecheck: shared-memory hazards between threads, found deterministically on the CPU.

* Hand-written kernels with each hazard kind (read-after-write, write-after-read,
  write-after-write; a missing ``__syncwarp`` before an ``ldmatrix`` of data other lanes
  stored; a cp.async destination read before the wait and before the barrier after it; plain
  stores of two blocks to the same global bytes) raise ``EmulatorRaceError``; the same kernels
  with the right synchronisation run clean.
* The tracker against an independent model: random straight-line programs of reads, writes,
  atomics, ``__syncthreads`` and ``__syncwarp`` have a race exactly when a pair of conflicting
  accesses is not separated by a barrier that orders both (checked in Python, by the
  definition).
* Every barrier of every template is load-bearing: each ``fa_sync()`` / ``__syncthreads()`` /
  ``__syncwarp()`` / cp.async wait is put behind a racecheck gate and skipped, one at a time,
  with ``fagen_emu_race_marker()`` (a no-op the reports name) in its place; a spec that runs
  that code then raises ``EmulatorRaceError`` naming the marker. The gates themselves are
  checked on a hand-written kernel.
* No false positives: a covering sample of specs (the SIMT and mma families, every kernel role;
  the Hopper forward) runs clean under ``fagen.runtime.cpu.racecheck()`` with the same results
  as a plain launch. (The Hopper primitives themselves: tests/test_racecheck_wgmma.py.)
"""
from __future__ import annotations

import functools
import itertools
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

import fagen.functional as F
from fagen import KernelSpec, renderer
from fagen.emulator import EmulatorError, EmulatorRaceError, KernelSig, build
from fagen.runtime import cpu

import gates

REPO = Path(__file__).resolve().parent.parent
PRIMS = (REPO / "templates/partials/primitives.cuh").read_text() + (REPO / "templates/partials/mma.cuh").read_text()


def _module(body: str, name: str, params: tuple[tuple[str, str], ...]):
    return build(PRIMS + body, [KernelSig(name, params)], racecheck=True)


def _race(mod, name: str, grid: int, block: int, smem: int, args: list, **kw) -> EmulatorRaceError:
    with pytest.raises(EmulatorRaceError) as ei:
        mod.launch(name, grid, block, smem, args, **kw)
    return ei.value


# --------------------------------------------------------------------------- hand-written hazards
HAZARDS = r"""
// mode 0: the right synchronisation; 1: none (a marker where the barrier was).
extern "C" __global__ void raw(float* out, int mode) {  // each thread reads what its left neighbour stored
    float* s = reinterpret_cast<float*>(fa_smem());
    const int t = threadIdx.x;
    s[t] = float(t);
    if (mode == 0) fa_sync(); else fagen_emu_race_marker();
    if (t > 0) out[t] = s[t - 1];
}
extern "C" __global__ void war(float* out, int mode) {  // thread t reads word t+1, then thread t+1 overwrites it
    float* s = reinterpret_cast<float*>(fa_smem());
    const int t = threadIdx.x;
    s[t] = 1.f;
    fa_sync();
    out[t] = s[(t + 1) % blockDim.x];
    if (mode == 0) fa_sync(); else fagen_emu_race_marker();
    s[t] = 2.f;
}
extern "C" __global__ void waw(float* out, int mode) {  // threads 0 and 1 store to the same word
    float* s = reinterpret_cast<float*>(fa_smem());
    const int t = threadIdx.x;
    if (t == 0) s[0] = 1.f;
    if (mode == 0) fa_sync(); else fagen_emu_race_marker();
    if (t == 1) s[0] = 2.f;
    fa_sync();
    out[t] = s[0];
}
// Lane l stores word (l + 1) % 32 of an 8x8 b16 matrix, then the warp reads it with ldmatrix: lane
// l receives word l. mode 0: __syncwarp between; 1: nothing; 2: only a shuffle (orders no memory).
extern "C" __global__ void ldsm(unsigned* out, int mode) {
    unsigned* s = reinterpret_cast<unsigned*>(fa_smem());
    const int l = threadIdx.x;
    s[(l + 1) % 32] = 0x10001u * unsigned(l);
    if (mode == 0) __syncwarp();
    else if (mode == 2) out[32 + l] = __shfl_xor_sync(0xffffffffu, unsigned(l), 1);
    unsigned r[1];
    fa_ldmatrix_x1(r, s + 4 * (l % 8));
    out[l] = r[0];
}
// Thread t copies 16 bytes into chunk t and reads chunk t - 1 (its left neighbour's).
// mode 0: wait_all + barrier; 1: wait_all only; 2: its own chunk before waiting.
extern "C" __global__ void cpasync(const float* in, float* out, int mode) {
    float* s = reinterpret_cast<float*>(fa_smem());
    const int t = threadIdx.x;
    fa_cp_async_16(s + 4 * t, in + 4 * t, true);
    fa_cp_async_commit();
    if (mode == 2) out[t] = s[4 * t];
    fa_cp_async_wait_all();
    if (mode == 0) fa_sync(); else fagen_emu_race_marker();
    if (t > 0) out[t] = s[4 * (t - 1)];
}
// mode 0: every thread atomicAdds word 0; 1: thread 3 stores it plainly as well.
extern "C" __global__ void atomics(float* out, int mode) {
    float* s = reinterpret_cast<float*>(fa_smem());
    const int t = threadIdx.x;
    if (t == 0) s[0] = 0.f;
    fa_sync();
    atomicAdd(s, 1.f);
    if (mode == 1 && t == 3) s[0] = 5.f;
    fa_sync();
    out[t] = s[0];
}
// Lanes of one warp ordered by __syncwarp, across warps only a barrier orders.
// mode 0: thread 33 reads thread 1's store after __syncthreads; 1: after __syncwarp only (not its warp);
// 2: thread 2 (same warp as 1) after __syncwarp.
extern "C" __global__ void warps(float* out, int mode) {
    float* s = reinterpret_cast<float*>(fa_smem());
    const int t = threadIdx.x;
    if (t == 1) s[0] = 7.f;
    if (mode == 0) fa_sync(); else __syncwarp();
    if ((mode != 2 && t == 33) || (mode == 2 && t == 2)) out[t] = s[0];
}
// Every block stores out[0..n) (mode 1), its own slice (mode 0) or adds with atomics (mode 2).
extern "C" __global__ void blocks(float* out, int mode) {
    const int t = threadIdx.x;
    if (mode == 0) out[blockIdx.x * blockDim.x + t] = 1.f;
    else if (mode == 1) out[t] = float(blockIdx.x);
    else atomicAdd(out + t, 1.f);
}
"""
_P = (("float*", "out"), ("int", "mode"))


@pytest.fixture(scope="module")
def hazards():
    return build(PRIMS + HAZARDS, [KernelSig(n, _P) for n in ("raw", "war", "waw", "atomics", "warps", "blocks")]
                 + [KernelSig("ldsm", (("unsigned*", "out"), ("int", "mode"))),
                    KernelSig("cpasync", (("const float*", "in"), ("float*", "out"), ("int", "mode")))],
                 racecheck=True)


def _src_line(mod, text: str) -> str:
    """``<stem>.cu:LINE`` of the (first) kernel-source line containing ``text``."""
    lines = mod.source_path.read_text().splitlines()
    return f"{mod.source_path.name}:{next(i for i, ln in enumerate(lines, 1) if text in ln)}"


def test_read_after_write_names_both_threads_lines_and_the_buffer(hazards) -> None:
    out = np.zeros(64, np.float32)
    hazards.launch("raw", 1, 64, 256, [out, 0])
    assert np.array_equal(out[1:], np.arange(63, dtype=np.float32))
    e = _race(hazards, "raw", 1, 64, 256, [out, 1], smem_buffers=[("pad", 0, 16), ("tile", 16, 240)])
    assert e.kind == "read-after-write" and e.space == "shared" and e.offset == 0 and e.buffer == "pad"
    assert e.kernel == "raw" and e.block == (0, 0, 0)
    msg = str(e)
    assert "write by block (0,0,0) thread (0,0,0) (warp 0, lane 0)" in msg
    assert "read by block (0,0,0) thread (1,0,0) (warp 0, lane 1)" in msg
    assert "shared memory buffer 'pad' (byte 0 of 16; smem offset 0)" in msg
    assert e.lines == (_src_line(hazards, "s[t] = float(t);"), _src_line(hazards, "out[t] = s[t - 1];"))
    assert f"after marker at {_src_line(hazards, 'fagen_emu_race_marker')}" in msg


def test_write_after_read_and_write_after_write(hazards) -> None:
    out = np.zeros(64, np.float32)
    for name, kind in (("war", "write-after-read"), ("waw", "write-after-write")):
        hazards.launch(name, 1, 64, 256, [out, 0])
        e = _race(hazards, name, 1, 64, 256, [out, 1])
        assert e.kind == kind, (name, str(e))
    e = _race(hazards, "war", 1, 64, 256, [out, 1])
    assert "read by block (0,0,0) thread (0,0,0)" in str(e) and "write by block (0,0,0) thread (1,0,0)" in str(e)
    assert e.offset == 4


def test_missing_syncwarp_before_ldmatrix_is_a_hazard_a_shuffle_does_not_order(hazards) -> None:
    out = np.zeros(64, np.uint32)
    hazards.launch("ldsm", 1, 32, 128, [out, 0])
    lanes = np.arange(32, dtype=np.uint32)
    # lane l receives word l of the matrix (row l/4, columns 2(l%4), +1), which lane l-1 stored
    assert np.array_equal(out[:32], 0x10001 * ((lanes - 1) % 32))
    for mode in (1, 2):
        e = _race(hazards, "ldsm", 1, 32, 128, [out, mode])
        assert e.kind == "read-after-write", str(e)
        assert e.lines == (_src_line(hazards, "s[(l + 1) % 32] ="), _src_line(hazards, "fa_ldmatrix_x1(r, s")), str(e)
        assert "thread (31,0,0) (warp 0, lane 31)" in str(e) and "thread (0,0,0) (warp 0, lane 0)" in str(e)


def test_cp_async_destination_needs_the_wait_and_a_barrier_after_it(hazards) -> None:
    src = np.arange(4 * 64, dtype=np.float32)
    out = np.zeros(64, np.float32)
    hazards.launch("cpasync", 1, 64, 1024, [src, out, 0])
    assert np.array_equal(out[1:], src.reshape(64, 4)[:63, 0])
    e = _race(hazards, "cpasync", 1, 64, 1024, [src, out, 1])  # the neighbour waited, but no barrier
    assert e.kind == "read-after-write" and "write by block (0,0,0) thread (0,0,0)" in str(e), str(e)
    assert "read by block (0,0,0) thread (1,0,0)" in str(e) and "; then cp.async.wait_all at " in str(e), str(e)
    e = _race(hazards, "cpasync", 1, 64, 1024, [src, out, 2])  # its own copy, before the wait
    assert "cp.async whose destination has not landed" in str(e), str(e)
    assert e.lines[0] == _src_line(hazards, "fa_cp_async_16(s + 4 * t")


def test_atomics_never_race_with_each_other_but_with_plain_stores(hazards) -> None:
    out = np.zeros(64, np.float32)
    hazards.launch("atomics", 1, 64, 64, [out, 0])
    assert np.all(out == 64)
    e = _race(hazards, "atomics", 1, 64, 64, [out, 1])
    assert "atomic by" in str(e) and "thread (3,0,0)" in str(e), str(e)


def test_syncwarp_orders_the_lanes_of_its_warp_only(hazards) -> None:
    out = np.zeros(64, np.float32)
    hazards.launch("warps", 1, 64, 64, [out, 0])
    hazards.launch("warps", 1, 64, 64, [out, 2])
    e = _race(hazards, "warps", 1, 64, 64, [out, 1])
    assert "(warp 0, lane 1)" in str(e) and "(warp 1, lane 1)" in str(e), str(e)


def test_plain_global_stores_of_two_blocks_to_the_same_bytes(hazards) -> None:
    out = np.zeros(4 * 32, np.float32)
    hazards.launch("blocks", 4, 32, 0, [out, 0])
    hazards.launch("blocks", 4, 32, 0, [out, 2])
    e = _race(hazards, "blocks", 4, 32, 0, [out, 1])
    assert e.space == "global" and e.kind == "write-after-write" and e.offset == out.ctypes.data
    assert "block (0,0,0) thread (0,0,0)" in str(e) and "block (1,0,0) thread (0,0,0)" in str(e), str(e)


AGENT = r"""
// The event API as an asynchronous copy engine would use it (mbarrier + TMA): thread 0 hands work
// to agent 0 (fence.proxy.async), the agent writes the tile and completes on an mbarrier; the
// threads read the tile after a __syncthreads, having waited on the mbarrier (mode 0) or not (1).
extern "C" __global__ void agent_api(float* out, int mode) {
    using namespace fagen_emu::race;
    static uint32_t handoff[2048], mbar[2048];  // synchronisation objects: dim() words each
    float* s = reinterpret_cast<float*>(fa_smem());
    const unsigned t = threadIdx.x;
    if (t == 0) {
        memset(handoff, 0, sizeof handoff);
        memset(mbar, 0, sizeof mbar);
        release(handoff, t, site(__FILE__, __LINE__, "fence.proxy.async"));
        acquire(handoff, agent(0), site(__FILE__, __LINE__, "cp.async.bulk issue"));
        access(agent(0), s, blockDim.x * sizeof(float), kWrite, site(__FILE__, __LINE__, "cp.async.bulk"));
        release(mbar, agent(0), site(__FILE__, __LINE__, "mbarrier complete_tx"));
    }
    fa_sync();
    if (mode == 0) acquire(mbar, t, site(__FILE__, __LINE__, "mbarrier.try_wait.parity"));
    out[t] = s[t];
}
"""


def test_event_api_models_an_asynchronous_agent_that_barriers_do_not_order() -> None:
    mod = _module(AGENT, "agent_api", _P)
    out = np.zeros(64, np.float32)
    mod.launch("agent_api", 1, 64, 256, [out, 0])
    e = _race(mod, "agent_api", 1, 64, 256, [out, 1])
    assert e.kind == "read-after-write" and "write by asynchronous agent 0" in str(e), str(e)
    assert "read by block (0,0,0) thread (0,0,0)" in str(e), str(e)


GATES = r"""
// Thread t stores word t, then reads its left neighbour's (gate 0 orders that); gate 1 guards a
// barrier nothing needs (no shared-memory access follows it).
extern "C" __global__ void gated(float* out, int unused) {
    float* s = reinterpret_cast<float*>(fa_smem());
    const int t = threadIdx.x;
    s[t] = float(t);
    (fagen_emu_race_gate(0) ? fa_sync() : (void)0);
    if (t > 0) out[t] = s[t - 1];
    (fagen_emu_race_gate(1) ? fa_sync() : (void)0);
    out[64 + t] = float(t);
}
"""


def test_a_gate_skips_only_the_selected_barrier() -> None:
    """race_gate(i): gate i skips its barrier, a marker in its place; -1 opens all; -2 marks all
    and keeps every barrier (which gates a launch passed); other values are refused. The run's
    outcome, by the definition: skipping gate 0 leaves the read of a neighbour's store unordered
    (a read-after-write naming gate 0's line), skipping gate 1 orders nothing anyone needs; a
    plain build skips the barrier as well (the reverse thread order then reads unwritten words)."""
    mod = _module(GATES, "gated", _P)
    g0, g1 = (_src_line(mod, f"fagen_emu_race_gate({i})") for i in (0, 1))
    out = np.zeros(128, np.float32)
    for gate, marks in ((-1, set()), (-2, {g0, g1}), (1, {g1})):
        mod.race_gate(gate)
        mod.launch("gated", 1, 64, 256, [out, 0])
        assert np.array_equal(out[1:64], np.arange(63, dtype=np.float32))
        assert {f"{mod.source_path.name}:{ln}" for ln in mod.race_marker_lines()} == marks, gate
    mod.race_gate(0)
    e = _race(mod, "gated", 1, 64, 256, [out, 0])
    assert e.kind == "read-after-write" and f"after marker at {g0}" in str(e), str(e)
    mod.race_gate(-1)
    mod.launch("gated", 1, 64, 256, [out, 0])  # open again: clean
    for bad in (-3, 1.5, True, "0"):
        with pytest.raises(EmulatorError, match="gate must be an int"):
            mod.race_gate(bad)  # type: ignore[arg-type]
    # a plain build skips the selected barrier too: in the reverse thread order thread t reads word
    # t - 1 before thread t - 1 stored it
    plain = build(PRIMS + GATES, [KernelSig("gated", _P)], extra_flags=("-DFAGEN_EMU_REVERSE_SCHEDULE",))
    for gate, right in ((-1, True), (1, True), (0, False), (-2, True)):
        plain.race_gate(gate)
        out[:] = -1
        plain.launch("gated", 1, 64, 256, [out, 0])
        assert np.array_equal(out[1:64], np.arange(63, dtype=np.float32)) == right, gate
    plain.race_gate(-1)


def test_racecheck_modules_only() -> None:
    mod = build(PRIMS + HAZARDS, [KernelSig("raw", _P)])
    with pytest.raises(EmulatorError, match="racecheck=True"):
        mod.race_markers()
    with pytest.raises(EmulatorError, match="separate builds"):
        build(PRIMS + HAZARDS, [KernelSig("raw", _P)], racecheck=True, sanitize=True)


# --------------------------------------------------------------------------- an independent model
# A program is a list of steps, the same for every thread (barriers are uniform): ("bar",),
# ("warp",) for __syncwarp, or ("acc", ops) with ops[t] = (op, word) or None per thread.
PROGRAM = r"""
extern "C" __global__ void program(const int* steps, int nsteps, float* out) {
    float* s = reinterpret_cast<float*>(fa_smem());
    const int t = threadIdx.x, n = blockDim.x;
    float acc = 0.f;
    for (int i = 0; i < nsteps; ++i) {
        const int kind = steps[i * (n + 1)], op = steps[i * (n + 1) + 1 + t];
        if (kind == 1) fa_sync();
        else if (kind == 2) __syncwarp();
        else if (op >= 0) {
            const int word = op >> 2;
            if ((op & 3) == 0) acc += s[word];
            else if ((op & 3) == 1) s[word] = float(t);
            else atomicAdd(s + word, 1.f);
        }
    }
    out[t] = acc;
}
"""
THREADS, WORDS = 64, 6


def _model_races(steps: list) -> bool:
    """The definition: two accesses of one word by different threads, at least one a plain write
    (not both atomics), race unless a __syncthreads lies between them, or a __syncwarp and both
    threads are in one warp."""
    accesses = []  # (step, thread, op, word)
    for i, st in enumerate(steps):
        if st[0] == "acc":
            accesses += [(i, t, a[0], a[1]) for t, a in enumerate(st[1]) if a is not None]
    for (i, t, op, w), (j, u, op2, w2) in itertools.combinations(accesses, 2):
        if w != w2 or t == u or (op == "r" and op2 == "r") or (op == "a" and op2 == "a"):
            continue
        between = [s[0] for s in steps[min(i, j) + 1:max(i, j)]]
        if "bar" in between or ("warp" in between and t // 32 == u // 32):
            continue
        return True
    return False


def _random_program(rng: random.Random) -> list:
    steps: list = []
    for _ in range(rng.randint(2, 7)):
        r = rng.random()
        if r < 0.2:
            steps.append(("bar",))
        elif r < 0.35:
            steps.append(("warp",))
        else:
            ops = [None] * THREADS
            for t in rng.sample(range(THREADS), rng.randint(1, 4)):
                ops[t] = (rng.choice("rrwa"), rng.randrange(WORDS))
            steps.append(("acc", ops))
    return steps


def _encode(steps: list) -> np.ndarray:
    rows = []
    for st in steps:
        if st[0] != "acc":
            rows.append([{"bar": 1, "warp": 2}[st[0]]] + [-1] * THREADS)
        else:
            rows.append([0] + [-1 if a is None else a[1] * 4 + "rwa".index(a[0]) for a in st[1]])
    return np.array(rows, dtype=np.int32).ravel()


def test_tracker_agrees_with_the_happens_before_definition_on_random_programs() -> None:
    mod = build(PRIMS + PROGRAM, [KernelSig("program", (("const int*", "steps"), ("int", "nsteps"),
                                                         ("float*", "out")))], racecheck=True)
    rng = random.Random(21)
    seen = {True: 0, False: 0}
    for _ in range(300):
        steps = _random_program(rng)
        want = _model_races(steps)
        out = np.zeros(THREADS, np.float32)
        try:
            mod.launch("program", 1, THREADS, 4 * WORDS, [_encode(steps), len(steps), out])
            got = False
        except EmulatorRaceError:
            got = True
        assert got == want, steps
        seen[want] += 1
    assert min(seen.values()) >= 50, seen  # both outcomes well represented


# --------------------------------------------------------------------------- every barrier is load-bearing
#: What counts as a barrier in a template: block barriers (fa_sync_or's too), __syncwarp, cp.async waits.
BARRIER = re.compile(r"\bfa_sync\(\)|\b__syncthreads\(\)|\b__syncwarp\([^()]*\)|\bfa_cp_async_wait(?:<\d+>)?\(\)"
                     r"|\bfa_cp_async_wait_all\(\)|\bfa_sync_or\([^()]*\)")
#: The files defining the primitives themselves (their barriers are the primitives' bodies).
PRIMITIVE_FILES = {"partials/primitives.cuh", "partials/mma.cuh"}
#: Template folders racecheck cannot run (none: the Hopper primitives report their accesses and
#: synchronisation to the tracker; tests/test_wgmma_family.py removes each of that family's
#: mbarrier and wgmma waits in turn as well).
NOT_RACECHECKED: tuple[str, ...] = ()
#: Barriers that turn out not to be needed for the spec that runs them, as (template, line text):
#: the cp.async waits before a block (or a dq pass) ends, when every copy was already waited for by
#: the last step's wait_all. templates/mma is being rewritten elsewhere, so they stay there (a
#: stale entry fails test_unneeded_barriers_exist).
UNNEEDED = {
    ("mma/fwd.cu.j2", "fa_cp_async_wait_all();  // nothing in flight when the block exits"),
    ("mma/bwd.cu.j2", "fa_cp_async_wait_all();  // nothing in flight when the block exits"),
    ("mma/bwd.cu.j2", "fa_cp_async_wait_all();  // nothing in flight past the pass"),
    ("mma/bwd_2d.cu.j2", "fa_cp_async_wait_all();  // nothing in flight when the block exits"),
    # the bias fill's first __syncwarp (BIAS_SMEM): the step's warpgroup synchronisation after the previous
    # step's ldmatrix reads (its wgmma and barriers) already orders them before the next fill; kept as the
    # warp's own guarantee, which does not lean on the rest of the step
    ("wgmma/mask_bias.cuh", "__syncwarp();  // the previous step's ldmatrix reads of sw came first"),
}


def _template_sites() -> list[tuple[str, int, int]]:
    """(template, character offset, line) of every barrier call in every template."""
    root = renderer.templates_dir()
    out = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if not path.is_file() or rel in PRIMITIVE_FILES or rel.startswith(NOT_RACECHECKED):
            continue
        text = path.read_text()
        for m in BARRIER.finditer(text):
            line_start = text.rfind("\n", 0, m.start()) + 1
            if text[line_start:m.start()].lstrip().startswith("//"):
                continue  # a comment naming a barrier
            out.append((rel, m.start(), text.count("\n", 0, m.start()) + 1))
    return out


SITES = _template_sites()
def _line_text(template: str, off: int) -> str:
    text = (renderer.templates_dir() / template).read_text()
    return text[text.rfind("\n", 0, off) + 1:text.find("\n", off)].strip()


def test_unneeded_barriers_exist() -> None:
    lines = {(t, _line_text(t, off)) for t, off, _ in SITES}
    assert UNNEEDED <= lines, UNNEEDED - lines
_G = torch.Generator().manual_seed(5)


#: The problems each candidate runs: GQA with more keys than queries, and a causal one with more
#: queries than keys, whose first Q blocks see no key at all (bottom-right alignment).
PROBLEMS = (dict(nq=40, nk=56, heads=2, heads_kv=1), dict(nq=56, nk=24, heads=1, heads_kv=1))


@functools.lru_cache(maxsize=None)
def _candidates() -> list[tuple[KernelSpec, tuple[dict, ...]]]:
    """Small specs that together execute every template path, cheapest first: a hand-picked start
    (several tiles per sequence, causal, with and without key padding, GQA, the deterministic dq kernel,
    both cp.async pipeline depths, K/V fragments in registers and in shared memory, a negative softmax
    scale, a v head dim of its own; :data:`COVER_FIRST` first), then the configurations the families
    accept (:func:`_accepted`, up to :data:`ACCEPTED_SCAN` of them), so a barrier only some valid tile
    executes is still found and removed (the coverage below stops at the shortest prefix that runs
    every site)."""
    out = _hand_picked()
    seen = {spec for spec, _ in out}
    out += [(spec, PROBLEMS) for spec in _accepted() if spec not in seen]
    return out


def _accepted() -> list[KernelSpec]:
    """Every (tile, warps, knobs) each family accepts for a small causal, key-padded spec (the autotuner's
    candidate space after its static pruning), forward, backward and deterministic backward; taken
    round-robin over (family, direction) groups, each group from the most Q rows per warp (the most
    passes of a block's rows) to the fewest."""
    from fagen.autotune.candidates import enumerate_candidates
    from fagen.families import family_names

    groups = []
    for impl in family_names():
        for direction, det in (("bwd", True), ("bwd", False), ("fwd", False)):
            base = dict(direction=direction, deterministic=det, head_dim=16, dtype="float16", causal=True,
                        key_padding=True, arch="sm_90a")
            try:
                spec = KernelSpec(impl=impl, **base)
            except ValidationError:
                continue  # the family does not take the base spec
            cands = [c for c in enumerate_candidates(spec) if c.impl == impl and c.status != "rejected"]
            cands.sort(key=lambda c: (-c.block_r / c.num_warps, c.block_r * c.block_c, c.num_warps, c.knobs))
            groups.append([spec.replace(block_r=c.block_r, block_c=c.block_c, num_warps=c.num_warps,
                                        knobs=c.knobs or None) for c in cands])
    return [g[i] for i in range(max(map(len, groups), default=0)) for g in groups if i < len(g)]


def _hand_picked() -> list[tuple[KernelSpec, tuple[dict, ...]]]:
    out = []
    for impl, knobs, d, warps in (("simt", None, 16, 2), ("mma", (("stages", 2),), 16, 2), ("mma", (("stages", 1),), 16, 2),
                                  ("mma", (("stages", 2),), 96, 2), ("mma", (("stages", 1),), 96, 2)):
        common = dict(head_dim=d, dtype="float16", impl=impl, causal=True, key_padding=True, num_warps=warps,
                      block_r=16 if impl == "simt" else 32, block_c=16, knobs=knobs)
        for kpad in (True, False):  # with key padding, and without (other barriers carry the load)
            common["key_padding"] = kpad
            out.append((KernelSpec(direction="fwd", **common), PROBLEMS))
            out.append((KernelSpec(direction="bwd", deterministic=True, **common), PROBLEMS))
            out.append((KernelSpec(direction="bwd", **common), PROBLEMS))
    # the mma backward's two-dimensional layout (mma/bwd_2d.cu.j2: d = 128, 64 x 128, 8 warps), GQA,
    # three Q blocks (the prefetch; the next head's first copy into the stage the last step read), one K/V
    # block, causal dead rows; both stage counts; on sm_80 dO_i has one buffer
    # (the next one copied after dV~)
    for arch, knobs in (("sm_90", (("stages", 2),)), ("sm_80", (("stages", 2),)), ("sm_90", (("stages", 1),))):
        out.append((KernelSpec(direction="bwd", arch=arch, head_dim=128, dtype="float16", impl="mma", causal=True,
                               block_r=64, block_c=128, num_warps=8, knobs=knobs),
                    (dict(nq=150, nk=90, heads=2, heads_kv=1),)))
    # the mma forward with a negative softmax scale (Q_i negated in shared memory once)
    out.append((KernelSpec(direction="fwd", head_dim=16, dtype="float16", impl="mma", causal=True, num_warps=2,
                           block_r=32, block_c=16, knobs=(("stages", 2),)),
                (dict(nq=40, nk=56, heads=2, heads_kv=1, scale=-0.3),)))
    # the Hopper forward (one consumer warpgroup: TMA, mbarriers, wgmma)
    out.append((KernelSpec(direction="fwd", arch="sm_90a", head_dim=64, dtype="float16", causal=True,
                           impl="wgmma"), PROBLEMS))
    # the Hopper backward (one consumer warpgroup, 64 Q rows per block; tests/test_wgmma_bwd.py has more)
    out.append((KernelSpec(direction="bwd", arch="sm_90a", head_dim=64, dtype="float16", causal=True,
                           impl="wgmma", num_warps=4, block_r=64), PROBLEMS))
    # the Hopper backward past head dim 128 (the split tile, templates/wgmma/bwd_split.cu.j2: two consumer
    # warpgroups on 64 K/V rows; its epilogue's warp readback)
    out.append((KernelSpec(direction="bwd", arch="sm_90a", head_dim=192, dtype="float16", causal=True,
                           impl="wgmma"), (dict(nq=70, nk=64, heads=2, heads_kv=1),)))
    # the Hopper backward's bias through shared memory (templates/wgmma/mask_bias.cuh, BIAS_SMEM): 16-byte
    # cp.async copies where a bias row is 16-byte aligned (64 keys), element by element where not (56)
    out.append((KernelSpec(direction="bwd", arch="sm_90a", head_dim=64, dtype="float16", causal=True,
                           impl="wgmma", bias=True),
                (dict(nq=70, nk=64, heads=2, heads_kv=1), dict(nq=40, nk=56, heads=2, heads_kv=1))))
    # the deterministic dq kernel's later passes (block_r > 16 x num_warps rows: a pass per 32 rows)
    out.append((KernelSpec(direction="bwd", deterministic=True, head_dim=16, dtype="float16", impl="mma",
                           causal=True, key_padding=True, num_warps=2, block_r=128, block_c=16,
                           knobs=(("stages", 1),), arch="sm_90a"), PROBLEMS))
    # a v head dim of its own (the mma backward's K_j / V_j fragments of two widths)
    for direction in ("fwd", "bwd"):
        out.append((KernelSpec(direction=direction, head_dim=16, head_dim_v=32, dtype="float16", impl="mma",
                               causal=True, key_padding=True, num_warps=2, block_r=32, block_c=16,
                               knobs=(("stages", 2),)), PROBLEMS))
    first = {name: i for i, name in enumerate(COVER_FIRST)}
    return sorted(out, key=lambda c: first.get(c[0].name, len(first)))  # stable: the rest keep their order


#: Candidates that together execute every barrier site, each site on one where its removal is reported
#: at the barrier (the two-stage dq kernel ahead of the one-stage one, whose missing cp.async wait shows as
#: a copy read before it landed rather than at the removed wait; a 32-row one-stage backward, where the
#: 128-row one runs its step barrier clean): the coverage fixture stops at the shortest covering prefix,
#: so these are all it computes. A stale list (a new site only a later candidate reaches) makes it compute
#: every candidate up to that one; test_the_cover_list_reaches_every_barrier says which to add.
COVER_FIRST = (
    "fa_fwd_d16_fp16_causal_br32_bc16_w2_s2_mma_sm90", "fa_bwd_d16_fp16_causal_det_br32_bc16_w2_s2_mma_sm90",
    "fa_bwd_d16_fp16_causal_det_br32_bc16_w2_s1_mma_sm90",
    "fa_fwd_d16_fp16_causal_br16_bc16_w2_simt_sm90", "fa_bwd_d16_fp16_causal_br16_bc16_w2_simt_sm90",
    "fa_bwd_d128_fp16_causal_br64_bc128_w8_s1_mma_sm90", "fa_fwd_d16_fp16_causal_br32_bc16_w2_s1_mma_sm90",
    "fa_bwd_d64_fp16_causal_br64_bc64_w4_s2_wgmma_sm90a", "fa_bwd_d16_fp16_causal_det_br16_bc16_w2_simt_sm90",
    "fa_bwd_d16_fp16_causal_kpad_br32_bc16_w2_s1_mma_sm90", "fa_fwd_d64_fp16_causal_br128_bc192_w8_s2_wgmma_sm90a",
    "fa_bwd_d128_fp16_causal_br64_bc128_w8_s2_mma_sm80", "fa_bwd_d16_fp16_causal_kpad_det_br128_bc16_w2_s1_mma_sm90a",
    "fa_bwd_d16_dv32_fp16_causal_kpad_br32_bc16_w2_s2_mma_sm90", "fa_bwd_d192_fp16_causal_br64_bc64_w8_s2_wgmma_sm90a",
    "fa_bwd_d64_fp16_causal_bias_br64_bc64_w4_s2_wgmma_sm90a",
)


DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


def _inputs(spec: KernelSpec, problem: dict) -> dict:
    """Random q, k, v, do of the problem, the options (key padding when the spec has it), and o,
    lse of a plain forward for a backward spec."""
    d, dv, dt = spec.head_dim, spec.head_dim_v or spec.head_dim, DTYPES[spec.dtype]
    q, do = (torch.randn(1, problem["nq"], problem["heads"], w, generator=_G).to(dt) for w in (d, dv))
    k, v = (torch.randn(1, problem["nk"], problem["heads_kv"], w, generator=_G).to(dt) for w in (d, dv))
    opt: dict = {"causal": spec.causal}
    if "scale" in problem:
        opt["softmax_scale"] = problem["scale"]
    if spec.key_padding:
        kpm = torch.rand(1, problem["nk"], generator=_G) > 0.25
        kpm[:, 0] = True
        opt["key_padding_mask"] = kpm
    if spec.bias:
        opt["attn_bias"] = torch.randn(1, problem["heads"], problem["nq"], problem["nk"], generator=_G).to(dt)
    t = {"q": q, "k": k, "v": v, "do": do, "opt": opt}
    if spec.direction == "bwd":
        t["o"], t["lse"] = F.attention_forward(q, k, v, **opt)
    return t


def _run(spec: KernelSpec, t: dict) -> None:
    if spec.direction == "fwd":
        F.attention_forward(t["q"], t["k"], t["v"], spec=spec, **t["opt"])
    else:
        F.attention_backward(t["do"], t["q"], t["k"], t["v"], t["o"], t["lse"], spec=spec,
                             deterministic=spec.deterministic, **t["opt"])


def _run_with(monkeypatch, spec: KernelSpec, problem: dict, mod: cpu.CpuModule) -> cpu.RacecheckedLaunches:
    real = cpu.cpu_module
    t = _inputs(spec, problem)
    monkeypatch.setattr(cpu, "cpu_module", lambda s: mod if s == spec else real(s))
    with cpu.racecheck() as record:
        _run(spec, t)
    monkeypatch.setattr(cpu, "cpu_module", real)
    return record


#: How many of the accepted configurations (after the hand-picked ones) the coverage may run before it
#: gives up on a site: a barrier none of them executes is reported as unreached (add the spec that
#: reaches it to _hand_picked()), in minutes rather than after every accepted tile.
ACCEPTED_SCAN = 48


@pytest.fixture(scope="module")
def coverage() -> dict[tuple[str, int], list[int]]:
    """Which candidates execute each barrier site, computed once per test run: one cached file
    per candidate in the run's cache dir (xdist workers share it, like the builds). The workers
    split the candidates -- each takes the first one nobody has claimed -- and every worker then
    reads the same shortest prefix of candidates that covers every reachable site, so the result
    does not depend on who computed what."""
    import hashlib
    import json
    import os

    from filelock import FileLock, Timeout

    key = hashlib.sha256(repr((SITES, [c[0].name for c in _candidates()], PROBLEMS)).encode())
    for path in sorted(renderer.templates_dir().rglob("*")):
        if path.is_file():
            key.update(path.read_bytes())
    stem = Path(os.environ["FAGEN_CACHE_DIR"]) / f"racecheck-coverage-{key.hexdigest()[:16]}"
    cands = _candidates()
    files = [Path(f"{stem}-{ci}.json") for ci in range(len(cands))]

    def compute(ci: int, block: bool) -> bool:
        """Candidate ci's sites into its file; False when another worker holds it (block=False)."""
        lock = FileLock(str(files[ci]) + ".lock")
        try:
            lock.acquire(timeout=-1 if block else 0)
        except Timeout:
            return False
        try:
            if not files[ci].exists():
                files[ci].write_text(json.dumps(sorted(_candidate_sites(ci, cands[ci]))))
        finally:
            lock.release()
        return True

    def read(ci: int) -> set[int]:
        compute(ci, block=True)  # waits for a worker computing it, or computes it
        return set(json.loads(files[ci].read_text()))

    reachable = set(range(len(SITES)))
    seen: set[int] = set()
    limit = min(len(cands), len(_hand_picked()) + ACCEPTED_SCAN)
    for ci in range(limit):  # claim work until the prefix computed so far covers every site
        if reachable <= seen:
            break
        if compute(ci, block=False) and all(f.exists() for f in files[:ci + 1]):
            seen = set().union(*(read(c) for c in range(ci + 1)))
    cover: dict[tuple[str, int], list[int]] = {(t, off): [] for t, off, _ in SITES}
    seen = set()
    for ci in range(limit):  # the shortest covering prefix, the same on every worker
        if reachable <= seen:
            break
        sites = read(ci)
        seen |= sites
        for i in sites:
            cover[SITES[i][:2]].append(ci)
    return cover


def _gated_module(spec: KernelSpec) -> cpu.CpuModule:
    """``spec``'s module with every barrier site of every template it renders behind a racecheck gate
    (``tests/gates.py``, gate i for SITES[i]): one build asks of each of them in turn whether it is
    load-bearing (a gate not selected runs its barrier, so the other sites are as written)."""
    if spec not in _GATED:
        texts = {}
        for template in _gated_templates(spec):
            text = (renderer.templates_dir() / template).read_text()
            sites = [(off, BARRIER.match(text, off).group(0), i) for i, (t, off, _) in enumerate(SITES) if t == template]
            texts[template] = gates.gated(text, sites)
        _GATED[spec] = gates.module_with(spec, texts)
    return _GATED[spec]


_GATED: dict[KernelSpec, cpu.CpuModule] = {}


def _gated_templates(spec: KernelSpec) -> list[str]:
    """The templates holding SITES that the spec renders (the family's, and the partials)."""
    rendered = _rendered_templates(spec)
    return sorted(t for t in {t for t, _, _ in SITES} if t in rendered or t.startswith("partials/"))


def _rendered_templates(spec: KernelSpec) -> set[str]:
    """The family's templates for the spec's direction and the family templates they include."""
    names = set(spec.family.templates(spec.direction))
    for name in list(names):
        names |= set(re.findall(r'\{%\s*include\s+"([^"]+)"', (renderer.templates_dir() / name).read_text()))
    return names


def _candidate_sites(ci: int, candidate: tuple[KernelSpec, tuple[dict, ...]]) -> set[int]:
    """The indices into SITES of the sites the candidate executes: its gated module with every
    gate a marker that keeps its barrier (gate -2), one racecheck run per problem."""
    spec, problems = candidate
    templates = _gated_templates(spec)
    if not templates:
        return set()
    mp = pytest.MonkeyPatch()
    mod = _gated_module(spec)
    emu = mod._build(sanitize=False, racecheck=True)
    passed = set()
    emu.race_gate(-2)
    try:
        for problem in problems:
            passed |= {line for _, line in _run_with(mp, spec, problem, mod).marker_lines}
    finally:
        emu.race_gate(-1)
        mp.undo()
    return {i for i, (t, _, _) in enumerate(SITES) if t in templates and gates.site_lines(mod, i) & passed}


def test_template_barriers_are_discovered() -> None:
    assert len({t for t, _, _ in SITES}) >= 4, SITES
    assert sum(t.startswith("simt/") for t, _, _ in SITES) >= 10


@pytest.mark.slow
def test_the_cover_list_reaches_every_barrier(coverage) -> None:
    """COVER_FIRST keeps the coverage fixture short: the candidates it names run every reachable site."""
    named = {i for i, (spec, _) in enumerate(_candidates()) if spec.name in COVER_FIRST}
    missed = [f"{t}:{line}" for t, off, line in SITES if coverage[(t, off)] and not named & set(coverage[(t, off)])]
    assert not missed, f"add the spec that reaches {missed} to COVER_FIRST (the fixture computed more candidates)"


@pytest.mark.parametrize("site", SITES, ids=[f"{t}:{line}" for t, _, line in SITES])
def test_removing_a_barrier_is_a_race_naming_it(site, coverage, monkeypatch) -> None:
    template, off, line = site
    runs = coverage[(template, off)]
    assert runs, (f"no configuration the families accept executes the barrier at templates/{template}:{line} "
                  "(dead code: remove it, or add the spec that reaches it to _hand_picked())")
    idx = SITES.index(site)
    tried = []
    if (template, _line_text(template, off)) in UNNEEDED:
        runs = runs[:1]  # known: confirm on one spec that it is still not needed
    for ci in runs:  # the candidates that run this barrier, each on its problems, until one races
        spec, problems = _candidates()[ci]
        mod = _gated_module(spec)
        emu = mod._build(sanitize=False, racecheck=True)
        lines = gates.site_lines(mod, idx)
        emu.race_gate(idx)  # this barrier skipped, a marker in its place
        try:
            for problem in problems:
                try:
                    record = _run_with(monkeypatch, spec, problem, mod)
                except EmulatorRaceError as e:
                    # a removed cp.async wait: the lane reads its own copy before it landed, reported as such
                    unlanded = "cp_async_wait" in _line_text(template, off) and "has not landed" in str(e)
                    assert unlanded or any(f"marker at {emu.source_path.name}:{ln}" in str(e) for ln in lines), \
                        f"templates/{template}:{line}: the report does not name the removed barrier:\n{e}"
                    assert (template, _line_text(template, off)) not in UNNEEDED, "listed as unneeded, but it is"
                    return
                tried.append((spec.name, problem, any(ln in lines for _, ln in record.marker_lines)))
        finally:
            emu.race_gate(-1)
    assert any(ran for _, _, ran in tried), f"templates/{template}:{line}: no run passed the removed barrier"
    assert (template, _line_text(template, off)) in UNNEEDED, (
        f"templates/{template}:{line}: {_line_text(template, off)} removed, every run is still clean ({tried}): "
        "the barrier is not needed (remove it from the template)")


# --------------------------------------------------------------------------- no false positives
#: Both families, every kernel role (forward; backward pre, main, dq, post), the feature flags.
CLEAN = [
    dict(impl="simt", dtype="float16", head_dim=64, causal=True),  # the standard tiles
    dict(impl="simt", dtype="bfloat16", head_dim=24, key_padding=True, dropout=True, window=True, block_r=16,
         block_c=16, num_warps=2, det=True),
    dict(impl="simt", dtype="float64", head_dim=8, softcap=True, alibi=True, block_r=16, block_c=16, num_warps=1),
    dict(impl="mma", dtype="float16", head_dim=64, causal=True),  # the standard tiles
    dict(impl="mma", dtype="bfloat16", head_dim=40, dropout=True, key_padding=True, window=True, block_r=32,
         block_c=16, num_warps=2, det=True),
    dict(impl="mma", dtype="float16", head_dim=160, causal=True, softcap=True, det=True),
    dict(impl="mma", dtype="bfloat16", head_dim=128, causal=True, key_padding=True, dropout=True),  # standard
]


@pytest.mark.parametrize("row", CLEAN, ids=lambda r: "-".join(f"{k}" if v is True else f"{v}" for k, v in r.items()))
def test_sample_runs_clean_and_bit_identical_under_racecheck(row) -> None:
    row = dict(row)
    det = row.pop("det", False)
    flags = {f: row.pop(f) for f in ("causal", "key_padding", "dropout", "window", "softcap", "alibi") if f in row}
    sf = KernelSpec(direction="fwd", **row, **flags)
    sb = KernelSpec(direction="bwd", deterministic=det, **row, **flags)
    g = torch.Generator().manual_seed(3)
    dt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}[row["dtype"]]
    B, H, Hkv, Nq, Nk, d = 1, 2, 1, 45, 70, row["head_dim"]
    q, do = (torch.randn(B, Nq, H, d, generator=g).to(dt) for _ in range(2))
    k, v = (torch.randn(B, Nk, Hkv, d, generator=g).to(dt) for _ in range(2))
    opt: dict = {"causal": flags.get("causal", False), "seed": 1, "offset": 2}
    if flags.get("dropout"):
        opt["dropout_p"] = 0.2
    if flags.get("key_padding"):
        kpm = torch.rand(B, Nk, generator=g) > 0.3
        kpm[:, 0] = True
        opt["key_padding_mask"] = kpm
    if flags.get("window"):
        opt["window_size"] = (20, 7)
    if flags.get("softcap"):
        opt["softcap"] = 5.0
    if flags.get("alibi"):
        opt["alibi_slopes"] = torch.rand(H, generator=g) + 0.1

    def run():
        o, lse = F.attention_forward(q, k, v, spec=sf, **opt)
        return (o, lse, *F.attention_backward(do, q, k, v, o, lse, spec=sb, deterministic=det, **opt))

    plain = run()
    with cpu.racecheck() as record:
        checked = run()
    roles = [role for _, role, _ in record.launches]
    assert roles == ["main", "pre", "main", *(["dq"] if det else []), "post"], roles
    for a, b in zip(plain, checked):
        assert torch.equal(a, b)


@pytest.mark.parametrize("stages", [1, 2])
def test_widest_forward_step_runs_clean_and_bit_identical_under_racecheck(stages: int) -> None:
    """The mma forward's default 128 x 256 tile at d <= 64 (rules.fwd_widest_step): two Q blocks, causal,
    each with a whole 256-key step, then a half step (FWD_HALF_STEP) out of the other stage."""
    spec = KernelSpec(direction="fwd", head_dim=32, dtype="float16", impl="mma", causal=True, knobs={"stages": stages})
    assert (spec.tile.block_r, spec.tile.block_c) == (128, 256)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 150, 2, 32, generator=g).to(torch.float16)
    k, v = (torch.randn(1, 300, 1, 32, generator=g).to(torch.float16) for _ in range(2))
    plain = F.attention_forward(q, k, v, spec=spec, causal=True)
    with cpu.racecheck() as record:
        checked = F.attention_forward(q, k, v, spec=spec, causal=True)
    assert [role for _, role, _ in record.launches] == ["main"]
    for a, b in zip(plain, checked):
        assert torch.equal(a, b)


#: The Hopper forward (one consumer warpgroup; two read the same K/V cells, whose FastTrack read
#: vectors outgrow racecheck's per-phase budget at these tiles): causal and key padding, bf16
#: with a 3-deep pipeline, several K/V blocks per Q block.
# the default two consumer warpgroups at d = 64; one at d = 128 with three stages (two warpgroups'
# 128 x 128 K/V reads of a barrier phase pass racecheck's memory budget)
WGMMA_CLEAN = [dict(dtype="float16", head_dim=64, causal=True, key_padding=True),
               dict(dtype="bfloat16", head_dim=128, num_warps=4, knobs={"stages": 3})]


@pytest.mark.parametrize("row", WGMMA_CLEAN, ids=lambda r: f"wgmma-{r['dtype']}-d{r['head_dim']}")
def test_wgmma_forward_runs_clean_and_bit_identical_under_racecheck(row) -> None:
    row = dict(row)
    kp = row.pop("key_padding", False)
    spec = KernelSpec(direction="fwd", arch="sm_90a", impl="wgmma", key_padding=kp, **row)
    g = torch.Generator().manual_seed(4)
    dt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[row["dtype"]]
    q = torch.randn(1, 100, 2, row["head_dim"], generator=g).to(dt)
    k, v = (torch.randn(1, 300, 1, row["head_dim"], generator=g).to(dt) for _ in range(2))
    opt: dict = {"causal": spec.causal}
    if kp:
        kpm = torch.rand(1, 300, generator=g) > 0.3
        kpm[:, 0] = True
        opt["key_padding_mask"] = kpm
    plain = F.attention_forward(q, k, v, spec=spec, **opt)
    with cpu.racecheck() as record:
        checked = F.attention_forward(q, k, v, spec=spec, **opt)
    assert [role for _, role, _ in record.launches] == ["main"]
    for a, b in zip(plain, checked):
        assert torch.equal(a, b)
