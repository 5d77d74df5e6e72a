"""Measured timing on a CUDA GPU (CUDA events, warm-up, median of runs).

One call of the module is timed as a whole: ``run_backward`` launches the
preprocess kernel (which computes D and zeroes the fp32 dQ accumulator), the
main kernel (and the deterministic backward's dq kernel) and the postprocess
kernel, so every timed backward starts from a zeroed accumulator and repeated
calls measure the same work. The inputs carry every runtime argument the spec's
feature flags compile in (``_Inputs``). A candidate that fails to compile or
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


class _Inputs:
    """Random inputs for one (spec without tiles, problem), built once and reused across candidates:
    q, k, v, dO and every runtime argument the spec's flags compile in, with realistic values, so
    each candidate is timed doing its real work.

    Shapes: q, dO [B, Nq, H, d] and k, v [B, Nk, H_kv, d] (H_kv = ``p.heads_kv``: GQA / MQA), or
    packed [B*N, heads, d] with equal-length sequences and int32 cu_seqlens when ``spec.varlen``.
    Feature arguments: key padding (every key takes part), dropout_p 0.1, a sliding window
    (Nk/8 keys to the left, none to the right), softcap 30, ALiBi slopes [H] fp32, a bool
    attn_mask [B, 1, Nq, Nk] (about 90 % True, a stride-0 broadcast over heads), an additive bias
    [1, H, Nq, Nk] of the spec's dtype (its gradient too when ``spec.bias_grad``); the causal
    alignment and the deterministic mode come from the spec. The backward's o and lse come from
    the forward of the same flags (family's default tile)."""

    def __init__(self, spec: KernelSpec, p: Workload, device: str = "cuda") -> None:
        import torch

        from .. import functional

        dt = getattr(torch, spec.dtype)
        g = torch.Generator(device=device).manual_seed(0)
        b, h, hkv, nq, nk, d = p.batch, p.heads, p.heads_kv or p.heads, p.seqlen_q, p.seqlen_k, spec.head_dim

        def randn(*shape: int) -> "torch.Tensor":
            return torch.randn(shape, generator=g, device=device, dtype=dt)

        self.kw: dict[str, Any] = {}
        if spec.varlen:  # B sequences of Nq queries and Nk keys, packed
            self.q, self.do = randn(b * nq, h, d), randn(b * nq, h, d)
            self.k, self.v = randn(b * nk, hkv, d), randn(b * nk, hkv, d)
            self.kw.update(
                cu_seqlens_q=torch.arange(0, b + 1, device=device, dtype=torch.int32) * nq,
                cu_seqlens_k=torch.arange(0, b + 1, device=device, dtype=torch.int32) * nk,
                max_seqlen_q=nq, max_seqlen_k=nk)
        else:
            self.q, self.do = randn(b, nq, h, d), randn(b, nq, h, d)
            self.k, self.v = randn(b, nk, hkv, d), randn(b, nk, hkv, d)
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
        if spec.direction == "bwd":
            fwd = spec.replace(direction="fwd", deterministic=False, bias_grad=False, block_r=None, block_c=None,
                               num_warps=4, impl=None)
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
