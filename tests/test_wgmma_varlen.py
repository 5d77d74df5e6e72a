"""The Hopper family (``wgmma``, sm_90a) with packed sequences (varlen: cu_seqlens, the seqlen arguments
the max lengths): tensor maps over the packed tensors as one batch, each tile placed at its sequence's
first token, rows past a sequence's end (the next sequence's) masked, the staged dQ_i rows past len_q
exact zeros, the forward's last V_j rows past len_k zeroed. Selection; both directions on the CPU
emulator, each sequence against the float64 oracle of that sequence alone with flash-attn's criterion
(fp16 / bf16, lengths 0 and 1, sequences shorter than one tile and longer than several, len_q != len_k,
rows that see no key, causal of both alignments, a window, GQA, softcap, ALiBi, sinks, a v head dim of
its own); a sequence's results do not move when its neighbour's tokens change (the forward's not even
for inf / NaN); equal lengths give the fixed-length kernels' bits; huge scores through lse_lo; the
public varlen entry point on CPU tensors with FAGEN_EMULATE_ARCH=sm_90a; racecheck and AddressSanitizer
of a forward and a backward (clean, bit-identical) and one forward / backward pair at the PTX level
(opt-in, FAGEN_TEST_SLOW=1). Sweeps past the first case of each direction are in the slow tier."""
from __future__ import annotations


import pytest
import torch

import fagen
import fagen.functional as F
from fagen import settings
from fagen.runtime import cpu

import sinkref as S
import wgmma_cases as W

#: lengths 0 and 1, shorter than a tile, several tiles, len_q != len_k, len_q > len_k (rows that see no
#: key with bottom-right causal), a sequence with no key
LENS = ((70, 90), (0, 5), (1, 1), (130, 40), (7, 0), (17, 17))


# --------------------------------------------------------------------------- selection
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_varlen_resolves_to_wgmma(direction) -> None:
    for kw in (dict(), dict(causal=True), dict(causal=True, align="top_left"), dict(window=(1, 1)),
               dict(softcap=True), dict(alibi=True), dict(dv=64)) + ((dict(sinks=True),) if direction == "fwd" else ()):
        for d in (64, 128):
            spec = W.varlen_spec(direction, dict(d=d, dtype="bfloat16", **kw))
            assert spec.impl == "wgmma" and spec.varlen, spec
    assert W.varlen_spec(direction, dict(d=64, dtype="float16"), arch="sm_90").impl == "mma"  # sm_90: unchanged


# --------------------------------------------------------------------------- numerics
FWD_CASES = [
    # GQA, bottom-right causal (sequence 3: 90 rows see no key; sequence 4: no key at all), 64 x 64 tiles:
    # sequences of 1 row, shorter than a tile, over three
    dict(d=64, dtype="float16", nw=4, tile=(64, 64), lens=LENS, H=2, Hkv=1, causal=True),
    # top-left causal, softcap, two consumer warpgroups, the default key block (192)
    dict(d=128, dtype="bfloat16", nw=8, lens=((200, 250), (64, 64), (1, 30), (33, 0), (0, 0)), H=2, Hkv=2,
         causal=True, align="top_left", softcap=True),
    # a window, sinks (a sequence with no key: the sink's logit), a v head dim of its own, MQA
    dict(d=64, dv=128, dtype="float16", nw=4, tile=(64, 64), lens=((90, 130), (5, 3), (0, 2), (40, 41), (6, 0)),
         H=3, Hkv=1, window=(20, 5), sinks=True),
    # ALiBi ([B, H] slopes: sequence b takes row b), bottom-right causal, d = 96
    dict(d=96, dtype="bfloat16", nw=8, lens=((150, 100), (1, 1), (20, 70)), H=2, Hkv=1, causal=True, alibi=True),
]


@pytest.mark.parametrize("c", W.slow(FWD_CASES))
def test_forward_matches_float64_per_sequence(c) -> None:
    t = W.varlen_inputs(c, scale=2.0 if c.get("softcap") else 1.0)
    spec = W.varlen_spec("fwd", c)
    assert spec.impl == "wgmma", spec
    o, lse = F.run_forward(spec, t["q"], t["k"], t["v"], **W.varlen_options(c, t))
    W.check_varlen_forward(c, t, o, lse)


