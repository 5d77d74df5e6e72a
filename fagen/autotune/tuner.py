"""The search: candidates -> compile-time pruning -> model ranking -> (GPU) timing -> record."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..arch import ARCH_SPECIFIC
from ..errors import InputError
from ..families import families
from ..spec import KernelSpec
from .. import choices as store
from .candidates import WARPS, Candidate, build_candidates
from .model import DeviceModel, Workload, device_model, nominal_flops, rank, score
from .timing import CudaTimer, DeviceInfo, Timer, cuda_available, current_device


@dataclass(frozen=True)
class TuneResult:
    spec: KernelSpec  # as given
    problem: Workload  # the representative (bucketed) workload
    device: DeviceModel
    candidates: tuple[Candidate, ...]  # ok ones by predicted time, then the rejected ones
    best: Candidate | None  # fastest measured when timed, else the model's first
    timed: bool

    @property
    def ok(self) -> tuple[Candidate, ...]:
        return tuple(c for c in self.candidates if c.status == "ok")

    @property
    def rejected(self) -> tuple[Candidate, ...]:
        return tuple(c for c in self.candidates if c.status == "rejected")

    @property
    def default(self) -> Candidate | None:
        return next((c for c in self.candidates if c.is_default), None)

    def tflops(self, c: Candidate) -> float | None:
        if c.measured_ms is None or not math.isfinite(c.measured_ms) or c.measured_ms <= 0:
            return None
        return nominal_flops(self.spec, self.problem) / (c.measured_ms * 1e-3) / 1e12

    def as_dict(self) -> dict[str, Any]:
        def row(c: Candidate) -> dict[str, Any]:
            d = c.as_dict()
            if self.timed:
                d["measured_tflops"] = self.tflops(c)
            return d

        return {
            "spec": self.spec.model_dump(),
            "problem": {"batch": self.problem.batch, "heads": self.problem.heads,
                        "seqlen_q": self.problem.seqlen_q, "seqlen_k": self.problem.seqlen_k,
                        **({"heads_kv": self.problem.heads_kv} if self.problem.heads_kv else {})},
            "device_model": {"name": self.device.name, "sm_count": self.device.sm_count,
                             "hbm_bytes_per_s": self.device.hbm_bytes_per_s,
                             "fp32_flops_per_s": self.device.fp32_flops_per_s,
                             "l2_bytes": self.device.l2_bytes, "l2_bytes_per_s": self.device.l2_bytes_per_s},
            "timed": self.timed,
            "candidates": [row(c) for c in self.candidates],
            "best": row(self.best) if self.best is not None else None,
        }


def tune(spec: KernelSpec, *, batch: int, heads: int, seqlen: int, seqlen_k: int | None = None,
         heads_kv: int | None = None, dry_run: bool = True, top: int = 4, timer: Timer | None = None,
         device: DeviceInfo | None = None,
         persist: bool = True, sizes: Sequence[int] | None = None, warps: Sequence[int] = WARPS,
         workers: int | None = None, progress: bool | None = None) -> TuneResult:
    """Rank ``spec``'s candidates by the cost model; unless ``dry_run``, time the top ``top`` (and the
    default; beside each, its twins in the knobs the model cannot rank, ``Knob.model_blind``) and record
    the fastest for ``device`` (the current CUDA device when None).

    ``batch`` and ``heads`` must be in 1..65535 (the grid's y and z), the seqlens in
    1..``fagen.spec.SEQLEN_MAX`` (the kernels' int32 lengths), ``heads_kv`` (GQA / MQA: K/V
    heads, None = ``heads``) a divisor of ``heads``; anything else is an InputError naming the
    argument."""
    problem = Workload.bucketed(batch, heads, seqlen, seqlen_k, heads_kv)
    if not dry_run and device is None:
        if not cuda_available():
            raise InputError("dry_run", "a CUDA GPU to time candidates on", "no CUDA GPU; use --dry-run")
        device = current_device()
    dev = device_model(spec.arch, device.name if device else None, device.sm_count if device else None)
    cands = rank(score(build_candidates(spec, sizes=sizes, warps=warps, workers=workers, progress=progress),
                       problem, dev))
    ok = [c for c in cands if c.status == "ok"]
    if dry_run:
        return TuneResult(spec, problem, dev, tuple(cands), ok[0] if ok else None, timed=False)

    timer = timer or CudaTimer()
    chosen = {c.key for c in ok[:max(0, top)]} | {c.key for c in ok if c.is_default}
    chosen |= _blind_twins(ok, chosen)
    measured: dict[tuple, float] = {}
    for c in ok:
        if c.key in chosen and c.spec is not None:
            measured[c.key] = float(timer(c.spec, problem))
    cands = [replace(c, measured_ms=measured[c.key]) if c.key in measured else c for c in cands]
    finite = [c for c in cands if c.measured_ms is not None and math.isfinite(c.measured_ms)]
    best = min(finite, key=lambda c: (c.measured_ms, c.predicted_ms, c.key)) if finite else None
    result = TuneResult(spec, problem, dev, tuple(cands), best, timed=True)
    if persist and best is not None and best.spec is not None and device is not None:
        default = result.default
        store.record(best.spec, seqlen_q=problem.seqlen_q, seqlen_k=problem.seqlen_k, device_name=device.name,
                     capability=device.capability, batch=batch, heads=heads, measured_ms=best.measured_ms,
                     predicted_ms=best.predicted_ms, default_ms=default.measured_ms if default else None)
    return result


def _blind_twins(ok: Sequence[Candidate], chosen: set[tuple]) -> set[tuple]:
    """The keys of the candidates that differ from a chosen one in ``Knob.model_blind`` knobs only (the model
    cannot rank those values: each is timed)."""
    blind = {k.name for fam in families() for k in fam.knobs if getattr(k, "model_blind", False)}

    def base(c: Candidate) -> tuple:
        return (c.impl, c.block_r, c.block_c, c.num_warps, tuple(kv for kv in c.knobs if kv[0] not in blind))

    picked = {base(c) for c in ok if c.key in chosen}
    return {c.key for c in ok if base(c) in picked}


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman rank correlation (average ranks for ties); None for fewer than 2 points or no spread."""
    if len(xs) != len(ys) or len(xs) < 2:
        return None
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = sum((a - mx) ** 2 for a in rx)
    vy = sum((b - my) ** 2 for b in ry)
    if vx == 0 or vy == 0:
        return None
    return cov / math.sqrt(vx * vy)


def _ranks(xs: Sequence[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


Shape = tuple[int, int, int, int, str, bool]  # (batch, heads, seqlen, head_dim, dtype, causal)


def gpu_check_rows(shapes: Sequence[Shape], top: int = 4, *, timer: Timer | None = None,
                   device: DeviceInfo | None = None, direction: str = "bwd",
                   sizes: Sequence[int] | None = None, warps: Sequence[int] = WARPS) -> list[dict[str, Any]]:
    """Model ranking vs measured timing of the top ``top`` candidates (plus the default) per shape.

    Each row: the spec, the timed candidates with predicted_ms, measured_ms, rank_predicted and
    rank_measured (1 = fastest, among the timed ones), and their Spearman rank correlation.
    Nothing is persisted.
    """
    if device is None:
        if not cuda_available():
            raise InputError("device", "a CUDA GPU for the autotune GPU check", "no CUDA GPU")
        device = current_device()
    if device.arch is None:
        raise InputError("device", "a compute capability of fagen's arch table (fagen.arch.ARCHS)",
                         f"{device.capability} ({device.name})")
    # the arch-specific target where the device runs one (sm_90a on 9.0: the Hopper family's candidates with
    # the generic families'), as the default specs of a CUDA tensor on it do
    arch = ARCH_SPECIFIC.get(device.arch, device.arch)
    rows = []
    for batch, heads, seqlen, head_dim, dtype, causal in shapes:
        spec = KernelSpec(direction=direction, head_dim=head_dim, dtype=dtype, causal=causal,  # type: ignore[arg-type]
                          arch=arch)  # type: ignore[arg-type]
        res = tune(spec, batch=batch, heads=heads, seqlen=seqlen, dry_run=False, top=top, timer=timer,
                   device=device, persist=False, progress=False, sizes=sizes, warps=warps)
        timed = [c for c in res.candidates if c.measured_ms is not None]
        finite = [c for c in timed if math.isfinite(c.measured_ms)]  # type: ignore[arg-type]
        rp = _ranks([c.predicted_ms for c in timed])  # type: ignore[misc]
        rm = _ranks([c.measured_ms for c in timed])  # type: ignore[misc]
        default = res.default
        rows.append({
            "shape": {"batch": batch, "heads": heads, "seqlen": seqlen, "head_dim": head_dim,
                      "dtype": dtype, "causal": causal},
            "spec": spec.name,
            "device": device.name,
            "candidates": [{**c.as_dict(), "label": f"{c.label} w{c.num_warps} {c.impl}",
                            "measured_tflops": res.tflops(c), "rank_predicted": a, "rank_measured": b}
                           for c, a, b in zip(timed, rp, rm)],
            "spearman": spearman([c.predicted_ms for c in finite], [c.measured_ms for c in finite]),  # type: ignore[misc]
            "best_measured": res.best.as_dict() if res.best else None,
            "best_predicted": res.ok[0].as_dict() if res.ok else None,
            "default_ms": default.measured_ms if default else None,
            "n_ok": len(res.ok), "n_rejected": len(res.rejected),
        })
    return rows
