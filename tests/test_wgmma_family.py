"""The Hopper family (``wgmma``, sm_90a): selection and declines, numerics of its forward on the
CPU emulator against a float64 oracle (flash-attn's criterion), its synchronisation (each
mbarrier wait, wgmma wait and the init barrier removed in turn breaks the run, six of them only
under racecheck), the tensor-map
launch hook, and the SASS NVRTC compiles for sm_90a (HGMMA in the tile loop, TMA, no ldmatrix,
no spills, the setmaxnreg register split). No GPU needed."""
from __future__ import annotations

import re

import pytest
import torch

import fagen.functional as F
from fagen import KernelSpec, renderer, sass
from fagen.abi import FWD_MAIN, is_tensormap
from fagen.compiler import compile as compile_spec
from fagen.emulator import EmulatorError, EmulatorRaceError
from fagen.families import BUILTIN_FAMILIES, FamilySpec, get_family
from fagen.families.mma import MMA
from fagen.families.wgmma import WGMMA, padded_dim, register_split, tensor_map_boxes
from fagen.runtime import cpu
from fagen.tma import TensorMapFields

import gates
from featref import assert_close, assert_lse_close, attention

DT = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _spec(**kw) -> KernelSpec:
    return KernelSpec(direction="fwd", arch="sm_90a", **{"head_dim": 64, "dtype": "float16", **kw})


# --------------------------------------------------------------------------- selection
def test_registered_and_chosen_for_sm90a_only() -> None:
    assert WGMMA in BUILTIN_FAMILIES and get_family("wgmma") is WGMMA
    for d, dtype in ((64, "float16"), (96, "float16"), (128, "bfloat16"), (192, "bfloat16"), (256, "float16")):
        spec = _spec(head_dim=d, dtype=dtype)
        assert spec.impl == "wgmma" and spec.name.endswith("_s2_wgmma_sm90a"), spec.name
        assert _spec(head_dim=d, dtype=dtype, causal=True, causal_align="top_left").impl == "wgmma"
        assert _spec(head_dim=d, dtype=dtype, key_padding=True, window=True).impl == "wgmma"
    # the default sm_90 path is unchanged: wgmma needs the arch-specific target
    assert KernelSpec(direction="fwd", head_dim=64, dtype="float16").impl == "mma"
    assert _spec().cache_key != _spec().replace(arch="sm_90", impl="mma").cache_key


@pytest.mark.parametrize("change, why", [
    (dict(direction="bwd", head_dim=128, dropout=True, alibi=True), "dropout and alibi"),  # ptxas would spill
    (dict(direction="bwd", head_dim=128, attn_mask=True, bias=True, alibi=True), "bias with alibi"),  # would spill
    (dict(head_dim=80, alibi=True), "head_dim=80, head_dim_v=80 with alibi"),  # padded: mma is cheaper
    (dict(head_dim=32, softcap=True), "head_dim=32, head_dim_v=32 with softcap"),
    (dict(dtype="float32"), "dtype=float32"),
    (dict(head_dim=224, softcap=True), "head_dim=224, head_dim_v=224 with softcap"),  # padded: mma is cheaper
    (dict(arch="sm_90"), "arch=sm_90"),
])
def test_what_it_does_not_implement_is_declined_by_name(change, why) -> None:
    fields = {"direction": "fwd", "head_dim": 64, "dtype": "float16", "arch": "sm_90a", **change}
    spec = KernelSpec(**fields)
    assert spec.impl != "wgmma"  # impl=None resolves to mma (or simt for float32)
    with pytest.raises(ValueError, match=re.escape(why)):
        KernelSpec(**fields, impl="wgmma")


