"""One prepared GPU check: the GPU tests, then fagen vs torch SDPA, within a time budget.

    python benchmarks/gpu_check.py OUTDIR [--quick] [--skip-tests] [--budget-s 450] [--iters 5] [--wheels DIR]
                                   [--seqlens 4096,16384] [--head-dims 128] [--providers fagen_wgmma,sdpa_flash]

Writes at most 8 files, all directly in OUTDIR: ``gpu_check.json`` (everything),
``gpu_check.txt`` (a readable summary), ``gpu_tests.log`` (pytest's output) and, when
matplotlib is installed, PNG plots (``tflops_fwd.png``, ``tflops_bwd.png``, one
``autotune_*.png`` per tuned shape; benchmarks/plots.py); the JSON lists them.

Offline GPU machine (torch, CuPy, jinja2, filelock, rich and cuda-pathfinder present, no
package index): ``--wheels DIR`` unzips the wheels of DIR that fit this Python into a fresh
folder under the temp dir and puts it first on the import path of the check and of its
pytest run -- the rest fagen needs (pydantic, pydantic-core, annotated-types,
typing-inspection, platformdirs, typing-extensions: docs/performance.md says how to download
them). Nothing is installed, and the checkout needs no ``pip install -e``. The
same by hand: ``pip install --no-index --no-deps --target SITE DIR/*.whl`` and
``PYTHONPATH=SITE:$PWD python benchmarks/gpu_check.py OUTDIR``.

1. Preflight: the packages fagen needs at run time (torch, cupy, jinja2, pydantic,
   numpy, cuda-pathfinder, filelock, platformdirs; pytest for the tests), a CUDA
   device, the CUDA versions (driver, CuPy, torch, NVRTC: fagen's decision at first
   use, or the one-line fix). No GPU: the JSON says so and the exit status is 0.
   Missing packages: the JSON and stderr name them (with the pip command) and the
   exit status is 2.
2. ``pytest -m gpu`` over the test files with GPU tests in a subprocess (its summary line is
   kept; with pytest-xdist on up to 8 workers where there are 4 cores or more), sharing fagen's cubin cache with the benchmark: tests/test_gpu.py (the op
   layer), tests/test_gpu_features.py (every family's kernels over the feature matrix) and the
   Hopper primitives' GPU tests.
3. Benchmark rows: forward and backward time and TFLOP/s of fagen and of torch's
   SDPA backends (math, flash, efficient, cuDNN; each "n/a" when unavailable, math
   skipped at N = 16k), for d in {64, 128}, fp16/bf16, causal or not, N in
   {1k, 4k, 16k} with B * N = 16k tokens and H = 16. Every provider is timed the same
   way: the forward op, and the backward through ``torch.autograd.grad``; CUDA events
   around k back-to-back calls (k chosen so one repetition spans >= 2 ms), the host
   synchronised once after all repetitions, median (fagen.autotune.timing.measure).
   FLOPs: forward 4 B H Nq Nk d, backward 2.5x that, both halved when causal.
   ``fagen_mma_det``: the same with the deterministic backward (its dq kernel's recomputation
   is not counted as work: its TFLOP/s are comparable with the atomic backward's).
   Rows that would overrun the budget are skipped with a note.
4. ``fagen.autotune.gpu_check_rows`` for one or two shapes, when it exists and time is
   left; candidates reached after the budget are not run (they time as inf, noted).

Exit status: 0 when everything that ran passed (or there is no GPU), 1 when a test
failed, the CUDA setup does not fit together or the benchmark hit a CUDA error, 2 for
missing packages.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # this checkout's fagen, installed or not

#: import name -> pip distribution, for what fagen needs on a GPU.
REQUIRED = {
    "torch": "torch", "cupy": "cupy-cuda12x (or cupy-cuda13x)", "jinja2": "jinja2", "pydantic": "pydantic",
    "numpy": "numpy", "cuda.pathfinder": "cuda-pathfinder", "filelock": "filelock", "platformdirs": "platformdirs",
}
TEST_REQUIRED = {"pytest": "pytest"}

#: fagen_<family>: each kernel family through an explicit spec (forward and backward kernels alone);
#: fagen_<family>_det: with the deterministic backward (dq kernel, no atomics).
FAMILIES = ("mma", "simt")
DETERMINISTIC = ("mma",)
#: fagen_wgmma: the Hopper family on a capability-9.0 GPU (its sm_90a kernels): its forward, and the
#: backward the sm_90a spec resolves to (the Hopper family where it takes the spec, else mma).
HOPPER = "wgmma"
HOPPER_ARCH = "sm_90a"
PROVIDERS = ("fagen_mma", "fagen_simt", "fagen_mma_det", "fagen_wgmma", "sdpa_math", "sdpa_flash", "sdpa_efficient",
             "sdpa_cudnn")
REFERENCE = "sdpa_flash"  # each row's ratios: reference ms / provider ms (> 1: faster than FlashAttention-2)
TOKENS = 16 * 1024
HEADS = 16
FINAL_RESERVE_S = 15.0  # writing the outputs
AUTOTUNE_RESERVE_S = 75.0
AUTOTUNE_MIN_S = 45.0
MAX_OUTPUT_FILES = 8  # everything the check writes into OUTDIR


# --------------------------------------------------------------------------- arguments
def _int_list(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir", type=Path, help="directory for gpu_check.json, gpu_check.txt, gpu_tests.log and the "
                                              f"plots (at most {MAX_OUTPUT_FILES} files)")
    ap.add_argument("--quick", action="store_true", help="fewer benchmark rows and iterations")
    ap.add_argument("--skip-tests", action="store_true", help="do not run the GPU tests (pytest -m gpu)")
    ap.add_argument("--budget-s", type=float, default=450.0, help="wall-clock budget of the whole check (s)")
    ap.add_argument("--iters", type=int, default=None, help="timed iterations per measurement (median)")
    ap.add_argument("--seqlens", type=_int_list, default=None, metavar="N,N",
                    help="benchmark only these sequence lengths (default: 1024,4096,16384; --quick: 1024,4096)")
    ap.add_argument("--head-dims", type=_int_list, default=None, metavar="D,D",
                    help="benchmark only these head dims (default: 64,128)")
    ap.add_argument("--providers", type=lambda t: tuple(x for x in t.split(",") if x), default=PROVIDERS,
                    metavar="NAME,NAME", help=f"time only these providers (default: all of {','.join(PROVIDERS)})")
    ap.add_argument("--wheels", type=Path, default=None, metavar="DIR",
                    help="offline: a folder of wheels for the packages the GPU machine lacks (unzipped into a temp "
                         "folder put first on the import path; nothing is installed)")
    args = ap.parse_args(argv)
    if args.wheels is not None and not args.wheels.is_dir():
        ap.error(f"--wheels {args.wheels}: not a folder")
    if args.budget_s <= 0:
        ap.error("--budget-s must be positive")
    if unknown := [p for p in args.providers if p not in PROVIDERS]:
        ap.error(f"--providers: unknown provider {unknown[0]!r} (choose from {', '.join(PROVIDERS)})")
    if not args.providers:
        ap.error("--providers: name at least one provider")
    if args.seqlens is not None and any(TOKENS % n for n in args.seqlens):
        ap.error(f"--seqlens: each length must divide the {TOKENS} tokens of a row")
    if args.iters is not None and args.iters < 1:
        ap.error("--iters must be at least 1")
    if args.iters is None:
        args.iters = 3 if args.quick else 5
    return args


# --------------------------------------------------------------------------- clock
class Deadline:
    """Seconds left of a budget; ``clock`` is injectable for tests."""

    def __init__(self, budget_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.start = clock()
        self.end = self.start + budget_s

    def left(self) -> float:
        return self.end - self._clock()

    def elapsed(self) -> float:
        return self._clock() - self.start


# --------------------------------------------------------------------------- offline wheels
def wheel_fits(filename: str, version: tuple[int, int] | None = None, machine: str | None = None) -> str | None:
    """None when the wheel ``filename`` can be imported by this interpreter (its Python, ABI and
    platform tags), else why not."""
    v = version or sys.version_info[:2]
    machine = machine or platform.machine()
    parts = filename.removesuffix(".whl").split("-")
    if len(parts) < 5 or not filename.endswith(".whl"):
        return "not a wheel file name"
    py, abi, plat = parts[-3], parts[-2], parts[-1]
    cp = f"cp{v[0]}{v[1]}"
    if not set(py.split(".")) & {"py3", cp, f"py{v[0]}{v[1]}"}:
        return f"built for {py}, this is Python {v[0]}.{v[1]}"
    if not set(abi.split(".")) & {"none", "abi3", cp}:
        return f"ABI {abi}, this is {cp}"
    if plat != "any" and not any(machine in p for p in plat.split(".")):
        return f"platform {plat}, this is {machine}"
    return None


def unpack_wheels(folder: Path, site: Path | None = None) -> dict[str, Any]:
    """Unzip every wheel of ``folder`` that fits this interpreter into ``site`` (a fresh temp
    folder when None) -- a wheel is a zip of its importable tree, so no pip is needed -- and put
    ``site`` first on ``sys.path`` and on the ``PYTHONPATH`` the pytest subprocess inherits."""
    site = site or Path(tempfile.mkdtemp(prefix="fagen-site-"))
    installed, skipped = [], {}
    for whl in sorted(folder.glob("*.whl")):
        why = wheel_fits(whl.name)
        if why:
            skipped[whl.name] = why
            continue
        with zipfile.ZipFile(whl) as z:
            z.extractall(site)
        installed.append(whl.name)
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    os.environ["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO)] +
                                               ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    return {"folder": str(folder), "site": str(site), "unpacked": installed, "skipped": skipped}


# --------------------------------------------------------------------------- preflight
def missing_packages(names: dict[str, str]) -> dict[str, str]:
    """Import name -> pip name of those not importable."""
    missing = {}
    for mod, pip_name in names.items():
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):  # a parent package is missing
            found = False
        if not found:
            missing[mod] = pip_name
    return missing


def install_hint(missing: dict[str, str]) -> str:
    return "pip install " + " ".join(sorted(set(missing.values())))


def environment() -> dict[str, Any]:
    """Versions and the device, as far as they can be read."""
    env: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform()}
    for mod in ("torch", "cupy", "numpy", "pydantic", "jinja2"):
        try:
            env[mod] = getattr(__import__(mod), "__version__", "?")
        except Exception:  # noqa: BLE001 - a broken install reads as absent
            env[mod] = None
    try:
        import torch

        env["torch_cuda"] = torch.version.cuda
        env["cuda_available"] = bool(torch.cuda.is_available())
        if env["cuda_available"]:
            props = torch.cuda.get_device_properties(0)
            env["device"] = {"name": props.name, "capability": f"{props.major}.{props.minor}",
                             "sm_count": props.multi_processor_count,
                             "memory_gib": round(props.total_memory / 2**30, 1),
                             "count": torch.cuda.device_count()}
    except ImportError:
        env["cuda_available"] = False
    return env


def cupy_info() -> dict[str, Any]:
    """CuPy's view of the driver and runtime (a CUDA 12 driver cannot run cupy-cuda13x)."""
    try:
        import cupy

        rt = cupy.cuda.runtime
        return {"driver": rt.driverGetVersion(), "runtime": rt.runtimeGetVersion(), "devices": rt.getDeviceCount()}
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def detect_arch() -> str:
    """fagen's arch for device 0 (raises SpecError for a GPU fagen does not target)."""
    import torch

    from fagen.runtime.gpu import device_arch

    return device_arch(torch.device("cuda", 0))


