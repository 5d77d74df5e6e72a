"""Ring attention (context parallelism) on fagen's functional API and torch.distributed p2p.

Each rank of ``group`` holds a shard of the sequence: q, k, v ``[B, N_local, H(_kv), d]``.
``layout="contiguous"``: rank r holds rows/keys ``[r*N_local, (r+1)*N_local)``;
``layout="zigzag"``: the sequence is cut into 2W chunks of ``N_local/2`` and rank r holds
chunks r and 2W-1-r (balances causal work). Every rank owns its chunks' (q, k, v) rows.

Forward, step s = 0..W-1: rank r holds the K/V (and key padding) shard of rank (r - s) mod W,
posts the send of it to rank r+1 and the receive of the next one from rank r-1, computes its
Q chunks against the held K/V chunks -- each (q chunk, kv chunk) pair is a full call, a
diagonal causal call, or skipped -- and merges the partial (o, lse) into the running result by
lse (a partial whose rows have no allowed key has lse = -inf and weight 0). Backward: the K/V
shards travel again together with fp32 dK/dV accumulators; every pair calls
:func:`fagen.attention_backward` with the global o and lse of its Q rows; after W hops each
accumulator is back at its owner. Dropout uses the global row/column indices (the kernels'
``dropout_row_offset``/``dropout_col_offset``), so the keep mask equals
:func:`fagen.dropout_keep_mask` of the whole sequence.
"""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from .. import functional as F
from ..errors import InputError, InputTypeError, check_dropout_p
from ..ops import custom_op_tags, draw_rng_state

__all__ = ["ring_flash_attn_func", "LAYOUTS", "step_times", "StepTimes"]

LAYOUTS = ("contiguous", "zigzag")
Tensor = torch.Tensor

FULL, DIAG, SKIP = "full", "diag", "skip"


# --------------------------------------------------------------------------- geometry
@dataclass(frozen=True)
class Ring:
    """The group's ring: this rank's index, the world size, global ranks of its neighbours."""
    group: Any
    rank: int
    world: int
    layout: str

    @property
    def next_rank(self) -> int:
        return dist.get_global_rank(self.group, (self.rank + 1) % self.world) if self.group is not None \
            else (self.rank + 1) % self.world

    @property
    def prev_rank(self) -> int:
        return dist.get_global_rank(self.group, (self.rank - 1) % self.world) if self.group is not None \
            else (self.rank - 1) % self.world

    def chunks(self, owner: int) -> tuple[int, ...]:
        """Global chunk indices held by rank ``owner`` (in its local order)."""
        if self.layout == "contiguous":
            return (owner,)
        return (owner, 2 * self.world - 1 - owner)


def pair_kind(q_chunk: int, k_chunk: int, causal: bool) -> str:
    """How a Q chunk sees a K/V chunk of the same length: every key, the causal diagonal, none."""
    if not causal or k_chunk < q_chunk:
        return FULL
    return DIAG if k_chunk == q_chunk else SKIP


def _group_info(group: Any) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise InputError("group", "an initialised torch.distributed process group (dist.init_process_group)", None)
    return dist.get_rank(group), dist.get_world_size(group)


# --------------------------------------------------------------------------- communication
class _Exchange:
    """Send tensors to the next rank and receive same-shaped ones from the previous one
    (non-blocking; :meth:`wait` returns the received tensors)."""

    def __init__(self, ring: Ring, tensors: list[Tensor], tag0: int = 0):
        self.sent = [t.contiguous() for t in tensors]  # alive until wait()
        self.recv = [torch.empty_like(t) for t in self.sent]
        self.works: list[Any] = []
        for i, (t, r) in enumerate(zip(self.sent, self.recv)):  # posted at once: they overlap the compute
            self.works.append(dist.isend(t, ring.next_rank, group=ring.group, tag=tag0 + i))
            self.works.append(dist.irecv(r, ring.prev_rank, group=ring.group, tag=tag0 + i))

    def wait(self) -> list[Tensor]:
        for w in self.works:
            w.wait()
        return self.recv


