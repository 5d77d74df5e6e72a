"""The wgmma family's codegen knobs (fagen.families.wgmma.codegen): legality and starting points (the
family's rules), the config record and its sources, the template constants they set, the stored search
over them, and each knob's other value through the emulator against the float64 reference."""
from __future__ import annotations

import math

import pytest

from fagen.autotune.codegen import Evaluation, default_classes, search_class, write_table
from fagen.families.codegen import class_key
from fagen.families.wgmma import bwd
from fagen.families.wgmma.codegen import CODEGEN, CODEGEN_KNOBS
from fagen.generate import standard_matrix
from fagen.plan import plan_of
from fagen.renderer import render
from fagen.spec import KernelSpec
from feature_harness import FeatCase, check_case

B = dict(direction="bwd", arch="sm_90a", impl="wgmma")


def _wgmma_specs() -> list[KernelSpec]:
    specs = [s for s in standard_matrix() if s.impl == "wgmma"]
    specs += [s for s in default_classes("wgmma")]
    return specs


def test_every_starting_point_is_legal_and_is_the_family_rule():
    for spec in _wgmma_specs():
        fs = spec.family_spec
        start = CODEGEN.start_values(fs)
        assert CODEGEN.illegal_reason(fs, start) is None, spec.name
        if spec.direction == "bwd":
            one_acc = not bwd.split_dkv(fs)
            assert start["dv_early"] == int(one_acc and bwd.dv_early(fs)), spec.name
            assert start["bias_smem"] == int(one_acc and bwd.bias_smem(fs)), spec.name
            assert start["ds_row_xor"] == 0 and start["lse_rows_rolled"] == 0
        else:
            assert start == {}


def test_illegal_settings_are_rejected_naming_the_knob():
    softcap = KernelSpec(**B, head_dim=64, softcap=True).family_spec
    assert "dv_early=1" in CODEGEN.illegal_reason(softcap, {"dv_early": 1})
    wide = KernelSpec(**B, head_dim=192).family_spec
    assert CODEGEN.illegal_reason(wide, {"dv_early": 1}) == "dv_early=1: the spec's kernel has no such choice"
    assert CODEGEN.illegal_reason(wide, {"ds_row_xor": 1}) is None  # the split tile stores dS^T too
    plain = KernelSpec(**B, head_dim=128).family_spec
    assert "bias_smem=1" in CODEGEN.illegal_reason(plain, {"bias_smem": 1})
    alibi_bias = KernelSpec(**B, head_dim=64, bias=True, alibi=True).family_spec
    assert "reads the bias per element" in CODEGEN.override_reason(alibi_bias, {"bias_smem": 1})
    assert "not one of" in CODEGEN.illegal_reason(plain, {"ds_row_xor": 2})
    assert "not a codegen knob" in CODEGEN.override_reason(plain, {"fwd_q_in_regs": 1})
    with pytest.raises(ValueError, match="codegen: 'bwd_pin' is not a codegen knob of the bwd kernels"):
        KernelSpec(**B, head_dim=64, codegen={"bwd_pin": 1})
    with pytest.raises(ValueError, match="dv_early=1: with softcap"):
        KernelSpec(**B, head_dim=64, softcap=True, codegen={"dv_early": 1})


def test_template_constants_and_layout_follow_the_config():
    base = KernelSpec(**B, head_dim=64, bias=True)
    src = render(base).source
    assert "constexpr bool BIAS_SMEM = true;" in src and "constexpr bool DS_ROW_XOR = false;" in src
    assert "bias" in base.smem_layout.breakdown()
    off = KernelSpec(**B, head_dim=64, bias=True, codegen={"bias_smem": 0, "ds_row_xor": 1, "lse_rows_rolled": 1})
    src = render(off).source
    assert "BIAS_SMEM" not in src and "constexpr bool DS_ROW_XOR = true;" in src
    assert "#pragma unroll 1\n                    for (int rr = 0;" in src
    assert "bias" not in off.smem_layout.breakdown()
    cfg = plan_of(off).codegen
    sources = {k.name: k.source for k in cfg.knobs}
    assert sources.pop("dv_early") in ("start", "table")  # the class's table entry, where the table has one
    assert sources == {"bias_smem": "user", "ds_row_xor": "user", "lse_rows_rolled": "user", "softcap_rcp": "start",
                       "alibi_fold": "start"}
    assert plan_of(KernelSpec(direction="fwd", arch="sm_90a", impl="wgmma", head_dim=64)).codegen.knobs == ()


def test_search_takes_a_clean_setting_over_a_spilling_start(tmp_path):
    """The deterministic backward at d = 64 with key padding spills 32 bytes at its starting point
    (ptxas keeps the four dS^T stmatrix addresses past the register budget); a setting that spills
    nothing wins even at a higher cost, and is stored in the family's table format."""
    spec = KernelSpec(**B, head_dim=64, dtype="bfloat16", deterministic=True, key_padding=True)

    def evaluate(s, values):
        if values["ds_row_xor"]:
            return Evaluation({"interior": 485.0 - 5 * values["lse_rows_rolled"]})
        return Evaluation({"interior": 484.0}, spill_bytes=32)

    r = search_class(spec, evaluate=evaluate, major=13)
    assert r.start_trial.rejected == "spills 32 bytes"
    assert r.best.values["ds_row_xor"] == 1 and r.best.values["lse_rows_rolled"] == 1
    path = write_table([r], tmp_path / "t.json", major=13)
    cfg = CODEGEN.config(spec.family_spec, table=path, major=13)
    assert cfg.class_key == class_key(spec.family_spec, 13)
    assert {k.name: (k.value, k.source) for k in cfg.knobs} == {
        "dv_early": (0, "table"), "bias_smem": (0, "start"), "ds_row_xor": (1, "table"), "lse_rows_rolled": (1, "table"),
        "softcap_rcp": (0, "start"), "alibi_fold": (0, "start")}
    assert all(math.isfinite(t.cost) or t.rejected for t in r.trials)


