"""The Hopper family's backward (``wgmma``, sm_90a) at head dims past 128 (Gemma's 256, MLA's 192 with
head_dim_v 128): the split tile (``fagen.families.wgmma.bwd.split_dkv``: 64 Q rows x 64 K/V rows, warpgroup 0
dK~, warpgroup 1 dV~ and dQ_i). Selection, the shared-memory and register bounds declined by name, and the
backward on the CPU emulator against the float64 oracle with flash-attn's criterion (fp16 / bf16, causal of
both alignments, a window, GQA / MQA, key padding, softcap, ALiBi, dropout, varlen, a v head dim of its
own, Nq != Nk, lengths off the tiles, rows with no key); racecheck and AddressSanitizer of one backward
(clean, bit-identical) and one forward / backward pair at the PTX level (opt-in, FAGEN_TEST_SLOW=1).
Sweeps past the first case are in the slow tier."""
from __future__ import annotations

import re

import pytest

import fagen.functional as F
from fagen import renderer
from fagen.families.wgmma import bwd as B
from fagen.runtime import cpu

import gates
import wgmma_cases as W


# --------------------------------------------------------------------------- selection
@pytest.mark.parametrize("d, dv, stages", [(256, 256, 1), (192, 192, 2), (192, 128, 3), (256, 128, 2), (128, 256, 2),
                                           (64, 192, 3), (256, 192, 1)])
def test_wide_head_dims_resolve_to_the_split_tile(d, dv, stages) -> None:
    """64 x 64 on two consumer warpgroups; three Q_i / dO_i stages where they fit, else two, else one."""
    for kw in (dict(), dict(causal=True, softcap=True, alibi=True, key_padding=True)):
        spec = W.spec("bwd", dict(d=d, dv=dv, dtype="bfloat16"), **kw)
        assert spec.impl == "wgmma", spec
        assert (spec.tile.block_r, spec.tile.block_c, spec.num_warps) == (64, 64, 8)
        assert spec.knob_values == {"stages": stages}
        assert spec.smem_bytes <= 227 * 1024
        assert "constexpr bool SPLIT_DKV = true;" in renderer.render(spec).source


def test_what_does_not_fit_is_declined_by_name() -> None:
    # d = 256 with dv = 256 and two Q_i / dO_i stages: with the fp32 dQ_i staging, 264 KiB
    assert W.spec("bwd", dict(d=256, dtype="float16", stages=2)).impl == "mma"  # impl=None: another family
    with pytest.raises(ValueError, match=r"head_dim=256, head_dim_v=256: the wgmma backward's 64 x 64 tile needs "
                                         r"270336 bytes of shared memory \(K_j, V_j, 2 Q_i / dO_i stages"):
        W.spec("bwd", dict(d=256, dtype="float16", stages=2), impl="wgmma")
    # one stage only where two do not fit (the other tiles: the family's choices, 2 and 3)
    with pytest.raises(ValueError, match=r"stages=1 must be one of \(2, 3\)"):
        W.spec("bwd", dict(d=192, dtype="float16", stages=1), impl="wgmma")
    with pytest.raises(ValueError, match=r"stages=1 must be one of \(2, 3\)"):
        W.spec("bwd", dict(d=128, dtype="float16", stages=1), impl="wgmma")
    # d = 256 with dropout and ALiBi: the dK~ warpgroup's registers beside the keep bits (ptxas would spill)
    assert W.spec("bwd", dict(d=256, dv=128, dtype="float16", alibi=True), dropout=True).impl == "mma"
    assert W.spec("bwd", dict(d=192, dv=128, dtype="float16", alibi=True), dropout=True).impl == "wgmma"
    with pytest.raises(ValueError, match=r"head_dim=256, head_dim_v=128 with dropout and alibi: 208 fp32 registers"):
        W.spec("bwd", dict(d=256, dv=128, dtype="float16", alibi=True), dropout=True, impl="wgmma")
    with pytest.raises(ValueError, match=r"block_c=128 must be 64 at head_dim=192"):  # two stages: the tile fits
        W.spec("bwd", dict(d=192, dv=128, dtype="float16", stages=2), block_c=128, impl="wgmma")
    with pytest.raises(ValueError, match=r"block_c\n.*no tile fits"):  # the default three: 64 x 128 does not
        W.spec("bwd", dict(d=192, dv=128, dtype="float16"), block_c=128, impl="wgmma")
    with pytest.raises(ValueError, match=r"num_warps=4 must be 8 at head_dim=192"):
        W.spec("bwd", dict(d=192, dv=128, dtype="float16", nw=4), impl="wgmma")