def test_tile_and_warps() -> None:
    spec = _spec(num_warps=8, block_r=128)  # two consumer warpgroups
    assert spec.impl == "wgmma" and spec.tile.block_r == 128
    assert renderer.kernel_infos(spec)[0].threads == 384  # + the producer warpgroup
    with pytest.raises(ValueError, match="block_r=64 must be 16 x num_warps=8"):
        _spec(num_warps=8, block_r=64, impl="wgmma")
    with pytest.raises(ValueError, match=r"num_warps must be one of \(4, 8\)"):
        _spec(num_warps=2, block_r=64, impl="wgmma")
    assert _spec(num_warps=2).impl == "mma"
    assert _spec(knobs={"stages": 3}).knob_values == {"stages": 3}


def test_register_split() -> None:
    # FlashAttention-3's split with two consumer warpgroups: 168 at launch -> 240 / 24
    assert register_split(8, 1) == (240, 24)
    assert register_split(4, 2) == (232, 24)  # 128 at launch: (232 + 24) / 2
    for nw in (4, 8):
        for blocks in (1, 2, 3):
            consumer, producer = register_split(nw, blocks)
            launch = min(255, 65536 // ((32 * nw + 128) * blocks)) // 8 * 8
            assert consumer % 8 == 0 and 24 <= consumer <= 240
            assert consumer * 32 * nw + producer * 128 <= launch * (32 * nw + 128)


# --------------------------------------------------------------------------- tensor maps
def test_tensor_maps_of_the_launch() -> None:
    spec = _spec(head_dim=128, num_warps=8, block_r=128)
    kern = renderer.kernel_infos(spec)[0]
    maps = [n for c, n in kern.params if is_tensormap(c)]
    want = tuple((c.replace("T*", "__half*"), n) for c, n in FWD_MAIN.params)  # the ABI's, T made concrete
    assert maps == ["tma_q", "tma_k", "tma_v"] and kern.params[:len(FWD_MAIN.params)] == want
    q = torch.zeros(2, 100, 3, 128, dtype=torch.float16)
    k = torch.zeros(2, 70, 1, 128, dtype=torch.float16)
    got = WGMMA.tensor_maps(spec.family_spec, kern.role, {"q": q, "k": k, "v": k})
    assert all(isinstance(f, TensorMapFields) for f in got.values())
    assert got["tma_q"].dims == (128, 3, 100, 2) and got["tma_q"].box == (64, 1, 128, 1)
    assert got["tma_k"].box == (64, 1, spec.tile.block_c, 1) and got["tma_k"].swizzle == 128
    assert tensor_map_boxes(spec.family_spec)["tma_v"] == (1, spec.tile.block_c, 1, 64)
    # a family whose role takes tensor maps must build them
    with pytest.raises(NotImplementedError, match="takes tensor maps"):
        MMA.tensor_maps(spec.family_spec, kern.role, {})
    assert MMA.tensor_maps(FamilySpec("fwd", 64, "float16", "sm_90"), FWD_MAIN, {}) == {}


def test_strides_a_tensor_map_cannot_take_are_copied_not_refused() -> None:
    """mma takes any row stride, so this family does too: an input whose rows are not a multiple
    of 16 bytes apart is copied for its tensor map (tests/test_wgmma_inputs.py: every such layout)."""
    spec = _spec()
    q = torch.randn(1, 64, 1, 72, dtype=torch.float16)[..., :64]  # row stride 72 elements: 144 bytes, fine
    k = torch.randn(1, 64, 1, 68, dtype=torch.float16)[..., :64]  # 136 bytes: not a multiple of 16
    o, lse = F.run_forward(spec, q, k, k)
    want, want_lse = F.run_forward(spec, q, k.contiguous(), k.contiguous())
    assert torch.equal(o, want) and torch.equal(lse, want_lse)


# --------------------------------------------------------------------------- numerics
CASES = [
    dict(d=64, dtype="float16", nw=4, B=1, Nq=100, Nk=130, H=1, Hkv=1),
    dict(d=128, dtype="bfloat16", nw=8, B=2, Nq=200, Nk=77, H=2, Hkv=1),  # GQA, two consumer warpgroups
    dict(d=64, dtype="float16", nw=8, B=1, Nq=150, Nk=300, H=2, Hkv=2, causal=True, stages=3),
    dict(d=64, dtype="bfloat16", nw=4, B=1, Nq=200, Nk=70, H=1, Hkv=1, causal=True),  # rows that see no key
    dict(d=128, dtype="float16", nw=4, B=1, Nq=90, Nk=200, H=1, Hkv=1, causal=True, align="top_left"),
    dict(d=64, dtype="float16", nw=4, B=2, Nq=70, Nk=150, H=1, Hkv=1, kpm=True),  # batch 1: every key padded
    dict(d=64, dtype="float16", nw=4, B=1, Nq=130, Nk=260, H=1, Hkv=1, window=(40, 10)),
    # the default key block (192) with two consumer warpgroups; a negative softmax scale (the row
    # extreme is the min of the raw scores) and a zero one
    dict(d=128, dtype="bfloat16", nw=8, bc=192, B=1, Nq=140, Nk=450, H=1, Hkv=1, causal=True, scale=-0.3),
    dict(d=64, dtype="float16", nw=4, bc=192, B=1, Nq=100, Nk=230, H=2, Hkv=1, scale=0.0),
    # d = 96: one and a half panels (TMA zero-fills columns 96..127, O += P V at N = 128)
    dict(d=96, dtype="float16", nw=8, bc=192, B=1, Nq=150, Nk=230, H=2, Hkv=1, causal=True),
    dict(d=96, dtype="bfloat16", nw=4, B=2, Nq=70, Nk=150, H=1, Hkv=1, kpm=True),
    # d = 192 / 256: three / four panels, the default key block shrunk to 64 (shared memory)
    dict(d=192, dtype="bfloat16", nw=8, B=1, Nq=150, Nk=200, H=1, Hkv=1, causal=True),
    dict(d=256, dtype="float16", nw=4, B=2, Nq=70, Nk=150, H=2, Hkv=1, kpm=True),
]


def _run_case(c: dict, gen: torch.Generator):
    dt = DT[c["dtype"]]
    q = torch.randn(c["B"], c["Nq"], c["H"], c["d"], generator=gen).to(dt)
    k = torch.randn(c["B"], c["Nk"], c["Hkv"], c["d"], generator=gen).to(dt)
    v = torch.randn(c["B"], c["Nk"], c["Hkv"], c["d"], generator=gen).to(dt)
    causal, align, window = c.get("causal", False), c.get("align", "bottom_right"), c.get("window", (-1, -1))
    kpm = None
    if c.get("kpm"):
        kpm = torch.rand(c["B"], c["Nk"], generator=gen) > 0.3
        kpm[-1] = False
    tile = {"block_c": c["bc"]} if "bc" in c else {}
    spec = _spec(head_dim=c["d"], dtype=c["dtype"], num_warps=c["nw"], block_r=16 * c["nw"], causal=causal, **tile,
                 causal_align=align, key_padding=kpm is not None, window=window != (-1, -1),
                 knobs={"stages": c.get("stages", 2)})
    assert spec.impl == "wgmma"
    kw = dict(causal=causal, key_padding_mask=kpm)
    if align != "bottom_right":
        kw["causal_align"] = align
    if window != (-1, -1):
        kw["window_size"] = window
    ref = dict(causal=causal, align=align, kpm=kpm, window=window)
    if "scale" in c:
        kw["softmax_scale"] = ref["scale"] = c["scale"]
    o, lse = F.run_forward(spec, q, k, v, **kw)
    return (q, k, v), (o, lse), ref


@pytest.mark.parametrize("c", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_forward_matches_float64(c) -> None:
    gen = torch.Generator().manual_seed(23)
    (q, k, v), (o, lse), ref = _run_case(c, gen)
    o64, lse64 = attention(q.double(), k.double(), v.double(), **ref)
    o_pt, _ = attention(q, k, v, **ref)
    _, lse32 = attention(q.float(), k.float(), v.float(), **ref)
    dead = ~torch.isfinite(lse64)
    assert_close("o", o, o64, o_pt, q.dtype)
    assert_lse_close("lse", lse, lse64, lse32)
    if c.get("kpm") or (c.get("causal") and c["Nq"] > c["Nk"]):
        assert dead.any() and torch.equal(o.transpose(1, 2)[dead], torch.zeros_like(o.transpose(1, 2)[dead]))


def test_attention_forward_on_the_public_path() -> None:
    q = torch.randn(1, 80, 2, 64, dtype=torch.float16)
    k = torch.randn(1, 96, 2, 64, dtype=torch.float16)
    o, lse = F.attention_forward(q, k, k, spec=_spec(causal=True), causal=True)
    o64, _ = attention(q.double(), k.double(), k.double(), causal=True)
    assert_close("o", o, o64, attention(q, k, k, causal=True)[0], torch.float16)


# --------------------------------------------------------------------------- synchronisation
TEMPLATE = "wgmma/fwd.cu.j2"
SYNC = re.compile(r"fa_mbarrier_wait_parity\([^;]*\);|fa_wgmma_wait_group<[01]>\(\);|fa_sync\(\);|__syncwarp\(\);")


def _sync_sites() -> list[tuple[int, str]]:
    text = (renderer.templates_dir() / TEMPLATE).read_text()
    out = []
    for m in SYNC.finditer(text):
        line_start = text.rfind("\n", 0, m.start()) + 1
        if not text[line_start:m.start()].lstrip().startswith("//"):
            out.append((m.start(), m.group(0)))
    return out


def test_the_template_synchronises_at_thirteen_sites() -> None:
    """The producer's waits for a free K slot and a free V slot; Q_i, tile 0's K, tile j's K, V_{j-1} in the
    loop and the last V after it (the consumers' mbarrier waits); tile 0's S, S_j while P~V runs (wait_group
    1), P~V in the loop and after it (wait_group 0); the barrier after the init; the epilogue's __syncwarp
    (O through shared memory)."""
    kinds = [s for _, s in _sync_sites()]
    assert len(kinds) == 13 and sum(k.startswith("fa_mbarrier_wait_parity") for k in kinds) == 7, kinds
    assert sum(k == "fa_wgmma_wait_group<1>();" for k in kinds) == 1, kinds


#: Removals the emulator's plain schedules do not expose: its TMA loads land when issued, and the
#: producer has issued them before the consumers get past their warpgroup collectives (setmaxnreg,
#: wgmma), in either thread order, so a consumer that skips the wait still finds its data.
#: Likewise thread 0 initialises the mbarriers before any thread is past its setmaxnreg, so the
#: barrier after the initialisation is not exposed either. Racecheck catches each of them (a TMA
#: load's data is visible only through its mbarrier phase; mbarrier operations must be ordered
#: after the init): the test checks that too. The same holds for the consumers' waits for K_j and V_j
#: in the loop and for the last V_j: with K and V in pipelines of their own the producer is not held
#: back by a V slot when it issues K_j (nor by a K slot for V_j), so in the emulator's orders each
#: tile has landed before a consumer reaches it. When a plain schedule catches one, this test fails:
#: remove it from the set.
PLAIN_UNDETECTED = {"fa_mbarrier_wait_parity(q_full, 0);", "fa_mbarrier_wait_parity(&k_full[0], 0);", "fa_sync();",
                    "fa_mbarrier_wait_parity(&k_full[st], (it / STAGES) & 1);",
                    "fa_mbarrier_wait_parity(&v_full[prev], ((it - 1) / STAGES) & 1);",
                    "fa_mbarrier_wait_parity(&v_full[last], ((it - 1) / STAGES) & 1);",
                    "__syncwarp();"}  # stmatrix completes for the whole warp in the emulator: a race, not wrong data


def _broken(spec: KernelSpec, gate: int, schedule: str, monkeypatch) -> bool:
    """The forward with synchronisation site ``gate`` skipped, in the emulator's ``schedule``
    thread order: an emulator error or a wrong O."""
    mod = _gated(spec, schedule)
    emu = mod._build(sanitize=False)
    real = cpu.cpu_module
    monkeypatch.setattr(cpu, "cpu_module", lambda s: mod if s == spec else real(s))
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 130, 1, 64, generator=gen).to(torch.float16)
    k = torch.randn(1, 520, 1, 64, generator=gen).to(torch.float16)  # several K/V blocks per Q block
    want, _ = attention(q.double(), k.double(), k.double(), causal=True)
    emu.race_gate(gate)
    try:
        o, _ = F.run_forward(spec, q, k, k)
    except EmulatorError:
        return True  # the emulator names the misuse (or the deadlock)
    finally:
        emu.race_gate(-1)
        monkeypatch.setattr(cpu, "cpu_module", real)
    return not torch.allclose(o.double(), want, atol=1e-2)


_GATED: dict[tuple[KernelSpec, str], cpu.CpuModule] = {}


def _gated(spec: KernelSpec, schedule: str = "forward") -> cpu.CpuModule:
    """``spec``'s module in ``schedule``'s thread order, every synchronisation site i of the
    template behind gate i (``tests/gates.py``): one build skips each in turn."""
    if (spec, schedule) not in _GATED:
        text = (renderer.templates_dir() / TEMPLATE).read_text()
        sites = [(off, call, i) for i, (off, call) in enumerate(_sync_sites())]
        _GATED[(spec, schedule)] = gates.mutated_module(spec, TEMPLATE, gates.gated(text, sites), schedule)
    return _GATED[(spec, schedule)]


@pytest.mark.parametrize("site", _sync_sites(), ids=lambda s: f"{s[0]}:{s[1][:30]}")
def test_removing_a_wait_breaks_the_run(site, monkeypatch) -> None:
    i, call = _sync_sites().index(site), site[1]
    spec = _spec(causal=True)
    broken = any(_broken(spec, i, schedule, monkeypatch) for schedule in ("forward", "reverse"))
    assert broken == (call not in PLAIN_UNDETECTED), (
        f"{call} removed: {'caught' if broken else 'the forward is still right in both thread orders'}")
    if call in PLAIN_UNDETECTED:
        mod = _gated(spec)
        emu = mod._build(sanitize=False, racecheck=True)
        emu.race_gate(i)
        try:
            assert isinstance(_racecheck_error(mod, spec, monkeypatch), EmulatorRaceError), (
                f"{call} removed: racecheck does not report it")
        finally:
            emu.race_gate(-1)


def _racecheck_error(mod: cpu.CpuModule, spec: KernelSpec, monkeypatch) -> EmulatorError | None:
    real = cpu.cpu_module
    monkeypatch.setattr(cpu, "cpu_module", lambda s: mod if s == spec else real(s))
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 130, 1, 64, generator=gen).to(torch.float16)
    k = torch.randn(1, 520, 1, 64, generator=gen).to(torch.float16)
    try:
        with cpu.racecheck():
            F.run_forward(spec, q, k, k)
    except EmulatorError as e:
        return e
    finally:
        monkeypatch.setattr(cpu, "cpu_module", real)
    return None