BWD_CASES = [
    # GQA, bottom-right causal (rows that see no key, a sequence with none, one with no query), 128 x 128
    dict(d=64, dtype="bfloat16", nw=8, lens=LENS, H=2, Hkv=1, causal=True),
    # top-left causal with a window, ALiBi, d = 128 (64 x 128 tiles): sequences over several Q blocks
    dict(d=128, dtype="float16", nw=8, lens=((150, 200), (3, 1), (0, 9), (64, 64), (65, 129)), H=2, Hkv=2,
         causal=True, align="top_left", window=(40, -1), alibi=True),
    # softcap, a v head dim of its own (one consumer warpgroup), MQA
    dict(d=64, dv=128, dtype="float16", nw=4, lens=((90, 70), (1, 50), (30, 0), (17, 17)), H=3, Hkv=1,
         softcap=True),
    dict(d=96, dtype="bfloat16", nw=8, lens=((100, 130), (129, 64), (2, 2)), H=2, Hkv=1, window=(30, 5)),
]


@pytest.mark.parametrize("c", W.slow(BWD_CASES))
def test_backward_matches_float64_per_sequence(c) -> None:
    t = W.varlen_inputs(c, scale=2.0 if c.get("softcap") else 1.0)
    spec = W.varlen_spec("bwd", c)
    assert spec.impl == "wgmma", spec
    W.check_varlen_backward(c, t, *W.varlen_backward(c, t, spec))


# --------------------------------------------------------------------------- neighbours
#: Each sequence's last tiles reach into the next one (64 x 64 forward tiles, 64 Q rows / 64 keys backward).
NEIGHBOURS = dict(d=64, dtype="float16", nw=4, tile=(64, 64), lens=((50, 70), (40, 30), (30, 45)), H=2, Hkv=1,
                  causal=True)


@pytest.mark.slow
@pytest.mark.parametrize("finite", [True, False], ids=["finite", "inf-nan"])
def test_a_sequence_is_untouched_by_its_neighbours_tokens(finite) -> None:
    """Changing sequence 1's q, k, v and dO to other values leaves every output and gradient of sequences 0
    and 2 bit for bit as it was: the rows past a sequence's end that its tiles load enter only masked (P = 0,
    dS = 0) and the staged dQ_i rows past len_q add exact zeros to the next sequence's dq_accum rows. With
    inf and NaN among them, the forward's o and lse of sequences 0 and 2 stay as they were too (its last
    V_j rows past len_k are zeroed before P V); the backward's isolation holds for finite values."""
    c = NEIGHBOURS
    t = W.varlen_inputs(c)
    fwd, bwd = W.varlen_spec("fwd", c), W.varlen_spec("bwd", c)
    assert fwd.impl == bwd.impl == "wgmma"

    def run(t):
        o, lse = F.run_forward(fwd, t["q"], t["k"], t["v"], **W.varlen_options(c, t))
        dq, dk, dv = F.run_backward(bwd, t["do"], t["q"], t["k"], t["v"], o, lse, **W.varlen_options(c, t))
        return o, lse.transpose(0, 1), dq, dk, dv

    base = run(t)
    cq, ck = t["cu_q"].tolist(), t["cu_k"].tolist()
    moved = dict(t)
    for n, lo in (("q", cq), ("do", cq), ("k", ck), ("v", ck)):
        moved[n] = t[n].clone()
        moved[n][lo[1]:lo[2]] = (3 * torch.randn_like(t[n][lo[1]:lo[2]].float())).to(t[n].dtype)
        if not finite:  # the first and last rows, which the neighbours' tiles load
            moved[n][lo[1], 0, :3] = torch.tensor([float("inf"), float("nan"), -float("inf")])
            moved[n][lo[2] - 1, -1, -3:] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    after = run(moved)
    names = ("o", "lse", "dq", "dk", "dv") if finite else ("o", "lse")
    for name, a, b, lo in zip(names, base, after, (cq, cq, cq, ck, ck)):
        for s in (0, 2):
            r = slice(lo[s], lo[s + 1])
            assert torch.equal(a[r], b[r]), f"{name} of sequence {s} moved with sequence 1's tokens"
        r = slice(lo[1], lo[2])
        assert not torch.equal(a[r], b[r]), name  # sequence 1's own did move