def test_the_head_dims_up_to_128_keep_their_tiles() -> None:
    spec = W.spec("bwd", dict(d=128, dtype="float16"))
    assert (spec.tile.block_r, spec.tile.block_c, spec.num_warps) == (64, 128, 8)
    assert not B.split_dkv(spec.family_spec)
    assert "SPLIT_DKV" not in renderer.render(spec).source


# --------------------------------------------------------------------------- numerics
BWD_CASES = [
    # d = 192, causal, GQA (two q heads per kv head), Nq != Nk, lengths off the 64 x 64 tile
    dict(d=192, dtype="float16", nw=8, B=1, Nq=70, Nk=90, H=2, Hkv=1, causal=True),
    # MLA's d = 192, dv = 128, key padding (a batch with every key padded), softcap
    dict(d=192, dv=128, dtype="bfloat16", nw=8, B=2, Nq=70, Nk=100, H=2, Hkv=1, kpm=True, softcap=True),
    # Gemma's d = 256 (one Q_i / dO_i stage: the producer's loads wait for each step's dQ_i), bf16, causal,
    # GQA, three Q blocks
    dict(d=256, dtype="bfloat16", nw=8, B=1, Nq=150, Nk=100, H=2, Hkv=1, causal=True),
    # d = 256, dv = 128: rows that see no key (top-left, Nq > Nk), ALiBi
    dict(d=256, dv=128, dtype="float16", nw=8, B=1, Nq=90, Nk=50, H=2, Hkv=2, causal=True, align="top_left",
         alibi=True),
    # a wide v head dim (dv = 256) under a narrow, padded one (d = 96: dK~ and dQ_i on zero columns 96..127),
    # a window, MQA
    dict(d=96, dv=256, dtype="bfloat16", nw=8, B=1, Nq=100, Nk=80, H=3, Hkv=1, window=(30, 5)),
    dict(d=192, dtype="bfloat16", nw=8, B=1, Nq=65, Nk=129, H=1, Hkv=1, causal=True, softcap=True, alibi=True),
]


@pytest.mark.parametrize("c", W.slow(BWD_CASES))
def test_backward_matches_float64(c) -> None:
    t = W.inputs(c, scale=2.0 if c.get("softcap") else 1.0)
    spec = W.spec("bwd", c)
    assert spec.impl == "wgmma" and B.split_dkv(spec.family_spec), spec
    W.check_backward(c, t, *W.backward(c, t, spec))


DROPOUT_CASES = [
    # dropout (the dK~ and dV~ warpgroups draw the same keep bits), causal, GQA, key padding
    dict(d=192, dv=128, dtype="float16", nw=8, B=1, Nq=70, Nk=90, H=2, Hkv=1, causal=True, kpm=True, dropout=0.2),
    dict(d=256, dtype="bfloat16", nw=8, B=1, Nq=70, Nk=60, H=2, Hkv=2, softcap=True, dropout=0.1),
]


@pytest.mark.slow
@pytest.mark.parametrize("c", DROPOUT_CASES)
def test_dropout_backward_matches_float64(c) -> None:
    t = W.inputs(c)
    spec = W.dropout_spec("bwd", c)
    assert spec.impl == "wgmma" and B.split_dkv(spec.family_spec), spec
    W.check_backward(c, t, *W.dropout_backward(c, t, spec))


VARLEN_CASES = [
    # packed sequences (one with no query, one with no key), bottom-right causal, GQA
    dict(d=192, dv=128, dtype="bfloat16", nw=8, lens=((70, 90), (1, 30), (0, 9), (40, 0), (65, 65)), H=2, Hkv=1,
         causal=True),
]


@pytest.mark.slow
@pytest.mark.parametrize("c", VARLEN_CASES)
def test_varlen_backward_matches_float64_per_sequence(c) -> None:
    t = W.varlen_inputs(c)
    spec = W.varlen_spec("bwd", c)
    assert spec.impl == "wgmma" and B.split_dkv(spec.family_spec), spec
    W.check_varlen_backward(c, t, *W.varlen_backward(c, t, spec))


# --------------------------------------------------------------------------- racecheck, ASan, PTX
#: Both warpgroups' barriers (dS^T from the dK~ warpgroup to the dV~ warpgroup's dQ_i, the staging tile to the
#: producer's reduce-add) with one Q_i / dO_i stage (d = 256): causal, key padding, GQA (four steps per CTA),
#: Nq and Nk ending inside a tile.
CHECK_BWD = dict(d=256, dtype="float16", nw=8, B=1, Nq=70, Nk=50, H=2, Hkv=1, causal=True, kpm=True)


