"""The CPU-side parts of benchmarks/gpu_check.py: arguments, plan, budget, outputs, no-GPU run."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


gc = _load()


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# --------------------------------------------------------------------------- arguments
def test_parse_args_defaults_and_flags(tmp_path: Path) -> None:
    a = gc.parse_args([str(tmp_path)])
    assert (a.outdir, a.quick, a.skip_tests, a.budget_s, a.iters) == (tmp_path, False, False, 450.0, 5)
    b = gc.parse_args([str(tmp_path), "--quick", "--skip-tests", "--budget-s", "100"])
    assert (b.quick, b.skip_tests, b.budget_s, b.iters) == (True, True, 100.0, 3)


@pytest.mark.parametrize("argv", [[], ["out", "--budget-s", "0"], ["out", "--iters", "0"], ["out", "--bogus"],
                                  ["out", "--providers", "fagen_nope"], ["out", "--providers", ","],
                                  ["out", "--seqlens", "3000"], ["out", "--seqlens", "x"], ["out", "--head-dims", "0"]])
def test_parse_args_rejects(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        gc.parse_args(argv)
    assert e.value.code == 2


# --------------------------------------------------------------------------- plan and FLOPs
def test_rows_and_providers_can_be_narrowed(tmp_path: Path) -> None:
    a = gc.parse_args([str(tmp_path), "--seqlens", "16384,4096", "--head-dims", "128",
                       "--providers", "fagen_wgmma,sdpa_flash"])
    assert a.providers == ("fagen_wgmma", "sdpa_flash") and gc.parse_args([str(tmp_path)]).providers == gc.PROVIDERS
    shapes = gc.plan(False, a.seqlens, a.head_dims)
    assert [s.seqlen for s in shapes] == [4096] * 4 + [16384] * 4 and {s.head_dim for s in shapes} == {128}
    specs = gc.bench_specs(shapes, "sm_90", a.providers)
    assert {s.arch for s in specs} == {"sm_90a"} and len(specs) == 2 * 4  # the Hopper fwd + bwd per kind, no others
    assert not gc.bench_specs(shapes, "sm_90", ("sdpa_flash",))
    assert {s.impl for s in gc.bench_specs(shapes, "sm_80", ("fagen_mma_det",))} == {"mma"}


def test_flop_formulas() -> None:
    s = gc.Shape(2, 16, 1024, 64, "float16", False)
    assert gc.fwd_flops(s) == 4 * 2 * 16 * 1024 * 1024 * 64
    assert gc.bwd_flops(s) == 2.5 * gc.fwd_flops(s)
    causal = gc.Shape(2, 16, 1024, 64, "float16", True)
    assert gc.fwd_flops(causal) == gc.fwd_flops(s) / 2 and gc.bwd_flops(causal) == gc.bwd_flops(s) / 2
    assert gc.tflops(4e12, 1000.0) == pytest.approx(4.0)
    assert gc.tflops(1.0, None) is None and gc.tflops(1.0, 0.0) is None


def test_plan_covers_the_matrix_with_16k_tokens() -> None:
    full = gc.plan(quick=False)
    assert len(full) == 3 * 2 * 2 * 2
    assert {(s.seqlen, s.head_dim, s.dtype, s.causal) for s in full} == {
        (n, d, dt, c) for n in (1024, 4096, 16384) for d in (64, 128) for dt in ("float16", "bfloat16")
        for c in (False, True)}
    assert all(s.batch * s.seqlen == 16 * 1024 and s.heads == 16 for s in full)
    assert [s.seqlen for s in full] == sorted(s.seqlen for s in full)  # longest last: dropped first
    quick = gc.plan(quick=True)
    assert set(quick) < set(full) and max(s.seqlen for s in quick) == 4096


def test_bench_specs_one_per_direction_and_kind() -> None:
    specs = gc.bench_specs(gc.plan(quick=False), "sm_90")
    kinds = 2 * 2 * 2  # d x dtype x causal
    # + the Hopper family's forward and the backward sm_90a resolves to, per kind
    assert len(specs) == kinds * (2 * len(gc.FAMILIES) + len(gc.DETERMINISTIC) + 2) == len({s.name for s in specs})
    assert {s.direction for s in specs} == {"fwd", "bwd"} and {s.arch for s in specs} == {"sm_90", "sm_90a"}
    assert {s.impl for s in specs if s.arch == "sm_90"} == set(gc.FAMILIES) == {"mma", "simt"}
    hopper = [s for s in specs if s.arch == "sm_90a"]
    assert {s.impl for s in hopper if s.direction == "fwd"} == {gc.HOPPER} == {"wgmma"}
    assert {s.impl for s in specs if s.deterministic} == set(gc.DETERMINISTIC) == {"mma"}
    assert {f"fagen_{f}" for f in gc.FAMILIES} | {f"fagen_{f}_det" for f in gc.DETERMINISTIC} <= set(gc.PROVIDERS)
    assert f"fagen_{gc.HOPPER}" in gc.PROVIDERS
    assert set(gc.providers(1, 1)) == set(gc.PROVIDERS) and gc.REFERENCE in gc.PROVIDERS
    # another arch: no sm_90a kernels
    assert {s.arch for s in gc.bench_specs(gc.plan(quick=True), "sm_80")} == {"sm_80"}


def test_rows_report_the_ratio_to_sdpa_flash() -> None:
    shape = gc.Shape(4, 16, 4096, 64, "float16", False)
    row = gc.Row(shape, {"fagen_mma": gc.Measurement(2.0, 8.0), "sdpa_flash": gc.Measurement(3.0, 6.0),
                         "fagen_simt": gc.Measurement(note="n/a: x")}).as_dict()["results"]
    assert row["fagen_mma"]["fwd_vs_flash"] == pytest.approx(1.5) and row["fagen_mma"]["bwd_vs_flash"] == pytest.approx(0.75)
    assert row["sdpa_flash"]["fwd_vs_flash"] == pytest.approx(1.0)
    assert row["fagen_simt"]["fwd_vs_flash"] is None
    assert gc.Row(shape, {"fagen_mma": gc.Measurement(2.0, 8.0)}).as_dict()["results"]["fagen_mma"]["bwd_vs_flash"] is None


# --------------------------------------------------------------------------- benchmark loop
def test_run_benchmark_records_errors_as_na_and_respects_the_budget() -> None:
    clock = FakeClock()
    deadline = gc.Deadline(60.0, clock)
    shapes = [gc.Shape(16, 16, 1024, 64, "float16", False), gc.Shape(4, 16, 4096, 64, "float16", False),
              gc.Shape(1, 16, 16384, 64, "float16", False)]
    calls: list[tuple[str, int]] = []

    def fake(name: str, seconds_per_1k: float):
        def run(shape):
            calls.append((name, shape.seqlen))
            clock.now += seconds_per_1k * shape.seqlen / 1024  # B * N fixed: time grows like the FLOPs
            if name == "broken":
                raise RuntimeError("no kernel for this input\nsecond line")
            return gc.Measurement(fwd_ms=1.0, bwd_ms=2.5)
        return run

    # row 1 takes 4 s; row 2 (4x the FLOPs) is estimated at 16 s and fits (56 s left); row 3 is
    # estimated at 64 s with 40 s left: skipped
    rows = gc.run_benchmark(shapes, {"ok": fake("ok", 3.0), "broken": fake("broken", 1.0)}, deadline,
                            stop_at_left_s=10.0)
    assert [r.note for r in rows[:2]] == ["", ""]
    assert rows[2].note.startswith("skipped: time budget") and rows[2].results == {}
    assert rows[0].results["broken"].note == "n/a: RuntimeError: no kernel for this input"
    assert rows[0].results["ok"].fwd_ms == 1.0
    assert (("ok", 16384) not in calls) and len(calls) == 4


def test_run_benchmark_stops_after_a_lost_context() -> None:
    deadline = gc.Deadline(1e6)
    shapes = gc.plan(quick=True)[:3]

    def boom(shape):
        raise RuntimeError("an illegal memory access was encountered")

    def lost() -> None:
        raise gc.CudaContextLost("illegal memory access")

    rows = gc.run_benchmark(shapes, {"a": boom, "b": boom}, deadline, stop_at_left_s=0.0, health_check=lost)
    assert list(rows[0].results) == ["a"]  # "b" never ran
    assert all(r.note.startswith("skipped: CUDA context lost") for r in rows[1:])


# --------------------------------------------------------------------------- outputs
def test_parse_pytest_summary() -> None:
    out = "....s.F\n=========== 1 failed, 5 passed, 1 skipped, 2 warnings in 12.34s ===========\n"
    got = gc.parse_pytest_summary(out)
    assert (got["passed"], got["failed"], got["skipped"], got["errors"]) == (5, 1, 1, 0)
    assert got["summary"] == "1 failed, 5 passed, 1 skipped, 2 warnings in 12.34s"
    assert gc.parse_pytest_summary("14 skipped in 3.3s")["skipped"] == 14
    assert gc.parse_pytest_summary("1 error in 0.5s")["errors"] == 1
    assert gc.parse_pytest_summary("Traceback ...")["summary"] == "(no pytest summary line)"


def test_write_outputs_json_and_text(tmp_path: Path) -> None:
    shape = gc.Shape(4, 16, 4096, 128, "bfloat16", True)
    row = gc.Row(shape, {"fagen": gc.Measurement(10.0, 30.0), "sdpa_cudnn": gc.Measurement(note="n/a: nope")})
    result = {"status": "ok", "budget_s": 450.0, "elapsed_s": 123.0,
              "environment": {"torch": "2.x", "device": {"name": "H200", "capability": "9.0", "sm_count": 132}},
              "tests": {"summary": "14 passed in 50s", "returncode": 0, "log": "gpu_tests.log"},
              "benchmark": {"rows": [row.as_dict(), gc.Row(shape, note="skipped: time budget").as_dict()]},
              "autotune": {"status": "unavailable", "note": "autotune: unavailable (ImportError: x)"}}
    gc.write_outputs(tmp_path / "out", result)
    data = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    fagen = data["benchmark"]["rows"][0]["results"]["fagen"]
    assert fagen["fwd_tflops"] == pytest.approx(gc.fwd_flops(shape) / 10e-3 / 1e12)
    assert data["benchmark"]["rows"][0]["results"]["sdpa_cudnn"]["fwd_tflops"] is None
    text = (tmp_path / "out" / "gpu_check.txt").read_text()
    assert "H200" in text and "14 passed" in text and "n/a: nope" in text and "skipped: time budget" in text
    assert "autotune: unavailable" in text


def test_missing_packages_named_with_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "filelock" else real(n, *a))
    missing = gc.missing_packages(gc.REQUIRED)
    assert missing == {"filelock": "filelock"} and gc.install_hint(missing) == "pip install filelock"
    assert gc.missing_packages({"no_such_pkg.sub": "x"}) == {"no_such_pkg.sub": "x"}


def test_autotune_unavailable_is_a_note(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fagen.autotune", None)  # import fails
    got = gc.run_autotune([gc.Shape(1, 16, 4096, 64, "float16", False)], gc.Deadline(100))
    assert got["status"] == "unavailable" and got["note"].startswith("autotune: unavailable")


# --------------------------------------------------------------------------- whole script
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_script_without_gpu_exits_0_and_says_so(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "o"), "--quick"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "o" / "gpu_check.json").read_text())
    assert data["status"] == "no_gpu" and "no CUDA GPU" in data["reason"]
    assert "no_gpu" in (tmp_path / "o" / "gpu_check.txt").read_text()


def test_script_reports_missing_packages_with_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gc, "REQUIRED", {**gc.REQUIRED, "definitely_not_installed_pkg": "dnip"})
    assert gc.main([str(tmp_path / "o"), "--skip-tests"]) == 2
    data = json.loads((tmp_path / "o" / "gpu_check.json").read_text())
    assert data["status"] == "missing_packages" and data["install_hint"] == "pip install dnip"


def test_gpu_path_end_to_end_with_fake_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU branch of main() on the CPU: real NVRTC precompile and pytest run, fake timings."""
    env = {**gc.environment(), "cuda_available": True,
           "device": {"name": "FakeGPU", "capability": "9.0", "sm_count": 132, "memory_gib": 1.0, "count": 1}}
    monkeypatch.setattr(gc, "environment", lambda: env)
    monkeypatch.setattr(gc, "detect_arch", lambda: "sm_90")
    monkeypatch.setattr(gc, "cuda_health_check", lambda: None)
    monkeypatch.setattr(gc, "providers", lambda warmup, iters: {"fagen": lambda s: gc.Measurement(2.0, 5.0)})
    rc = gc.main([str(tmp_path / "o"), "--quick"])
    data = json.loads((tmp_path / "o" / "gpu_check.json").read_text())
    assert rc == 0, data
    assert data["tests"]["ok"] and data["tests"]["skipped"] > 0  # every GPU test skips here
    assert data["benchmark"]["precompile"]["failed"] == {}  # the bench specs compile for sm_90
    assert len(data["benchmark"]["rows"]) == len(gc.plan(quick=True))
    assert data["autotune"]["notes"]  # gpu_check_rows needs a real GPU: recorded, not raised
    assert (tmp_path / "o" / "gpu_tests.log").read_text().strip()


