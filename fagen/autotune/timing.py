"""Measured timing on a CUDA GPU (CUDA events, warm-up, median of runs).

:func:`measure` times ``calls`` back-to-back calls between each pair of CUDA events and
synchronises once, after the last repetition: the host enqueues ahead of the GPU, so
Python's per-call cost (tens of microseconds) is not counted as GPU time where the
kernels take longer than that (at N = 1k they barely do). ``calls`` is chosen from the
warm-up so that one repetition spans at least ``MIN_REP_MS``.

One call of the module is timed as a whole: ``run_backward`` launches the
preprocess kernel (which computes D and zeroes the fp32 dQ accumulator), the
main kernel (and the deterministic backward's dq kernel) and the postprocess
kernel, so every timed backward starts from a zeroed accumulator and repeated
calls measure the same work. The inputs carry every runtime argument the spec's
feature flags compile in (``TimingInputs``). A candidate that fails to compile or
launch times as ``inf``; the search goes on.
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


def alibi_slopes(heads: int) -> list[float]:
    """ALiBi's standard slopes for ``heads`` heads: 2^(-8 (i + 1) / H) (Press et al., 2022)."""
    return [2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)]


class TimingInputs:
    """Random inputs for one (spec without tiles, problem), built once and reused across candidates:
    q, k, v, dO and every runtime argument the spec's flags compile in, with realistic values, so
    each candidate is timed doing its real work.

    Shapes: q, dO [B, Nq, H, d] and k, v [B, Nk, H_kv, d] (H_kv = ``p.heads_kv``: GQA / MQA), or
    packed [B*N, heads, d] with equal-length sequences and int32 cu_seqlens when ``spec.varlen``.
    Feature arguments: key padding (every key takes part), dropout_p 0.1, a sliding window
    (Nk/8 keys to the left, none to the right), softcap 30, ALiBi slopes [H] fp32, a bool
    attn_mask [B, 1, Nq, Nk] (about 90 % True, a stride-0 broadcast over heads), an additive bias
    [1, H, Nq, Nk] of the spec's dtype (its gradient too when ``spec.bias_grad``), attention sinks
    fp32 [H] in [-1, 1] (a forward with ``spec.sinks``); v and dO of ``spec.head_dim_v``; the causal
    alignment and the deterministic mode come from the spec. The backward's o and lse come from
    the forward of the same flags (family's default tile)."""

    def __init__(self, spec: KernelSpec, p: Workload, device: str = "cuda") -> None:
        import torch

        from .. import functional

        dt = getattr(torch, spec.dtype)
        g = torch.Generator(device=device).manual_seed(0)
        b, h, hkv, nq, nk, d = p.batch, p.heads, p.heads_kv or p.heads, p.seqlen_q, p.seqlen_k, spec.head_dim
        dv = spec.head_dim_v or d  # v, o, dO (MLA: their own head dim)

        def randn(*shape: int) -> "torch.Tensor":
            return torch.randn(shape, generator=g, device=device, dtype=dt)

        self.kw: dict[str, Any] = {}
        if spec.varlen:  # B sequences of Nq queries and Nk keys, packed
            self.q, self.do = randn(b * nq, h, d), randn(b * nq, h, dv)
            self.k, self.v = randn(b * nk, hkv, d), randn(b * nk, hkv, dv)
            self.kw.update(
                cu_seqlens_q=torch.arange(0, b + 1, device=device, dtype=torch.int32) * nq,
                cu_seqlens_k=torch.arange(0, b + 1, device=device, dtype=torch.int32) * nk,
                max_seqlen_q=nq, max_seqlen_k=nk)
        else:
            self.q, self.do = randn(b, nq, h, d), randn(b, nq, h, dv)
            self.k, self.v = randn(b, nk, hkv, d), randn(b, nk, hkv, dv)
        if spec.key_padding:
            self.kw["key_padding_mask"] = torch.ones((b, nk), dtype=torch.bool, device=device)
        if spec.dropout:
            self.kw["dropout_p"] = 0.1
        if spec.window:
            self.kw["window_size"] = (max(1, nk // 8), 0)
        if spec.softcap:
            self.kw["softcap"] = 30.0
        if spec.alibi:
            self.kw["alibi_slopes"] = torch.tensor(alibi_slopes(h), dtype=torch.float32, device=device)
        if spec.attn_mask:
            self.kw["attn_mask"] = torch.rand((b, 1, nq, nk), generator=g, device=device) < 0.9
        if spec.bias:
            self.kw["attn_bias"] = randn(1, h, nq, nk)
        if getattr(spec, "sinks", False):
            self.kw["sinks"] = torch.linspace(-1.0, 1.0, h, device=device)
        if spec.direction == "bwd":
            fwd = spec.replace(direction="fwd", deterministic=False, bias_grad=False, block_r=None, block_c=None,
                               num_warps=4, impl=None)
            self.o, self.lse = functional.run_forward(fwd, self.q, self.k, self.v, **self.kw)

    def call(self, spec: KernelSpec) -> Callable[[], object]:
        from .. import functional

        if spec.direction == "bwd":
            return lambda: functional.run_backward(spec, self.do, self.q, self.k, self.v, self.o, self.lse, **self.kw)
        return lambda: functional.run_forward(spec, self.q, self.k, self.v, **self.kw)


#: One timed repetition spans at least this many milliseconds of GPU time (unless MAX_CALLS caps it).
MIN_REP_MS = 2.0
#: Most back-to-back calls between one pair of events.
MAX_CALLS = 64


def calls_per_rep(call_ms: float) -> int:
    """Back-to-back calls per event pair for calls of about ``call_ms`` each."""
    if not call_ms > 0 or not math.isfinite(call_ms):
        return MAX_CALLS if call_ms == 0 else 1
    return max(1, min(MAX_CALLS, math.ceil(MIN_REP_MS / call_ms)))


def measure(fn: Callable[[], object], *, warmup: int = 3, reps: int = 10, calls: int | None = None) -> float:
    """Median milliseconds of one call of ``fn``: ``reps`` pairs of CUDA events, each around
    ``calls`` back-to-back calls, after ``warmup`` calls (themselves timed, to choose ``calls``
    when None: :func:`calls_per_rep`). The host synchronises after the warm-up and once after
    the last repetition, never in between."""
    import torch

    if calls is not None and calls < 1:
        raise ValueError(f"calls must be at least 1, got {calls}")
    first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    first.record()
    for _ in range(max(1, warmup)):
        fn()
    last.record()
    torch.cuda.synchronize()
    k = calls if calls is not None else calls_per_rep(first.elapsed_time(last) / max(1, warmup))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        for _ in range(k):
            fn()
        end.record()
    torch.cuda.synchronize()
    return float(statistics.median(start.elapsed_time(end) / k for start, end in events))


class CudaTimer:
    """The GPU timer: inputs are built once per (spec without tiles, problem).

    ``stop_at`` (a ``time.monotonic()`` instant): candidates reached after it are not run and
    time as ``inf`` (counted in ``skipped``), so a caller's budget bounds the loop over
    candidates, not only the loop over problems."""

    def __init__(self, *, warmup: int = 3, reps: int = 10, stop_at: float | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        import time

        self.warmup = warmup
        self.reps = reps
        self.stop_at = stop_at
        self.skipped = 0
        self._clock = clock or time.monotonic
        self._inputs: dict[tuple[str, Workload], TimingInputs] = {}

    def __call__(self, spec: KernelSpec, p: Workload) -> float:
        import json

        if self.stop_at is not None and self._clock() >= self.stop_at:
            self.skipped += 1
            return math.inf
        key = (json.dumps(spec.without_tiles(), sort_keys=True), p)
        try:
            if key not in self._inputs:
                self._inputs.clear()  # one problem's tensors at a time
                self._inputs[key] = TimingInputs(spec, p)
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