def nvrtc_info() -> dict[str, Any]:
    try:
        from fagen import nvrtc

        return {"version": list(nvrtc.version()), "include_dir": str(nvrtc.include_dir()),
                "toolchain": nvrtc.toolchain_id(), "supported_archs": sorted(nvrtc.supported_archs()),
                "installed": [{"major": t.major, "release": t.release, "library": str(t.library)}
                              for t in nvrtc.toolkits()]}
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return {"error": f"{type(e).__name__}: {e}"}


def toolchain_decision() -> dict[str, Any]:
    """fagen's first-use decision (driver, CuPy, torch vs NVRTC); ``error``: the one-line fix."""
    try:
        from fagen.runtime import gpu

        driver = gpu.driver_version()  # the same reading the runtime does
        versions = gpu.installed_versions(driver) if driver else None
        major = gpu.ensure_toolchain()
        return {"driver": driver, "versions": asdict(versions) if versions else None, "nvrtc_major": major}
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return {"error": f"{type(e).__name__}: {e}"}


# --------------------------------------------------------------------------- tests
_SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected|warnings?)")


def parse_pytest_summary(output: str) -> dict[str, Any]:
    """Counts from pytest's final summary line ("3 passed, 1 skipped in 2.1s")."""
    lines = [ln.strip("= ").strip() for ln in output.strip().splitlines() if re.search(r"\bin [\d.]+s\b", ln)]
    line = lines[-1] if lines else ""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    for n, what in _SUMMARY.findall(line):
        key = {"error": "errors", "errors": "errors"}.get(what, what)
        if key in counts:
            counts[key] = int(n)
    return {"summary": line or "(no pytest summary line)", **counts}