# --------------------------------------------------------------------------- SASS
needs_nvdisasm = pytest.mark.skipif(sass.nvdisasm_path() is None, reason="nvdisasm (nvidia-cuda-nvdisasm) not installed")


@needs_nvdisasm
@pytest.mark.parametrize("d, causal, nw", [(64, False, 4), (96, True, 8), (128, True, 8), (256, False, 8)])
def test_sass_hgmma_in_the_tile_loop_tma_no_ldmatrix_no_spills(d, causal, nw) -> None:
    from fagen.autotune.sassloops import tile_loop

    spec = _spec(head_dim=d, causal=causal, num_warps=nw, block_r=16 * nw)
    mod = compile_spec(spec)
    res = mod.resource("main")
    assert res.spill_store_bytes == 0 and res.spill_load_bytes == 0 and res.stack_frame_bytes == 0, res
    name = mod.rendered.kernel("main").name
    ops = sass.instruction_mix(mod.cubin)[name]
    assert ops.get("LDL", 0) == 0 and ops.get("STL", 0) == 0 and ops.get("LDSM", 0) == 0, ops
    for op in ("HGMMA", "UTMALDG", "SYNCS", "USETMAXREG", "ELECT", "WARPGROUP"):
        assert ops.get(op, 0) > 0, (op, ops)
    text = sass.disassemble(mod.cubin)
    loop = tile_loop(text, name, WGMMA.tile_work(spec.family_spec, "main"))
    # the tile loop (walked): d/16 wgmmas for S, block_c/16 for O += P V; no ldmatrix, no cp.async
    assert not loop.unsolved and loop.count("HGMMA") == d // 16 + spec.tile.block_c // 16, loop.mix
    assert loop.count("LDSM") == 0 and loop.count("LDGSTS") == 0, loop.mix
    assert loop.count("MUFU") == spec.tile.block_c // 2 + 2  # one exp2 per score, one per row's alpha
    assert loop.count("FMUL") <= d // 2 + 4, loop.mix  # the O rescale; the scale is folded into the FFMA
    # the producer warp's loop: one TMA load per 64-element panel of K_j and of V_j
    prod = tile_loop(text, name, WGMMA.producer_work(spec.family_spec), anchor=("UTMALDG",), smallest=True)
    assert prod.count("UTMALDG") == 2 * padded_dim(d) // 64 and prod.count("HGMMA") == 0, prod.mix


