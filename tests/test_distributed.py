"""Ring attention over real gloo processes on the CPU, against single-process fagen on the whole
sequence (same dtype) and the float64 reference; the merge by lse; argument errors."""
from __future__ import annotations

import copy
import math
import os
import socket
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fagen.ops import draw_rng_state
import fagen
import fagen.functional as F
from fagen import reference as R
from fagen.distributed import ring_flash_attn_func, step_times
from fagen.distributed.ring import Ring, merge, pair_kind
from fagen.errors import InputError, InputTypeError

B, H, D = 1, 2, 16

# (name, kwargs): each runs in every world; odd N_local in the contiguous cases.
CASES = [
    ("plain", dict(n_local=5, causal=False, layout="contiguous")),
    ("causal", dict(n_local=5, causal=True, layout="contiguous")),
    ("zigzag", dict(n_local=6, causal=True, layout="zigzag")),
    ("padding", dict(n_local=5, causal=True, layout="contiguous", padding=True)),
    ("gqa", dict(n_local=4, causal=True, layout="zigzag", heads_kv=1)),
    ("dropout", dict(n_local=5, causal=False, layout="contiguous", dropout_p=0.3)),
    ("dropout-zigzag", dict(n_local=4, causal=True, layout="zigzag", dropout_p=0.25)),
    # float16: the tensor-core family; chunks of 3 keys exercise its keep-mask path for column
    # offsets that are not multiples of 4 as well as the ones that are
    ("fp16", dict(n_local=6, causal=True, layout="zigzag", dropout_p=0.2, dtype=torch.float16)),
]
#: Three ranks (odd world: the rank that both sends and receives first) run a subset, for time.
WORLD_CASES = {2: [name for name, _ in CASES] + ["compile", "ddp", "fsdp"], 3: ["zigzag", "dropout-zigzag"]}


def _global_index(rank: int, world: int, n_local: int, layout: str) -> torch.Tensor:
    """Global positions of rank's shard, in its local order."""
    if layout == "contiguous":
        return torch.arange(rank * n_local, (rank + 1) * n_local)
    c = n_local // 2
    return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                      torch.arange((2 * world - 1 - rank) * c, (2 * world - rank) * c)])


def _inputs(world: int, n_local: int, heads_kv: int = H, padding: bool = False,
            dtype: torch.dtype = torch.float32, **_: object):
    g = torch.Generator().manual_seed(1234 + n_local)
    n = world * n_local
    q = torch.randn(B, n, H, D, generator=g)
    k = torch.randn(B, n, heads_kv, D, generator=g)
    v = torch.randn(B, n, heads_kv, D, generator=g)
    do = torch.randn(B, n, H, D, generator=g)
    q, k, v, do = (t.to(dtype) for t in (q, k, v, do))
    kpm = None
    if padding:  # a whole shard of keys padded away (fully masked partial blocks) and a few more
        kpm = torch.ones(B, n, dtype=torch.bool)
        kpm[:, :n_local] = False
        kpm[:, -2:] = False
    return q, k, v, do, kpm