#: The test files that hold ``gpu``-marked tests (tests/test_gpu_check.py checks the list is whole): collecting
#: only these keeps the run short where every test skips.
GPU_TEST_FILES = ("test_gpu.py", "test_gpu_features.py", "test_wgmma_gpu.py", "test_wgmma_dq_staging.py",
                  "test_autotune.py")


def test_workers() -> int:
    """pytest-xdist workers for the GPU tests, one GPU shared: the CPU computes their float64 references and NVRTC
    compiles their kernels, so one per core up to 8 (16 were slower on a 16-core machine: each worker starts
    Python and a CUDA context); :func:`run_tests` uses none below 4 cores, where starting them costs more than
    they save."""
    return max(1, min(8, os.cpu_count() or 1))


def run_tests(outdir: Path, timeout_s: float, cache_dir: str | None) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", *(str(REPO / "tests" / f) for f in GPU_TEST_FILES), "-m", "gpu", "-q",
           "-rs", "-p", "no:cacheprovider"]
    if importlib.util.find_spec("xdist") is not None and test_workers() >= 4:
        cmd += ["-n", str(test_workers())]
    env = dict(os.environ)
    if cache_dir:
        env["FAGEN_TEST_CACHE_DIR"] = cache_dir  # share cubins with the benchmark
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=max(timeout_s, 1.0))
        output, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        output = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        output += f"\n[gpu_check] pytest stopped after {timeout_s:.0f}s (budget)\n"
        rc = None
    (outdir / "gpu_tests.log").write_text(output)
    result = {"command": " ".join(cmd), "returncode": rc, "seconds": round(time.monotonic() - t0, 1),
              "log": "gpu_tests.log", **parse_pytest_summary(output)}
    result["ok"] = rc == 0 or (rc == 5 and result["failed"] == 0)  # 5: nothing collected/selected
    if rc is None:
        result["summary"] = f"timed out after {timeout_s:.0f}s; " + result["summary"]
    return result