def test_a_capability_90_gpu_takes_sm90a_only_where_this_family_applies() -> None:
    from types import SimpleNamespace

    flags = {"causal": True, "key_padding": False, "dropout": False}
    gpu = SimpleNamespace(device=torch.device("cuda", 0), head_dim=64, dtype="float16")
    spec = F._arch_specific_spec("fwd", gpu, "sm_90", flags)
    assert spec is not None and spec.arch == "sm_90a" and spec.impl == "wgmma" and spec.causal
    bwd = F._arch_specific_spec("bwd", gpu, "sm_90", flags)  # the backward too (tests/test_wgmma_bwd.py)
    assert bwd is not None and bwd.impl == "wgmma" and bwd.direction == "bwd"
    for direction in ("fwd", "bwd"):  # dropout: this family's too
        drop = F._arch_specific_spec(direction, gpu, "sm_90", {**flags, "dropout": True})
        assert drop is not None and drop.impl == "wgmma" and drop.dropout
    for direction in ("fwd", "bwd"):  # attn_mask: this family's too (tests/test_wgmma_mask_bias.py)
        masked = F._arch_specific_spec(direction, gpu, "sm_90", {**flags, "attn_mask": True})
        assert masked is not None and masked.impl == "wgmma" and masked.attn_mask
    assert F._arch_specific_spec("fwd", SimpleNamespace(**{**vars(gpu), "head_dim": 96}), "sm_90", flags) is not None
    d80 = SimpleNamespace(**{**vars(gpu), "head_dim": 80})  # padded to 128 (tests/test_wgmma_head_dims.py)
    assert F._arch_specific_spec("fwd", d80, "sm_90", flags) is not None
    assert F._arch_specific_spec("fwd", d80, "sm_90", {**flags, "softcap": True}) is None  # mma is cheaper there
    assert F._arch_specific_spec("fwd", gpu, "sm_80", flags) is None  # no arch-specific target
    cpu_p = SimpleNamespace(**{**vars(gpu), "device": torch.device("cpu")})
    assert F._arch_specific_spec("fwd", cpu_p, "sm_90", flags) is None  # the emulator keeps sm_90


