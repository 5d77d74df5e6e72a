"""The Hopper family's (``wgmma``, sm_90a) deterministic backward: dQ_i's reduce-adds into dq_accum take
turns at a counter per (Q block, batch, q head, copy) (``templates/wgmma/deterministic.cuh``), in the order
the K/V blocks arrive (descending; rotated visits and two partial sums of dQ where every K/V block reaches
every Q block), so dQ is the same fp32 sum on every run. Selection (no dq role; what is declined by name),
numerics against the float64 oracle with flash-attn's criterion (fp16 / bf16, causal of both alignments,
a window, key padding, GQA / MQA, head_dim_v, softcap, dropout, packed sequences, Nq != Nk, lengths off
the tiles, rows that see no key), the summation order (dq_accum is, bit for bit, the per-K/V-block dQ
tiles added in the documented order of each copy, which ascending order is not), a turn taken out of order
reported by the emulator (a reverse schedule, a wrong turn, a missing cap; and with the wait removed the
reverse schedule sums in the other order), racecheck and AddressSanitizer of one backward, the PTX
instructions of the turns at the PTX level against a model and one forward / backward pair at the PTX
level (opt-in, FAGEN_TEST_SLOW=1). Sweeps past the first case are in the slow tier."""
from __future__ import annotations

import re
from unittest import mock

import numpy as np
import pytest
import torch

import fagen
import fagen.functional as F
from fagen import KernelSpec, masking, renderer, sass
from fagen.abi import DQ_COPIES, DQ_SEM, dq_sem_count, roles_for
from fagen.emulator import EmulatorDeadlockError
from fagen.runtime import cpu

import gates
import wgmma_cases as W

TEMPLATE = "wgmma/bwd.cu.j2"


def _det(c: dict, **kw) -> KernelSpec:
    return W.spec("bwd", c, deterministic=True, **kw)


# --------------------------------------------------------------------------- selection
def test_deterministic_backward_resolves_to_wgmma_without_a_dq_kernel() -> None:
    for d in (64, 96, 128):
        for dtype in ("float16", "bfloat16"):
            for kw in (dict(), dict(causal=True), dict(causal=True, causal_align="top_left"), dict(window=True),
                       dict(key_padding=True), dict(varlen=True), dict(dropout=True), dict(softcap=True),
                       dict(head_dim_v=64)):
                spec = KernelSpec(direction="bwd", head_dim=d, dtype=dtype, arch="sm_90a", deterministic=True, **kw)
                assert spec.impl == "wgmma", (d, dtype, kw)
    spec = KernelSpec(direction="bwd", head_dim=128, arch="sm_90a", deterministic=True)
    infos = renderer.kernel_infos(spec)
    assert [k.role.name for k in infos] == ["pre", "main", "post"]  # the family's roles: no dq kernel
    assert DQ_SEM in infos[1].params and DQ_SEM not in renderer.kernel_infos(spec.replace(deterministic=False))[1].params
    assert [r.name for r in roles_for("bwd", deterministic=True)] == ["pre", "main", "dq", "post"]  # the others'
    assert KernelSpec(direction="bwd", head_dim=64, deterministic=True).impl == "mma"  # sm_90: unchanged
    assert dq_sem_count(2, 3, 130, 64) == 2 * 3 * 3 * DQ_COPIES


def test_deterministic_with_alibi_takes_the_one_accumulator_tile_and_one_spilling_mix_is_declined_by_name() -> None:
    """ALiBi with the turns at d = 96 / 128 takes the 64 x 128 tile (its distance a float per element: no spill); with
    a window and key padding together d = 128 spills 56 bytes: declined by name (mma takes it), d = 96 does not."""
    fields = dict(direction="bwd", head_dim=128, dtype="float16", arch="sm_90a", deterministic=True, alibi=True)
    for d in (64, 96, 128):
        assert KernelSpec(**{**fields, "head_dim": d}).impl == "wgmma", d
    assert KernelSpec(**fields).tile.block_r == 64 and KernelSpec(**fields).tile.block_c == 128
    both = {**fields, "window": True, "key_padding": True}
    assert KernelSpec(**both).impl == "mma"
    with pytest.raises(ValueError, match=re.escape("deterministic with alibi, window and key_padding at head_dim=128")):
        KernelSpec(**both, impl="wgmma")
    assert KernelSpec(**{**both, "head_dim": 96}).impl == "wgmma"
    assert KernelSpec(**{**both, "window": False}).impl == "wgmma"


