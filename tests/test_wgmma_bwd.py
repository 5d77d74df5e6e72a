"""The Hopper family's backward (``wgmma``, sm_90a): selection and declines, numerics of dq / dk / dv
on the CPU emulator against a float64 oracle (flash-attn's criterion: Nq != Nk, lengths not
multiples of the tiles, both causal alignments, a window, rows that see no key, key padding, GQA),
racecheck, AddressSanitizer (clean; a removed row guard caught), its synchronisation (removing a
wait, a named barrier or a proxy fence is caught) and the SASS NVRTC compiles for sm_90a (HGMMA in
the tile loop, no ldmatrix, no spills, no local memory). No GPU needed."""
from __future__ import annotations

import re

import pytest
import torch

import fagen.functional as F
from fagen import KernelSpec, renderer, sass
from fagen.compiler import compile as compile_spec
from fagen.emulator import EmulatorError
from fagen.families import get_family
from fagen.families.wgmma import WGMMA
from fagen.families.wgmma.bwd import BWD_TMA, bwd_tensor_map_boxes, dq_split
from fagen.runtime import cpu

import gates
from featref import assert_close, attention

DT = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _spec(**kw) -> KernelSpec:
    return KernelSpec(direction="bwd", arch="sm_90a", **{"head_dim": 64, "dtype": "float16", **kw})


# --------------------------------------------------------------------------- selection
def test_chosen_for_sm90a_backward() -> None:
    for d, dtype, br in ((64, "float16", 128), (96, "float16", 64), (128, "bfloat16", 64)):
        two = _spec(head_dim=d, dtype=dtype)  # the family's default_warps: two consumer warpgroups
        assert two.impl == "wgmma" and two.name.endswith("_w8_s2_wgmma_sm90a"), two.name
        assert two.tile.block_r == br and two.tile.block_c == 128  # FlashAttention-3's tiles
        one = _spec(head_dim=d, dtype=dtype, num_warps=4)
        assert one.tile.block_r == br and one.tile.block_c == 64
        assert renderer.kernel_infos(two)[1].threads == 384 and renderer.kernel_infos(two)[0].threads == 256
        for kw in (dict(causal=True), dict(causal=True, causal_align="top_left"), dict(window=True),
                   dict(key_padding=True)):
            assert _spec(head_dim=d, dtype=dtype, **kw).impl == "wgmma", kw
    assert KernelSpec(direction="bwd", head_dim=64, dtype="float16").impl == "mma"  # sm_90: unchanged
    assert [k.role.name for k in renderer.kernel_infos(_spec())] == ["pre", "main", "post"]


@pytest.mark.parametrize("change, why", [
    (dict(head_dim=128, dropout=True, alibi=True), "dropout and alibi"),  # ptxas would spill
    (dict(attn_mask=True, num_warps=8, block_r=128), "block_r=128 with head_dim=64 and attn_mask"),  # would spill
    (dict(head_dim=128, deterministic=True, alibi=True, window=True, key_padding=True),
     "deterministic with alibi, window and key_padding at head_dim=128"),  # ptxas would spill
    (dict(head_dim=256, dropout=True, alibi=True), "head_dim=256, head_dim_v=256 with dropout and alibi: 208 fp32"),
    (dict(head_dim=160, softcap=True), "head_dim=160, head_dim_v=160 with softcap: the padded wgmma bwd"),
    (dict(head_dim=16, alibi=True), "head_dim=16, head_dim_v=16 with alibi"),  # padded: mma is cheaper
    (dict(arch="sm_90"), "arch=sm_90"),
])
def test_what_the_backward_does_not_implement_is_declined_by_name(change, why) -> None:
    fields = {"direction": "bwd", "head_dim": 64, "dtype": "float16", "arch": "sm_90a", **change}
    assert KernelSpec(**fields).impl == "mma"
    with pytest.raises(ValueError, match=re.escape(why)):
        KernelSpec(**fields, impl="wgmma")


