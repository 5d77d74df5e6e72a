"""GPU check of the autotuner's cost model: predicted vs measured ranks (prints JSON).

    python benchmarks/autotune_check.py [--top 4] [--shape B,H,N,D,DTYPE,CAUSAL ...]

Needs a CUDA GPU; exits 2 with one line without one.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

DEFAULT_SHAPES = ["4,16,1024,64,float16,0", "2,16,2048,128,float16,1"]


def _shape(text: str) -> tuple[int, int, int, int, str, bool]:
    b, h, n, d, dtype, causal = text.split(",")
    return int(b), int(h), int(n), int(d), dtype, causal.strip().lower() in ("1", "true", "yes", "causal")


def _clean(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=int, default=4)
    ap.add_argument("--shape", action="append", default=None, help="B,H,N,D,DTYPE,CAUSAL (repeatable)")
    args = ap.parse_args(argv)
    from fagen.autotune import gpu_check_rows
    from fagen.autotune.timing import cuda_available

    if not cuda_available():
        print("autotune_check: no CUDA GPU", file=sys.stderr)
        return 2
    rows = gpu_check_rows([_shape(s) for s in (args.shape or DEFAULT_SHAPES)], top=args.top)
    json.dump(_clean(rows), sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
