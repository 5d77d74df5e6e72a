"""The Hopper forward's ping-pong (``wgmma``, sm_90a; knob ``pingpong``, FlashAttention-3's ``UsePingPong``): the two
consumer warpgroups take turns issuing their GEMMs through named barriers (``templates/wgmma/pingpong.cuh``).

The knob: 0 / 1, default 0 and elided (a spec at 0 is the spec without it: its name, source and cache key), legal
only for the forward with two consumer warpgroups (a typed error naming ``knobs`` otherwise), enumerated by the
autotuner. With 1 the forward meets the float64 oracle (causal with Nq != Nk and odd lengths, plain, varlen with
a sequence shorter than a block, one with no key and rows past the sequences) and keeps the bits of 0 (the turns
reorder issue, not arithmetic) beside every feature the forward takes at two warpgroups. Each barrier call removed
in turn is caught (a deadlock, or a barrier phase left open at the block's end); racecheck and AddressSanitizer
of a run; the SASS has BAR in the tile loop with the knob only; one run at the PTX level (FAGEN_TEST_SLOW=1).
Cases past the first are in the slow tier."""
from __future__ import annotations

import re

import pytest
import torch
from pydantic import ValidationError

import fagen.functional as F
from fagen import KernelSpec, renderer, sass
from fagen.autotune.candidates import enumerate_candidates
from fagen.compiler import compile as compile_spec
from fagen.emulator import EmulatorError
from fagen.families.wgmma import PINGPONG, WGMMA
from fagen.runtime import cpu

import gates
import wgmma_cases as W
from feature_harness import FeatCase, make_inputs, specs
from featref import attention

HEADER = "wgmma/pingpong.cuh"
PP = {"pingpong": 1}


def _pp(s: KernelSpec) -> KernelSpec:
    """``s`` with the ping-pong (its other knobs kept)."""
    return s.replace(knobs={**s.knob_values, **PP})


# --------------------------------------------------------------------------- the knob
def test_the_knob_is_elided_at_0_and_legal_only_with_two_consumer_warpgroups_of_the_forward() -> None:
    assert PINGPONG in WGMMA.knobs and (PINGPONG.default, PINGPONG.choices, PINGPONG.elided) == (0, (0, 1), True)
    base = W.spec("fwd", dict(d=128, dtype="float16"))
    assert base.num_warps == 8 and "pingpong" not in base.knob_values
    assert W.spec("fwd", dict(d=128, dtype="float16"), knobs={"pingpong": 0}) == base  # 0 is the spec without it
    on = _pp(base)
    assert on.knob_values == {"pingpong": 1, "stages": 2} and on.name == base.name.replace("_s2_", "_s2_pp1_")
    assert on.cache_key != base.cache_key
    src0, src1 = renderer.render(base).source, renderer.render(on).source
    assert "wg_pp_" not in src0 and "PINGPONG" not in src0
    assert "constexpr int PINGPONG = 1;" in src1
    body = src1[src1.index("fa_setmaxnreg_inc<CONSUMER_REGS>"):]
    assert [m.group(1) for m in re.finditer(r"wg_pp_(\w+)\(wg\);", body)] == ["start", "take", "give", "end"]
    loop = body[body.index("for (int j0 = j_begin + BLOCK_C"):]
    assert loop.index("wg_pp_take") < loop.index("issue_s(") < loop.index("issue_pv(") < loop.index("wg_pp_give")
    for kw in (dict(num_warps=4), dict(direction="bwd")):
        with pytest.raises(ValidationError, match=r"pingpong=1 needs the forward with two consumer warpgroups") as e:
            W.spec(kw.pop("direction", "fwd"), dict(d=64, dtype="float16"), impl="wgmma", knobs=PP, **kw)
        assert e.value.errors()[0]["loc"] == ("knobs",)
    # the autotuner times both values where the knob is legal, rejects 1 by name elsewhere
    cands = enumerate_candidates(W.spec("fwd", dict(d=64, dtype="float16")), sizes=(64, 128), warps=(4, 8))
    by = {(c.block_r, c.block_c, c.num_warps, c.knobs): c for c in cands if c.impl == "wgmma"}
    assert by[(128, 64, 8, (("pingpong", 1), ("stages", 2)))].status == "pending"
    assert by[(128, 64, 8, (("stages", 2),))].status == "pending"
    w4 = by[(64, 64, 4, (("pingpong", 1), ("stages", 2)))]
    assert w4.status == "rejected" and "pingpong=1 needs" in w4.reason