# --------------------------------------------------------------------------- benchmark plan
@dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    seqlen: int
    head_dim: int
    dtype: str
    causal: bool

    @property
    def label(self) -> str:
        return (f"B{self.batch} H{self.heads} N{self.seqlen} d{self.head_dim} {self.dtype}"
                f"{' causal' if self.causal else ''}")


def fwd_flops(s: Shape) -> float:
    """4 B H Nq Nk d (two matmuls of 2 flops per multiply-add), halved when causal."""
    f = 4.0 * s.batch * s.heads * s.seqlen * s.seqlen * s.head_dim
    return f / 2 if s.causal else f


def bwd_flops(s: Shape) -> float:
    """2.5x the forward (five matmuls instead of two)."""
    return 2.5 * fwd_flops(s)


def plan(quick: bool, seqlens: Sequence[int] | None = None, dims: Sequence[int] | None = None) -> list[Shape]:
    """Rows in the order they run: shorter sequences first, so a tight budget drops the longest."""
    seqlens = sorted(seqlens) if seqlens else ((1024, 4096) if quick else (1024, 4096, 16384))
    dims = tuple(dims) if dims else (64, 128)
    dtypes = ("float16",) if quick else ("float16", "bfloat16")
    return [Shape(TOKENS // n, HEADS, n, d, dt, causal)
            for n in seqlens for d in dims for dt in dtypes for causal in (False, True)]


# --------------------------------------------------------------------------- measurements
@dataclass
class Measurement:
    fwd_ms: float | None = None
    bwd_ms: float | None = None
    note: str = ""


@dataclass
class Row:
    shape: Shape
    results: dict[str, Measurement] = field(default_factory=dict)
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"shape": asdict(self.shape), "label": self.shape.label, "note": self.note,
                               "fwd_gflop": fwd_flops(self.shape) / 1e9, "bwd_gflop": bwd_flops(self.shape) / 1e9}
        ref = self.results.get(REFERENCE, Measurement())
        out["results"] = {name: {**asdict(m), "fwd_tflops": tflops(fwd_flops(self.shape), m.fwd_ms),
                                 "bwd_tflops": tflops(bwd_flops(self.shape), m.bwd_ms),
                                 "fwd_vs_flash": ratio(ref.fwd_ms, m.fwd_ms), "bwd_vs_flash": ratio(ref.bwd_ms, m.bwd_ms)}
                          for name, m in self.results.items()}
        return out


def tflops(flops: float, ms: float | None) -> float | None:
    return None if ms is None or ms <= 0 or not math.isfinite(ms) else flops / (ms * 1e-3) / 1e12


def ratio(ref_ms: float | None, ms: float | None) -> float | None:
    """Speed relative to the reference (its time over ours); None when either is missing."""
    ok = all(x is not None and x > 0 and math.isfinite(x) for x in (ref_ms, ms))
    return ref_ms / ms if ok else None  # type: ignore[operator]


#: provider -> (shape -> Measurement); raising means "n/a" with the error as the note.
Provider = Callable[[Shape], Measurement]


class CudaContextLost(RuntimeError):
    """A sticky CUDA error: nothing more can run in this process."""


