"""Measured timing on a CUDA GPU (CUDA events, warm-up, median of runs).

One call of the module is timed as a whole: ``run_backward`` launches the
preprocess kernel (which computes D and zeroes the fp32 dQ accumulator), the
main kernel and the postprocess kernel, so every timed backward starts from a
zeroed accumulator and repeated calls measure the same work. A candidate that
fails to compile or launch times as ``inf``; the search goes on.
"""
from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..spec import KernelSpec, arch_for_capability
from .model import Workload

#: (spec, workload) -> milliseconds; injectable so the search is testable without a GPU.
Timer = Callable[[KernelSpec, Workload], float]


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return bool(torch.cuda.is_available())


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    capability: tuple[int, int]
    sm_count: int
    arch: str | None


def current_device(index: int | None = None) -> DeviceInfo:
    import torch

    idx = torch.cuda.current_device() if index is None else index
    props = torch.cuda.get_device_properties(idx)
    cap = (int(props.major), int(props.minor))
    return DeviceInfo(str(props.name), cap, int(props.multi_processor_count), arch_for_capability(cap))


class _Inputs:
    """Random inputs for one (spec without tiles, problem), built once and reused across candidates."""

    def __init__(self, spec: KernelSpec, p: Workload) -> None:
        import torch

        from .. import functional

        dt = getattr(torch, spec.dtype)
        g = torch.Generator(device="cuda").manual_seed(0)
        shape_q = (p.batch, p.seqlen_q, p.heads, spec.head_dim)
        shape_k = (p.batch, p.seqlen_k, p.heads, spec.head_dim)
        self.q = torch.randn(shape_q, generator=g, device="cuda", dtype=dt)
        self.k = torch.randn(shape_k, generator=g, device="cuda", dtype=dt)
        self.v = torch.randn(shape_k, generator=g, device="cuda", dtype=dt)
        self.do = torch.randn(shape_q, generator=g, device="cuda", dtype=dt)
        self.kw: dict[str, Any] = {}
        if spec.key_padding:
            self.kw["key_padding_mask"] = torch.ones((p.batch, p.seqlen_k), dtype=torch.bool, device="cuda")
        if spec.dropout:
            self.kw["dropout_p"] = 0.1
        if spec.direction == "bwd":
            fwd = spec.replace(direction="fwd", block_r=None, block_c=None, num_warps=4)
            self.o, self.lse = functional.run_forward(fwd, self.q, self.k, self.v, **self.kw)

    def call(self, spec: KernelSpec) -> Callable[[], object]:
        from .. import functional

        if spec.direction == "bwd":
            return lambda: functional.run_backward(spec, self.do, self.q, self.k, self.v, self.o, self.lse, **self.kw)
        return lambda: functional.run_forward(spec, self.q, self.k, self.v, **self.kw)


def measure(fn: Callable[[], object], *, warmup: int = 3, reps: int = 10) -> float:
    """Median milliseconds of ``fn`` over ``reps`` runs after ``warmup`` runs (CUDA events)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(statistics.median(times))


class CudaTimer:
    """The GPU timer: inputs are built once per (spec without tiles, problem)."""

    def __init__(self, *, warmup: int = 3, reps: int = 10) -> None:
        self.warmup = warmup
        self.reps = reps
        self._inputs: dict[tuple[str, Workload], _Inputs] = {}

    def __call__(self, spec: KernelSpec, p: Workload) -> float:
        import json

        key = (json.dumps(spec.without_tiles(), sort_keys=True), p)
        try:
            if key not in self._inputs:
                self._inputs.clear()  # one problem's tensors at a time
                self._inputs[key] = _Inputs(spec, p)
            return measure(self._inputs[key].call(spec), warmup=self.warmup, reps=self.reps)
        except Exception as e:  # noqa: BLE001 - a failing candidate scores inf, the search goes on
            warnings.warn(f"autotune: timing {spec.name} failed: {type(e).__name__}: {e}", stacklevel=2)
            _recover()
            return math.inf


def _recover() -> None:
    try:
        import torch

        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - a sticky CUDA error cannot be cleared in-process
        pass