# --------------------------------------------------------------------------- numerics and bits
CASES = {
    "causal-odd": dict(d=64, dtype="float16", nw=8, B=1, Nq=131, Nk=203, H=2, Hkv=1, causal=True, bc=64),
    "plain-d128": dict(d=128, dtype="bfloat16", nw=8, B=2, Nq=200, Nk=330, H=1, Hkv=1),
    # a sequence shorter than a block, one with no key (no tile: no turn taken), rows past each sequence
    "varlen": dict(d=64, dtype="float16", nw=8, lens=((70, 40), (130, 257), (5, 0), (1, 9)), H=2, Hkv=1,
                   causal=True, bc=64),
}


def _forward(c: dict, pingpong: int):
    kw = dict(block_c=c["bc"]) if "bc" in c else {}
    if pingpong:
        kw["knobs"] = PP
    if "lens" in c:
        t = W.varlen_inputs(c)
        s, opts = W.varlen_spec("fwd", c, **kw), W.varlen_options(c, t)
    else:
        t = W.inputs(c)
        s, opts = W.spec("fwd", c, **kw), W.options(c, t)
    assert s.impl == "wgmma" and s.knob_values.get("pingpong", 0) == pingpong
    o, lse = F.run_forward(s, t["q"], t["k"], t["v"], **opts)
    return t, o, lse


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if i == 0 else pytest.mark.slow) for i, n in enumerate(CASES)])
def test_forward_matches_float64_and_keeps_the_bits_of_pingpong_0(name) -> None:
    c = CASES[name]
    t, o, lse = _forward(c, 1)
    if "lens" in c:
        W.check_varlen_forward(c, t, o, lse)
    else:
        W.check_forward(c, t, o, lse)
    _, o0, lse0 = _forward(c, 0)
    assert torch.equal(o, o0) and torch.equal(lse, lse0), f"{name}: pingpong=1 changed the bits"


#: The forward's features at two consumer warpgroups, each with the ping-pong: the bits of pingpong=0.
FEATURES = [
    FeatCase("window-gqa", batch=2, heads=2, heads_kv=1, seqlen_q=150, seqlen_k=211, head_dim=64, window=(70, 10)),
    FeatCase("dropout-softcap", batch=1, heads=2, heads_kv=2, seqlen_q=130, seqlen_k=140, head_dim=64, dropout_p=0.2,
             softcap=4.0, q_scale=2.0),
    FeatCase("alibi-top-left", dtype="bfloat16", batch=2, heads=2, heads_kv=1, seqlen_q=140, seqlen_k=100, head_dim=128,
             causal=True, align="top_left", alibi="bh"),
    FeatCase("mask-bias", batch=2, heads=2, heads_kv=1, seqlen_q=150, seqlen_k=130, head_dim=64, causal=True,
             mask=(2, 1, 150, 130), bias=(1, 2, 150, 130)),
    FeatCase("dead-rows-d96", dtype="bfloat16", batch=1, heads=2, heads_kv=2, seqlen_q=140, seqlen_k=90, head_dim=96,
             mask=(1, 1, 140, 1)),
    FeatCase("d256-causal", batch=1, heads=1, heads_kv=1, seqlen_q=130, seqlen_k=190, head_dim=256, causal=True),
    FeatCase("d40-varlen", batch=1, heads=2, heads_kv=1, head_dim=40, lens=((150, 30), (20, 200), (129, 129)),
             causal=True),
]


