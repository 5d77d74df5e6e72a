"""User settings of the mma family's codegen knobs (``KernelSpec.codegen``): before the stored
search's table and the starting points, checked against each knob's legal values, part of the name,
the cache key and the rendered source only when given, shown with the source ``"user"``."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from fagen.cli import main as cli_main
from fagen.explain.facts import explain
from fagen.plan import plan_of
from fagen.renderer import render
from fagen.spec import KernelSpec

FWD = {"direction": "fwd", "head_dim": 128, "arch": "sm_80"}


def test_a_user_setting_changes_the_constant_the_name_and_the_cache_key():
    base = KernelSpec(**FWD)
    start = plan_of(base).codegen.value("fwd_half_step")
    spec = KernelSpec(**FWD, codegen={"fwd_half_step": 1 - start})
    cfg = plan_of(spec).codegen
    knob = next(k for k in cfg.knobs if k.name == "fwd_half_step")
    assert (knob.value, knob.source, knob.start) == (1 - start, "user", start)
    # the others keep their table / start
    assert {k.name: (k.value, k.source) for k in cfg.knobs if k.name != "fwd_half_step"} == \
        {k.name: (k.value, k.source) for k in plan_of(base).codegen.knobs if k.name != "fwd_half_step"}
    want = "true" if 1 - start else "false"
    assert f"FWD_HALF_STEP = {want};" in render(spec).source and f"FWD_HALF_STEP = {want};" not in render(base).source
    assert spec.cache_key != base.cache_key and spec.name != base.name
    assert spec.name == base.name.replace("_s2_mma", f"_s2_cg_fwd_half_step{1 - start}_mma")
    # round trip through the JSON the compile cache and the sources' header carry
    assert KernelSpec(**json.loads(spec.model_dump_json())) == spec


def test_no_setting_leaves_the_spec_as_before():
    base = KernelSpec(**FWD)
    assert KernelSpec(**FWD, codegen={}) == base and KernelSpec(**FWD, codegen=None) == base
    assert "codegen" not in base.model_dump() and '"codegen"' not in base.model_dump_json()
    assert "cg_" not in base.name


@pytest.mark.parametrize(("codegen", "words"), [
    ({"nope": 1}, ["'nope'", "fwd_q_in_regs", "fwd_half_copy", "fwd_half_step"]),  # the list of knobs
    ({"fwd_q_in_regs": 2}, ["fwd_q_in_regs=2", "not one of (0, 1)"]),
    ({"bwd_pin": 1}, ["'bwd_pin'", "fwd kernels"]),
])
def test_a_bad_setting_names_the_field_and_the_knob(codegen, words):
    with pytest.raises(ValidationError) as e:
        KernelSpec(**FWD, impl="mma", codegen=codegen)
    err = e.value.errors()[0]
    assert err["loc"] == ("codegen",)
    assert all(w in err["msg"] for w in words), err["msg"]


def test_an_illegal_value_says_why():
    # 32-row warps (block_r 128 on 4 warps) read Q from shared memory
    with pytest.raises(ValidationError, match=r"fwd_q_in_regs=1: 32-row warps"):
        KernelSpec(**FWD, impl="mma", block_r=128, block_c=64, num_warps=4, codegen={"fwd_q_in_regs": 1})
    # a knob the spec's kernel does not have (the 2-D backward's on the 1-D one)
    with pytest.raises(ValidationError, match=r"bwd_2d_pin=1: the spec's kernel has no such choice"):
        KernelSpec(direction="bwd", head_dim=64, arch="sm_80", impl="mma", codegen={"bwd_2d_pin": 1})
    # across knobs: 2 chunks of 32 rows do not divide a 32-row Q block
    with pytest.raises(ValidationError, match=r"bwd_chunk_unroll=2"):
        KernelSpec(direction="bwd", head_dim=64, arch="sm_80", impl="mma", block_r=32, block_c=64, num_warps=4,
                   codegen={"bwd_chunk_sub": 2, "bwd_chunk_unroll": 2})
    # dq_2d: 32 x 32 blocks, one per warp, must tile dQ_i (4 blocks of a 64 x 64 tile, 2 warps)
    with pytest.raises(ValidationError, match=r"dq_2d=1: 32 x 32 blocks, one per warp, do not tile dQ_i"):
        KernelSpec(direction="bwd", head_dim=64, arch="sm_80", impl="mma", block_r=64, block_c=32, num_warps=2,
                   codegen={"dq_2d": 1})
    # a family without codegen knobs
    with pytest.raises(ValidationError, match="impl='simt' has no codegen knobs"):
        KernelSpec(**FWD, impl="simt", codegen={"fwd_q_in_regs": 0})


def test_explain_and_the_cli_show_the_user_source(capsys):
    spec = KernelSpec(**FWD, codegen={"fwd_q_in_regs": 0})
    cg = explain(spec, 256, with_resources=False)["codegen"]
    assert cg["knobs"]["fwd_q_in_regs"]["source"] == "user" and cg["knobs"]["fwd_q_in_regs"]["value"] == 0
    assert cli_main(["inspect", "--direction", "fwd", "--head-dim", "128", "--arch", "sm_80",
                     "--codegen", "fwd_q_in_regs=0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["name"] == spec.name
    assert cli_main(["inspect", "--direction", "fwd", "--head-dim", "128", "--arch", "sm_80",
                     "--codegen", "fwd_q_in_regs"]) == 2
    assert cli_main(["inspect", "--direction", "fwd", "--head-dim", "128", "--arch", "sm_80", "--impl", "mma",
                     "--codegen", "fwd_q_in_regs=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("fagen: error: --codegen: expects KNOB=VALUE")
    assert err[1].startswith("fagen: error: --codegen:") and "fwd_q_in_regs=3" in err[1]