# --------------------------------------------------------------------------- autotuner
def test_autotuner_candidates_take_the_family_with_its_knobs() -> None:
    from fagen.autotune.candidates import enumerate_candidates

    spec = _spec(head_dim=128)
    cands = {(c.block_r, c.block_c, c.num_warps, c.knobs): c for c in enumerate_candidates(spec) if c.impl == "wgmma"}
    # tiles up to 256 keys, one or two consumer warpgroups, the stages knob
    assert cands[(64, 192, 4, (("stages", 2),))].status == "pending"
    assert cands[(128, 192, 8, (("stages", 2),))].status == "pending"
    assert cands[(64, 128, 4, (("stages", 3),))].status == "pending"
    assert "smem" in cands[(128, 256, 8, (("stages", 2),))].reason  # 32 + 2 x 128 KiB
    assert "block_r=64 must be 16 x num_warps=8" in cands[(64, 128, 8, (("stages", 2),))].reason
    assert cands[(128, 192, 8, (("stages", 2),))].is_default  # the family's default_warps: two warpgroups


def test_pair_cost_counts_every_warp_and_the_operands_wgmma_reads() -> None:
    from fagen.families.wgmma.cost import pair_cost

    fs = _spec(head_dim=128, num_warps=4).family_spec  # 64 x 192, one consumer warpgroup
    est = pair_cost(fs)
    assert est.atomics == 0 and est.warp_iterations == 4 * (128 // 16 + 192 // 16)
    assert est.lds_wavefronts == (64 * 128 + 2 * 192 * 128) * 2 / 128  # Q_i, K_j, V_j once per pair
    walked = pair_cost(fs, {"HGMMA": 20, "FFMA": 96, "MUFU": 98})
    assert walked.warp_instructions == 4 * (20 + 96 + 98) + 2 * 2 + 40  # + the producer warp
    wide = pair_cost(_spec(head_dim=128, num_warps=8, block_r=128).family_spec)
    flops = lambda f: 4 * f.block_r * f.block_c * f.head_dim  # noqa: E731
    # a longer key block spreads the O rescale and the per-tile overhead over more FLOPs
    narrow_fs = _spec(head_dim=128, block_c=64, num_warps=4).family_spec
    narrow = pair_cost(narrow_fs)
    assert est.warp_instructions / flops(fs) < narrow.warp_instructions / flops(narrow_fs)
    assert wide.warp_instructions > est.warp_instructions and WGMMA.pair_cost(fs) == est


# --------------------------------------------------------------------------- sanitizer
def test_forward_is_clean_under_asan_and_an_overrun_is_caught(monkeypatch) -> None:
    """Under AddressSanitizer (``cpu.sanitized``) the forward reads and writes inside its tensors and
    gives the plain run's bits (key padding, causal, GQA, lengths that end inside a tile); with the
    epilogue's row guard removed its stores past the end of ``o`` are a memory error naming it."""
    from fagen.emulator import EmulatorMemoryError

    gen = torch.Generator().manual_seed(9)
    q = torch.randn(1, 77, 2, 64, generator=gen).half()
    k = torch.randn(1, 150, 1, 64, generator=gen).half()
    v = torch.randn(1, 150, 1, 64, generator=gen).half()
    kpm = torch.rand(1, 150, generator=gen) > 0.2
    spec = _spec(causal=True, key_padding=True, block_c=64)
    want = F.run_forward(spec, q, k, v, key_padding_mask=kpm)
    with cpu.sanitized() as rec:
        got = F.run_forward(spec, q, k, v, key_padding_mask=kpm)
    assert rec.roles == {"main"} and all(torch.equal(a, b) for a, b in zip(got, want))

    text = (renderer.templates_dir() / TEMPLATE).read_text()
    guard = "        if (row >= {{ LQ }}) continue;\n"  # LQ: the sequence's len_q (varlen) or seqlen_q
    assert text.count(guard) == 1
    mod = gates.mutated_module(spec, TEMPLATE, text.replace(guard, ""))
    real = cpu.cpu_module
    monkeypatch.setattr(cpu, "cpu_module", lambda s: mod if s == spec else real(s))
    qs = torch.randn(1, 70, 1, 64, generator=gen).half()  # 70 rows: the tile's last 58 lie past o's end
    with pytest.raises(EmulatorMemoryError, match=r"\bo\b"):
        with cpu.sanitized():
            F.run_forward(spec, qs, k[:, :, :1], v[:, :, :1], key_padding_mask=kpm)