# --------------------------------------------------------------------------- timing
class StepTimes:
    """Seconds spent per pass ("fwd"/"bwd") in compute (kernels and merges) and in waiting for
    the ring's messages that compute did not hide; filled while :func:`step_times` is active."""

    def __init__(self) -> None:
        self.compute: dict[str, float] = {"fwd": 0.0, "bwd": 0.0}
        self.wait: dict[str, float] = {"fwd": 0.0, "bwd": 0.0}
        self.steps: dict[str, int] = {"fwd": 0, "bwd": 0}


_TIMES: Optional[StepTimes] = None


@contextlib.contextmanager
def step_times() -> Iterator[StepTimes]:
    """Measure the ring calls made inside the block (for benchmarks/ring.py): on CUDA tensors the
    device is synchronised at each boundary, which removes some overlap."""
    global _TIMES
    old, _TIMES = _TIMES, StepTimes()
    try:
        yield _TIMES
    finally:
        _TIMES = old


class _Clock:
    def __init__(self, what: str, device: torch.device):
        self.what, self.cuda = what, device.type == "cuda"
        self.t = self._now()

    def _now(self) -> float:
        if _TIMES is not None and self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def lap(self, kind: str) -> None:
        if _TIMES is None:
            return
        t = self._now()
        getattr(_TIMES, kind)[self.what] += t - self.t
        if kind == "compute":
            _TIMES.steps[self.what] += 1
        self.t = t


