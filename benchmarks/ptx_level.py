"""Cost of the emulator's PTX level against the source level, per kernel.

For the default kernels of each family (d = 64, fp16, causal; B = 1, H = 2, N = 256): the PTX
translation time, the g++ build time of each level (cold: a fresh cache folder) and the run time
of every launch, by kernel role. Prints a markdown table (docs/emulator.md, "Two levels").

    python benchmarks/ptx_level.py [--out table.md]
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--seqlen", type=int, default=256)
    args = ap.parse_args()
    os.environ.setdefault("FAGEN_CACHE_DIR", tempfile.mkdtemp(prefix="fagen-ptx-bench-"))
    import torch

    import fagen.functional as F
    from fagen import KernelSpec
    from fagen.compiler import compile as nvrtc_compile
    from fagen.emulator import EmuModule
    from fagen.emulator.ptx import translate
    from fagen.runtime import cpu

    timings: dict[str, float] = {}
    real_launch = EmuModule.launch

    def timed(self, name, *a, **kw):
        t0 = time.perf_counter()
        try:
            return real_launch(self, name, *a, **kw)
        finally:
            timings[name] = timings.get(name, 0.0) + time.perf_counter() - t0

    EmuModule.launch = timed  # type: ignore[method-assign]
    rows = []
    for impl, arch in (("simt", "sm_80"), ("mma", "sm_80"), ("mma", "sm_90"), ("wgmma", "sm_90a")):
        common = dict(head_dim=64, dtype="float16", causal=True, impl=impl, arch=arch)
        fwd, bwd = KernelSpec(direction="fwd", **common), KernelSpec(direction="bwd", **common)
        g = torch.Generator().manual_seed(0)
        q, k, v, do = (torch.randn(1, args.seqlen, 2, 64, generator=g).half() for _ in range(4))
        for spec in (fwd, bwd):
            ptx = nvrtc_compile(spec, ptx_target=arch.replace("sm_", "compute_")).cubin.decode()
            t0 = time.perf_counter()
            translate(ptx)
            t_tr = time.perf_counter() - t0
            mod = cpu.cpu_module(spec)
            t0 = time.perf_counter()
            mod.ptx_build()
            t_ptx = time.perf_counter() - t0
            t0 = time.perf_counter()
            mod._build(sanitize=False)
            t_src = time.perf_counter() - t0
            rows.append((spec.name, f"{len(ptx.splitlines())}", f"{t_tr:.2f}", f"{t_ptx:.1f}", f"{t_src:.1f}"))
        per_level = {}
        for level in ("source", "ptx"):
            timings.clear()
            if level == "ptx":
                with cpu.ptx():
                    o, lse = F.run_forward(fwd, q, k, v)
                    F.run_backward(bwd, do, q, k, v, o, lse)
            else:
                o, lse = F.run_forward(fwd, q, k, v)
                F.run_backward(bwd, do, q, k, v, o, lse)
            per_level[level] = dict(timings)
        for name in per_level["ptx"]:
            rows.append((name, "", "", f"run {per_level['ptx'][name]:.3f}", f"run {per_level['source'].get(name, 0):.3f}"))
    lines = ["| kernel | PTX lines | translate (s) | PTX level: build / run (s) | source level: build / run (s) |",
             "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