# --------------------------------------------------------------------------- numerics
BWD_CASES = [
    # causal (bottom-right), GQA (two q heads per kv head), B = 2, Nq != Nk, lengths off the 128 x 64 tiles
    dict(d=64, dtype="float16", nw=4, B=2, Nq=90, Nk=150, H=4, Hkv=2, causal=True),
    # top-left causal with Nq > Nk (rows that see no key), key padding (a batch with every key padded), MQA
    dict(d=128, dtype="bfloat16", nw=8, B=2, Nq=150, Nk=70, H=2, Hkv=1, causal=True, align="top_left", kpm=True),
    # a window: the K/V blocks that reach a Q block start past block 0 (turns from j_first)
    dict(d=96, dtype="float16", nw=8, B=1, Nq=130, Nk=260, H=2, Hkv=2, window=(40, 10)),
    # a v head dim of its own, softcap, MQA over three q heads
    dict(d=64, dv=128, dtype="bfloat16", nw=4, B=1, Nq=70, Nk=140, H=3, Hkv=1, softcap=True),
    dict(d=128, dtype="float16", nw=8, B=1, Nq=130, Nk=150, H=2, Hkv=1, causal=True, softcap=True),
    dict(d=128, dtype="float16", nw=8, B=1, Nq=70, Nk=100, H=2, Hkv=1, kpm=True, alibi=True),  # ALiBi: 64 x 128
    # head dims past 128: the split tile (its producer's reduce-adds a step late take the same turns)
    dict(d=256, dtype="float16", nw=8, B=1, Nq=130, Nk=150, H=2, Hkv=1, causal=True),
    dict(d=192, dv=128, dtype="bfloat16", nw=8, B=2, Nq=70, Nk=140, H=2, Hkv=2, window=(40, 10)),
]


@pytest.mark.parametrize("c", W.slow(BWD_CASES))
def test_backward_matches_float64(c) -> None:
    t = W.inputs(c, scale=2.0 if c.get("softcap") else 1.0)
    spec = _det(c)
    assert spec.impl == "wgmma", spec
    W.check_backward(c, t, *W.backward(c, t, spec))


@pytest.mark.slow
def test_backward_with_dropout_matches_float64() -> None:
    c = dict(d=64, dtype="bfloat16", nw=4, B=1, Nq=77, Nk=130, H=2, Hkv=1, causal=True, dropout=0.17)
    t = W.inputs(c)
    spec = W.dropout_spec("bwd", c, deterministic=True)
    assert spec.impl == "wgmma", spec
    W.check_backward(c, t, *W.dropout_backward(c, t, spec))


@pytest.mark.slow
def test_packed_backward_matches_float64_per_sequence() -> None:
    """Packed sequences: lengths 0 and 1, len_q > len_k, several 64-row blocks; the counters of the max length."""
    c = dict(d=64, dtype="float16", nw=4, tile=(64, 64), lens=((70, 90), (0, 5), (1, 1), (130, 40), (7, 0)),
             H=2, Hkv=1, causal=True)
    t = W.varlen_inputs(c)
    spec = W.varlen_spec("bwd", c, deterministic=True)
    assert spec.impl == "wgmma", spec
    W.check_varlen_backward(c, t, *W.varlen_backward(c, t, spec))


# --------------------------------------------------------------------------- the summation order
#: Four K/V blocks of 64 keys (one consumer warpgroup), two Q blocks of 128 rows, GQA; a window (40, 100), so
#: a row sums three K/V blocks' tiles and those reaching the second Q block start at block 1: the visits in
#: order, every add in copy 0. The spec has key padding, which isolates one K/V block (every other key padded)
#: with the same kernel.
ORDER = dict(d=64, dtype="float16", nw=4, B=1, Nq=250, Nk=250, H=2, Hkv=1, window=(40, 100), kpm=True)
#: Every K/V block reaches every Q block and n_kv <= n_q (four of each): the rotated visits, both copies.
ORDER_ROTATED = dict(d=64, dtype="float16", nw=4, B=1, Nq=500, Nk=250, H=2, Hkv=1, kpm=True)


