"""The Hopper family (``wgmma``, sm_90a): selection and declines, numerics of its forward on the
CPU emulator against a float64 oracle (flash-attn's criterion), its synchronisation (each
mbarrier wait, wgmma wait and the init barrier removed in turn breaks the run, three of them only
under racecheck), the tensor-map
launch hook, and the SASS NVRTC compiles for sm_90a (HGMMA in the tile loop, TMA, no ldmatrix,
no spills, the setmaxnreg register split). No GPU needed."""
from __future__ import annotations

import re

import pytest
import torch

import fagen.functional as F
import fagen.settings
from fagen import KernelSpec, renderer, sass
from fagen.abi import FWD_MAIN, is_tensormap
from fagen.compiler import compile as compile_spec
from fagen.emulator import EmulatorError, EmulatorRaceError
from fagen.families import BUILTIN_FAMILIES, FamilySpec, get_family
from fagen.families.mma import MMA
from fagen.families.wgmma import WGMMA, register_split, tensor_map_boxes
from fagen.runtime import cpu
from fagen.tma import TensorMapFields

from featref import assert_close, assert_lse_close, attention

DT = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _spec(**kw) -> KernelSpec:
    return KernelSpec(direction="fwd", arch="sm_90a", **{"head_dim": 64, "dtype": "float16", **kw})


# --------------------------------------------------------------------------- selection
def test_registered_and_chosen_for_sm90a_only() -> None:
    assert WGMMA in BUILTIN_FAMILIES and get_family("wgmma") is WGMMA
    for d, dtype in ((64, "float16"), (128, "bfloat16")):
        spec = _spec(head_dim=d, dtype=dtype)
        assert spec.impl == "wgmma" and spec.name.endswith("_s2_wgmma_sm90a"), spec.name
        assert _spec(head_dim=d, dtype=dtype, causal=True, causal_align="top_left").impl == "wgmma"
        assert _spec(head_dim=d, dtype=dtype, key_padding=True, window=True).impl == "wgmma"
    # the default sm_90 path is unchanged: wgmma needs the arch-specific target
    assert KernelSpec(direction="fwd", head_dim=64, dtype="float16").impl == "mma"
    assert _spec().cache_key != _spec().replace(arch="sm_90", impl="mma").cache_key


