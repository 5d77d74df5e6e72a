"""The Hopper forward's schedule (``wgmma``, sm_90a; FlashAttention-3's): K_j and V_j in pipelines of their own
(a full and an empty mbarrier per K slot and per V slot: S = Q K_j^T waits for K_j alone, a K slot is refilled
once S has read it) and the producer's tensor-map prefetch. The schedule moves no arithmetic: the outputs keep
the bits of the schedule before it (one full / empty pair per K_j + V_j slot), stated here by their digests, and
meet the float64 oracle with flash-attn's criterion (causal, GQA, a window with key padding and three stages,
varlen, dropout, softcap, a v head dim of its own, d = 256). Each new arrive / wait removed in turn is caught
(racecheck, a deadlock or a wrong O); racecheck and AddressSanitizer of a forward (clean, bit-identical); the
SASS shows the separate waits and the prefetch (UTMACCTL.PF); one forward at the PTX level (opt-in,
FAGEN_TEST_SLOW=1). Cases past the first are in the slow tier."""
from __future__ import annotations

import hashlib
import re

import pytest
import torch

import fagen.functional as F
from fagen import KernelSpec, renderer, sass
from fagen.compiler import compile as compile_spec
from fagen.emulator import EmulatorError
from fagen.families.wgmma import WGMMA
from fagen.runtime import cpu

import gates
import wgmma_cases as W
from featref import attention

TEMPLATE = "wgmma/fwd.cu.j2"

# --------------------------------------------------------------------------- numerics and bits
#: name -> (case, the sha256 prefix of the forward's o (as int16) and lse bytes on the emulator with the schedule
#: before the separate K / V pipelines). ``bc``: the key block (64: several K/V tiles per Q block, both slots
#: refilled).
CASES = {
    "gqa-causal-d128": (dict(d=128, dtype="bfloat16", nw=8, B=1, Nq=130, Nk=330, H=2, Hkv=1, causal=True, bc=64),
                        "d0bfa13b18670a39"),
    "stages3-window-kpm-d64": (dict(d=64, dtype="float16", nw=4, B=2, Nq=70, Nk=300, H=1, Hkv=1, window=(100, 20),
                                    stages=3, bc=64, kpm=True), "e1582ecb4cb830d5"),
    "varlen-d64": (dict(d=64, dtype="float16", nw=8, tile=(128, 64), lens=((70, 200), (130, 90), (5, 0)), H=2,
                        Hkv=1, causal=True), "2f3e082043611ea2"),
    "dropout-d64": (dict(d=64, dtype="float16", nw=8, B=1, Nq=100, Nk=260, H=2, Hkv=2, dropout=0.25, bc=64),
                    "4b0c9bc0f251c28b"),
    "softcap-d128": (dict(d=128, dtype="bfloat16", nw=8, B=1, Nq=90, Nk=270, H=1, Hkv=1, softcap=True, bc=64),
                     "247a58d411c9790a"),
    "dv-d192-128": (dict(d=192, dv=128, dtype="bfloat16", nw=8, B=1, Nq=70, Nk=200, H=2, Hkv=1, bc=64),
                    "eb1d053273c3b98c"),
    "d256-causal": (dict(d=256, dtype="float16", nw=8, B=1, Nq=90, Nk=180, H=1, Hkv=1, causal=True, bc=64),
                    "8e482764ac48fa1b"),
}


def _forward(c: dict):
    """The case's (spec, tensors, o, lse) on the emulator."""
    kw = dict(block_c=c["bc"]) if "bc" in c else {}
    if "lens" in c:
        t, s, opts = W.varlen_inputs(c), W.varlen_spec("fwd", c, **kw), None
        opts = W.varlen_options(c, t)
    elif "dropout" in c:
        t, s = W.inputs(c), W.dropout_spec("fwd", c, **kw)
        opts = W.dropout_options(c, t)
    else:
        t, s = W.inputs(c, scale=2.0 if c.get("softcap") else 1.0), W.spec("fwd", c, **kw)
        opts = W.options(c, t)
    assert s.impl == "wgmma", s
    o, lse = F.run_forward(s, t["q"], t["k"], t["v"], **opts)
    return s, t, o, lse


