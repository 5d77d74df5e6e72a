"""The mma family's codegen knobs: legality, the config record and its sources, the stored search
(``fagen tune-codegen``) and its table, explain's view of the knobs."""
from __future__ import annotations

import itertools
import json
import math

import pytest

from fagen.autotune.codegen import Evaluation, search_class, write_table
from fagen.cli import main as cli_main
from fagen.explain.facts import explain
from fagen.explain.page import render_html
from fagen.families.mma.codegen import (
    CODEGEN_KNOBS,
    REGISTER_FILE,
    TABLE_PATH,
    class_key,
    codegen_config,
    forcing,
    illegal_reason,
    knobs_for,
    load_table,
    start_values,
)
from fagen.families.mma.rules import fwd_m_tiles, padded_dim
from fagen.generate import standard_matrix
from fagen.plan import plan_of
from fagen.renderer import render, render_with
from fagen.spec import KernelSpec


def _mma_specs() -> list[KernelSpec]:
    specs = [s for s in standard_matrix() if s.impl == "mma"]
    specs += [KernelSpec(direction=dr, head_dim=d, arch=a, causal=c, **extra)
              for dr in ("bwd", "fwd") for d in (24, 64, 96, 128, 256) for a in ("sm_80", "sm_100") for c in (False, True)
              for extra in ({}, {"dropout": True}, {"varlen": True, "window": True})]
    specs += [KernelSpec(direction=dr, head_dim=64, block_r=48, block_c=32, num_warps=2) for dr in ("bwd", "fwd")]
    return [s for s in specs if s.impl == "mma"]


def _settings(fs) -> list[dict[str, int]]:
    knobs = [k for k in CODEGEN_KNOBS if k.direction == fs.direction]
    return [dict(zip([k.name for k in knobs], vals)) for vals in itertools.product(*(k.values for k in knobs))]


def test_every_starting_point_is_legal_and_renders_todays_source():
    for spec in _mma_specs():
        fs = spec.family_spec
        assert illegal_reason(fs, start_values(fs)) is None, spec.name
        cfg = plan_of(spec).codegen
        assert {k.name for k in cfg.knobs} == {k.name for k in CODEGEN_KNOBS if k.direction == spec.direction}


