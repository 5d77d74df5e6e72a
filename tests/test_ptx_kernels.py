"""fagen's kernels at the PTX level (fagen.runtime.cpu.ptx()): NVRTC's PTX for the spec's real
target, translated and run on the CPU, judged against the float64 reference by flash-attn's
criterion (tests/test_ptx_levels.py compares the two levels bit for bit where they execute the same
operations); and mutations of the inline PTX that only this level runs.

Default run: the SIMT backward with every role (pre, main, dq, post) and the forward on sm_80, and
the wgmma family on sm_90a; the mma family (sm_80, sm_90) and more variants are ``slow``."""
from __future__ import annotations

import os

import pytest
import torch
from featref import assert_lse_close, flash_criterion
from featref import attention as attention_oracle

import fagen.functional as F
from fagen import KernelSpec
from fagen import reference as R
from fagen.runtime import cpu

#: Out of the fast tier, in the full suite (CI): the mma kernels on both archs and the mutations.
SLOW = [pytest.mark.slow]
#: The rest of the sweep (more dtypes per family): only with ``FAGEN_TEST_SLOW=1``.
HEAVY = [pytest.mark.slow, pytest.mark.skipif(not os.environ.get("FAGEN_TEST_SLOW"),
                                              reason="heavy PTX-level sweep: set FAGEN_TEST_SLOW=1")]

ATOL = {"float16": 2e-4, "bfloat16": 2e-3}
DT = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _inputs(b: int, h: int, nq: int, nk: int, d: int, dtype: str):
    g = torch.Generator().manual_seed(77 + nq + d)
    dt = DT[dtype]
    q = torch.randn(b, nq, h, d, generator=g).to(dt)
    k = torch.randn(b, nk, h, d, generator=g).to(dt)
    v = torch.randn(b, nk, h, d, generator=g).to(dt)
    do = torch.randn(b, nq, h, d, generator=g).to(dt)
    return q, k, v, do