def test_tile_rules() -> None:
    with pytest.raises(ValueError, match="block_c=64 must be 16 x num_warps=8"):
        _spec(num_warps=8, block_c=64, impl="wgmma")
    assert _spec(num_warps=4, block_r=64).tile.block_r == 64
    fs = _spec(head_dim=128, num_warps=8).family_spec
    assert dq_split(fs) == (1, 64)  # 64 Q rows: the warpgroups split dQ_i's head dim
    assert dq_split(_spec(num_warps=8).family_spec) == (1, 64)  # 128 Q rows: one m64 tile each
    assert dq_split(_spec(num_warps=4).family_spec) == (2, 64)
    boxes = bwd_tensor_map_boxes(fs)
    assert boxes["tma_q"] == (1, 64, 1, 64) and boxes["tma_k"] == (1, 128, 1, 64)
    assert boxes["tma_dqa"] == (1, 1, 16, 64, 8)  # fp32 over dq_staging_view: the whole staging tile, no swizzle
    kern = renderer.kernel_infos(_spec(head_dim=128, num_warps=8))[1]
    assert [n for _, n in kern.params[-len(BWD_TMA):]] == [n for n, *_ in BWD_TMA]
    assert WGMMA.tile_work(fs, "main") == {"HGMMA": 2 * 8 + 2 * 4 + 8} and WGMMA.tile_work(fs, "pre") is None


# --------------------------------------------------------------------------- numerics
CASES = [
    dict(d=64, dtype="float16", nw=4, B=1, Nq=100, Nk=130, H=1, Hkv=1),
    dict(d=128, dtype="bfloat16", nw=8, B=2, Nq=200, Nk=77, H=2, Hkv=1),  # GQA, two consumer warpgroups
    dict(d=128, dtype="float16", nw=4, B=1, Nq=128, Nk=128, H=1, Hkv=1),  # whole tiles only
    dict(d=64, dtype="bfloat16", nw=8, B=1, Nq=150, Nk=300, H=2, Hkv=2, causal=True, stages=3),
    dict(d=64, dtype="float16", nw=4, B=1, Nq=200, Nk=70, H=1, Hkv=1, causal=True),  # rows that see no key
    dict(d=128, dtype="float16", nw=4, B=1, Nq=90, Nk=200, H=1, Hkv=1, causal=True, align="top_left"),
    dict(d=64, dtype="float16", nw=4, B=2, Nq=70, Nk=150, H=1, Hkv=1, kpm=True),  # batch 1: every key padded
    dict(d=64, dtype="float16", nw=8, B=1, Nq=130, Nk=260, H=3, Hkv=1, window=(40, 10)),
    # d = 96 in the d = 128 tiles (zero-filled columns 96..127): the two warpgroups split dQ_i's 128
    # columns (the second stages 32 of its 64), one warpgroup computes both 64-column chunks
    dict(d=96, dtype="float16", nw=8, B=1, Nq=150, Nk=200, H=2, Hkv=1, causal=True),
    dict(d=96, dtype="bfloat16", nw=4, B=2, Nq=70, Nk=100, H=1, Hkv=1, kpm=True),
]


def _inputs(c: dict, gen: torch.Generator) -> dict:
    dt = DT[c["dtype"]]
    t = {n: torch.randn(c["B"], c["Nq" if n in ("q", "do") else "Nk"], c["H" if n in ("q", "do") else "Hkv"],
                        c["d"], generator=gen).to(dt) for n in ("q", "k", "v", "do")}
    kpm = None
    if c.get("kpm"):
        kpm = torch.rand(c["B"], c["Nk"], generator=gen) > 0.3
        kpm[-1] = False
    return {**t, "kpm": kpm}


def _run(c: dict, t: dict, spec: KernelSpec):
    causal, align, window = c.get("causal", False), c.get("align", "bottom_right"), c.get("window", (-1, -1))
    ref = dict(causal=causal, align=align, kpm=t["kpm"], window=window)
    q, k, v, do = (t[n] for n in ("q", "k", "v", "do"))
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    o64, lse64 = attention(*leaves, **ref)
    o64.backward(do.double())
    g64 = [x.grad for x in leaves]
    same = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o_pt, _ = attention(*same, **ref)
    o_pt.backward(do)
    kw = dict(causal=causal, key_padding_mask=t["kpm"])
    if align != "bottom_right":
        kw["causal_align"] = align
    if window != (-1, -1):
        kw["window_size"] = window
    grads = F.run_backward(spec, do, q, k, v, o64.to(q.dtype), lse64.float(), **kw)
    return grads, g64, [x.grad for x in same]


def _case_spec(c: dict, **kw) -> KernelSpec:
    return _spec(head_dim=c["d"], dtype=c["dtype"], num_warps=c["nw"], causal=c.get("causal", False),
                 causal_align=c.get("align", "bottom_right"), key_padding=bool(c.get("kpm")),
                 window="window" in c, knobs={"stages": c.get("stages", 2)}, **kw)