@pytest.mark.slow
def test_sequences_of_one_length_give_the_fixed_length_kernels_bits() -> None:
    """Packed sequences of equal lengths are the fixed-length batch bit for bit (o, lse, dq, dk, dv): the
    next sequence's rows that the packed tiles load where the fixed-length ones zero-fill enter only
    multiplied by exact zeros."""
    c = dict(d=64, dtype="float16", nw=4, tile=(64, 64), lens=((70, 90),) * 3, H=2, Hkv=1, causal=True)
    t = W.varlen_inputs(c, seed=9)
    fixed = dict(c, B=3, Nq=70, Nk=90)
    tf = {n: t[n].reshape(3, -1, *t[n].shape[1:]) for n in ("q", "k", "v", "do")}
    tf.update(kpm=None, sinks=None, alibi=None)
    kw = dict(block_r=64, block_c=64)
    o, lse = F.run_forward(W.varlen_spec("fwd", c), t["q"], t["k"], t["v"], **W.varlen_options(c, t))
    of, lsef = F.run_forward(W.spec("fwd", fixed, **kw), tf["q"], tf["k"], tf["v"], **W.options(fixed, tf))
    assert torch.equal(o, of.reshape(o.shape)) and torch.equal(lse, lsef.permute(1, 0, 2).reshape(lse.shape))
    g = F.run_backward(W.varlen_spec("bwd", c), t["do"], t["q"], t["k"], t["v"], o, lse, **W.varlen_options(c, t))
    gf = F.run_backward(W.spec("bwd", fixed, **kw), tf["do"], tf["q"], tf["k"], tf["v"], of, lsef,
                        **W.options(fixed, tf))
    for name, a, b in zip(("dq", "dk", "dv"), g, gf):
        assert torch.equal(a, b.reshape(a.shape)), name


# --------------------------------------------------------------------------- the public entry point
@pytest.fixture
def emulate_sm90a(monkeypatch: pytest.MonkeyPatch):
    """FAGEN_EMULATE_ARCH=sm_90a for the test (CPU tensors take what a GPU of that arch takes)."""
    monkeypatch.setenv("FAGEN_EMULATE_ARCH", "sm_90a")
    settings.reset()
    yield
    monkeypatch.delenv("FAGEN_EMULATE_ARCH", raising=False)
    settings.reset()


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list:
    """The specs of the CPU modules the launches use, in order."""
    seen: list = []
    real = cpu.cpu_module

    def record(spec):
        seen.append(spec)
        return real(spec)
    monkeypatch.setattr(cpu, "cpu_module", record)
    return seen


def test_flash_attn_varlen_func_runs_wgmma_on_sm90a(emulate_sm90a, launched) -> None:
    """fagen.flash_attn_varlen_func forward and backward (autograd) reach the wgmma kernels; each
    sequence's o and gradients against the float64 oracle of that sequence alone."""
    c = dict(d=64, dtype="float16", lens=((40, 60), (0, 3), (1, 1), (70, 20)), H=2, Hkv=1, causal=True)
    t = W.varlen_inputs(c, seed=5)
    leaves = [t[n].clone().requires_grad_() for n in ("q", "k", "v")]
    o = fagen.flash_attn_varlen_func(*leaves, t["cu_q"], t["cu_k"], 70, 60, causal=True)
    (o * t["do"]).sum().backward()
    assert [(s.direction, s.impl, s.varlen) for s in launched] == [("fwd", "wgmma", True), ("bwd", "wgmma", True)]
    o64, _, g64 = W.varlen_oracle(c, t, torch.float64, grads=True)
    o_pt, _, g_pt = W.varlen_oracle(c, t, torch.float16, grads=True)
    S.criterion("o", o.detach(), o64, o_pt, torch.float16)
    W.check_varlen_backward(c, t, [x.grad for x in leaves], g64, g_pt)


