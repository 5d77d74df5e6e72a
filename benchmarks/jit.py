"""JIT and per-call host latency: what a training loop pays before any kernel runs.

    python benchmarks/jit.py [--repeat N] [--json] [--host-only] [--rounds R]

Rows (each in a private, empty cache dir unless stated):

* ``import fagen``: ``import fagen`` in a fresh interpreter (torch included).
* ``compile cold``: ``fagen.compile(spec)`` in a fresh process on an empty cache
  (render + NVRTC + store).
* ``compile disk hit``: ``fagen.compile(spec)`` in a fresh process once the cubin
  is cached (the index path: no rendering, neither NVRTC nor CuPy loaded).
* ``compile memo hit``: a repeated ``fagen.compile(spec)`` in one process.
* ``first flash_attn_func fwd+bwd``: the same call, first in a fresh process (what a
  training job pays once, before its first step).
* ``flash_attn_func fwd+bwd host``: one ``flash_attn_func`` forward and
  ``backward`` on small inputs (B=2, N=128, H=4, d=64, fp16) with the kernel
  launch replaced by the GPU launcher's own Python work minus CuPy: argument
  packing by name, grid/block limit checks and numpy scalar conversion of every
  parameter (a launch plan's constant ones converted on its first launch, the
  pointers, seed and offset per call). The inputs are CPU tensors (no CUDA device is needed), so what is
  measured is everything Python does per call up to the launch -- the torch
  custom-op and autograd dispatch, validation, spec lookup, tuned-choice lookup,
  argument packing -- plus the host-side allocation of outputs (``torch.empty``)
  and of ``dq_accum`` (zeroed on the CPU here, a memset on a GPU). On a GPU the
  spec lookup also asks torch for the device's compute capability (memoised by
  torch) and CuPy's launch adds its own few microseconds.
* ``bare custom-op pair``: the same forward + backward through a bare
  ``torch.library.custom_op`` pair (forward and backward ops, ``register_autograd``)
  that allocates the same outputs and launches nothing -- the floor of any binding of
  this shape (flash-attn's is one). Measured in the same process, interleaved with the
  fagen rows (best of the rounds for each), and printed as the ratio fagen / bare. Both
  host rows count the calling thread's CPU time (``time.thread_time``; torch runs on one
  thread here), so time the thread spends descheduled on a busy machine is not counted.

Spec: backward, d=64, fp16, causal, sm_90 (the family the default picks).
Numbers are medians over ``--repeat`` runs (fresh-process rows) or many calls.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import timeit
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
SPEC = 'KernelSpec(direction="bwd", head_dim=64, dtype="float16", causal=True, arch="sm_90")'

_IMPORT = """
import time
t = time.perf_counter()
import fagen
print(time.perf_counter() - t)
"""

_COMPILE = f"""
import sys, time
import fagen
from fagen.spec import KernelSpec
spec = {SPEC}
t = time.perf_counter()
mod = fagen.compile(spec)
dt = time.perf_counter() - t
print(dt, mod.cached, "cupy" in sys.modules, "cuda.pathfinder" in sys.modules)
"""


_FIRST_CALL = """
import time
import torch
import fagen
import fagen.functional as F
import fagen.renderer as R
from fagen.runtime import gpu

class HostOnlyLauncher:
    def launch(self, kernel, grid, args):
        gpu.prepare_launch(kernel, grid, args)