@pytest.mark.parametrize("c", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_backward_matches_float64(c) -> None:
    spec = _case_spec(c)
    assert spec.impl == "wgmma"
    t = _inputs(c, torch.Generator().manual_seed(23))
    grads, g64, g_pt = _run(c, t, spec)
    for name, ours, r64, pt in zip(("dq", "dk", "dv"), grads, g64, g_pt):
        assert_close(name, ours, r64, pt, t["q"].dtype)
    if c.get("kpm"):  # padded keys get zero gradients, a batch with no key at all zero dq
        pad = ~t["kpm"]
        assert torch.equal(grads[1][pad], torch.zeros_like(grads[1][pad]))
        assert torch.equal(grads[0][-1], torch.zeros_like(grads[0][-1]))


def test_backward_on_the_public_path() -> None:
    q = torch.randn(1, 80, 2, 64, dtype=torch.float16)
    k = torch.randn(1, 96, 2, 64, dtype=torch.float16)
    spec = _spec(causal=True)
    o, lse = F.attention_forward(q, k, k, causal=True, spec=spec.replace(direction="fwd"))
    do = torch.randn_like(q)
    dq, dk, dv = F.attention_backward(do, q, k, k, o, lse, causal=True, spec=spec)
    leaves = [x.double().requires_grad_() for x in (q, k)]
    o64, _ = attention(leaves[0], leaves[1], leaves[1], causal=True)
    o64.backward(do.double())
    same = [x.clone().requires_grad_() for x in (q, k)]
    o_pt, _ = attention(same[0], same[1], same[1], causal=True)
    o_pt.backward(do)
    assert_close("dq", dq, leaves[0].grad, same[0].grad, torch.float16)
    assert_close("dk + dv", dk + dv, leaves[1].grad, same[1].grad, torch.float16)


# --------------------------------------------------------------------------- synchronisation
TEMPLATE = "wgmma/bwd.cu.j2"
#: The race tests' configuration: two consumer warpgroups (their named barriers and the shared
#: dS^T and dQ_i staging tiles), GQA (two q heads per kv head), several Q blocks per slot.
RACE_SPEC = dict(num_warps=8, causal=True)
#: One consumer warpgroup, 64 Q rows: dV~ issued early (DV_EARLY), the other branch of the template.
RACE_SPEC_1WG = dict(num_warps=4, block_r=64, causal=True)
RACE_CASE = dict(d=64, dtype="float16", nw=8, B=1, Nq=300, Nk=150, H=2, Hkv=1, causal=True)


def _racecheck_error(spec: KernelSpec, mod: cpu.CpuModule | None = None, monkeypatch=None,
                     case: dict = RACE_CASE, huge: bool = False) -> EmulatorError | None:
    """The run's emulator error under racecheck, else None once its gradients pass the criterion.
    ``huge``: q and k scaled by 200 (scores ~1e5: every step takes the exact path of huge rows,
    partials/common.cuh); only the emulator's verdict counts then (no lse_lo: P is the rounded lse's)."""
    real = cpu.cpu_module
    if mod is not None:
        monkeypatch.setattr(cpu, "cpu_module", lambda s: mod if s == spec else real(s))
    t = _inputs(case, torch.Generator().manual_seed(5))
    if huge:
        t["q"], t["k"] = (t[n].float().mul(200.0).to(t[n].dtype) for n in ("q", "k"))
    try:
        with cpu.racecheck():
            grads, g64, g_pt = _run(case, t, spec)
    except EmulatorError as e:
        return e
    finally:
        if mod is not None:
            monkeypatch.setattr(cpu, "cpu_module", real)
    if huge:
        return None
    for name, ours, r64, pt in zip(("dq", "dk", "dv"), grads, g64, g_pt):
        assert_close(name, ours, r64, pt, torch.float16)
    return None


@pytest.mark.parametrize("kw", [RACE_SPEC, RACE_SPEC_1WG, {**RACE_SPEC, "head_dim": 96}],
                         ids=["wg2", "wg1-br64", "wg2-d96"])
def test_racecheck_clean(kw) -> None:
    case = {**RACE_CASE, "d": kw.get("head_dim", RACE_CASE["d"])}
    assert _racecheck_error(_spec(**kw), case=case) is None
    assert _racecheck_error(_spec(**kw), case=case, huge=True) is None  # the exact path too


SYNC = re.compile(r"fa_mbarrier_wait_parity\([^;]*\);|fa_wgmma_wait_group<\d>\(\);|fa_sync\(\);|"
                  r"fa_named_barrier_sync\([^;]*\);|fa_fence_proxy_async\(\);|fa_bulk_wait_group(_read)?<0>\(\);|"
                  r"__syncwarp\(\);")


def _sync_sites() -> list[tuple[int, str]]:
    text = (renderer.templates_dir() / TEMPLATE).read_text()
    out = []
    for m in SYNC.finditer(text):
        line_start = text.rfind("\n", 0, m.start()) + 1
        if not text[line_start:m.start()].lstrip().startswith("//"):
            out.append((m.start(), m.group(0)))
    return out


def test_the_template_synchronises_at_these_sites() -> None:
    kinds = [s for _, s in _sync_sites()]
    assert len(kinds) == 18, kinds  # + the epilogue's __syncwarp, the exact path's BAR_LO (huge rows), the
    # deterministic backward's wait for its reduce-add's writes
    assert sum(k.startswith("fa_mbarrier_wait_parity") for k in kinds) == 5, kinds  # + dq_full, dq_empty
    assert sum(k.startswith("fa_wgmma_wait_group") for k in kinds) == 4, kinds
    def dv_early(spec):
        consts = get_family("wgmma").template_context(spec.family_spec)["constants"]
        return next(c.value for c in consts if c.name == "DV_EARLY")

    assert dv_early(_spec(**RACE_SPEC)) is False and dv_early(_spec(**RACE_SPEC_1WG)) is True


#: Removals the emulator does not report (none: the producer's read wait after each dQ_i reduce-add
#: is also its check that no thread returns with a bulk store / reduce in flight).
UNDETECTED: set[str] = set()


_GATED: dict[KernelSpec, cpu.CpuModule] = {}


def _gated(spec: KernelSpec) -> cpu.CpuModule:
    """``spec``'s module with every synchronisation site i of the backward behind gate i
    (``tests/gates.py``): one build skips each in turn."""
    if spec not in _GATED:
        text = (renderer.templates_dir() / TEMPLATE).read_text()
        sites = [(off, call, i) for i, (off, call) in enumerate(_sync_sites())]
        _GATED[spec] = gates.mutated_module(spec, TEMPLATE, gates.gated(text, sites))
    return _GATED[spec]


@pytest.mark.parametrize("site", _sync_sites(), ids=lambda s: f"{s[0]}:{s[1][:36]}")
def test_removing_a_synchronisation_is_reported(site, monkeypatch) -> None:
    """Each wait, barrier and fence removed in turn: racecheck reports the run (or it fails)."""
    i, call = _sync_sites().index(site), site[1]
    # the configuration whose rendering holds the site (the DV_EARLY branches differ)
    spec = next(s for s in (_spec(**RACE_SPEC), _spec(**RACE_SPEC_1WG), _spec(**RACE_SPEC, deterministic=True))
                if f"/*FAGEN_SITE_{i}*/" in _gated(s).rendered.source)
    mod = _gated(spec)
    emu = mod._build(sanitize=False, racecheck=True)
    emu.race_gate(i)
    try:  # the exact path's barrier (BAR_LO) only runs on a step with a huge row
        err = _racecheck_error(spec, mod, monkeypatch, huge="BAR_LO" in call)
    except AssertionError:
        err = AssertionError("wrong gradients")
    finally:
        emu.race_gate(-1)
    assert (err is not None) == (call not in UNDETECTED), f"{call} removed: {err or 'not reported'}"


_EXIT_KERNEL = r"""
// A bulk reduce-add of 64 floats from shared memory; mode 1: return without waiting for it.
extern "C" __global__ void exits(float* acc, int mode) {
    float* s = reinterpret_cast<float*>(fa_smem_1024());
    for (int x = 0; x < 64; ++x) s[x] = 1.f;
    fa_fence_proxy_async();
    fa_bulk_reduce_add_f32(acc, s, 256);  // LINE:reduce
    fa_bulk_commit_group();
    if (mode == 1) return;
    fa_bulk_wait_group_read<0>();
}
"""


def test_a_thread_returning_with_a_bulk_reduce_in_flight_is_reported() -> None:
    """The emulator's check behind the last bulk wait of the backward: a thread must not return
    before its bulk stores / reduces have read their shared source."""
    import numpy as np

    from fagen.emulator import EmulatorKernelError, KernelSig, build

    root = renderer.templates_dir()
    source = ((root / "partials/primitives.cuh").read_text() + "\n" + (root / "wgmma/hopper.cuh").read_text()
              + _EXIT_KERNEL)
    line = next(i for i, t in enumerate(source.splitlines(), 1) if t.rstrip().endswith("// LINE:reduce"))
    mod = build(source, [KernelSig("exits", (("float*", "acc"), ("int", "mode")))])
    acc = np.zeros(64, np.float32)
    mod.launch("exits", 1, 1, 1024, [acc, 0])
    np.testing.assert_array_equal(acc, np.ones(64, np.float32))
    with pytest.raises(EmulatorKernelError, match=rf"exits with the bulk store / reduce issued at .*:{line} not waited"):
        mod.launch("exits", 1, 1, 1024, [acc, 1])


# --------------------------------------------------------------------------- sanitizer
#: Causal, key padding, GQA (two q heads per kv head), Nq and Nk ending inside a tile.
ASAN_CASE = dict(d=64, dtype="float16", nw=8, B=1, Nq=77, Nk=150, H=2, Hkv=1, causal=True, kpm=True)
#: Guards whose removal makes a kernel touch memory past a tensor's end in ASAN_CASE, and the tensor:
#: the producer's lse_i / D_i row guard (the last q head's rows past Nq) and the dK / dV rows' key
#: guard (the last K/V block's keys past Nk).
ASAN_GUARDS = (("                        if (i0 + r < len_q) {", "                        {", r"argument '(lse|delta)'"),
               ("        if (key >= len_k) continue;\n", "", r"argument 'd[kv]'"))


def test_backward_is_clean_under_asan_and_an_overrun_is_caught(monkeypatch) -> None:
    """Under AddressSanitizer (``cpu.sanitized``) the backward's pre, main and post kernels read and
    write inside their tensors and give the plain run's bits; with a row guard removed, the reads /
    writes past a tensor's end are a memory error naming it."""
    from fagen.emulator import EmulatorMemoryError

    spec = _case_spec(ASAN_CASE)
    t = _inputs(ASAN_CASE, torch.Generator().manual_seed(31))
    want, _, _ = _run(ASAN_CASE, t, spec)
    with cpu.sanitized() as rec:
        got, _, _ = _run(ASAN_CASE, t, spec)
    assert rec.roles == {"pre", "main", "post"} and all(torch.equal(a, b) for a, b in zip(got, want))

    text = (renderer.templates_dir() / TEMPLATE).read_text()
    real = cpu.cpu_module
    for guard, replacement, tensor in ASAN_GUARDS:
        assert text.count(guard) == 1, guard
        mod = gates.mutated_module(spec, TEMPLATE, text.replace(guard, replacement))
        monkeypatch.setattr(cpu, "cpu_module", lambda s, mod=mod: mod if s == spec else real(s))
        with pytest.raises(EmulatorMemoryError, match=tensor):
            with cpu.sanitized():
                _run(ASAN_CASE, t, spec)
    monkeypatch.setattr(cpu, "cpu_module", real)


# --------------------------------------------------------------------------- SASS
needs_nvdisasm = pytest.mark.skipif(sass.nvdisasm_path() is None, reason="nvdisasm (nvidia-cuda-nvdisasm) not installed")


@needs_nvdisasm
@pytest.mark.parametrize("d, causal, nw", [(64, False, 8), (96, True, 8), (128, True, 8), (128, False, 4)])
def test_sass_hgmma_in_the_tile_loop_no_ldmatrix_no_spills(d, causal, nw) -> None:
    from fagen.autotune.sassloops import tile_loop

    spec = _spec(head_dim=d, causal=causal, num_warps=nw)
    mod = compile_spec(spec)
    res = mod.resource("main")
    assert res.spill_store_bytes == 0 and res.spill_load_bytes == 0 and res.stack_frame_bytes == 0, res
    name = mod.rendered.kernel("main").name
    ops = sass.instruction_mix(mod.cubin)[name]
    assert ops.get("LDL", 0) == 0 and ops.get("STL", 0) == 0 and ops.get("LDSM", 0) == 0, ops
    for op in ("HGMMA", "UTMALDG", "UTMAREDG", "SYNCS", "USETMAXREG", "STSM", "WARPGROUP"):
        assert ops.get(op, 0) > 0, (op, ops)
    assert ops.get("RED", 0) == 0 and ops.get("REDG", 0) == 0 and ops.get("ATOMG", 0) == 0, ops
    work = get_family("wgmma").tile_work(spec.family_spec, "main")
    loop = tile_loop(sass.disassemble(mod.cubin), name, work)
    assert loop is not None and loop.count("HGMMA") == work["HGMMA"], loop
    assert loop.count("LDSM") == 0 and loop.count("LDGSTS") == 0 and loop.count("STL") == 0, loop
