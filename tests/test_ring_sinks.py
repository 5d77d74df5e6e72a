"""Attention sinks in ring attention (fagen.distributed): two gloo processes on the CPU against
single-process ``flash_attn_func(..., sinks=...)`` on the whole sequence (causal zigzag with key
padding, GQA): the output shards, lse and dq, dk, dv, and the sinks' gradient summed over the
ranks (each rank's is its rows' part), of a loss on the output and on lse (lse is differentiable); the sink step alone (add_sinks / sink_grad) without processes."""
from __future__ import annotations

import os
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fagen
import fagen.functional as F
from fagen.distributed import ring_flash_attn_func
from fagen.distributed.ring import add_sinks, merge

import sinkref as S

B, H, HKV, D, N_LOCAL = 1, 2, 1, 16, 6


def _inputs(world: int):
    g = torch.Generator().manual_seed(5)
    n = world * N_LOCAL
    q, do = torch.randn(B, n, H, D, generator=g), torch.randn(B, n, H, D, generator=g)
    k, v = torch.randn(B, n, HKV, D, generator=g), torch.randn(B, n, HKV, D, generator=g)
    kpm = torch.ones(B, n, dtype=torch.bool)
    kpm[:, 1:4] = False
    return q, k, v, do, kpm, torch.tensor([1.5, -0.5])


def _zigzag(rank: int, world: int) -> torch.Tensor:
    c = N_LOCAL // 2
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * world - 1 - rank) * c,
                                                                          (2 * world - rank) * c)])


def _worker(rank: int, world: int, store: str, cache: str, errfile: str) -> None:
    os.environ["FAGEN_CACHE_DIR"] = cache
    torch.set_num_threads(1)
    # a file store, not TCP: no rank hosts the rendezvous, so a rank that ends first takes nothing from its
    # peer's teardown (with a TCP store one rank once died in C++ "terminate called" under CI's load)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        q, k, v, do, kpm, sinks = _inputs(world)
        full = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        o, lse = fagen.flash_attn_func(*full[:3], causal=True, key_padding_mask=kpm, sinks=full[3], return_lse=True)
        dl = torch.randn(lse.shape, generator=torch.Generator().manual_seed(9))  # a loss on lse too
        torch.autograd.backward([o, lse], [do, dl])
        idx = _zigzag(rank, world)
        shard = [t[:, idx].clone().requires_grad_() for t in (q, k, v)]
        s = sinks.clone().requires_grad_()
        o_l, lse_l = ring_flash_attn_func(*shard, causal=True, layout="zigzag", key_padding_mask=kpm[:, idx],
                                          sinks=s, return_lse=True)
        torch.autograd.backward([o_l, lse_l], [do[:, idx], dl[:, :, idx]])
        torch.testing.assert_close(o_l, o.detach()[:, idx], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse_l.float(), lse.detach()[:, :, idx], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(shard[0].grad, full[0].grad[:, idx], rtol=1e-4, atol=1e-4)
        dk, dv = shard[1].grad.clone(), shard[2].grad.clone()  # keys held here: their gradients are whole
        torch.testing.assert_close(dk, full[1].grad[:, idx], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(dv, full[2].grad[:, idx], rtol=1e-4, atol=1e-4)
        dsinks = s.grad.clone()
        dist.all_reduce(dsinks)  # the trainer's sum over the group
        torch.testing.assert_close(dsinks, full[3].grad, rtol=1e-4, atol=1e-5)
        dist.barrier()  # both ranks past their checks and their last exchange before either tears down
        Path(f"{errfile}.ok.{rank}").write_text("checked")
    except BaseException:
        Path(f"{errfile}.{rank}").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def _warm_cache() -> None:
    """Build every kernel the ranks run here, so they only load them from the cache: the whole
    sequence's forward and backward with sinks, and the ring's steps (a causal diagonal and a full
    pair of chunks, forward and backward). A rank that compiles while its peer waits in a gloo
    exchange under a loaded machine is what this keeps out of the test."""
    q, k, v, do, kpm, sinks = _inputs(2)
    full = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    o = fagen.flash_attn_func(*full[:3], causal=True, key_padding_mask=kpm, sinks=full[3])
    o.backward(do)
    c = N_LOCAL // 2
    for causal in (True, False):
        opts = dict(causal=causal, key_padding_mask=kpm[:, :c])
        o, lse = F.attention_forward(q[:, :c], k[:, :c], v[:, :c], **opts)
        F.attention_backward(do[:, :c], q[:, :c], k[:, :c], v[:, :c], o, lse, **opts)


def test_ring_sinks_match_single_process(tmp_path: Path) -> None:
    """Every check runs in the ranks; a rank that fails one writes its traceback (err.<rank>) and the test
    fails with it. A rank that passed every check and the closing barrier (err.ok.<rank>) but then died in
    gloo's teardown (C++ "terminate called without an active exception", seen under a loaded machine after
    destroy_process_group) has nothing of fagen's left to check: that exit status alone does not fail the
    test; any other failure does."""
    _warm_cache()
    errfile = str(tmp_path / "err")
    try:
        mp.spawn(_worker, args=(2, str(tmp_path / "store"), os.environ["FAGEN_CACHE_DIR"], errfile), nprocs=2,
                 join=True)
    except Exception as e:
        msgs = [p.read_text() for p in sorted(tmp_path.glob("err.[0-9]*"))]
        checked = sorted(p.name for p in tmp_path.glob("err.ok.*"))
        if msgs or checked != ["err.ok.0", "err.ok.1"]:
            pytest.fail("\n".join(msgs) or f"a ring process failed before its checks ended: {e}")
    assert sorted(p.name for p in tmp_path.glob("err.ok.*")) == ["err.ok.0", "err.ok.1"]


def test_add_sinks_after_merging_equals_the_sink_softmax() -> None:
    """Two partial results over disjoint keys, merged by lse, then the sink added once: the softmax
    over every key and the sink (the oracle); rows with no key in either part: o = 0, lse = sink."""
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 5, 2, 8, generator=g), torch.randn(1, 9, 2, 8, generator=g), torch.randn(1, 9, 2, 8,
                                                                                                        generator=g)
    sinks = torch.tensor([0.3, 2.0])
    kpm = torch.ones(1, 9, dtype=torch.bool)
    o1, l1 = S.attention(q, k[:, :4], v[:, :4], kpm=kpm[:, :4], dtype=torch.float64)
    o2, l2 = S.attention(q, k[:, 4:], v[:, 4:], kpm=kpm[:, 4:], dtype=torch.float64)
    o, lse = add_sinks(*merge(o1, l1, o2, l2), sinks)
    o64, lse64 = S.attention(q, k, v, sinks=sinks, dtype=torch.float64)
    torch.testing.assert_close(o, o64)
    torch.testing.assert_close(lse, lse64)
    dead_o, dead_lse = add_sinks(torch.zeros(1, 5, 2, 8), torch.full((1, 2, 5), -float("inf")), sinks)
    assert (dead_o == 0).all() and torch.equal(dead_lse, sinks[None, :, None].expand(1, 2, 5))