def test_the_gpu_test_files_are_every_file_with_gpu_tests() -> None:
    import re

    mark = re.compile(r"^\s*(@pytest\.mark\.gpu\b|pytest\.mark\.gpu,)", re.M)
    marked = {p.name for p in (REPO / "tests").glob("test_*.py") if mark.search(p.read_text(encoding="utf-8"))}
    assert marked == set(gc.GPU_TEST_FILES)


# --------------------------------------------------------------------------- offline mode, outputs
def test_help_documents_the_offline_mode() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    out = " ".join(proc.stdout.split())
    assert "--wheels DIR" in out and "Offline GPU machine" in out and "no ``pip install -e``" in out
    assert "PYTHONPATH=SITE:$PWD python benchmarks/gpu_check.py OUTDIR" in out
    assert "at most 8 files" in out


@pytest.mark.parametrize("name,why", [
    ("pydantic-2.14.4-py3-none-any.whl", None),
    ("pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl", None),
    ("pydantic_core-2.50.5-cp311-cp311-manylinux2014_x86_64.whl", "built for cp311, this is Python 3.12"),
    ("x-1.0-cp312-cp312-manylinux2014_aarch64.whl", "platform manylinux2014_aarch64, this is x86_64"),
    ("x-1.0-cp312-abi3-manylinux2014_x86_64.whl", None),
    ("notes.txt", "not a wheel file name"),
])
def test_wheel_tags_decide_what_is_unpacked(name: str, why: str | None) -> None:
    assert gc.wheel_fits(name, (3, 12), "x86_64") == why