def _run(fwd: KernelSpec, bwd: KernelSpec, q, k, v, do):
    o, lse = F.run_forward(fwd, q, k, v)
    dq, dk, dv = F.run_backward(bwd, do, q, k, v, o, lse)
    return {"o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def _judge(out: dict, q, k, v, do, causal: bool, dtype: str) -> None:
    for name, t in out.items():
        assert not torch.isnan(t).any(), f"NaN in {name}"
    o64, lse64 = R.attention_forward_ref(q, k, v, causal=causal)
    dq64, dk64, dv64 = R.attention_backward_ref(do, q, k, v, o64, lse64, causal=causal)
    qt, kt, vt = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    ot = R.attention_ref_torch(qt, kt, vt, causal=causal)
    ot.backward(do)
    pairs = {"o": (ot.detach(), o64), "dq": (qt.grad, dq64), "dk": (kt.grad, dk64), "dv": (vt.grad, dv64)}
    atol = ATOL[dtype] * max(1.0, max(r.abs().max().item() for _, r in pairs.values()))
    for name, (pt, ref) in pairs.items():
        flash_criterion(name, out[name], ref, pt, atol)
    lse32 = attention_oracle(q.float(), k.float(), v.float(), causal=causal, kpm=None)[1]
    assert_lse_close("lse", out["lse"], lse64, lse32)


def _specs(impl: str, arch: str, dtype: str, causal: bool, d: int = 64, **flags) -> tuple[KernelSpec, KernelSpec]:
    common = dict(head_dim=d, dtype=dtype, causal=causal, impl=impl, arch=arch)
    return KernelSpec(direction="fwd", **common), KernelSpec(direction="bwd", **common, **flags)


CASES = [
    pytest.param("simt", "sm_80", "float16", True, {"deterministic": True}, id="simt-sm80-fp16-causal-det",
                 marks=SLOW),
    pytest.param("wgmma", "sm_90a", "float16", True, {}, id="wgmma-sm90a-fp16-causal", marks=SLOW),
    pytest.param("mma", "sm_80", "float16", True, {"deterministic": True}, id="mma-sm80-fp16-causal-det",
                 marks=SLOW),
    pytest.param("mma", "sm_90", "bfloat16", False, {}, id="mma-sm90-bf16", marks=SLOW),
    pytest.param("mma", "sm_80", "bfloat16", True, {}, id="mma-sm80-bf16-causal", marks=HEAVY),
    pytest.param("wgmma", "sm_90a", "bfloat16", False, {}, id="wgmma-sm90a-bf16", marks=HEAVY),
    pytest.param("simt", "sm_90", "bfloat16", False, {}, id="simt-sm90-bf16", marks=HEAVY),
    pytest.param("wgmma", "sm_90a", "float16", True, {"deterministic": True}, id="wgmma-sm90a-fp16-causal-det",
                 marks=HEAVY),
]


@pytest.mark.parametrize("impl, arch, dtype, causal, flags", CASES)
def test_kernels_at_the_ptx_level_match_the_float64_reference(impl, arch, dtype, causal, flags) -> None:
    fwd, bwd = _specs(impl, arch, dtype, causal, **flags)
    q, k, v, do = _inputs(1, 2, 160, 200 if not causal else 160, 64, dtype)
    with cpu.ptx() as record:
        out = _run(fwd, bwd, q, k, v, do)
    # the deterministic backward adds the dq kernel (wgmma: none, its dQ adds take turns in the main kernel)
    want_roles = {"main", "pre", "post"} | ({"dq"} if flags.get("deterministic") and impl != "wgmma" else set())
    assert record.roles == want_roles and {s for s, _, _ in record.launches} == {fwd.name, bwd.name}
    _judge(out, q, k, v, do, causal, dtype)


def test_emu_level_setting_runs_a_whole_process_at_the_ptx_level(monkeypatch) -> None:
    from fagen import settings

    monkeypatch.setenv("FAGEN_EMU_LEVEL", "ptx")
    settings.reset()
    try:
        assert settings.get_settings().emu_level == "ptx"
        fwd, _ = _specs("simt", "sm_80", "float16", True)
        q, k, v, _ = _inputs(1, 1, 64, 64, 64, "float16")
        calls = []
        real = cpu.CpuModule.ptx_build
        monkeypatch.setattr(cpu.CpuModule, "ptx_build", lambda self: calls.append(self.spec.name) or real(self))
        o, _ = F.run_forward(fwd, q, k, v)
        assert calls == [fwd.name]  # the launch went through the PTX build, no context manager needed
        assert not torch.isnan(o).any()
    finally:
        monkeypatch.delenv("FAGEN_EMU_LEVEL")
        settings.reset()
    monkeypatch.setenv("FAGEN_EMU_LEVEL", "sass")
    settings.reset()
    try:
        with pytest.raises(ValueError, match="FAGEN_EMU_LEVEL"):
            settings.get_settings()
    finally:
        monkeypatch.delenv("FAGEN_EMU_LEVEL")
        settings.reset()


# --------------------------------------------------------------------------- mutations
def _mutated_forward(spec: KernelSpec, old: str, new: str):
    """The spec's forward built at the PTX level from its rendered source with ``old`` replaced by
    ``new`` (the inline-PTX strings of the device-function layer), installed as its CPU module's
    PTX build; returns the module to restore."""
    from fagen.compiler import options_for
    from fagen.emulator.ptx import build_ptx
    from fagen.nvrtc import compile_cubin
    from fagen.renderer import render

    rendered = render(spec)
    assert old in rendered.source, "the mutation site is gone from the rendered source"
    source = rendered.source.replace(old, new)
    target = spec.arch.replace("sm_", "compute_")
    res = compile_cubin(source, f"{spec.name}_mutant.cu", options_for(spec, target), ptx=True)
    assert res.ok, res.log
    return build_ptx(res.cubin, rendered.kernels)


def _forward_error(spec: KernelSpec, mutant) -> bool:
    """True when the forward through ``mutant`` misses the reference (flash criterion on o)."""
    q, k, v, _ = _inputs(1, 1, 128, 128, spec.head_dim, spec.dtype)
    module = cpu.cpu_module(spec)
    saved = module._ptx_build
    module._ptx_build = mutant
    try:
        with cpu.ptx():
            o, _ = F.run_forward(spec, q, k, v)
    finally:
        module._ptx_build = saved
    o64, _ = R.attention_forward_ref(q, k, v, causal=spec.causal)
    return not torch.allclose(o.double(), o64, atol=2e-2, rtol=0)


@pytest.mark.slow
def test_mutation_swapped_mma_operands_is_caught_only_at_the_ptx_level() -> None:
    spec, _ = _specs("mma", "sm_80", "float16", False)
    mutant = _mutated_forward(spec, "{ %4, %5, %6, %7 }", "{ %5, %4, %6, %7 }")
    assert _forward_error(spec, mutant)
    # the source level never runs the asm string: the same mutation is invisible there
    q, k, v, _ = _inputs(1, 1, 128, 128, 64, "float16")
    o, _ = F.run_forward(spec, q, k, v)
    o64, _ = R.attention_forward_ref(q, k, v, causal=False)
    assert torch.allclose(o.double(), o64, atol=2e-2, rtol=0)


@pytest.mark.slow
def test_mutation_wrong_wgmma_transpose_immediate_is_caught() -> None:
    spec, _ = _specs("wgmma", "sm_90a", "float16", False)
    # the descriptor form's imm-trans-b forced to 1 (MN-major B) whatever the template asks
    mutant = _mutated_forward(spec, '", p, 1, 1, %" #I3 ", %" #I4 ";', '", p, 1, 1, %" #I3 ", 1;')
    assert _forward_error(spec, mutant)


@pytest.mark.slow
def test_the_backwards_old_register_a_order_is_a_ptx_hazard() -> None:
    """templates/wgmma/bwd.cu.j2 once issued dK~ += dS^T Q_i (register A: dsa[kc]) and stored dS^T
    from those registers with stmatrix before any wgmma.wait_group; rendered in that order and run at
    the PTX level, the stmatrix is a PtxHazardError (the corrected order runs clean above)."""
    import gates
    from fagen import renderer
    from fagen.emulator.ptx import PtxHazardError

    template = "wgmma/bwd.cu.j2"
    text = (renderer.templates_dir() / template).read_text()
    stores_start = "                // dS^T -> smem. Stored before"
    issue_start = "                fa_wgmma_fence();\n{% if not DV_EARLY %}"
    issue_end = "                fa_wgmma_commit_group();\n"
    s0 = text.index(stores_start)
    i0 = text.index(issue_start, s0)
    i1 = text.index(issue_end, i0) + len(issue_end)
    old_order = text[:s0] + text[i0:i1] + "\n" + text[s0:i0] + text[i1:]
    fwd, bwd = _specs("wgmma", "sm_90a", "float16", True)
    old = gates.mutated_module(bwd, template, old_order)
    q, k, v, do = _inputs(1, 1, 70, 70, 64, "float16")
    with cpu.ptx():
        o, lse = F.run_forward(fwd, q, k, v)
    real = cpu.cpu_module
    try:
        cpu.cpu_module = lambda s: old if s == bwd else real(s)
        with cpu.ptx(), pytest.raises(PtxHazardError, match=r"in the A fragment of the wgmma.mma_async at PTX line "
                                                             r"\d+, still in flight .*: stmatrix"):
            F.run_backward(bwd, do, q, k, v, o, lse)
    finally:
        cpu.cpu_module = real