def run_benchmark(shapes: Sequence[Shape], providers: dict[str, Provider], deadline: Deadline, *,
                  stop_at_left_s: float, health_check: Callable[[], None] = lambda: None) -> list[Row]:
    """Measure every shape with every provider while the budget allows.

    A row is skipped (with a note) when its estimated cost -- the last measured
    row's time scaled by FLOPs -- would run past ``stop_at_left_s`` seconds before the
    deadline. A provider's exception is an "n/a" note; ``health_check`` raising
    :class:`CudaContextLost` skips everything after.
    """
    rows: list[Row] = []
    sec_per_flop = 0.0
    fatal = ""
    for shape in shapes:
        row = Row(shape)
        rows.append(row)
        estimate = sec_per_flop * fwd_flops(shape)
        if fatal:
            row.note = f"skipped: {fatal}"
            continue
        if deadline.left() - estimate < stop_at_left_s:
            row.note = f"skipped: time budget (about {estimate:.0f}s needed, {deadline.left() - stop_at_left_s:.0f}s left)"
            continue
        t0 = deadline.elapsed()
        for name, provider in providers.items():
            try:
                row.results[name] = provider(shape)
            except Exception as e:  # noqa: BLE001 - every failure is data
                row.results[name] = Measurement(note=f"n/a: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
                try:
                    health_check()
                except CudaContextLost as lost:
                    fatal = f"CUDA context lost ({lost})"
                    break
        sec_per_flop = (deadline.elapsed() - t0) / fwd_flops(shape)
    return rows


def cuda_timer(fn: Callable[[], Any], *, warmup: int, iters: int) -> float:
    """Median milliseconds of ``fn`` over ``iters`` runs (CUDA events, after ``warmup`` runs)."""
    from fagen.autotune.timing import measure  # the autotuner's timer: one way to time on GPU

    return measure(fn, warmup=warmup, reps=iters)


def _inputs(shape: Shape, layout: str) -> tuple[Any, Any, Any, Any]:
    """q, k, v (requiring grad) and do; layout "bnhd" (fagen) or "bhnd" (SDPA), contiguous."""
    import torch

    dims = ((shape.batch, shape.seqlen, shape.heads, shape.head_dim) if layout == "bnhd"
            else (shape.batch, shape.heads, shape.seqlen, shape.head_dim))
    dt = getattr(torch, shape.dtype)
    q, k, v, do = (torch.randn(dims, device="cuda", dtype=dt) for _ in range(4))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do


def _measure(forward: Callable[[], Any], inputs: tuple[Any, ...], warmup: int, iters: int) -> Measurement:
    """Forward alone, then backward through autograd (``torch.autograd.grad``: no accumulation)."""
    import torch

    q, k, v, do = inputs
    fwd_ms = cuda_timer(lambda: forward(), warmup=warmup, iters=iters)
    out = forward()
    bwd_ms = cuda_timer(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
                        warmup=warmup, iters=iters)
    return Measurement(fwd_ms, bwd_ms)


def _explicit_attention(fwd: Any, bwd: Any) -> Callable[..., Any]:
    """An autograd op on fixed specs (one kernel family, no dispatch): the forward kernel, and
    the backward kernels (pre, main, post; dq when deterministic) from the forward's o and lse."""
    import torch

    import fagen.functional as F

    class Explicit(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, v: Any) -> Any:
            o, lse = F.run_forward(fwd, q, k, v)
            ctx.save_for_backward(q, k, v, o, lse)
            return o

        @staticmethod
        def backward(ctx: Any, do: Any) -> Any:
            q, k, v, o, lse = ctx.saved_tensors
            return F.run_backward(bwd, do, q, k, v, o, lse)

    return Explicit.apply


def fagen_provider(impl: str, warmup: int, iters: int, deterministic: bool = False) -> Provider:
    """One kernel family through explicit specs, timed as SDPA is (:func:`_measure`: the forward,
    then the backward through ``torch.autograd.grad``)."""
    def run(shape: Shape) -> Measurement:
        import fagen.functional as F
        from fagen.spec import KernelSpec

        inputs = _inputs(shape, "bnhd")
        q, k, v, _ = inputs
        flags = dict(head_dim=shape.head_dim, dtype=shape.dtype, causal=shape.causal, impl=impl,
                     arch=F.default_arch(q.device))
        fwd = KernelSpec(direction="fwd", **flags)
        bwd = KernelSpec(direction="bwd", deterministic=deterministic, **flags)
        attention = _explicit_attention(fwd, bwd)
        m = _measure(lambda: attention(q, k, v), inputs, warmup, iters)
        m.note = fwd.name.replace("fa_fwd_", "").rsplit("_", 1)[0]
        return m

    return run


def hopper_specs(shape: Shape) -> tuple[Any, Any]:
    """The (forward, backward) specs of ``fagen_wgmma`` for a shape: the Hopper family's forward,
    the backward sm_90a resolves to (impl=None: the Hopper family where it takes it, else mma)."""
    from fagen.spec import KernelSpec

    flags = dict(head_dim=shape.head_dim, dtype=shape.dtype, causal=shape.causal, arch=HOPPER_ARCH)
    return KernelSpec(direction="fwd", impl=HOPPER, **flags), KernelSpec(direction="bwd", **flags)


def hopper_provider(warmup: int, iters: int) -> Provider:
    """The Hopper family through explicit sm_90a specs (:func:`hopper_specs`), timed as the others;
    "n/a" on a GPU of another capability (wgmma and setmaxnreg exist on sm_90a only)."""
    def run(shape: Shape) -> Measurement:
        import torch

        cap = torch.cuda.get_device_capability()
        if cap != (9, 0):
            return Measurement(note=f"n/a: {HOPPER_ARCH} kernels need a capability-9.0 GPU, this is {cap[0]}.{cap[1]}")
        fwd, bwd = hopper_specs(shape)
        inputs = _inputs(shape, "bnhd")
        q, k, v, _ = inputs
        attention = _explicit_attention(fwd, bwd)
        m = _measure(lambda: attention(q, k, v), inputs, warmup, iters)
        m.note = f"fwd {fwd.name.replace('fa_fwd_', '')}, bwd {bwd.impl}"
        return m

    return run


def sdpa_provider(backend_name: str, warmup: int, iters: int, *, max_seqlen: int | None = None) -> Provider:
    def run(shape: Shape) -> Measurement:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if max_seqlen is not None and shape.seqlen > max_seqlen:
            return Measurement(note=f"skipped at N > {max_seqlen} (N x N memory and time)")
        backend = getattr(SDPBackend, backend_name)
        inputs = _inputs(shape, "bhnd")
        q, k, v, _ = inputs

        def forward() -> Any:
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=shape.causal)

        try:
            return _measure(forward, inputs, warmup, iters)
        finally:
            del inputs, q, k, v
            torch.cuda.empty_cache()

    return run


