#!/usr/bin/env bash
# Prepare .whl/ for a lent GPU machine whose image lacks some of fagen's pure-Python
# dependencies (seen: no pydantic, no platformdirs; torch, cupy-cuda13x, jinja2, filelock,
# rich, numpy, cuda-pathfinder and the NVRTC wheels are there). Run here, where a registry
# is reachable; .whl/ is git-ignored and travels with the device tool's `carry`.
# Then, on the device (one command; see docs/performance.md):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 \
#     && python3 benchmarks/gpu_check.py "$OUT"
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  pydantic pydantic-core annotated-types typing-inspection typing-extensions platformdirs
ls -la .whl