# --------------------------------------------------------------------------- racecheck, ASan, PTX
#: GQA, bottom-right causal, 64-row Q blocks over sequences that end inside them (dQ_i rows past len_q; the
#: forward's 128 x 192 tiles on two consumer warpgroups: the last V_j rows past len_k zeroed).
CHECK_BWD = dict(d=64, dtype="float16", nw=4, lens=((50, 60), (0, 4), (70, 30), (9, 9)), H=2, Hkv=1, causal=True)


@pytest.mark.slow
def test_a_varlen_forward_and_backward_run_clean_and_bit_identical_under_racecheck_and_asan() -> None:
    """The backward, and the forward with its last tile's V_j rows past len_k zeroed behind a named barrier."""
    t = W.varlen_inputs(CHECK_BWD, seed=32)
    fwd = W.varlen_spec("fwd", CHECK_BWD, num_warps=8)  # two consumer warpgroups: each reads the other's zeros
    spec = W.varlen_spec("bwd", CHECK_BWD)
    assert fwd.impl == spec.impl == "wgmma"

    def forward():
        return F.run_forward(fwd, t["q"], t["k"], t["v"], **W.varlen_options(CHECK_BWD, t))
    W.assert_clean_under_racecheck_and_asan(lambda: (*forward(), *W.varlen_backward(CHECK_BWD, t, spec)[0]))


@pytest.mark.slow
@W.PTX_OPT_IN
def test_a_forward_and_backward_pair_at_the_ptx_level() -> None:
    """The inline PTX the GPU runs for a varlen forward and backward, translated and run on the CPU: each
    sequence against the float64 oracle (opt-in, as tests/test_ptx_kernels.py's heavy rows)."""
    c = dict(d=64, dtype="float16", nw=4, lens=((70, 50), (0, 3), (1, 9), (40, 70)), H=2, Hkv=1, causal=True)
    t = W.varlen_inputs(c, seed=41)
    fwd, bwd = W.varlen_spec("fwd", c), W.varlen_spec("bwd", c)
    with cpu.ptx() as record:
        o, lse = F.run_forward(fwd, t["q"], t["k"], t["v"], **W.varlen_options(c, t))
        grads, g64, g_pt = W.varlen_backward(c, t, bwd)
    assert {s for s, _, _ in record.launches} == {fwd.name, bwd.name}
    W.check_varlen_forward(c, t, o, lse)
    W.check_varlen_backward(c, t, grads, g64, g_pt)


@pytest.mark.slow
def test_varlen_on_huge_scores_takes_the_exact_path() -> None:
    """Scores of ~1e9 on packed sequences (tests/test_large_values.py's case at the family's head dim): the
    forward's lse_lo ([H, total_q], at cu_seqlens_q[b] + r) reaches the backward's exact P^T."""
    import test_large_values as L
    from feature_harness import FeatCase

    # (The criterion there is torch's fp32 error, zero where every row is one-hot: a sequence of one key, or
    # these lengths without ALiBi, fails it by the wgmma backward's D = rowsum(dO o O) against its dP rounding
    # as the fixed-length kernel does on the same data, varlen or not.)
    case = FeatCase("varlen", dtype="bfloat16", lens=((20, 3), (37, 45), (5, 9)), alibi="h", q_scale=2e4, head_dim=64,
                    heads=2, heads_kv=1)
    L.test_features_at_large_scores("wgmma", "sm_90a", case)


@pytest.mark.slow
def test_packed_sequences_with_dropout_softcap_window_and_gqa() -> None:
    """varlen and dropout together (each sequence's keep bits at its own (b, h, row, col), as the other
    families draw them): both directions against the float64 reference with the same keep mask, lengths
    0 and 1, a query-less and a key-less sequence, sequences longer than a block."""
    from feature_harness import FeatCase, check_case

    c = FeatCase("varlen-dropout", heads=4, heads_kv=2, causal=True, window=(40, -1), softcap=4.0, dropout_p=0.25,
                 head_dim=64, lens=((130, 200), (0, 5), (1, 1), (140, 133), (7, 0), (17, 17)), q_scale=2.0)
    fwd, bwd = check_case(c, "wgmma", extra={"arch": "sm_90a"})
    assert fwd.impl == bwd.impl == "wgmma"