def providers(warmup: int, iters: int) -> dict[str, Provider]:
    return {
        **{f"fagen_{impl}": fagen_provider(impl, warmup, iters) for impl in FAMILIES},
        **{f"fagen_{impl}_det": fagen_provider(impl, warmup, iters, deterministic=True) for impl in DETERMINISTIC},
        f"fagen_{HOPPER}": hopper_provider(warmup, iters),
        "sdpa_math": sdpa_provider("MATH", warmup, iters, max_seqlen=4096),
        "sdpa_flash": sdpa_provider("FLASH_ATTENTION", warmup, iters),
        "sdpa_efficient": sdpa_provider("EFFICIENT_ATTENTION", warmup, iters),
        "sdpa_cudnn": sdpa_provider("CUDNN_ATTENTION", warmup, iters),
    }


def cuda_health_check() -> None:
    import torch

    try:
        torch.cuda.synchronize()
    except RuntimeError as e:
        raise CudaContextLost(str(e).splitlines()[0]) from e


# --------------------------------------------------------------------------- compile ahead
def bench_specs(shapes: Sequence[Shape], arch: str, names: Sequence[str] = PROVIDERS) -> list[Any]:
    """The forward and backward specs the rows of providers ``names`` run (one per family, d, dtype,
    causal; the deterministic backward of the DETERMINISTIC families; on sm_90, a capability-9.0 GPU,
    the Hopper family's sm_90a specs too)."""
    from fagen.spec import KernelSpec

    specs = {}
    for s in shapes:
        for impl in FAMILIES:
            for direction, det in (("fwd", False), ("bwd", False), ("bwd", True)):
                if det and impl not in DETERMINISTIC:
                    continue
                if f"fagen_{impl}{'_det' if det else ''}" not in names:
                    continue
                spec = KernelSpec(direction=direction, head_dim=s.head_dim, dtype=s.dtype, causal=s.causal, arch=arch,
                                  impl=impl, deterministic=det)
                specs[spec.name] = spec
        if arch == "sm_90" and f"fagen_{HOPPER}" in names:
            for spec in hopper_specs(s):
                specs[spec.name] = spec
    return list(specs.values())


def precompile(specs: Sequence[Any], deadline: Deadline, stop_at_left_s: float) -> dict[str, Any]:
    """NVRTC for every spec up front (about a second each), so timing never includes a compile."""
    from fagen import compile as compile_spec

    seconds: dict[str, float] = {}
    failed: dict[str, str] = {}
    for spec in specs:
        if deadline.left() < stop_at_left_s:
            failed[spec.name] = "skipped: time budget"
            continue
        t0 = time.monotonic()
        try:
            compile_spec(spec)
        except Exception as e:  # noqa: BLE001 - the row will show the same error as n/a
            failed[spec.name] = f"{type(e).__name__}: {str(e)[:300]}"
        seconds[spec.name] = round(time.monotonic() - t0, 2)
    return {"specs": len(specs), "failed": failed, "seconds": seconds}