@pytest.mark.slow
@pytest.mark.parametrize("c", [pytest.param(c, id=c.name) for c in FEATURES])
def test_every_forward_feature_keeps_its_bits_with_the_ping_pong(c) -> None:
    t, opt = make_inputs(c)
    s0, _ = specs(c, "wgmma", extra=dict(arch="sm_90a"), fwd_extra=dict(num_warps=8, block_r=128))
    s1 = _pp(s0)
    o0, lse0 = F.attention_forward(t["q"], t["k"], t["v"], spec=s0, **opt)
    o1, lse1 = F.attention_forward(t["q"], t["k"], t["v"], spec=s1, **opt)
    assert not torch.isnan(o0).any()
    assert torch.equal(o0, o1) and torch.equal(lse0, lse1), f"{c.name}: pingpong=1 changed the bits"


# --------------------------------------------------------------------------- a removed barrier call is caught
#: The header's barrier calls: warpgroup 1's first hand-over (wg_pp_start), the wait for a turn (wg_pp_take), the
#: hand-over (wg_pp_give), warpgroup 0's last take (wg_pp_end).
SITE = re.compile(r"fa_named_barrier_(sync|arrive)\([^;]*\);")


def _sites() -> list[tuple[int, str]]:
    text = (renderer.templates_dir() / HEADER).read_text()
    return [(m.start(), m.group(0)) for m in SITE.finditer(text)]


_GATED: dict = {}


def _caught(spec: KernelSpec, gate: int, monkeypatch) -> bool:
    """The forward with call ``gate`` skipped: an emulator error (a deadlock, a phase left open) or a wrong O.
    Four K/V tiles per Q block: three trips of the tile loop, an odd count of hand-overs each way."""
    if spec not in _GATED:
        text = (renderer.templates_dir() / HEADER).read_text()
        _GATED[spec] = gates.mutated_module(spec, HEADER, gates.gated(text, [(o, c, i) for i, (o, c) in enumerate(_sites())]))
    mod = _GATED[spec]
    emu = mod._build(sanitize=False, racecheck=False)
    real = cpu.cpu_module
    monkeypatch.setattr(cpu, "cpu_module", lambda s: mod if s == spec else real(s))
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 130, 1, 64, generator=gen).to(torch.float16)
    k = torch.randn(1, 256, 1, 64, generator=gen).to(torch.float16)
    want, _ = attention(q.double(), k.double(), k.double())
    emu.race_gate(gate)
    try:
        o, _ = F.run_forward(spec, q, k, k)
    except EmulatorError as e:
        _ERRORS[gate] = str(e)
        return True
    finally:
        emu.race_gate(-1)
        monkeypatch.setattr(cpu, "cpu_module", real)
    return not torch.allclose(o.double(), want, atol=1e-2)


_ERRORS: dict[int, str] = {}


def test_the_sites() -> None:
    assert [c.split("(")[0] for _, c in _sites()] == ["fa_named_barrier_arrive", "fa_named_barrier_sync",
                                                      "fa_named_barrier_arrive", "fa_named_barrier_sync"]


@pytest.mark.parametrize("site", [pytest.param(s, id=f"{s[0]}:{s[1][:40]}", marks=())
                                  for i, s in enumerate(_sites())])
def test_removing_a_barrier_call_is_caught(site, monkeypatch) -> None:
    i = _sites().index(site)
    spec = W.spec("fwd", dict(d=64, dtype="float16", nw=8), block_c=64, knobs=PP)
    assert not _caught(spec, -1, monkeypatch), "the gated forward with every call in place is wrong"
    assert _caught(spec, i, monkeypatch), f"{site[1]} removed: nothing notices"
    if i == 3:  # warpgroup 0's last take: no one waits for it, the phase warpgroup 1's last hand-over opened stays open
        assert "the block ends with named barrier 2's phase open" in _ERRORS[i], _ERRORS[i]
    else:
        assert _ERRORS[i].startswith("deadlock"), _ERRORS[i]