F.get_module = lambda spec, device_type: HostOnlyLauncher()
torch.set_num_threads(1)
q, k, v = (torch.randn(2, 128, 4, 64).half().requires_grad_(True) for _ in range(3))
do = torch.randn(2, 128, 4, 64).half()
t = time.perf_counter()
fagen.flash_attn_func(q, k, v, causal=True).backward(do)
print(time.perf_counter() - t, R.render.cache_info().misses)
"""


def _child(code: str, cache_dir: str) -> list[str]:
    env = {**os.environ, "FAGEN_CACHE_DIR": cache_dir, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()


def import_time(repeat: int, cache_dir: str) -> list[float]:
    return [float(_child(_IMPORT, cache_dir)[0]) for _ in range(repeat)]


def compile_times(repeat: int) -> tuple[float, list[float], bool]:
    """(cold seconds, disk-hit seconds per fresh process, whether a hit loaded CuPy/NVRTC)."""
    with tempfile.TemporaryDirectory(prefix="fagen-jit-") as d:
        cold = _child(_COMPILE, d)
        assert cold[1] == "False", "the cold run found an entry"
        hits, loaded = [], False
        for _ in range(repeat):
            secs, cached, cupy, pathfinder = _child(_COMPILE, d)
            assert cached == "True", "a fresh process missed the disk cache"
            hits.append(float(secs))
            loaded = loaded or cupy == "True" or pathfinder == "True"
        return float(cold[0]), hits, loaded


def memo_hit_seconds() -> float:
    import fagen
    from fagen.spec import KernelSpec  # noqa: F401 - used by SPEC

    spec = eval(SPEC)  # noqa: S307 - a constant expression of this file
    fagen.compile(spec)
    n = 20000
    return min(timeit.repeat(lambda: fagen.compile(spec), number=n, repeat=5)) / n


def _bare_pair() -> "Callable[..., Any]":
    """A bare custom-op forward/backward pair with flash-attn's arguments: allocates the
    outputs fagen allocates (o, lse; dq, dk, dv) and launches nothing."""
    import torch

    def fwd(q, k, v, dropout_p, softmax_scale, causal):
        return torch.empty_like(q), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)

    def bwd(do, q, k, v, o, lse, dropout_p, softmax_scale, causal):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    # the schemas infer_schema would give these signatures (this file's annotations are strings)
    bare_fwd = torch.library.custom_op(
        "fagen_bench::bare_fwd", fwd, mutates_args=(),
        schema="(Tensor q, Tensor k, Tensor v, float dropout_p, float softmax_scale, bool causal) -> (Tensor, Tensor)")
    bare_bwd = torch.library.custom_op(
        "fagen_bench::bare_bwd", bwd, mutates_args=(),
        schema="(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, float dropout_p, float softmax_scale, "
               "bool causal) -> (Tensor, Tensor, Tensor)")

    def setup(ctx, inputs, output):
        q, k, v, dropout_p, scale, causal = inputs
        o, lse = output
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (dropout_p, scale, causal)
        ctx.mark_non_differentiable(lse)

    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = bare_bwd(do, q, k, v, o, lse, *ctx.args)
        return dq, dk, dv, None, None, None

    bare_fwd.register_autograd(backward, setup_context=setup)
    return bare_fwd


def host_call_seconds(rounds: int = 7) -> dict[str, float]:
    """One flash_attn_func forward + backward with a launcher that does the GPU launcher's
    Python work -- pack, limit checks, numpy scalars -- and launches nothing; the part of it
    spent in that launch preparation (replayed on the recorded launches); and the same step
    through a bare custom-op pair, interleaved round by round (best round of each)."""
    import torch

    import fagen
    import fagen.functional as F
    from fagen.runtime import gpu

    recorded: list[tuple] = []

    class HostOnlyLauncher:
        def launch(self, kernel, grid, args):
            gpu.prepare_launch(kernel, grid, args)  # what GpuModule.launch does before CuPy
            if len(recorded) < 4:
                recorded.append((kernel, grid, args))  # as launched (LaunchArgs: the plan's constants converted once)

    torch.set_num_threads(1)  # the host work is serial; extra threads only add noise here
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 128, 4, 64, generator=g).half().requires_grad_(True) for _ in range(3))
    do = torch.randn(2, 128, 4, 64, generator=g).half()
    bare = _bare_pair()

    def step() -> None:
        fagen.flash_attn_func(q, k, v, causal=True).backward(do)

    def bare_step() -> None:
        bare(q, k, v, 0.0, 0.125, True)[0].backward(do)

    launcher = HostOnlyLauncher()
    real = F.get_module
    F.get_module = lambda spec, device_type: launcher
    n = 200
    try:
        for _ in range(20):
            step()
            bare_step()
        ours, floor = [], []
        for _ in range(rounds):  # interleaved, on the thread's CPU clock: a busy machine slows both alike
            ours.append(timeit.timeit(step, number=n, timer=time.thread_time) / n)
            floor.append(timeit.timeit(bare_step, number=n, timer=time.thread_time) / n)
    finally:
        F.get_module = real

    def replay() -> None:
        for kernel, grid, args in recorded:
            gpu.prepare_launch(kernel, grid, args)

    packing = min(timeit.repeat(replay, number=2000, repeat=5, timer=time.thread_time)) / 2000
    return {"fagen": min(ours), "bare": min(floor), "packing": packing, "ratio": min(ours) / min(floor)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=7, help="fresh processes per row (default 7)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    ap.add_argument("--host-only", action="store_true", help="only the per-call host rows (fagen, bare pair, ratio)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds of 200 calls per host row (default 7)")
    args = ap.parse_args(argv)
    if args.host_only:
        sys.path.insert(0, str(REPO))
        host = host_call_seconds(args.rounds)
        if args.json:
            print(json.dumps(host, indent=2))
        else:
            print(f"flash_attn_func fwd+bwd host  {1e6 * host['fagen']:.0f} us per call "
                  f"({1e6 * host['packing']:.0f} us of it prepares the 4 launches)")
            print(f"bare custom-op pair fwd+bwd   {1e6 * host['bare']:.0f} us per call")
            print(f"host cost ratio               {host['ratio']:.2f} x the bare custom-op pair (target <= 1.3)")
        return 0

    with tempfile.TemporaryDirectory(prefix="fagen-jit-") as d:
        imports = import_time(args.repeat, d)
        os.environ["FAGEN_CACHE_DIR"] = d
        cold, hits, loaded = compile_times(args.repeat)
        sys.path.insert(0, str(REPO))
        memo = memo_hit_seconds()
        host = host_call_seconds(args.rounds)
        first = [_child(_FIRST_CALL, d) for _ in range(3)]
    result = {
        "import_fagen_s": {"median": statistics.median(imports), "min": min(imports)},
        "compile_cold_s": cold,
        "compile_disk_hit_s": {"median": statistics.median(hits), "min": min(hits), "max": max(hits)},
        "disk_hit_loaded_cupy_or_nvrtc": loaded,
        "compile_memo_hit_s": memo,
        "flash_attn_fwd_bwd_host_s": host["fagen"],
        "flash_attn_fwd_bwd_launch_preparation_s": host["packing"],
        "bare_custom_op_fwd_bwd_host_s": host["bare"],
        "host_cost_ratio_vs_bare_custom_op": host["ratio"],
        "first_flash_attn_fwd_bwd_s": statistics.median(float(f[0]) for f in first),
        "first_call_renders": int(first[0][1]),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    rows = [
        ("import fagen (fresh process)", f"{1e3 * result['import_fagen_s']['median']:.1f} ms median, "
                                         f"{1e3 * result['import_fagen_s']['min']:.1f} ms min"),
        ("compile cold", f"{cold:.3f} s"),
        ("compile disk hit (fresh process)", f"{1e3 * statistics.median(hits):.2f} ms median, "
                                             f"{1e3 * min(hits):.2f} ms min, {1e3 * max(hits):.2f} ms max"
                                             + ("  (loaded CuPy/NVRTC!)" if loaded else "")),
        ("compile memo hit", f"{1e6 * memo:.2f} us"),
        ("flash_attn_func fwd+bwd host", f"{1e6 * host['fagen']:.0f} us per call (4 launches replaced by host-only "
                                         f"packing; {1e6 * host['packing']:.0f} us of it prepares the 4 launches)"),
        ("bare custom-op pair fwd+bwd", f"{1e6 * host['bare']:.0f} us per call (allocates, launches nothing)"),
        ("host cost ratio", f"{host['ratio']:.2f} x the bare custom-op pair (target <= 1.3)"),
    ]
    rows.append(("first flash_attn_func fwd+bwd", f"{1e3 * result['first_flash_attn_fwd_bwd_s']:.0f} ms in a fresh process "
                 f"(torch's first custom-op dispatch included; {result['first_call_renders']} template renders)"))
    w = max(len(k) for k, _ in rows)
    print(textwrap.dedent(f"spec: {SPEC}"))
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
