"""Autotuning of block sizes, warps and kernel family against SRAM capacity.

candidates (enumerate + prune by smem and by the compile report) -> model
(rank on CPU) -> timing (GPU) -> fagen.choices (persisted choices, ``lookup``;
below the functional API, which looks choices up).
See docs/autotune.md.
"""
from __future__ import annotations

from .candidates import Candidate, build_candidates, enumerate_candidates
from ..choices import lookup, record, tuned_or_default
from .model import DeviceModel, Prediction, Workload, ceiling_tflops, device_model, predict, rank, score
from .timing import CudaTimer, Timer
from .tuner import TuneResult, gpu_check_rows, spearman, tune

__all__ = [
    "Candidate", "build_candidates", "enumerate_candidates",
    "DeviceModel", "Prediction", "Workload", "ceiling_tflops", "device_model", "predict", "rank", "score",
    "lookup", "record", "tuned_or_default",
    "CudaTimer", "Timer",
    "TuneResult", "tune", "gpu_check_rows", "spearman",
]