@pytest.mark.slow
def test_a_wide_backward_runs_clean_and_bit_identical_under_racecheck_and_asan() -> None:
    t = W.inputs(CHECK_BWD, seed=32)
    spec = W.spec("bwd", CHECK_BWD)
    assert spec.impl == "wgmma"
    W.assert_clean_under_racecheck_and_asan(lambda: W.backward(CHECK_BWD, t, spec)[0])


@pytest.mark.slow
@W.PTX_OPT_IN
def test_a_forward_and_backward_pair_at_the_ptx_level() -> None:
    """The inline PTX the GPU runs for a d = 192, dv = 128 forward and backward, translated and run on the
    CPU: the flash-attn criterion against the float64 oracle (opt-in: FAGEN_TEST_SLOW=1)."""
    c = dict(d=192, dv=128, dtype="bfloat16", nw=8, B=1, Nq=70, Nk=80, H=2, Hkv=1, causal=True)
    t = W.inputs(c, seed=41)
    fwd, bwd = W.spec("fwd", c), W.spec("bwd", c)
    with cpu.ptx() as record:
        o, lse = F.run_forward(fwd, t["q"], t["k"], t["v"], **W.options(c, t))
        grads, g64, g_pt = W.backward(c, t, bwd)
    assert {s for s, _, _ in record.launches} == {fwd.name, bwd.name}
    W.check_forward(c, t, o, lse)
    W.check_backward(c, t, grads, g64, g_pt)


# --------------------------------------------------------------------------- synchronisation sites
SPLIT_TEMPLATE = "wgmma/bwd_split.cu.j2"
SYNC = re.compile(r"fa_mbarrier_wait_parity\([^;]*\);|fa_wgmma_wait_group<\d>\(\);|fa_named_barrier_sync\([^;]*\);|"
                  r"fa_fence_proxy_async\(\);|__syncwarp\(\);")
#: One Q_i / dO_i stage (d = 256), three steps per CTA: the producer refills the slot the warpgroups just read.
RACE_SPLIT = dict(d=256, dtype="float16", nw=8, B=1, Nq=150, Nk=50, H=1, Hkv=1)


def _split_sites() -> list[tuple[int, str]]:
    """The waits, barriers and fences of the split tile's consumers (each site of the macros rendered for both
    warpgroups where they share it)."""
    text = (renderer.templates_dir() / SPLIT_TEMPLATE).read_text()
    return [(m.start(), m.group(0)) for m in SYNC.finditer(text)]


def test_the_split_tile_synchronises_at_these_sites() -> None:
    kinds = [s for _, s in _split_sites()]
    assert len(kinds) == 13, kinds
    assert sum(k.startswith("fa_named_barrier_sync") for k in kinds) == 4, kinds  # BAR_DS, BAR_DQ in each branch


_GATED: dict = {}


def _gated(spec):
    if spec not in _GATED:
        text = (renderer.templates_dir() / SPLIT_TEMPLATE).read_text()
        sites = [(off, call, i) for i, (off, call) in enumerate(_split_sites())]
        _GATED[spec] = gates.mutated_module(spec, SPLIT_TEMPLATE, gates.gated(text, sites))
    return _GATED[spec]


@pytest.mark.slow
@pytest.mark.parametrize("site", _split_sites(), ids=lambda s: f"{s[0]}:{s[1][:36]}")
def test_removing_a_synchronisation_of_the_split_tile_is_reported(site, monkeypatch) -> None:
    """Each wait, barrier and fence of the two warpgroups removed in turn: racecheck reports the run (or its
    gradients fail the criterion)."""
    from fagen.emulator import EmulatorError

    i = _split_sites().index(site)
    spec = W.spec("bwd", RACE_SPLIT)
    assert spec.knob_values == {"stages": 1}
    mod = _gated(spec)
    emu = mod._build(sanitize=False, racecheck=True)
    emu.race_gate(i)
    real = cpu.cpu_module
    monkeypatch.setattr(cpu, "cpu_module", lambda s: mod if s == spec else real(s))
    t = W.inputs(RACE_SPLIT, seed=5)
    err = None
    try:
        with cpu.racecheck():
            grads, g64, g_pt = W.backward(RACE_SPLIT, t, spec)
        W.check_backward(RACE_SPLIT, t, grads, g64, g_pt)
    except (EmulatorError, AssertionError) as e:
        err = e
    finally:
        emu.race_gate(-1)
    assert err is not None, f"{site[1]} removed: not reported"