def test_while_nothing_is_clean_the_search_walks_from_the_fewest_spills():
    """Only ds_row_xor=1 with lse_rows_rolled=1 spills nothing; each alone spills less than the start: the
    walk moves to the one that spills least and finds the pair."""
    spec = KernelSpec(**B, head_dim=64, dtype="bfloat16", deterministic=True, key_padding=True)

    spills = {(0, 0): 32, (1, 0): 16, (0, 1): 24, (1, 1): 0}

    def evaluate(s, values):
        got = spills[values["ds_row_xor"], values["lse_rows_rolled"]] + 64 * values["dv_early"]
        return Evaluation({"interior": 480.0}, spill_bytes=got)

    r = search_class(spec, evaluate=evaluate, major=13)
    assert (r.best.rejected, r.best.values["ds_row_xor"], r.best.values["lse_rows_rolled"]) == (None, 1, 1)


def test_the_shipped_table_is_legal_for_its_classes():
    table = CODEGEN.load_table()
    assert table, "the wgmma family's table ships with the package"
    for key, entry in table.items():
        spec = KernelSpec(**entry["spec"])
        assert class_key(spec.family_spec, int(key.split("/")[0][5:])) == key
        assert CODEGEN.illegal_reason(spec.family_spec, entry["values"]) is None, key


# Each knob's value other than its start, rendered, compiled for the emulator and run against the float64
# reference (what the GPU runs is the same source): the split tile's dS^T store; the one-accumulator tile's
# dS^T store, rolled producer rows and early dV~ beside the deterministic order; the bias
# from global memory with the early dV~.
KNOB_CASES = [
    (FeatCase("d64-det-bf16", "bfloat16", head_dim=64, seqlen_q=150, seqlen_k=200, deterministic=True), {},
     {"ds_row_xor": 1, "lse_rows_rolled": 1, "dv_early": 1}),
    (FeatCase("d64-bias-fp16", head_dim=64, seqlen_q=70, seqlen_k=90, bias=(1, 4, 70, 90)), {},
     {"bias_smem": 0, "dv_early": 1}),
    pytest.param(FeatCase("d192-causal-fp16", batch=1, heads=2, heads_kv=2, head_dim=192, seqlen_q=70, seqlen_k=90,
                          causal=True), {}, {"ds_row_xor": 1}, marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("case", "flags", "knobs"), KNOB_CASES, ids=lambda x: str(x) if isinstance(x, FeatCase) else None)
def test_other_knob_values_meet_the_reference(case, flags, knobs):
    extra = {"arch": "sm_90a", **flags}
    fwd, bwd_spec = check_case(case, "wgmma", extra=extra, bwd_extra={"codegen": knobs})
    assert bwd_spec.impl == "wgmma"
    cfg = plan_of(bwd_spec).codegen
    assert {k.name: k.value for k in cfg.knobs if k.source == "user"} == knobs


@pytest.mark.slow
@pytest.mark.skipif(not __import__("os").environ.get("FAGEN_TEST_SLOW"), reason="heavy PTX-level run: set FAGEN_TEST_SLOW=1")
def test_other_knob_values_at_the_ptx_level():
    """The inline PTX the GPU runs (stmatrix at a held shared address XORed per k step, the producer's rolled
    rows, the early dV~ beside the deterministic order), translated and run on the CPU: the float64
    criterion (opt-in: FAGEN_TEST_SLOW=1)."""
    from fagen.runtime import cpu

    case, flags, knobs = KNOB_CASES[0]
    with cpu.ptx() as record:
        check_case(case, "wgmma", extra={"arch": "sm_90a", **flags}, bwd_extra={"codegen": knobs})
    assert record.roles == {"main", "pre", "post"}


def test_no_shipped_table_holds_a_class_of_generated():
    """generated/'s kernels render from the starting points whatever NVRTC the machine has: neither family's
    shipped table holds their classes, and ``fagen tune-codegen --all`` leaves them out of the table."""
    from fagen.autotune.codegen import generated_classes
    from fagen.families.mma.codegen import CODEGEN as MMA
    from fagen.generate import hopper_matrix

    gen = generated_classes(13)
    assert class_key(hopper_matrix()[0].family_spec, 13) in gen
    for cs in (MMA, CODEGEN):
        assert not gen & set(cs.load_table()), cs.family
    searched = {class_key(s.family_spec, 13) for s in default_classes("wgmma")}
    assert set(CODEGEN.load_table()) <= searched  # --all regenerates every class the table holds


def _toolchain() -> bool:
    from fagen import sass
    from fagen.families.codegen import nvrtc_major

    return nvrtc_major() is not None and sass.nvdisasm_path() is not None


@pytest.mark.slow
@pytest.mark.skipif(not _toolchain(), reason="needs NVRTC and nvdisasm")
def test_real_search_of_a_spilling_class():
    """NVRTC, nvdisasm and the warp-specialised count end to end: the deterministic backward at d = 64 with key
    padding spills at its starting point (ptxas, NVRTC 13: 32 bytes), and the search finds a clean setting
    with HGMMA rows (consumer and producer loops found)."""
    spec = KernelSpec(**B, head_dim=64, dtype="bfloat16", deterministic=True, key_padding=True)
    res = search_class(spec, max_configs=8)
    assert res.best.rejected is None and res.best.evaluation.spill_bytes == 0
    assert 300 < res.best.evaluation.rows["interior"] < 700
    assert all(t.evaluation.error is None for t in res.trials)
