"""Ring attention (fagen.distributed.ring_flash_attn_func): time per ring step, split into compute
and the communication compute did not hide.

    python benchmarks/ring.py [--world 2] [--backend gloo|nccl] [--seqlen-local 64] [--heads 2]
                              [--head-dim 32] [--dtype float32] [--causal] [--layout zigzag] [--iters 3]

Spawns ``--world`` processes on this machine (gloo on the CPU, where the emulator runs the
kernels; ``--backend nccl`` puts rank r on GPU r). Per pass (forward, backward) it prints, as
rank 0 measured them, seconds per step in compute (kernels and the lse merge) and in waiting for
the ring's messages after the compute, the bytes sent per step, and the total per call.
"""
from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    from fagen.distributed import ring_flash_attn_func, step_times

    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world)
    device = torch.device("cuda", rank) if args.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(rank)
    shape = (1, args.seqlen_local, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, dtype=DTYPES[args.dtype], device=device, requires_grad=True) for _ in range(3))
    do = torch.randn(shape, dtype=q.dtype, device=device)

    def call() -> None:
        o = ring_flash_attn_func(q, k, v, causal=args.causal, layout=args.layout)
        o.backward(do)

    call()  # builds / loads the kernels
    dist.barrier()
    t0 = time.perf_counter()
    with step_times() as t:
        for _ in range(args.iters):
            call()
    total = (time.perf_counter() - t0) / args.iters
    if rank == 0:
        kv = 2 * k.numel() * k.element_size()
        acc = 2 * k.numel() * (8 if q.dtype == torch.float64 else 4)
        print(f"world {args.world} ({args.backend}, {device.type}), B=1 N_local={args.seqlen_local} H={args.heads} "
              f"d={args.head_dim} {args.dtype} causal={args.causal} layout={args.layout}")
        for what, sent in (("fwd", kv), ("bwd", kv + acc)):
            n = max(1, t.steps[what])
            print(f"  {what}: {n // args.iters} steps/call, compute {t.compute[what] / n * 1e3:9.2f} ms/step, "
                  f"waiting {t.wait[what] / n * 1e3:9.2f} ms/step, {sent} bytes sent/step")
        print(f"  total: {total * 1e3:.1f} ms per forward+backward call")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    ap.add_argument("--seqlen-local", type=int, default=64)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--layout", choices=("contiguous", "zigzag"), default="contiguous")
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(args, port), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