def test_the_shared_wheel_folder_fits_cpython_3_12() -> None:
    cands = [Path(os.environ["FAGEN_TEST_GPU_WHEELS"])] if os.environ.get("FAGEN_TEST_GPU_WHEELS") else []
    cands += [REPO / "shared" / "gpu-wheels", REPO.parent / "shared" / "gpu-wheels"]
    folder = next((c for c in cands if c.is_dir()), None)
    if folder is None:
        pytest.skip(f"no gpu-wheels folder at {[str(c) for c in cands]}")
    names = sorted(p.name for p in folder.glob("*.whl"))
    assert names and all(gc.wheel_fits(n, (3, 12), "x86_64") is None for n in names)
    dists = {n.split("-")[0].lower() for n in names}
    assert {"pydantic", "pydantic_core", "annotated_types", "typing_inspection", "platformdirs",
            "typing_extensions"} <= dists


def _wheel(folder: Path, name: str, body: str) -> Path:
    path = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}/__init__.py", body)
        z.writestr(f"{name}-1.0.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    return path


def test_wheels_are_importable_in_the_check_and_its_pytest_run(tmp_path: Path) -> None:
    """--wheels on a fresh interpreter: a package only the folder has imports in the script and in the
    pytest subprocess it starts (PYTHONPATH), without pip and without installing anything."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "offline_probe", "VALUE = 42\n")
    (wheels / "other-1.0-cp27-cp27mu-linux_x86_64.whl").write_bytes(b"")  # never opened: wrong Python
    code = ("import sys, subprocess, runpy; sys.argv = ['gpu_check.py', '--help']; "
            f"gc = runpy.run_path({str(SCRIPT)!r}, run_name='gpu_check_probe'); "
            f"info = gc['unpack_wheels'](__import__('pathlib').Path({str(wheels)!r})); "
            "import offline_probe; print('in-process', offline_probe.VALUE); "
            "print(subprocess.run([sys.executable, '-c', 'import offline_probe; print(offline_probe.VALUE)'], "
            "capture_output=True, text=True).stdout.strip()); print(sorted(info['skipped']))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines == ["in-process 42", "42", "['other-1.0-cp27-cp27mu-linux_x86_64.whl']"]


def test_outputs_are_at_most_eight_files_in_one_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    shapes = gc.plan(quick=False)
    rows = [gc.Row(s, {"fagen_mma": gc.Measurement(1.0, 2.0), "sdpa_flash": gc.Measurement(1.5, 3.0)}).as_dict()
            for s in shapes]
    cands = [{"predicted_ms": 1.0 + i, "measured_ms": 1.2 + i, "label": f"c{i}", "default": i == 0} for i in range(3)]
    result = {"status": "ok", "budget_s": 1.0, "environment": {}, "benchmark": {"rows": rows},
              "autotune": {"rows": [{"spec": f"shape{i}", "candidates": cands} for i in range(9)]}}
    out = tmp_path / "o"
    out.mkdir()
    (out / "gpu_tests.log").write_text("1 passed in 1s\n")
    args = gc.parse_args([str(out)])
    gc._finish(args, gc.Deadline(1.0), result)
    files = [p for p in out.rglob("*")]
    assert all(p.is_file() and p.parent == out for p in files)
    assert len(files) == gc.MAX_OUTPUT_FILES
    data = json.loads((out / "gpu_check.json").read_text())
    assert sorted(data["outputs"]) == sorted(p.name for p in files) and data["plots_left_out"]


def test_autotune_candidates_after_the_budget_are_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The budget bounds the loop over candidates inside one shape, not only the loop over shapes."""
    import math

    from fagen.autotune import timing

    clock = FakeClock()
    timer = timing.CudaTimer(stop_at=10.0, clock=clock)
    ran: list[str] = []

    def fake_measure(fn, **kw):
        ran.append("x")
        clock.now += 4.0
        return 1.0

    monkeypatch.setattr(timing, "measure", fake_measure)
    monkeypatch.setattr(timing, "TimingInputs", lambda spec, p: type("I", (), {"call": lambda self, s: None})())
    from fagen.autotune.model import Workload
    from fagen.spec import KernelSpec

    spec, p = KernelSpec(head_dim=32, arch="sm_80"), Workload(1, 1, 128, 128)
    times = [timer(spec, p) for _ in range(5)]
    assert times[:3] == [1.0, 1.0, 1.0] and all(math.isinf(t) for t in times[3:])
    assert len(ran) == 3 and timer.skipped == 2


class _FakeEvents:
    """torch.cuda.Event / synchronize on a fake GPU clock: each call of the timed function takes
    ``call_ms`` of GPU time; records where the host synchronised."""

    def __init__(self, call_ms: float) -> None:
        self.gpu_ms, self.call_ms, self.log = 0.0, call_ms, []
        fake = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.t = None

            def record(self) -> None:
                self.t = fake.gpu_ms
                fake.log.append("record")

            def elapsed_time(self, end: "Event") -> float:
                return end.t - self.t

        self.Event = Event

    def fn(self) -> None:
        self.gpu_ms += self.call_ms
        self.log.append("call")

    def synchronize(self) -> None:
        self.log.append("sync")


def test_measure_times_back_to_back_calls_and_syncs_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from fagen.autotune import timing

    fake = _FakeEvents(call_ms=0.05)
    monkeypatch.setattr(torch.cuda, "Event", fake.Event)
    monkeypatch.setattr(torch.cuda, "synchronize", fake.synchronize)
    ms = timing.measure(fake.fn, warmup=2, reps=5)
    assert ms == pytest.approx(0.05)
    k = timing.calls_per_rep(0.05)
    assert k == 40  # 2 ms of GPU time per repetition
    assert fake.log.count("sync") == 2  # after the warm-up, after the last repetition
    timed = fake.log[fake.log.index("sync") + 1:]
    assert timed.count("call") == 5 * k and timed[-1] == "sync"
    first = timed[: timed.index("record", 1) + 1]
    assert first == ["record"] + ["call"] * k + ["record"]  # k calls between one pair of events
    assert timing.calls_per_rep(10.0) == 1 and timing.calls_per_rep(1e-6) == timing.MAX_CALLS
    with pytest.raises(ValueError, match="calls must be at least 1"):
        timing.measure(fake.fn, calls=0)


def test_fagen_provider_runs_through_autograd_like_sdpa() -> None:
    """The explicit-spec op the benchmark times: autograd.grad gives run_backward's gradients."""
    import fagen.functional as F
    from fagen.spec import KernelSpec

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 40, 2, 16, generator=g, dtype=torch.float32).requires_grad_() for _ in range(3))
    do = torch.randn(1, 40, 2, 16, generator=g)
    fwd = KernelSpec(direction="fwd", head_dim=16, dtype="float32", causal=True, impl="simt", arch="sm_90")
    bwd = fwd.replace(direction="bwd")
    out = gc._explicit_attention(fwd, bwd)(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), do)
    o, lse = F.run_forward(fwd, q.detach(), k.detach(), v.detach())
    want = F.run_backward(bwd, do, q.detach(), k.detach(), v.detach(), o, lse)
    assert torch.equal(out.detach(), o) and all(torch.equal(a, b) for a, b in zip(grads, want))