# --------------------------------------------------------------------------- racecheck, ASan, SASS, PTX
@pytest.mark.slow
def test_a_forward_runs_clean_and_bit_identical_under_racecheck_and_asan() -> None:
    c = dict(d=64, dtype="float16", nw=8, B=1, Nq=130, Nk=330, H=2, Hkv=1, causal=True)
    t = W.inputs(c, seed=31)
    spec = W.spec("fwd", c, block_c=64, knobs=PP)
    W.assert_clean_under_racecheck_and_asan(lambda: F.run_forward(spec, t["q"], t["k"], t["v"], **W.options(c, t)),
                                            roles=frozenset({"main"}))


@pytest.mark.skipif(sass.nvdisasm_path() is None, reason="nvdisasm (nvidia-cuda-nvdisasm) not installed")
def test_sass_has_the_turns_in_the_tile_loop_with_the_knob_only() -> None:
    """d = 128's default forward: two BAR (the turn's bar.sync, the hand-over's bar.arrive) in the walked tile loop
    with pingpong=1, none without; 0 spills either way."""
    from fagen.autotune.sassloops import tile_loop

    base = W.spec("fwd", dict(d=128, dtype="float16"))
    bars = {}
    for spec in (base, _pp(base)):
        mod = compile_spec(spec)
        res = mod.resource("main")
        assert res.spill_store_bytes == 0 and res.spill_load_bytes == 0, res
        loop = tile_loop(sass.disassemble(mod.cubin), mod.rendered.kernel("main").name,
                         WGMMA.tile_work(spec.family_spec, "main"))
        bars[spec.knob_values.get("pingpong", 0)] = loop.count("BAR")
    assert bars == {0: 0, 1: 2}, bars


@pytest.mark.slow
@W.PTX_OPT_IN
def test_a_forward_at_the_ptx_level() -> None:
    """The inline PTX the GPU runs (bar.sync / bar.arrive of the turns), translated and run on the CPU: the
    float64 oracle with flash-attn's criterion."""
    c = dict(d=64, dtype="float16", nw=8, B=1, Nq=131, Nk=200, H=1, Hkv=1, causal=True)
    t = W.inputs(c, seed=41)
    spec = W.spec("fwd", c, block_c=64, knobs=PP)
    with cpu.ptx() as record:
        o, lse = F.run_forward(spec, t["q"], t["k"], t["v"], **W.options(c, t))
    assert {s for s, _, _ in record.launches} == {spec.name}
    W.check_forward(c, t, o, lse)


@pytest.mark.slow
def test_the_autotuner_times_both_values_beside_each_candidate_it_times() -> None:
    """The model cannot see what the ping-pong buys (``Knob.model_blind``): each timed candidate's twin with the
    other value is timed too, and a timing that favours the ping-pong picks it."""
    from fagen.autotune.timing import DeviceInfo
    from fagen.autotune.tuner import tune

    spec = W.spec("fwd", dict(d=64, dtype="float16"))
    calls: list[KernelSpec] = []

    def timer(s: KernelSpec, p) -> float:
        calls.append(s)
        return 1.0 if s.knob_values.get("pingpong") else 2.0

    dev = DeviceInfo("NVIDIA H100 80GB HBM3", (9, 0), 132, "sm_90a")
    r = tune(spec, batch=2, heads=4, seqlen=4096, dry_run=False, top=1, timer=timer, device=dev, persist=False,
             sizes=(64, 128), warps=(8,), progress=False)
    timed = {(c.impl, c.block_r, c.block_c, c.num_warps, c.knobs) for c in r.candidates if c.measured_ms is not None}
    for k in (k for k in timed if k[0] == "wgmma"):
        other = {kv for kv in k[4] if kv[0] != "pingpong"}
        assert {(*k[:4], tuple(sorted(other | x))) for x in (set(), {("pingpong", 1)})} <= timed, timed
    assert r.best.impl == "wgmma" and dict(r.best.knobs).get("pingpong") == 1, r.best