# --------------------------------------------------------------------------- merging
def merge(o_acc: Tensor, lse_acc: Tensor, o: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """Combine two partial softmax results over disjoint key sets by their lse.

    o_acc, o: [B, N, H, d] (o_acc fp32); lse_acc, lse: fp32 [B, H, N]. Rows with no allowed key
    in one part (lse = -inf) take the other part unchanged; rows with none in both stay o = 0,
    lse = -inf; a NaN lse stays NaN."""
    lse = lse.to(lse_acc.dtype)
    new = torch.logaddexp(lse_acc, lse)
    dead = new == -math.inf
    w_acc = torch.where(dead, 0.0, torch.exp(lse_acc - new))
    w = torch.where(dead, 0.0, torch.exp(lse - new))
    t = lambda x: x.transpose(1, 2).unsqueeze(-1)  # noqa: E731  [B, H, N] -> [B, N, H, 1]
    return o_acc * t(w_acc) + o.to(o_acc.dtype) * t(w), new


# --------------------------------------------------------------------------- the ring passes
@dataclass(frozen=True)
class _Opts:
    causal: bool
    dropout_p: float
    softmax_scale: Optional[float]
    seed: int
    offset: int


def _chunk(t: Optional[Tensor], i: int, n: int, dim: int = 1) -> Optional[Tensor]:
    """Local chunk i of n along the sequence dim (None passes through)."""
    if t is None or n == 1:
        return t
    size = t.shape[dim] // n
    return t.narrow(dim, i * size, size)


def _kw(opts: _Opts, kind: str, kpm: Optional[Tensor], row0: int, col0: int) -> dict[str, Any]:
    kw: dict[str, Any] = dict(causal=kind == DIAG, key_padding_mask=kpm, dropout_p=opts.dropout_p,
                              softmax_scale=opts.softmax_scale, seed=opts.seed, offset=opts.offset)
    if opts.dropout_p > 0:
        kw.update(dropout_row_offset=row0, dropout_col_offset=col0)
    return kw


def _held(k: Tensor, v: Tensor, kpm: Optional[Tensor]) -> list[Tensor]:
    """What travels: K, V and the key padding (as uint8, which every backend sends)."""
    return [k, v] + ([kpm.to(torch.uint8)] if kpm is not None else [])


def _unpack(held: list[Tensor]) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    return held[0], held[1], (held[2].bool() if len(held) > 2 else None)


def _acc_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def add_sinks(o: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """The merged result of every key with the attention sinks added once: lse' = logaddexp(lse,
    sink_h), o' = o exp(lse - lse') (the sink has no value). A row with no allowed key gets o = 0,
    lse = the sink. o [B, N, H, d] (fp32), lse [B, H, N]."""
    new = torch.logaddexp(lse, sinks.to(lse.dtype)[None, :, None].expand_as(lse))
    w = torch.where(lse == -math.inf, 0.0, torch.exp(lse - new))
    return o * w.transpose(1, 2).unsqueeze(-1), new


def sink_grad(do: Tensor, o: Tensor, lse: Tensor, sinks: Tensor, dlse: Optional[Tensor] = None) -> Tensor:
    """This shard's d sink_h = -sum_{b,i} exp(sink_h - lse_i) (rowsum(dO o O)_i - dlse_i) (float64 sums
    in a fixed order; ``dlse``: the gradient of the returned lse, None = 0). A replicated parameter's
    gradient: the trainer sums it over the group as it sums the other parameters' (DDP / FSDP)."""
    D = (do.double() * o.double()).sum(-1).transpose(1, 2)  # [B, H, N]
    if dlse is not None:
        D = D - dlse.double()
    return (-(torch.exp(sinks.double()[None, :, None] - lse.double()) * D).sum(dim=(0, 2))).to(sinks.dtype)


def _ring_forward(ring: Ring, q: Tensor, k: Tensor, v: Tensor, kpm: Optional[Tensor],
                  opts: _Opts, sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    B, n_local, H, _ = q.shape
    nc = len(ring.chunks(ring.rank))
    csize = n_local // nc
    o_acc = torch.zeros(q.shape, dtype=_acc_dtype(q), device=q.device)
    lse_acc = torch.full((B, H, n_local), -math.inf, dtype=_acc_dtype(q), device=q.device)
    held = _held(k, v, kpm)
    clock = _Clock("fwd", q.device)
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world
        xchg = _Exchange(ring, held) if step + 1 < ring.world else None
        hk, hv, hm = _unpack(held)
        for qi, qc in enumerate(ring.chunks(ring.rank)):
            for ki, kc in enumerate(ring.chunks(src)):
                kind = pair_kind(qc, kc, opts.causal)
                if kind == SKIP:
                    continue
                o, lse = F.attention_forward(_chunk(q, qi, nc), _chunk(hk, ki, nc), _chunk(hv, ki, nc),
                                             **_kw(opts, kind, _chunk(hm, ki, nc), qc * csize, kc * csize))
                rows = slice(qi * csize, (qi + 1) * csize)
                o_acc[:, rows], lse_acc[:, :, rows] = merge(o_acc[:, rows], lse_acc[:, :, rows], o, lse)
        clock.lap("compute")
        if xchg is not None:
            held = xchg.wait()
        clock.lap("wait")
    if sinks is not None:
        o_acc, lse_acc = add_sinks(o_acc, lse_acc, sinks)
    return o_acc.to(q.dtype), lse_acc


def _ring_backward(ring: Ring, do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                   kpm: Optional[Tensor], opts: _Opts, dlse: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """dq of this rank's rows, dk / dv of its keys (after W hops). ``dlse``: the gradient of the
    returned lse, entering every step's dS as P dlse (the functional backward's ``dlse``)."""
    n_local = q.shape[1]
    nc = len(ring.chunks(ring.rank))
    csize = n_local // nc
    dq = torch.zeros(q.shape, dtype=_acc_dtype(q), device=q.device)
    held = _held(k, v, kpm)
    dk = torch.zeros(k.shape, dtype=_acc_dtype(q), device=k.device)
    dv = torch.zeros(v.shape, dtype=_acc_dtype(q), device=v.device)
    clock = _Clock("bwd", q.device)
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world
        last = step + 1 == ring.world
        xchg = None if last else _Exchange(ring, held)  # K/V leave now; their grads after this step
        hk, hv, hm = _unpack(held)
        for qi, qc in enumerate(ring.chunks(ring.rank)):
            rows = slice(qi * csize, (qi + 1) * csize)
            for ki, kc in enumerate(ring.chunks(src)):
                kind = pair_kind(qc, kc, opts.causal)
                if kind == SKIP:
                    continue
                keys = slice(ki * csize, (ki + 1) * csize)
                g = F.attention_backward(do[:, rows], q[:, rows], hk[:, keys], hv[:, keys], o[:, rows],
                                         lse[:, :, rows], dlse=None if dlse is None else dlse[:, :, rows],
                                         **_kw(opts, kind, _chunk(hm, ki, nc), qc * csize, kc * csize))
                dq[:, rows] += g[0]
                dk[:, keys] += g[1]
                dv[:, keys] += g[2]
        clock.lap("compute")
        if ring.world == 1:
            break
        grads = _Exchange(ring, [dk, dv], tag0=8)  # to the next rank; after W hops back at the owner
        if xchg is not None:
            held = xchg.wait()
        dk, dv = grads.wait()
        clock.lap("wait")
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# --------------------------------------------------------------------------- ops
def _ring_of(group_name: str, layout: str) -> Ring:
    pg = c10d._resolve_process_group(group_name)
    return Ring(pg, dist.get_rank(pg), dist.get_world_size(pg), layout)


@torch.library.custom_op("fagen::ring_fwd", mutates_args=(),
                         **custom_op_tags(torch.Tag.nondeterministic_seeded))
def _ring_fwd(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], dropout_p: float,
              softmax_scale: Optional[float], causal: bool, layout: str,
              group_name: str, sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    ring = _ring_of(group_name, layout)
    _check_same_shards(ring, q)
    rng_state = draw_rng_state() if dropout_p > 0 else torch.zeros(2, dtype=torch.int64)
    seed, offset = (int(x) for x in rng_state.tolist())
    o, lse = _ring_forward(ring, q.contiguous(), k.contiguous(), v.contiguous(), key_padding_mask,
                           _Opts(causal, dropout_p, softmax_scale, seed, offset), sinks)
    return o, lse, rng_state


@_ring_fwd.register_fake
def _ring_fwd_fake(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], dropout_p: float,
                   softmax_scale: Optional[float], causal: bool, layout: str,
                   group_name: str, sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    B, n, H, _ = q.shape
    return (q.new_empty(q.shape), q.new_empty((B, H, n), dtype=_acc_dtype(q)),
            torch.empty((2,), dtype=torch.int64, device="cpu"))


@torch.library.custom_op("fagen::ring_bwd", mutates_args=())
def _ring_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, key_padding_mask: Optional[Tensor],
              dropout_p: float, softmax_scale: Optional[float], causal: bool, rng_state: Tensor, layout: str,
              group_name: str, sinks: Optional[Tensor] = None,
              dlse: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    seed, offset = (int(x) for x in rng_state.tolist())
    dlse = None if dlse is None else dlse.to(lse.dtype).contiguous()
    dq, dk, dv = _ring_backward(_ring_of(group_name, layout), do.contiguous(), q.contiguous(), k.contiguous(),
                                v.contiguous(), o.contiguous(), lse, key_padding_mask,
                                _Opts(causal, dropout_p, softmax_scale, seed, offset), dlse)
    dsinks = sink_grad(do, o, lse, sinks, dlse) if sinks is not None else q.new_empty((0,))
    return dq, dk, dv, dsinks


@_ring_bwd.register_fake
def _ring_bwd_fake(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                   key_padding_mask: Optional[Tensor], dropout_p: float, softmax_scale: Optional[float], causal: bool,
                   rng_state: Tensor, layout: str, group_name: str, sinks: Optional[Tensor] = None,
                   dlse: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dsinks = sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty((0,))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor, Tensor]) -> None:
    q, k, v, kpm, dropout_p, softmax_scale, causal, layout, group_name, *rest = inputs
    o, lse, rng_state = output
    ctx.save_for_backward(q, k, v, o, lse, kpm, rng_state, rest[0] if rest else None)
    ctx.args = (dropout_p, softmax_scale, causal, layout, group_name)
    ctx.mark_non_differentiable(rng_state)  # lse is differentiable: its gradient enters dS as P dlse


def _backward(ctx: Any, do: Tensor, dlse: Any, _drng: Any) -> tuple[Any, ...]:
    q, k, v, o, lse, kpm, rng_state, sinks = ctx.saved_tensors
    dropout_p, softmax_scale, causal, layout, group_name = ctx.args
    if do is None:  # only lse took part in the loss
        do = torch.zeros_like(o)
    dq, dk, dv, dsinks = _ring_bwd(do, q, k, v, o, lse, kpm, dropout_p, softmax_scale, causal, rng_state, layout,
                                   group_name, sinks, dlse)
    return dq, dk, dv, None, None, None, None, None, None, (dsinks if sinks is not None else None)


_ring_fwd.register_autograd(_backward, setup_context=_setup_context)


def _check(q: Any, k: Any, v: Any, kpm: Any, layout: Any) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(name, "a torch.Tensor [B, N_local, H, d]", type(t).__name__)
        if t.dim() != 4:
            raise InputError(name, "a 4-d tensor [B, N_local, H, d]", tuple(t.shape))
    if layout not in LAYOUTS:
        raise InputError("layout", f"one of {LAYOUTS}", layout)
    if k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]:
        raise InputError("k", f"the same local sequence length as q ({q.shape[1]}): every rank holds "
                         "matching shards of q, k and v", k.shape[1])
    if layout == "zigzag" and q.shape[1] % 2:
        raise InputError("q", "an even local sequence length for layout='zigzag' (two chunks per rank)", q.shape[1])
    if kpm is not None:
        if not isinstance(kpm, torch.Tensor) or kpm.dtype != torch.bool:
            raise InputTypeError("key_padding_mask", "a bool tensor [B, N_local] (sharded like k)",
                                 getattr(kpm, "dtype", type(kpm).__name__))
        if tuple(kpm.shape) != (k.shape[0], k.shape[1]):
            raise InputError("key_padding_mask", f"shape {(k.shape[0], k.shape[1])} (sharded like k)", tuple(kpm.shape))


def _check_same_shards(ring: Ring, q: Tensor) -> None:
    """Every rank must hold shards of the same shape (the ring's receive buffers are this rank's)."""
    if ring.world == 1:
        return
    dims = torch.tensor(list(q.shape) + [-x for x in q.shape], dtype=torch.int64)
    dist.all_reduce(dims, op=dist.ReduceOp.MAX, group=ring.group)
    if dims[:4].tolist() != [-x for x in dims[4:].tolist()]:
        raise InputError("q", "the same shard shape on every rank of the group", tuple(q.shape))


def ring_flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0,
                         softmax_scale: Optional[float] = None, causal: bool = False, *, group: Any = None,
                         layout: str = "contiguous", key_padding_mask: Optional[Tensor] = None,
                         return_lse: bool = False, sinks: Optional[Tensor] = None) -> Tensor | tuple[Tensor, Tensor]:
    """Attention over a sequence sharded across the ranks of ``group``, differentiable.

    q: ``[B, N_local, H, d]``, k, v: ``[B, N_local, H_kv, d]`` -- this rank's shard in ``layout``
    (``"contiguous"``: rank r holds positions ``[r*N_local, (r+1)*N_local)``; ``"zigzag"``: chunks
    r and 2W-1-r of length ``N_local/2``). Every rank passes shards of the same shape.
    ``key_padding_mask``: bool ``[B, N_local]`` sharded like k (True = the key takes part).
    ``causal`` is over global positions (Nq = Nk, so bottom-right = top-left). Dropout draws its
    (seed, offset) like :func:`fagen.flash_attn_func` -- ranks whose torch generators agree draw the
    same key -- and keeps exactly the elements :func:`fagen.dropout_keep_mask` of the whole
    sequence keeps. Returns this rank's output shard (and its lse ``[B, H, N_local]`` with
    ``return_lse``, differentiable like :func:`fagen.flash_attn_func`'s). ``group``: the process group (None = the default group). ``sinks``: fp32
    ``[H]`` attention sinks, as :func:`fagen.flash_attn_func`'s: added once, after the merge over
    every K/V shard (lse includes them); their gradient is this shard's part (rows held here), which
    the trainer sums over the group like any replicated parameter's (DDP / FSDP do).
    """
    _check(q, k, v, key_padding_mask, layout)
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.dtype != torch.float32
                              or tuple(sinks.shape) != (q.shape[2],)):
        raise InputError("sinks", f"a float32 tensor [H] = [{q.shape[2]}] (one logit per query head)",
                         getattr(sinks, "shape", type(sinks).__name__))
    p = check_dropout_p(dropout_p)
    if not isinstance(causal, bool):
        raise InputTypeError("causal", "a bool", type(causal).__name__)
    _group_info(group)
    pg = group if group is not None else dist.group.WORLD
    o, lse, _ = _ring_fwd(q, k, v, key_padding_mask, p, softmax_scale, causal, layout, pg.group_name, sinks)
    return (o, lse) if return_lse else o