def test_legal_settings_keep_the_kernels_structure():
    """Every setting the formulas accept keeps whole chunks per Q block, whole warps per copy half,
    Q fragments within the register file and 16-row warps, and leaves the knobs a kernel does not
    have at their start; each rejection names the knob."""
    for spec in _mma_specs():
        fs = spec.family_spec
        own, start = {k.name for k in knobs_for(fs)}, start_values(fs)
        for values in _settings(fs):
            why = illegal_reason(fs, values)
            if why is not None:
                assert why.split("=")[0] in values, why
                continue
            assert all(values[n] == start[n] for n in values if n not in own), (spec.name, values)
            if fs.direction == "bwd" and "bwd_chunk_sub" in own:
                assert fs.block_r % (16 * values["bwd_chunk_sub"] * values["bwd_chunk_unroll"]) == 0
                assert not values["bwd_split_mask"] or fs.block_r % 32 == 0
            if fs.direction == "fwd":
                if values["fwd_q_in_regs"]:
                    assert fwd_m_tiles(fs.block_r, fs.num_warps) == 1
                    assert padded_dim(fs.head_dim) // 4 + fs.block_c // 2 + padded_dim(fs.dv) // 2 <= REGISTER_FILE
                if values["fwd_half_copy"]:
                    assert fs.num_warps % 2 == 0 and (16 * fs.num_warps) % (padded_dim(fs.head_dim) // 8) == 0
                if values["fwd_half_step"]:
                    assert fs.block_c % 32 == 0


def test_illegal_settings_are_rejected():
    fs = KernelSpec(direction="bwd", head_dim=64, block_r=48, block_c=32, num_warps=2).family_spec
    assert "bwd_chunk_sub" in illegal_reason(fs, {"bwd_chunk_sub": 2})
    assert "bwd_split_mask" in illegal_reason(fs, {"bwd_split_mask": 1})
    two_d = KernelSpec(direction="bwd", head_dim=128, arch="sm_90").family_spec
    assert {k.name for k in knobs_for(two_d)} >= {"bwd_2d_fresh", "bwd_2d_pin"}
    assert illegal_reason(two_d, {"bwd_pin": 1 - start_values(two_d)["bwd_pin"]}) is not None  # not the 2-D kernel's
    wide = KernelSpec(direction="fwd", head_dim=128, block_r=128, block_c=64, num_warps=4).family_spec
    assert "fwd_q_in_regs" in illegal_reason(wide, {"fwd_q_in_regs": 1})  # 32-row warps
    assert "nope" in illegal_reason(wide, {"nope": 1})


def _table(tmp_path, spec, values, major, name="table.json"):
    path = tmp_path / name
    path.write_text(json.dumps({"format": 1, "classes": {class_key(spec.family_spec, major): {"values": values}}}))
    return path


def test_config_sources_table_start_and_other_major(tmp_path):
    spec = KernelSpec(direction="bwd", head_dim=64, arch="sm_80")
    fs = spec.family_spec
    flip = 1 - start_values(fs)["lse_now"]
    path = _table(tmp_path, spec, {"lse_now": flip}, 12)
    hit = codegen_config(fs, table=path, major=12)
    assert hit.value("lse_now") == flip and {k.name: k.source for k in hit.knobs}["lse_now"] == "table"
    assert hit.note == ""
    other = codegen_config(fs, table=path, major=13)  # another NVRTC major: the starting points, said so
    assert all(k.source == "start" and k.value == k.start for k in other.knobs) and "searched with nvrtc12" in other.note
    unseen = codegen_config(KernelSpec(direction="bwd", head_dim=96, arch="sm_80").family_spec, table=path, major=12)
    assert all(k.source == "start" for k in unseen.knobs) and "not in the table" in unseen.note
    bad = _table(tmp_path, spec, {"bwd_chunk_sub": 3}, 12, "bad.json")
    assert "illegal" in codegen_config(fs, table=bad, major=12).note
    assert codegen_config(fs) is codegen_config(fs)  # one record per spec


def test_template_context_reads_the_config():
    spec = KernelSpec(direction="bwd", head_dim=64, arch="sm_80")
    start = start_values(spec.family_spec)["lse_now"]
    with forcing({"lse_now": 1 - start}):
        src = render_with(spec, {}).source
    assert f"LSE_NOW = {'false' if start else 'true'};" in src
    assert f"LSE_NOW = {'true' if start else 'false'};" in render(spec).source


def _fake(costs: dict, spills=(), errors=()):
    def evaluate(spec, values):
        key = tuple(sorted(values.items()))
        if key in errors:
            return Evaluation(error="NVRTC: error: boom")
        return Evaluation({"interior": costs.get(key, 1000.0)}, spill_bytes=64 if key in spills else 0)
    return evaluate


def test_search_picks_the_cheapest_clean_setting_and_stores_it(tmp_path):
    spec = KernelSpec(direction="fwd", head_dim=64, arch="sm_80")
    fs = spec.family_spec
    start = start_values(fs)
    qr = {**start, "fwd_q_in_regs": 1 - start["fwd_q_in_regs"]}
    hc = {**start, "fwd_half_copy": 1 - start["fwd_half_copy"]}
    both = {**qr, "fwd_half_copy": hc["fwd_half_copy"]}
    k = lambda v: tuple(sorted(v.items()))
    ev = _fake({k(qr): 990.0, k(hc): 900.0, k(both): 950.0}, spills={k(hc)})
    res = search_class(spec, evaluate=ev, max_configs=10, major=12)
    assert res.best.values == both and res.best.cost == 950.0
    assert any("spills" in (t.rejected or "") for t in res.trials)
    failing = search_class(spec, evaluate=_fake({k(qr): 500.0}, errors={k(qr)}), major=12)
    bad = next(t for t in failing.trials if t.values == qr)
    assert bad.cost == math.inf and "boom" in bad.rejected and failing.best.values == start
    assert "winner" in "\n".join(res.summary())
    spilling_start = search_class(spec, evaluate=_fake({k(start): 100.0, k(qr): 2000.0}, spills={k(start)}), major=12)
    assert spilling_start.best.values != start and spilling_start.best.evaluation.spill_bytes == 0
    path = write_table([res], tmp_path / "t.json")
    assert load_table(path)[res.key]["values"] == both
    cfg = codegen_config(fs, table=path, major=12)
    assert cfg.values == both and {kv.source for kv in cfg.knobs if kv.name in {k.name for k in knobs_for(fs)}} == {"table"}
    assert cfg.knobs[-1].name == "fwd_dropout_16bit_sum" and cfg.knobs[-1].source == "start"  # no dropout: not its choice


def test_the_shipped_tables_entries_are_legal_for_their_classes():
    for key, entry in load_table(TABLE_PATH).items():
        spec = KernelSpec(**entry["spec"])
        major = int(key.split("/")[0].removeprefix("nvrtc"))
        assert class_key(spec.family_spec, major) == key
        assert illegal_reason(spec.family_spec, entry["values"]) is None, key
        assert all(entry["cost"][r] <= entry["start_cost"][r] for r in entry["cost"])


def test_explain_shows_every_knob_and_its_source():
    spec = KernelSpec(direction="fwd", head_dim=64, arch="sm_80")
    facts = explain(spec, 256, with_resources=False)
    cg = facts["codegen"]
    assert set(cg["knobs"]) == {k.name for k in CODEGEN_KNOBS if k.direction == "fwd"}
    assert {v["source"] for v in cg["knobs"].values()} <= {"table", "start"}
    html = render_html(facts)
    assert 'id="codegen-table"' in html and "fwd_q_in_regs" in html


def test_cli_errors_name_the_option(capsys):
    assert cli_main(["tune-codegen", "--head-dim", "64", "--max-configs", "0"]) == 2
    assert cli_main(["tune-codegen"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("fagen: error: --max-configs") and err[1].startswith("fagen: error: --head-dim")
    # a family without codegen knobs, and one table for two families' classes
    assert cli_main(["tune-codegen", "--all", "--impl", "simt"]) == 2
    assert cli_main(["tune-codegen", "--head-dim", "64", "--impl", "simt", "--dry-run"]) == 2
    assert cli_main(["tune-codegen", "--all", "--table", "t.json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(e.startswith(f"fagen: error: {o}") for e, o in zip(err, ("--impl", "--impl", "--table")))
    assert "(mma, wgmma)" in err[0]


def _toolchain():
    from fagen import sass
    from fagen.families.mma.codegen import nvrtc_major

    return nvrtc_major() is not None and sass.nvdisasm_path() is not None


@pytest.mark.skipif(not _toolchain(), reason="needs NVRTC and nvdisasm")
def test_real_search_of_a_small_class(tmp_path):
    spec = KernelSpec(direction="fwd", head_dim=32, arch="sm_80", block_r=64, block_c=64, num_warps=4)
    res = search_class(spec, max_configs=2)
    assert len(res.trials) == 2 and res.start_trial.cost < math.inf
    assert res.best.cost <= res.start_trial.cost and res.best.evaluation.spill_bytes == 0