@pytest.mark.parametrize("change, why", [
    (dict(direction="bwd", dropout=True), "dropout"),
    (dict(dropout=True), "dropout"),
    (dict(head_dim=96), "head_dim=96"),
    (dict(head_dim=32), "head_dim=32"),
    (dict(dtype="float32"), "dtype=float32"),
    (dict(softcap=True), "softcap"),
    (dict(alibi=True), "alibi"),
    (dict(attn_mask=True), "attn_mask"),
    (dict(varlen=True), "varlen"),
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
    assert maps == ["tma_q", "tma_k", "tma_v"] and kern.params[:len(FWD_MAIN.params)] == renderer._concrete(
        FWD_MAIN.params, "__half")
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


def test_unaligned_strides_are_an_input_error_naming_them() -> None:
    spec = _spec()
    q = torch.randn(1, 64, 1, 72, dtype=torch.float16)[..., :64]  # row stride 72 elements: 144 bytes, fine
    k = torch.randn(1, 64, 1, 68, dtype=torch.float16)[..., :64]  # 136 bytes: not a multiple of 16
    with pytest.raises(ValueError, match="strides"):
        F.run_forward(spec, q, k, k)


# --------------------------------------------------------------------------- numerics
CASES = [
    dict(d=64, dtype="float16", nw=4, B=1, Nq=100, Nk=130, H=1, Hkv=1),
    dict(d=128, dtype="bfloat16", nw=8, B=2, Nq=200, Nk=77, H=2, Hkv=1),  # GQA, two consumer warpgroups
    dict(d=64, dtype="float16", nw=8, B=1, Nq=150, Nk=300, H=2, Hkv=2, causal=True, stages=3),
    dict(d=64, dtype="bfloat16", nw=4, B=1, Nq=200, Nk=70, H=1, Hkv=1, causal=True),  # rows that see no key
    dict(d=128, dtype="float16", nw=4, B=1, Nq=90, Nk=200, H=1, Hkv=1, causal=True, align="top_left"),
    dict(d=64, dtype="float16", nw=4, B=2, Nq=70, Nk=150, H=1, Hkv=1, kpm=True),  # batch 1: every key padded
    dict(d=64, dtype="float16", nw=4, B=1, Nq=130, Nk=260, H=1, Hkv=1, window=(40, 10)),
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
    spec = _spec(head_dim=c["d"], dtype=c["dtype"], num_warps=c["nw"], block_r=16 * c["nw"], causal=causal,
                 causal_align=align, key_padding=kpm is not None, window=window != (-1, -1),
                 knobs={"stages": c.get("stages", 2)})
    assert spec.impl == "wgmma"
    kw = dict(causal=causal, key_padding_mask=kpm)
    if align != "bottom_right":
        kw["causal_align"] = align
    if window != (-1, -1):
        kw["window_size"] = window
    o, lse = F.run_forward(spec, q, k, v, **kw)
    ref = dict(causal=causal, align=align, kpm=kpm, window=window)
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
SYNC = re.compile(r"fa_mbarrier_wait_parity\([^;]*\);|fa_wgmma_wait_group<0>\(\);|fa_sync\(\);")


def _sync_sites() -> list[tuple[int, str]]:
    text = (renderer.templates_dir() / TEMPLATE).read_text()
    out = []
    for m in SYNC.finditer(text):
        line_start = text.rfind("\n", 0, m.start()) + 1
        if not text[line_start:m.start()].lstrip().startswith("//"):
            out.append((m.start(), m.group(0)))
    return out


def test_the_template_synchronises_at_six_sites() -> None:
    kinds = [s for _, s in _sync_sites()]
    assert len(kinds) == 6 and sum(k.startswith("fa_mbarrier_wait_parity") for k in kinds) == 3, kinds


#: Removals the emulator's plain schedules do not expose: its TMA loads land when issued, and the
#: producer has issued them before the consumers get past their warpgroup collectives (setmaxnreg,
#: wgmma), in either thread order, so a consumer that skips the wait still finds its data.
#: Likewise thread 0 initialises the mbarriers before any thread is past its setmaxnreg, so the
#: barrier after the initialisation is not exposed either. Racecheck catches each of them (a TMA
#: load's data is visible only through its mbarrier phase; mbarrier operations must be ordered
#: after the init): the test checks that too. When a plain schedule catches one, this test fails:
#: remove it from the set.
PLAIN_UNDETECTED = {"fa_mbarrier_wait_parity(q_full, 0);",
                    "fa_mbarrier_wait_parity(&kv_full[st], (it / STAGES) & 1);", "fa_sync();"}


def _broken(mod: cpu.CpuModule, spec: KernelSpec, schedule: str, monkeypatch) -> bool:
    real = cpu.cpu_module
    monkeypatch.setattr(cpu, "cpu_module", lambda s: mod if s == spec else real(s))
    fagen.settings.configure(emu_schedule=schedule)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 130, 1, 64, generator=gen).to(torch.float16)
    k = torch.randn(1, 520, 1, 64, generator=gen).to(torch.float16)  # several K/V blocks per Q block
    want, _ = attention(q.double(), k.double(), k.double(), causal=True)
    try:
        o, _ = F.run_forward(spec, q, k, k)
    except EmulatorError:
        return True  # the emulator names the misuse (or the deadlock)
    finally:
        fagen.settings.reset()
        monkeypatch.setattr(cpu, "cpu_module", real)
    return not torch.allclose(o.double(), want, atol=1e-2)


@pytest.mark.parametrize("site", _sync_sites(), ids=lambda s: f"{s[0]}:{s[1][:30]}")
def test_removing_a_wait_breaks_the_run(site, monkeypatch) -> None:
    off, call = site
    spec = _spec(causal=True)
    text = (renderer.templates_dir() / TEMPLATE).read_text()
    mod = _mutated(spec, TEMPLATE, text[:off] + "/* removed */;" + text[off + len(call):])
    broken = any(_broken(mod, spec, schedule, monkeypatch) for schedule in ("forward", "reverse"))
    assert broken == (call not in PLAIN_UNDETECTED), (
        f"{call} removed: {'caught' if broken else 'the forward is still right in both thread orders'}")
    if call in PLAIN_UNDETECTED:
        assert isinstance(_racecheck_error(mod, spec, monkeypatch), EmulatorRaceError), (
            f"{call} removed: racecheck does not report it")


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


def _mutated(spec: KernelSpec, template: str, text: str) -> cpu.CpuModule:
    import jinja2

    env = renderer._env().overlay(loader=jinja2.ChoiceLoader([jinja2.DictLoader({template: text}),
                                                              renderer._env().loader]))
    mod = cpu.CpuModule.__new__(cpu.CpuModule)
    real = renderer._env
    renderer._env = lambda: env  # type: ignore[assignment]
    try:
        cpu.CpuModule.__init__(mod, spec)
        mod.rendered = renderer.render.__wrapped__(spec)
    finally:
        renderer._env = real  # type: ignore[assignment]
    return mod


# --------------------------------------------------------------------------- SASS
needs_nvdisasm = pytest.mark.skipif(sass.nvdisasm_path() is None, reason="nvdisasm (nvidia-cuda-nvdisasm) not installed")


@needs_nvdisasm
@pytest.mark.parametrize("d, causal, nw", [(64, False, 4), (128, True, 8)])
def test_sass_hgmma_in_the_tile_loop_tma_no_ldmatrix_no_spills(d, causal, nw) -> None:
    from fagen.autotune.sassloops import main_loop_mix

    spec = _spec(head_dim=d, causal=causal, num_warps=nw, block_r=16 * nw)
    mod = compile_spec(spec)
    res = mod.resource("main")
    assert res.spill_store_bytes == 0 and res.spill_load_bytes == 0 and res.stack_frame_bytes == 0, res
    name = mod.rendered.kernel("main").name
    ops = sass.instruction_mix(mod.cubin)[name]
    assert ops.get("LDL", 0) == 0 and ops.get("STL", 0) == 0 and ops.get("LDSM", 0) == 0, ops
    for op in ("HGMMA", "UTMALDG", "SYNCS", "USETMAXREG", "ELECT", "WARPGROUP"):
        assert ops.get(op, 0) > 0, (op, ops)
    loop = main_loop_mix(mod.cubin, name).merged()
    # the tile loop: d/16 wgmmas for S, block_c/16 for O += P V; no ldmatrix, no cp.async
    assert loop.get("HGMMA", 0) == d // 16 + spec.tile.block_c // 16, loop
    assert loop.get("LDSM", 0) == 0 and loop.get("LDGSTS", 0) == 0, loop


def test_a_capability_90_gpu_takes_sm90a_only_where_this_family_applies() -> None:
    from types import SimpleNamespace

    flags = {"causal": True, "key_padding": False, "dropout": False}
    gpu = SimpleNamespace(device=torch.device("cuda", 0), head_dim=64, dtype="float16")
    spec = F._arch_specific_spec("fwd", gpu, "sm_90", flags)
    assert spec is not None and spec.arch == "sm_90a" and spec.impl == "wgmma" and spec.causal
    bwd = F._arch_specific_spec("bwd", gpu, "sm_90", flags)  # the backward too (tests/test_wgmma_bwd.py)
    assert bwd is not None and bwd.impl == "wgmma" and bwd.direction == "bwd"
    assert F._arch_specific_spec("bwd", gpu, "sm_90", {**flags, "dropout": True}) is None  # mma: the default path
    assert F._arch_specific_spec("fwd", gpu, "sm_90", {**flags, "dropout": True}) is None
    assert F._arch_specific_spec("fwd", SimpleNamespace(**{**vars(gpu), "head_dim": 96}), "sm_90", flags) is None
    assert F._arch_specific_spec("fwd", gpu, "sm_80", flags) is None  # no arch-specific target
    cpu_p = SimpleNamespace(**{**vars(gpu), "device": torch.device("cpu")})
    assert F._arch_specific_spec("fwd", cpu_p, "sm_90", flags) is None  # the emulator keeps sm_90
