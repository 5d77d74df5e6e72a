"""Autotuning of block sizes, warps and kernel family against SRAM capacity.

candidates (enumerate + prune by smem and by the compile report) -> model
(rank on CPU) -> timing (GPU) -> store (persisted choices, ``lookup``).
See docs/autotune.md.
"""
from __future__ import annotations

from .candidates import Candidate, build_candidates, enumerate_candidates
from .model import DeviceModel, Prediction, Problem, device_model, predict, rank, score
from .store import lookup, record, tuned_or_default
from .timing import CudaTimer, Timer
from .tuner import TuneResult, gpu_check_rows, spearman, tune

__all__ = [
    "Candidate", "build_candidates", "enumerate_candidates",
    "DeviceModel", "Prediction", "Problem", "device_model", "predict", "rank", "score",
    "lookup", "record", "tuned_or_default",
    "CudaTimer", "Timer",
    "TuneResult", "tune", "gpu_check_rows", "spearman",
]
