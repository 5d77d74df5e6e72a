"""benchmarks/plots.py: the series it draws from gpu_check.json, and the files it writes (skipped
without matplotlib, an optional extra)."""
from __future__ import annotations

import importlib.util
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("fagen_bench_plots", REPO / "benchmarks" / "plots.py")
plots = importlib.util.module_from_spec(_spec)
sys.modules["fagen_bench_plots"] = plots
_spec.loader.exec_module(plots)


def _row(n: int, d: int, dtype: str, causal: bool, results: dict) -> dict:
    return {"shape": {"batch": 16384 // n, "heads": 16, "seqlen": n, "head_dim": d, "dtype": dtype, "causal": causal},
            "label": f"N{n}", "note": "", "results": results}


def _m(fwd: float | None, bwd: float | None, note: str = "") -> dict:
    return {"fwd_ms": 1.0, "bwd_ms": 2.0, "note": note, "fwd_tflops": fwd, "bwd_tflops": bwd}


GPU_CHECK = {
    "status": "ok", "environment": {"device": {"name": "NVIDIA H200"}},
    "benchmark": {"rows": [
        _row(4096, 64, "float16", False, {"fagen": _m(2.0, 1.5), "sdpa_flash": _m(300.0, 200.0)}),
        _row(1024, 64, "float16", False, {"fagen": _m(1.0, 0.5), "sdpa_flash": _m(100.0, None, "n/a: x")}),
        _row(1024, 128, "bfloat16", True, {"fagen": _m(0.8, 0.4), "sdpa_math": _m(None, None, "skipped")}),
    ]},
    "autotune": {"status": "ran", "rows": [{"spec": "fa_bwd_d64_fp16", "candidates": [
        {"label": "64x64 w4 simt", "predicted_ms": 1.0, "measured_ms": 1.2, "default": True},
        {"label": "32x64 w4 simt", "predicted_ms": 1.5, "measured_ms": 1.1, "default": False},
        {"label": "16x16 w4 simt", "predicted_ms": 2.0, "measured_ms": None, "default": False}]}]},
}


def test_tflops_series_per_panel_provider_and_dtype() -> None:
    s = plots.tflops_series(GPU_CHECK["benchmark"]["rows"], "bwd")
    assert list(s) == [(64, False), (128, True)]
    assert s[(64, False)][("fagen", "float16")] == [(1024, 0.5), (4096, 1.5)]  # sorted by N
    assert s[(64, False)][("sdpa_flash", "float16")] == [(4096, 200.0)]  # the n/a point is left out
    assert ("sdpa_math", "bfloat16") not in s[(128, True)]


def test_autotune_panels_from_each_output() -> None:
    tuned = {"spec": {"head_dim": 64, "dtype": "float16", "causal": True, "direction": "bwd"},
             "problem": {"batch": 1, "heads": 16, "seqlen_q": 4096}, "candidates": [{"predicted_ms": 1.0}]}
    assert plots._autotune_panels(tuned)[0][0] == "d64 float16 causal bwd B1 H16 N4096"
    assert [t for t, _ in plots._autotune_panels(GPU_CHECK["autotune"])] == ["fa_bwd_d64_fp16"]
    assert len(plots._autotune_panels(GPU_CHECK["autotune"]["rows"])) == 1
    with pytest.raises(plots.PlotError, match="not an autotune result"):
        plots._autotune_panels({"foo": 1})


def test_plot_files(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    src = tmp_path / "gpu_check.json"
    src.write_text(json.dumps(GPU_CHECK))
    assert plots.main([str(src), "--out", str(tmp_path / "plots")]) == 0
    names = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert names == sorted(f"{stem}.{ext}" for stem in ("tflops_fwd", "tflops_bwd", "autotune_fa_bwd_d64_fp16")
                           for ext in ("png", "svg"))
    assert (tmp_path / "plots" / "tflops_bwd.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = (tmp_path / "plots" / "tflops_fwd.svg").read_text()
    ET.fromstring(svg)  # well-formed
    assert "fagen float16" in svg and "sdpa_flash float16" in svg and "d = 128, causal" in svg


def test_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bad = tmp_path / "x.json"
    bad.write_text('{"foo": 1}')
    assert plots.main([str(bad)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_gpu_check_writes_the_plots(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location("fagen_bench_gpu_check", REPO / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    sys.modules["fagen_bench_gpu_check"] = gpu_check  # dataclasses look their module up
    spec.loader.exec_module(gpu_check)
    paths = gpu_check.write_plots(tmp_path, GPU_CHECK, slots=5)
    assert {p.name for p in paths} >= {"tflops_fwd.png", "tflops_bwd.png"}  # PNG only: few output files
    assert all(p.suffix == ".png" and p.parent == tmp_path and p.stat().st_size > 1000 for p in paths)
    assert gpu_check.write_plots(tmp_path / "none", GPU_CHECK, slots=0) == []