def _digest(o: torch.Tensor, lse: torch.Tensor) -> str:
    h = hashlib.sha256()
    h.update(o.contiguous().view(torch.int16).numpy().tobytes())
    h.update(lse.contiguous().float().numpy().tobytes())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if i == 0 else pytest.mark.slow) for i, n in enumerate(CASES)])
def test_forward_keeps_its_bits_and_matches_float64(name) -> None:
    c, want = CASES[name]
    _, t, o, lse = _forward(c)
    assert _digest(o, lse) == want, f"{name}: the forward's bits changed"
    if "lens" in c:
        W.check_varlen_forward(c, t, o, lse)
    elif "dropout" in c:
        W.check_dropout_forward(c, t, o, lse)
    else:
        W.check_forward(c, t, o, lse)


def test_the_forward_has_a_k_and_a_v_pipeline_and_prefetches_its_tensor_maps() -> None:
    """Four mbarriers per slot (K full, V full, K empty, V empty) and Q's; S waits on K_j's full barrier, P~ V on
    V_j's; the producer's elected lane prefetches the three tensor maps before its first load."""
    for stages in (2, 3):
        spec = W.spec("fwd", dict(d=128, dtype="float16", stages=stages))
        layout = WGMMA.smem_layout(spec.family_spec)
        assert {b.name: b.count for b in layout.buffers}["bars"] == 1 + 4 * stages
    src = renderer.render(W.spec("fwd", dict(d=128, dtype="float16"))).source
    body = src[src.index("wg == CONSUMER_WGS"):]
    assert [m.group(1) for m in re.finditer(r"fa_prefetch_tensormap\(&(tma_\w)\)", body)] == ["tma_q", "tma_k", "tma_v"]
    assert body.index("fa_prefetch_tensormap") < body.index("fa_tma_load_4d")
    loop = body[body.index("for (int j0 = j_begin + BLOCK_C"):]
    waits = re.findall(r"fa_mbarrier_wait_parity\(&(\w+)\[", loop)
    assert waits[:2] == ["k_full", "v_full"] and loop.index("issue_s(") < loop.index("&v_full[prev]"), waits
    assert loop.index("fa_mbarrier_arrive(&k_empty[st])") < loop.index("softmax(j0")


# --------------------------------------------------------------------------- a removed arrive / wait is caught
#: The new synchronisation sites: the producer's waits for a free K / V slot, the consumers' waits for K_j and
#: V_j, their arrivals once S / P~ V have read a slot. The arrival after the last P~ V is not among them: the
#: producer has issued its last load by then, nothing waits for that slot again.
NEW_SITE = re.compile(r"fa_mbarrier_wait_parity\(&[kv]_(full|empty)\[[^;]*\);|"
                      r"fa_mbarrier_arrive\(&(k_empty\[(0|st)\]|v_empty\[prev\])\);")


def _sites() -> list[tuple[int, str]]:
    text = (renderer.templates_dir() / TEMPLATE).read_text()
    return [(m.start(), m.group(0)) for m in NEW_SITE.finditer(text)]


def test_the_new_sites() -> None:
    calls = [c for _, c in _sites()]
    assert sum(c.startswith("fa_mbarrier_wait_parity") for c in calls) == 6, calls  # 2 producer, 4 consumer
    assert sum(c.startswith("fa_mbarrier_arrive") for c in calls) == 3, calls


_GATED: dict = {}


def _caught(spec: KernelSpec, gate: int, monkeypatch, racecheck: bool) -> bool:
    """The forward with site ``gate`` skipped: an emulator error (a race, a deadlock, a misuse) or a wrong O."""
    key = (spec, racecheck)
    if key not in _GATED:
        text = (renderer.templates_dir() / TEMPLATE).read_text()
        sites = [(off, call, i) for i, (off, call) in enumerate(_sites())]
        _GATED[key] = gates.mutated_module(spec, TEMPLATE, gates.gated(text, sites))
    mod = _GATED[key]
    emu = mod._build(sanitize=False, racecheck=racecheck)
    real = cpu.cpu_module
    monkeypatch.setattr(cpu, "cpu_module", lambda s: mod if s == spec else real(s))
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 130, 1, 64, generator=gen).to(torch.float16)
    k = torch.randn(1, 400, 1, 64, generator=gen).to(torch.float16)  # 7 K/V tiles: both slots refilled
    want, _ = attention(q.double(), k.double(), k.double(), causal=True)
    emu.race_gate(gate)
    try:
        if racecheck:
            with cpu.racecheck():
                o, _ = F.run_forward(spec, q, k, k)
        else:
            o, _ = F.run_forward(spec, q, k, k)
    except EmulatorError:
        return True
    finally:
        emu.race_gate(-1)
        monkeypatch.setattr(cpu, "cpu_module", real)
    return not torch.allclose(o.double(), want, atol=1e-2)