def _dq_accum(run) -> tuple[torch.Tensor, tuple]:
    """The fp32 dq_accum of the backward ``run()`` makes (its last float32 4-D allocation) and run's result."""
    made: list[torch.Tensor] = []
    real_like, real = torch.empty_like, torch.empty

    def recording(make):
        def alloc(*args, **kwargs):
            made.append(make(*args, **kwargs))
            return made[-1]
        return alloc

    with mock.patch.object(torch, "empty_like", recording(real_like)), mock.patch.object(torch, "empty", recording(real)):
        out = run()
    return next(x for x in reversed(made) if x.dtype == torch.float32 and x.dim() == 4), out


def _order_run(c: dict, t: dict, spec: KernelSpec, kpm: torch.Tensor):
    o64, lse64, _ = W.oracle(c, t, torch.float64)  # one o and lse for every run (D and P as the full problem's)
    opts = {**W.options(c, t), "key_padding_mask": kpm}
    return _dq_accum(lambda: F.run_backward(spec, t["do"], t["q"], t["k"], t["v"], o64.to(t["q"].dtype),
                                            lse64.float(), **opts))


def _add_orders(c: dict, block_r: int, block_c: int) -> dict[int, tuple[list[int], list[int]]]:
    """The documented order of each Q block's adds (templates/wgmma/deterministic.cuh), from the mask band
    alone: the K/V blocks reaching Q block i, copy 0 and copy 1 each in descending order; copy 1 holds those
    above i where the spec has neither a causal mask nor a window (every K/V block reaches every Q block) and
    there are no more K/V blocks than Q blocks."""
    n_q, n_kv = -(-c["Nq"] // block_r), -(-c["Nk"] // block_c)
    reach = {}
    for i in range(n_q):
        c0, c1 = masking.q_block_kv_range(i * block_r, c["Nq"], c["Nk"], block_r=block_r, block_c=block_c,
                                          causal=bool(c.get("causal")), window=c.get("window", (-1, -1)))
        reach[i] = list(range(c0 // block_c, -(-c1 // block_c)))
    rotated = not c.get("causal") and c.get("window") is None and n_kv <= n_q
    assert not rotated or all(reach[i] == list(range(n_kv)) for i in range(n_q))  # no band: every pair
    return {i: (sorted((j for j in js if not (rotated and j > i)), reverse=True),
                sorted((j for j in js if rotated and j > i), reverse=True)) for i, js in reach.items()}


@pytest.mark.parametrize("c, tile", [pytest.param(ORDER, (128, 64), id="d64-in-order"),
                                     pytest.param(ORDER_ROTATED, (128, 64), id="d64-rotated"),
                                     pytest.param(dict(ORDER, d=256, nw=8), (64, 64), id="d256-split",
                                                  marks=pytest.mark.slow),
                                     pytest.param(dict(ORDER_ROTATED, d=256, nw=8, Nq=250), (64, 64),
                                                  id="d256-split-rotated", marks=pytest.mark.slow)])
def test_dq_is_the_k_v_blocks_tiles_added_in_the_documented_order(c, tile) -> None:
    """dq_accum of the deterministic backward equals, bit for bit, the per-K/V-block dQ tiles (the same kernel
    with every key outside block j padded: its dq_accum is block j's tile in the copy block j adds to, the
    other blocks adding exact zeros) summed in fp32 in each copy's order (_add_orders); ascending order gives
    other bits. dQ is the copies' sum."""
    block_r, block_c = tile
    t = W.inputs(c, seed=7)
    t["kpm"] = torch.ones(1, c["Nk"], dtype=torch.bool)
    spec = _det(c)
    assert spec.impl == "wgmma" and (spec.tile.block_r, spec.tile.block_c) == tile
    got, (dq, *_) = _order_run(c, t, spec, t["kpm"])
    assert got.shape == (c["B"], c["Nq"], c["H"] * DQ_COPIES, c["d"])
    tiles = []
    for j in range(-(-c["Nk"] // block_c)):
        only = torch.zeros_like(t["kpm"])
        only[:, block_c * j:block_c * (j + 1)] = True
        acc = _order_run(c, t, spec, only)[0].numpy()
        tiles.append(acc[:, :, 0::2] + acc[:, :, 1::2])  # the tile wherever it went (+ exact zeros)
    orders = _add_orders(c, block_r, block_c)
    assert any(o[1] for o in orders.values()) == (c is not ORDER and c.get("window") is None)
    want, up = np.zeros(got.shape, np.float32), np.zeros(got.shape, np.float32)
    for i, copies in orders.items():
        rows = slice(i * block_r, (i + 1) * block_r)
        for copy, js in enumerate(copies):
            for j in js:
                want[:, rows, copy::2] += tiles[j][:, rows]
        for j in sorted(copies[0] + copies[1]):
            up[:, rows, 0::2] += tiles[j][:, rows]
    assert not np.array_equal(want[:, :, 0::2] + want[:, :, 1::2], up[:, :, 0::2])  # the order shows in the bits
    np.testing.assert_array_equal(got.numpy(), want)
    torch.testing.assert_close(dq, (got[:, :, 0::2] + got[:, :, 1::2]).to(dq.dtype), rtol=0, atol=0)


def test_a_turn_taken_out_of_order_is_reported_not_spun_on() -> None:
    """Blocks in descending order (the emulator's reverse schedule): the first block to add waits for a
    turn no other block can give while it runs; the emulator reports it as a deadlock naming the semaphore
    and both values. (So the reverse-schedule runs of the racecheck tests do not take this kernel.)"""
    c = dict(d=64, dtype="float16", nw=4, B=1, Nq=70, Nk=130, H=2, Hkv=1)
    t = W.inputs(c)
    spec = _det(c)
    fagen.settings.configure(emu_schedule="reverse")
    try:
        with pytest.raises(EmulatorDeadlockError, match=r"semaphore wait that can never complete .* semaphore "
                                                         r"\[\d+\] .* to hold 2; it holds 0"):
            W.backward(c, t, spec)
    finally:
        fagen.settings.reset()


WAIT = "                wg_dq_turn_wait(dq_sem, sem, sdqc[{{ DQC }} * (k % STAGES) + 3]);\n"
CAP = "    if (rot && j * BLOCK_R <= i0 && i0 / BLOCK_R < top) top = i0 / BLOCK_R;\n"


@pytest.mark.slow
def test_ordering_bugs_are_caught(monkeypatch) -> None:
    """The turns in ascending K/V block order (the arrival order's reverse) are waits that can never complete;
    so is copy 0's turn of a rotated sequence counted from the highest K/V block reaching the Q block, not
    from the Q block's own index; without the wait at all the reverse schedule adds in ascending order, so
    dq_accum differs from the ordered run's, which the turns keep the same."""
    text = (renderer.templates_dir() / TEMPLATE).read_text()
    det_text = (renderer.templates_dir() / "wgmma/deterministic.cuh").read_text()
    assert text.count(WAIT) == 1 and det_text.count(CAP) == 1
    real = cpu.cpu_module
    for c, template, mutated in ((ORDER, TEMPLATE, text.replace(WAIT, WAIT.replace("sdqc[{{ DQC }} * (k % STAGES) + 3]", "j"))),
                                 (ORDER_ROTATED, "wgmma/deterministic.cuh", det_text.replace(CAP, ""))):
        t = W.inputs(c, seed=7)
        spec = _det(c)
        wrong = gates.mutated_module(spec, template, mutated)
        monkeypatch.setattr(cpu, "cpu_module", lambda s: wrong if s == spec else real(s))
        with pytest.raises(EmulatorDeadlockError, match=r"semaphore \[\d+\] .* to hold [1-9]\d*; it holds 0"):
            _order_run(c, t, spec, t["kpm"])
        monkeypatch.setattr(cpu, "cpu_module", real)
    c = ORDER
    t = W.inputs(c, seed=7)
    spec = _det(c)
    ordered, _ = _order_run(c, t, spec, t["kpm"])
    unordered = gates.mutated_module(spec, TEMPLATE, text.replace(WAIT, ""), schedule="reverse")
    monkeypatch.setattr(cpu, "cpu_module", lambda s: unordered if s == spec else real(s))
    reversed_sum, _ = _order_run(c, t, spec, t["kpm"])
    monkeypatch.setattr(cpu, "cpu_module", real)
    assert not torch.equal(ordered, reversed_sum)
    torch.testing.assert_close(ordered, reversed_sum, rtol=1e-5, atol=1e-5)


def test_dq_bits_repeat_whatever_the_order_of_independent_blocks() -> None:
    """Two calls give the same bits (the counters are zeroed per call: a second call on reused counters
    would wait for turns past the first call's and be reported), and so do calls whose independent blocks
    run in another order: the batches swapped (the blocks of batch 1's data run first) and the two q heads
    of a kv head swapped (each CTA's loop adds the other head's dQ_i first)."""
    c = BWD_CASES[0]
    assert c["B"] == 2 and c["H"] == 2 * c["Hkv"]
    t = W.inputs(c)
    spec = _det(c)
    o64, lse64, _ = W.oracle(c, t, torch.float64)
    o, lse = o64.to(t["q"].dtype), lse64.float()

    def run(perm_b, perm_h):
        x = {n: t[n][perm_b][:, :, perm_h] if n in ("q", "do") else t[n][perm_b] for n in ("q", "k", "v", "do")}
        return F.run_backward(spec, x["do"], x["q"], x["k"], x["v"], o[perm_b][:, :, perm_h],
                              lse[perm_b][:, perm_h].contiguous(), **W.options(c, t))[0]

    same_b, same_h = list(range(c["B"])), list(range(c["H"]))
    swap_b = same_b[::-1]
    swap_h = [h ^ 1 for h in same_h]  # heads 2g, 2g + 1 share kv head g
    base = run(same_b, same_h)
    assert torch.equal(base, run(same_b, same_h))
    assert torch.equal(base, run(swap_b, same_h)[swap_b])
    assert torch.equal(base, run(same_b, swap_h)[:, :, swap_h])


# --------------------------------------------------------------------------- SASS
@pytest.mark.skipif(sass.nvdisasm_path() is None, reason="nvdisasm (nvidia-cuda-nvdisasm) not installed")
@pytest.mark.parametrize("d, causal", [(64, False), (128, True)])
def test_sass_the_tile_loop_as_the_plain_backwards_no_spills(d, causal) -> None:
    """No spill; the turns are the producer's (an ld.acquire loop and a red.release per dQ_i: LDG.E.STRONG.GPU,
    REDG), so the consumers' tile loop keeps its HGMMA and issues at most 1.15x the plain backward's
    instructions (benchmarks/sass_cost.py: d64 421 / 419, d128 causal 294 / 291 per 1e6 FLOPs)."""
    from fagen.autotune.sassloops import tile_loop
    from fagen.compiler import compile as compile_spec
    from fagen.families import get_family

    loops = []
    for det in (False, True):
        spec = KernelSpec(direction="bwd", head_dim=d, dtype="float16", arch="sm_90a", causal=causal,
                          deterministic=det)
        assert spec.impl == "wgmma"
        mod = compile_spec(spec)
        res = mod.resource("main")
        assert res.spill_store_bytes == 0 and res.spill_load_bytes == 0 and res.stack_frame_bytes == 0, res
        name = mod.rendered.kernel("main").name
        work = get_family("wgmma").tile_work(spec.family_spec, "main")
        loop = tile_loop(sass.disassemble(mod.cubin), name, work)
        assert loop is not None and loop.count("HGMMA") == work["HGMMA"], loop
        loops.append(loop)
        ops = sass.instruction_mix(mod.cubin)[name]
        assert (ops.get("REDG", 0) > 0) == det and ops.get("UTMAREDG", 0) > 0, ops  # the release: det only
    assert loops[1].total() <= 1.15 * loops[0].total(), (loops[0].total(), loops[1].total())


# --------------------------------------------------------------------------- racecheck, ASan, PTX
#: Causal, key padding, GQA, dropout, Nq and Nk ending inside a tile.
CHECK_BWD = dict(d=64, dtype="float16", nw=4, B=1, Nq=50, Nk=130, H=2, Hkv=1, causal=True, kpm=True, dropout=0.2)


@pytest.mark.slow
def test_a_deterministic_backward_runs_clean_and_bit_identical_under_racecheck_and_asan() -> None:
    t = W.inputs(CHECK_BWD, seed=32)
    spec = W.dropout_spec("bwd", CHECK_BWD, deterministic=True)
    assert spec.impl == "wgmma"
    W.assert_clean_under_racecheck_and_asan(lambda: W.dropout_backward(CHECK_BWD, t, spec)[0])


_TURNS_PTX = """
.version 8.0
.target sm_90a
.address_size 64
.visible .entry turns(.param .u64 psem, .param .u64 pout)
{
    .reg .b32 %r<8>;
    .reg .pred %p<2>;
    .reg .b64 %rd<6>;
    ld.param.u64 %rd1, [psem];
    ld.param.u64 %rd2, [pout];
    mov.u32 %r1, %ctaid.x;
$wait:
    ld.acquire.gpu.global.b32 %r2, [%rd1];
    setp.ne.s32 %p1, %r2, %r1;
    @%p1 bra $wait;
    fence.proxy.async.global;
    ld.global.b32 %r3, [%rd2];
    mul.wide.u32 %rd3, %r1, 4;
    add.s64 %rd4, %rd2, %rd3;
    st.global.b32 [%rd4+4], %r3;
    add.s32 %r4, %r3, %r1;
    st.global.b32 [%rd2], %r4;
    fence.proxy.async.global;
    red.release.gpu.global.add.s32 [%rd1], 1;
    ret;
}
"""


def test_the_turns_instructions_at_the_ptx_level() -> None:
    """ld.acquire.gpu, red.release.gpu.add.s32 and fence.proxy.async.global, the turns' PTX, translated and run:
    block b waits until the counter holds b, appends the running sum and passes the turn on (the PTX ISA's
    semantics: the load returns the value, the reduction adds; modelled by a loop over the blocks in turn)."""
    from fagen.emulator import KernelSig
    from fagen.emulator.ptx import build_ptx

    mod = build_ptx(_TURNS_PTX, [KernelSig("turns", (("int*", "sem"), ("int*", "out")))])
    n = 6
    sem, out = np.zeros(1, np.int32), np.zeros(n + 1, np.int32)
    mod.launch("turns", n, 1, 0, [sem, out])
    want, total = np.zeros(n + 1, np.int32), 0
    for b in range(n):  # the model: block b in its turn
        want[b + 1] = total
        total += b
    want[0] = total
    np.testing.assert_array_equal(out, want)
    assert sem[0] == n


@pytest.mark.slow
@W.PTX_OPT_IN
def test_a_forward_and_deterministic_backward_pair_at_the_ptx_level() -> None:
    """The inline PTX the GPU runs (the turns' ld.acquire / red.release / fence.proxy.async.global and
    cp.async.bulk.wait_group), translated and run on the CPU: the float64 criterion, and dq_accum as the
    emulator branch's, bit for bit (opt-in: FAGEN_TEST_SLOW=1)."""
    c = dict(d=64, dtype="float16", nw=4, B=1, Nq=70, Nk=150, H=2, Hkv=1, causal=True)
    t = W.inputs(c, seed=41)
    fwd, bwd = W.spec("fwd", c), _det(c)
    want, _ = _dq_accum(lambda: W.backward(c, t, bwd))
    with cpu.ptx() as record:
        o, lse = F.run_forward(fwd, t["q"], t["k"], t["v"], **W.options(c, t))
        got, (grads, g64, g_pt) = _dq_accum(lambda: W.backward(c, t, bwd))
    assert {s for s, _, _ in record.launches} == {fwd.name, bwd.name}
    W.check_forward(c, t, o, lse)
    W.check_backward(c, t, grads, g64, g_pt)
    assert torch.equal(got, want)