# --------------------------------------------------------------------------- autotune
def run_autotune(shapes: Sequence[Shape], deadline: Deadline, timer: Any = None) -> dict[str, Any]:
    """``gpu_check_rows`` per shape while the budget allows; inside a shape, the timer stops running
    candidates once the deadline is reached (they time as inf and are counted in the notes)."""
    try:
        from fagen.autotune import gpu_check_rows
        from fagen.autotune.timing import CudaTimer
    except (ImportError, AttributeError) as e:
        return {"status": "unavailable", "note": f"autotune: unavailable ({type(e).__name__}: {e})"}
    if timer is None:
        timer = CudaTimer(warmup=2, reps=5, stop_at=time.monotonic() + max(deadline.left(), 0.0))
    rows, notes = [], []
    for s in shapes:
        if deadline.left() < AUTOTUNE_MIN_S:
            notes.append(f"{s.label}: skipped (time budget)")
            continue
        before = getattr(timer, "skipped", 0)
        try:
            rows += gpu_check_rows(shapes=[(s.batch, s.heads, s.seqlen, s.head_dim, s.dtype, s.causal)], top=4,
                                   timer=timer)
        except Exception as e:  # noqa: BLE001
            notes.append(f"{s.label}: {type(e).__name__}: {str(e)[:200]}")
        cut = getattr(timer, "skipped", 0) - before
        if cut:
            notes.append(f"{s.label}: {cut} candidate(s) not timed (time budget; shown as inf)")
    return {"status": "ran" if rows else "no rows", "rows": rows, "notes": notes}


# --------------------------------------------------------------------------- outputs
def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def summary_text(result: dict[str, Any]) -> str:
    lines = [f"fagen GPU check: {result['status']}", f"  {result.get('reason', '')}".rstrip()]
    env = result.get("environment", {})
    dev = env.get("device")
    lines.append(f"device: {dev['name']} (cc {dev['capability']}, {dev['sm_count']} SMs)" if dev else "device: none")
    lines.append(f"torch {env.get('torch')} (CUDA {env.get('torch_cuda')}), cupy {env.get('cupy')}, "
                 f"python {env.get('python')}")
    if result.get("missing_packages"):
        lines.append(f"missing packages: {', '.join(result['missing_packages'])} -> {result.get('install_hint')}")
    tests = result.get("tests")
    if tests:
        lines.append(f"tests: {tests.get('summary')} (exit {tests.get('returncode')}, log {tests.get('log')})")
    rows = result.get("benchmark", {}).get("rows", [])
    if rows:
        lines += ["", "benchmark (median ms / TFLOP/s; fwd FLOPs 4BHN^2d, bwd 2.5x, causal halved; "
                      f"x flash: {REFERENCE} time / this time)",
                  f"{'shape':<36} {'provider':<15} {'fwd ms':>9} {'fwd TF/s':>9} {'x flash':>7} "
                  f"{'bwd ms':>9} {'bwd TF/s':>9} {'x flash':>7}  note"]
        for row in rows:
            if row["note"]:
                lines.append(f"{row['label']:<36} {'-':<15} {'':>9} {'':>9} {'':>7} {'':>9} {'':>9} {'':>7}  {row['note']}")
            for name, m in row["results"].items():
                lines.append(f"{row['label']:<36} {name:<15} {_fmt(m['fwd_ms'], '9.3f')} {_fmt(m['fwd_tflops'], '9.2f')} "
                             f"{_fmt(m.get('fwd_vs_flash'), '7.2f')} {_fmt(m['bwd_ms'], '9.3f')} "
                             f"{_fmt(m['bwd_tflops'], '9.2f')} {_fmt(m.get('bwd_vs_flash'), '7.2f')}  {m['note']}")
    auto = result.get("autotune")
    if auto:
        lines.append("")
        lines.append(f"autotune: {auto.get('status')} {auto.get('note', '')}".rstrip())
        for r in auto.get("rows", []):
            lines.append(f"  {r.get('spec')}: spearman {r.get('spearman')}, default {r.get('default_ms')} ms, "
                         f"best measured {(r.get('best_measured') or {}).get('label', '?')}")
        lines += [f"  {n}" for n in auto.get("notes", [])]
    lines.append(f"\nelapsed {result.get('elapsed_s', 0):.0f}s of a {result.get('budget_s', 0):.0f}s budget")
    return "\n".join(lines) + "\n"


def write_outputs(outdir: Path, result: dict[str, Any]) -> None:
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "gpu_check.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (outdir / "gpu_check.txt").write_text(summary_text(result))


# --------------------------------------------------------------------------- main
def _benchmark(args: argparse.Namespace, deadline: Deadline, shapes: list[Shape], arch: str) -> dict[str, Any]:
    compile_report = precompile(bench_specs(shapes, arch, args.providers), deadline,
                                AUTOTUNE_RESERVE_S + FINAL_RESERVE_S)
    warmup = 1 if args.quick else 2
    chosen = {n: p for n, p in providers(warmup, args.iters).items() if n in args.providers}
    rows = run_benchmark(shapes, chosen, deadline,
                         stop_at_left_s=AUTOTUNE_RESERVE_S + FINAL_RESERVE_S, health_check=cuda_health_check)
    return {"warmup": warmup, "iters": args.iters, "precompile": compile_report,
            "rows": [r.as_dict() for r in rows]}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    deadline = Deadline(args.budget_s)
    args.outdir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"status": "ok", "budget_s": args.budget_s, "quick": args.quick}
    if args.wheels is not None:
        result["wheels"] = unpack_wheels(args.wheels)
    missing = missing_packages({**REQUIRED, **({} if args.skip_tests else TEST_REQUIRED)})
    result["environment"] = environment()
    if missing:
        result.update(status="missing_packages", missing_packages=sorted(missing), install_hint=install_hint(missing),
                      reason=f"missing Python packages: {', '.join(sorted(missing))}; {install_hint(missing)}")
    elif not result["environment"].get("cuda_available"):
        result.update(status="no_gpu", reason="no CUDA GPU (torch.cuda.is_available() is False); nothing was measured")
    else:
        _gpu_check(args, deadline, result)
    return _finish(args, deadline, result)