def _check_case(rank: int, world: int, name: str, n_local: int, causal: bool, layout: str,
                dropout_p: float = 0.0, **kw: Any) -> None:
    q, k, v, do, kpm = _inputs(world, n_local, **kw)
    idx = _global_index(rank, world, n_local, layout)
    shard = lambda t: t[:, idx].clone()  # noqa: E731
    ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
    torch.manual_seed(77)  # every rank's generator agrees: the same dropout key
    o_l, lse_l = ring_flash_attn_func(ql, kl, vl, dropout_p, None, causal, layout=layout,
                                      key_padding_mask=None if kpm is None else shard(kpm), return_lse=True)
    o_l.backward(shard(do))

    torch.manual_seed(77)
    seed, offset = (int(x) for x in draw_rng_state().tolist())
    opts = dict(causal=causal, key_padding_mask=kpm, dropout_p=dropout_p, seed=seed, offset=offset)
    o, lse = F.attention_forward(q, k, v, **opts)
    dq, dk, dv = F.attention_backward(do, q, k, v, o, lse, **opts)
    keep = F.dropout_keep_mask(B, H, q.shape[1], k.shape[1], dropout_p, seed=seed, offset=offset) \
        if dropout_p else None
    o64, lse64 = R.attention_forward_ref(q.double(), k.double(), v.double(), causal=causal, key_padding_mask=kpm,
                                         dropout_p=dropout_p, keep_mask=keep)
    dq64, dk64, dv64 = R.attention_backward_ref(do.double(), q.double(), k.double(), v.double(), o64, lse64,
                                                causal=causal,
                                                key_padding_mask=kpm, dropout_p=dropout_p, keep_mask=keep)
    ring = {"o": o_l, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
    single = {"o": shard(o), "dq": shard(dq), "dk": shard(dk), "dv": shard(dv)}
    ref = {"o": shard(o64), "dq": shard(dq64), "dk": shard(dk64), "dv": shard(dv64)}
    half = q.dtype == torch.float16  # partial outputs rounded to half before the merge
    for key in ring:
        err = (ring[key].double() - ref[key]).abs().max().item()
        base = (single[key].double() - ref[key]).abs().max().item()
        atol = 2e-4 if half else 2e-5  # tests/numerics.py's ATOL (float32's scaled to these sizes)
        assert err <= 2 * base + atol, f"{name} rank {rank}/{world} {key}: ring err {err:.3g} vs single {base:.3g}"
        if not half:
            torch.testing.assert_close(ring[key], single[key], atol=2e-5, rtol=1e-4, msg=lambda m: f"{name} {key}: {m}")
    if dropout_p:
        _check_keep_mask(rank, world, n_local, causal, layout, dropout_p, idx, keep, q.dtype)
    lse_single = lse[:, :, idx]
    assert torch.equal(torch.isinf(lse_l), torch.isinf(lse_single)), name
    fin = torch.isfinite(lse_single)
    torch.testing.assert_close(lse_l[fin], lse_single[fin], atol=1e-5, rtol=1e-5)


def _probe(n: int, n_q: int, heads: int = H) -> tuple[torch.Tensor, torch.Tensor]:
    """q = 0 (uniform scores) and v = one-hot of the key index: o[b, i, h, j] != 0 iff key j is
    allowed and kept for row i, so o shows the keep mask the kernels applied (n <= 16)."""
    assert n <= 16
    q = torch.zeros(B, n_q, heads, 16)
    v = torch.eye(n, 16).expand(B, heads, n, 16).transpose(1, 2).contiguous()
    return q, v


def _check_keep_mask(rank: int, world: int, n_local: int, causal: bool, layout: str, dropout_p: float,
                     idx: torch.Tensor, keep: torch.Tensor, dtype: torch.dtype) -> None:
    """The ring's keep mask equals dropout_keep_mask of the whole sequence, bit for bit."""
    n = world * n_local
    q, v = (t.to(dtype) for t in _probe(n, n))
    torch.manual_seed(77)
    o_l = ring_flash_attn_func(q[:, idx], v[:, idx], v[:, idx], dropout_p, None, causal, layout=layout)
    kept = (o_l != 0).permute(0, 2, 1, 3)[..., :n]  # [B, H, rows of this rank, global keys]
    want = keep[:, :, idx]
    if causal:
        want = want & torch.ones(n, n, dtype=torch.bool).tril()[idx]
    assert torch.equal(kept, want), f"keep mask of rank {rank}/{world} ({layout})"


class _Attn(torch.nn.Module):
    """A small attention block on fagen.flash_attn_func (causal)."""

    def __init__(self, width: int = 32, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.out = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, w = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, w // self.heads).unbind(2)
        return self.out(fagen.flash_attn_func(q, k, v, causal=True).reshape(b, n, w))


def _train(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _check_training(rank: int, world: int, kind: str) -> None:
    """DDP / FSDP2 (fully_shard) of a model on fagen.flash_attn_func, 3 steps, each rank a slice of
    the batch: the parameters equal a single-process run on the whole batch."""
    torch.manual_seed(5)
    ref = _Attn()
    x, y = torch.randn(2 * world, 6, 32), torch.randn(2 * world, 6, 32)
    model, init = copy.deepcopy(ref), copy.deepcopy(ref)
    _train(ref, x, y)
    mine = slice(2 * rank, 2 * rank + 2)
    if kind == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        _train(wrapped, x[mine], y[mine])
        params = dict(model.named_parameters())
    else:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
        _train(model, x[mine], y[mine])
        params = {n: p.full_tensor() for n, p in model.named_parameters()}
    for name, p in ref.named_parameters():
        torch.testing.assert_close(params[name], p, atol=1e-5, rtol=1e-5, msg=lambda m: f"{kind} {name}: {m}")
    assert not torch.allclose(params["qkv.weight"], init.qkv.weight)  # the steps did train


def _check_compiled(rank: int, world: int) -> None:
    """torch.compile(fullgraph=True) traces the ring as opaque ops: same output and grads as eager."""
    q, k, v, do, _ = _inputs(world, 4)
    idx = _global_index(rank, world, 4, "zigzag")

    def run(fn):
        ql, kl, vl = (t[:, idx].clone().requires_grad_() for t in (q, k, v))
        o = fn(ql, kl, vl)
        o.backward(do[:, idx])
        return o, ql.grad, kl.grad, vl.grad

    attn = lambda q, k, v: ring_flash_attn_func(q, k, v, causal=True, layout="zigzag")  # noqa: E731
    compiled = run(torch.compile(attn, fullgraph=True, backend="aot_eager"))
    with step_times() as t:
        eager = run(attn)
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert t.steps == {"fwd": world, "bwd": world} and min(t.compute.values()) > 0


def _worker(rank: int, world: int, port: int, cache: str, names: list[str], errfile: str) -> None:
    os.environ["FAGEN_CACHE_DIR"] = cache
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for name, kw in CASES:
            if name in names:
                _check_case(rank, world, name, **kw)
        if "compile" in names:
            _check_compiled(rank, world)
        for kind in ("ddp", "fsdp"):
            if kind in names:
                _check_training(rank, world, kind)
    except BaseException:
        Path(f"{errfile}.{rank}").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(world: int, names: list[str], tmp_path: Path) -> None:
    errfile = str(tmp_path / "err")
    try:
        mp.spawn(_worker, args=(world, _free_port(), os.environ["FAGEN_CACHE_DIR"], names, errfile),
                 nprocs=world, join=True)
    except Exception:
        msgs = [p.read_text() for p in sorted(tmp_path.glob("err.*"))]
        pytest.fail("\n".join(msgs) or "a ring process failed")


@pytest.fixture(scope="module")
def _warm_cache() -> None:
    """Build the kernels once in this process (the spawned ranks then load them from the cache)."""
    for name, kw in CASES:
        q, k, v, do, kpm = _inputs(1, **kw)
        opts: dict[str, Any] = dict(causal=kw["causal"], key_padding_mask=kpm, dropout_p=kw.get("dropout_p", 0.0))
        for causal in {False, kw["causal"]}:
            opts["causal"] = causal
            o, lse = F.attention_forward(q, k, v, **opts)
            F.attention_backward(do, q, k, v, o, lse, **opts)


@pytest.mark.parametrize("world", [2, 3])
def test_ring_matches_single_process(world: int, tmp_path: Path, _warm_cache: None) -> None:
    _spawn(world, WORLD_CASES[world], tmp_path)


# --------------------------------------------------------------------------- pieces, no processes
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("row0,col0,n_q,n_k", [(0, 0, 7, 9), (5, 3, 6, 7), (13, 6, 5, 10), (9, 8, 3, 12)])
def test_dropout_offsets_follow_the_whole_sequence(row0: int, col0: int, n_q: int, n_k: int,
                                                   dtype: torch.dtype) -> None:
    """A block at (row0, col0) with the offsets keeps what the whole sequence keeps there, in the
    forward and (dv = P_dropped^T do) in the backward; float16 runs the default half family."""
    n = max(row0 + n_q, col0 + n_k)
    p, seed, offset = 0.4, 1234, 77
    q, v = (t.to(dtype) for t in _probe(n_k, n_q))
    opts = dict(dropout_p=p, seed=seed, offset=offset, dropout_row_offset=row0, dropout_col_offset=col0)
    keep = F.dropout_keep_mask(B, H, n, n, p, seed=seed, offset=offset)[:, :, row0:row0 + n_q, col0:col0 + n_k]
    o, lse = F.attention_forward(q, v, v, **opts)
    assert torch.equal((o != 0).permute(0, 2, 1, 3)[..., :n_k], keep)
    do = torch.eye(n_q, 16).expand(B, H, n_q, 16).transpose(1, 2).contiguous().to(dtype)  # dv[j, i] = P~[i, j]
    _, _, dv = F.attention_backward(do, q, v, v, o, lse, **opts)
    assert torch.equal((dv[..., :n_q] != 0).permute(0, 2, 3, 1), keep)
    with pytest.raises(InputError, match="dropout_col_offset"):
        F.attention_forward(q, v, v, dropout_p=p, dropout_col_offset=-1)


def test_merge_handles_fully_masked_parts() -> None:
    o1, o2 = torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4)
    lse1 = torch.tensor([[[0.5, -math.inf, -math.inf]]])
    lse2 = torch.tensor([[[1.0, 2.0, -math.inf]]])
    o2[:, 2] = 0.0
    o, lse = merge(o1, lse1, o2, lse2)
    w1, w2 = math.exp(0.5 - lse[0, 0, 0].item()), math.exp(1.0 - lse[0, 0, 0].item())
    torch.testing.assert_close(o[:, 0], w1 * o1[:, 0] + w2 * o2[:, 0])
    torch.testing.assert_close(o[:, 1], o2[:, 1])  # the -inf part has weight 0
    assert torch.equal(o[:, 2], torch.zeros_like(o[:, 2])) and lse[0, 0, 2].item() == -math.inf
    assert not torch.isnan(o).any()
    nan_o, nan_lse = merge(o1, torch.full_like(lse1, math.nan), o2, lse2)
    assert torch.isnan(nan_lse).all() and torch.isnan(nan_o).all()


def test_pair_kinds_and_zigzag_chunks() -> None:
    assert [pair_kind(2, c, True) for c in range(4)] == ["full", "full", "diag", "skip"]
    assert {pair_kind(2, c, False) for c in range(4)} == {"full"}
    ring = Ring(None, 1, 3, "zigzag")
    assert [ring.chunks(r) for r in range(3)] == [(0, 5), (1, 4), (2, 3)]
    # zigzag balances causal work: every rank computes the same number of non-skipped pairs
    work = [sum(pair_kind(qc, kc, True) != "skip" for s in range(3) for qc in ring.chunks(r) for kc in ring.chunks(s))
            for r in range(3)]
    assert len(set(work)) == 1


@pytest.mark.parametrize("kw, argument", [
    (dict(layout="ring"), "layout"),
    (dict(layout="zigzag", n=5), "q"),
    (dict(n_k=3), "k"),
    (dict(key_padding_mask=torch.ones(1, 4)), "key_padding_mask"),
    (dict(key_padding_mask=torch.ones(1, 3, dtype=torch.bool)), "key_padding_mask"),
    (dict(dropout_p=1.0), "dropout_p"),
    (dict(causal=1), "causal"),
])
def test_argument_errors_name_the_argument(kw: dict, argument: str) -> None:
    n, n_k = kw.pop("n", 4), kw.pop("n_k", None)
    q = torch.randn(1, n, 1, 8)
    k = torch.randn(1, n_k or n, 1, 8)
    with pytest.raises((InputError, InputTypeError)) as err:
        ring_flash_attn_func(q, k, k, **kw)
    assert err.value.argument == argument


def test_needs_a_process_group() -> None:
    q = torch.randn(1, 4, 1, 8)
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    with pytest.raises(InputError, match="group"):
        ring_flash_attn_func(q, q, q)