@pytest.mark.parametrize("site", [pytest.param(s, id=f"{s[0]}:{s[1][:40]}", marks=() if i == 0 else pytest.mark.slow)
                                  for i, s in enumerate(_sites())])
def test_removing_a_new_arrive_or_wait_is_caught(site, monkeypatch) -> None:
    i = _sites().index(site)
    spec = W.spec("fwd", dict(d=64, dtype="float16", causal=True), block_c=64)
    assert spec.impl == "wgmma"
    assert not _caught(spec, -1, monkeypatch, racecheck=False), "the gated forward with every site in place is wrong"
    assert _caught(spec, i, monkeypatch, racecheck=False) or _caught(spec, i, monkeypatch, racecheck=True), (
        f"{site[1]} removed: neither racecheck nor the numerics notice")


# --------------------------------------------------------------------------- racecheck, ASan, SASS, PTX
@pytest.mark.slow
def test_a_forward_runs_clean_and_bit_identical_under_racecheck_and_asan() -> None:
    c = dict(d=64, dtype="float16", nw=8, B=1, Nq=130, Nk=330, H=2, Hkv=1, causal=True)
    t = W.inputs(c, seed=31)
    spec = W.spec("fwd", c, block_c=64)
    assert spec.impl == "wgmma"
    W.assert_clean_under_racecheck_and_asan(lambda: F.run_forward(spec, t["q"], t["k"], t["v"], **W.options(c, t)),
                                            roles=frozenset({"main"}))


@pytest.mark.skipif(sass.nvdisasm_path() is None, reason="nvdisasm (nvidia-cuda-nvdisasm) not installed")
def test_sass_waits_on_k_and_v_apart_and_prefetches_the_tensor_maps() -> None:
    """The tile loop's mbarrier operations: the wait for K_j, the wait for V_{j-1}, the arrivals on K_j's and
    V_{j-1}'s empty barriers (4 SYNCS); the producer's loop: two waits for a free slot and two expect_tx (4);
    three UTMACCTL.PF (prefetch.tensormap) before the first TMA load; no spills."""
    from fagen.autotune.sassloops import tile_loop

    spec = W.spec("fwd", dict(d=128, dtype="float16"))
    mod = compile_spec(spec)
    res = mod.resource("main")
    assert res.spill_store_bytes == 0 and res.spill_load_bytes == 0, res
    name = mod.rendered.kernel("main").name
    text = sass.disassemble(mod.cubin)
    loop = tile_loop(text, name, WGMMA.tile_work(spec.family_spec, "main"))
    assert loop.count("SYNCS") == 4 and loop.count("HGMMA") == 128 // 16 + spec.tile.block_c // 16, loop.mix
    prod = tile_loop(text, name, WGMMA.producer_work(spec.family_spec), anchor=("UTMALDG",), smallest=True)
    assert prod.count("SYNCS") == 4, prod.mix
    lines = [ln for ln in text.splitlines() if "UTMACCTL.PF" in ln or "UTMALDG" in ln]
    assert [("PF" in ln) for ln in lines[:4]] == [True, True, True, False], lines[:4]


@pytest.mark.slow
@W.PTX_OPT_IN
def test_a_forward_at_the_ptx_level() -> None:
    """The inline PTX the GPU runs (prefetch.tensormap, the K and V mbarriers), translated and run on the CPU:
    the float64 oracle with flash-attn's criterion."""
    c = dict(d=64, dtype="float16", nw=4, B=1, Nq=70, Nk=200, H=2, Hkv=1, causal=True)
    t = W.inputs(c, seed=41)
    spec = W.spec("fwd", c, block_c=64)
    with cpu.ptx() as record:
        o, lse = F.run_forward(spec, t["q"], t["k"], t["v"], **W.options(c, t))
    assert {s for s, _, _ in record.launches} == {spec.name}
    W.check_forward(c, t, o, lse)