def _gpu_check(args: argparse.Namespace, deadline: Deadline, result: dict[str, Any]) -> None:
    """Tests, benchmark and autotune rows on the GPU; fills ``result``."""
    result["cupy"] = cupy_info()
    result["toolchain"] = toolchain_decision()
    result["nvrtc"] = nvrtc_info()
    if "error" in result["toolchain"]:
        result.update(status="failed", reason=f"CUDA setup: {result['toolchain']['error']}")
        return
    try:
        arch = detect_arch()
    except Exception as e:  # noqa: BLE001
        result.update(status="failed", reason=f"no fagen target arch for this GPU: {e}")
        return
    result["arch"] = arch
    if args.skip_tests:
        result["tests"] = {"summary": "skipped (--skip-tests)", "returncode": None, "ok": True}
    else:
        test_budget = max(60.0, deadline.left() * (0.35 if args.quick else 0.45))
        result["tests"] = run_tests(args.outdir, test_budget, os.environ.get("FAGEN_CACHE_DIR") or _cache_dir())
    result["benchmark"] = _benchmark(args, deadline, plan(args.quick, args.seqlens, args.head_dims), arch)
    at_shapes = [Shape(1, HEADS, 4096, 64, "float16", False)]
    if not args.quick:
        at_shapes.append(Shape(1, HEADS, 4096, 128, "bfloat16", True))
    result["autotune"] = run_autotune(at_shapes, Deadline(max(deadline.left() - FINAL_RESERVE_S, 0.0)))
    lost = any("CUDA context lost" in r["note"] for r in result["benchmark"]["rows"])
    if not result["tests"].get("ok", False):
        result.update(status="failed", reason="GPU tests failed (see gpu_tests.log)")
    elif lost:
        result.update(status="failed", reason="CUDA context lost in the benchmark")


def _cache_dir() -> str:
    from fagen.settings import get_settings

    return str(get_settings().cache_dir)


def write_plots(outdir: Path, result: dict[str, Any], slots: int) -> list[Path]:
    """TFLOP/s and autotune plots (benchmarks/plots.py, PNG) when matplotlib is installed: at most
    ``slots`` files (the rest are left out, with a note in the JSON)."""
    if importlib.util.find_spec("matplotlib") is None or slots <= 0:
        return []
    spec = importlib.util.spec_from_file_location("fagen_bench_plots", Path(__file__).resolve().parent / "plots.py")
    plots = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plots)
    with tempfile.TemporaryDirectory(prefix="fagen-plots-") as tmp:
        try:
            made = plots.plot_gpu_check(result, Path(tmp), formats=("png",))
        except Exception as e:  # noqa: BLE001 - a plot never fails the check
            print(f"[gpu_check] plots: {type(e).__name__}: {e}", file=sys.stderr)
            return []
        kept = []
        for path in made[:slots]:
            dest = outdir / path.name
            dest.write_bytes(path.read_bytes())
            kept.append(dest)
        if len(made) > slots:
            result["plots_left_out"] = [p.name for p in made[slots:]]
        return kept


def _finish(args: argparse.Namespace, deadline: Deadline, result: dict[str, Any]) -> int:
    result["elapsed_s"] = round(deadline.elapsed(), 1)
    base = ["gpu_check.json", "gpu_check.txt"] + (["gpu_tests.log"] if (args.outdir / "gpu_tests.log").exists() else [])
    plots = write_plots(args.outdir, result, MAX_OUTPUT_FILES - len(base))
    result["outputs"] = base + [p.name for p in plots]
    write_outputs(args.outdir, result)
    for plot in plots:
        print(f"[gpu_check] wrote {plot}")
    print(summary_text(result), end="")
    print(f"[gpu_check] wrote {args.outdir / 'gpu_check.json'} and {args.outdir / 'gpu_check.txt'}")
    if result["status"] == "missing_packages":
        print(f"[gpu_check] {result['reason']}", file=sys.stderr)
        return 2
    return 1 if result["status"] == "failed" else 0


if __name__ == "__main__":
    sys.exit(main())
