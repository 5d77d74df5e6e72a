"""The Hopper family's (``wgmma``, sm_90a) rows of ``benchmarks/sass_cost.py``: its default forward
kernels (fp16 / bf16, head dim 64 / 128, causal or not) counted with that script's method (one
interior tile pair's walked loop trip, every warp of the CTA: the consumer warps' tile loop and the
producer warp's TMA loop) beside FlashAttention-3's figures. Extra arguments go to sass_cost.py.

    python benchmarks/wgmma_sass.py
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sass_cost  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(sass_cost.main(["--arch", "sm_90a", "--direction", "fwd", *sys.argv[1:]]))