# --------------------------------------------------------------------------- benchmarks/gpu_features.py
def _gpu_features():
    spec = importlib.util.spec_from_file_location("gpu_features", REPO / "benchmarks" / "gpu_features.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_features"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_gpu_features_arguments_and_table(tmp_path: Path) -> None:
    gf = _gpu_features()
    a = gf.parse_args([str(tmp_path)])
    assert (a.head_dims, a.seqlen, a.arch) == ((64, 128), 4096, None)
    for bad in (["--seqlen", "3000"], ["--head-dims", "4"], ["--budget-s", "0"]):
        with pytest.raises(SystemExit) as e:
            gf.parse_args([str(tmp_path), *bad])
        assert e.value.code == 2
    assert list(gf.FEATURES)[0] == "plain"  # every row's ratio is to it
    rows = [{"feature": "plain", "head_dim": 64, "fwd_ms": 2.0, "bwd_ms": 4.0, "fwd_tflops": 1.0, "bwd_tflops": 1.0,
             "fwd_family": "wgmma", "bwd_family": "wgmma"},
            {"feature": "softcap", "head_dim": 64, "fwd_ms": 3.0, "bwd_ms": 5.0, "fwd_tflops": 1.0, "bwd_tflops": 1.0,
             "fwd_family": "wgmma", "bwd_family": "mma"},
            {"feature": "bias", "head_dim": 64, "error": "skipped: time budget"}]
    lines = gf.table(rows).splitlines()
    assert "1.50" in lines[2] and "1.25" in lines[2] and lines[2].endswith("wgmma / mma")
    assert lines[3].endswith("skipped: time budget")


def test_gpu_features_without_a_gpu_measures_nothing(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the benchmark would run")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_features.py"), str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0 and "no CUDA GPU" in proc.stdout
