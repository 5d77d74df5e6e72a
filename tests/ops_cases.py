"""Shared cases of the autograd op layer (tests/test_ops.py on the CPU, tests/test_gpu.py on a GPU):
a small matrix of dtypes, head dims, masks and dropout, their inputs, and flash_attn_func with
autograd."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fagen.ops import flash_attn_func
from numerics import ATOL, DTYPES

__all__ = ["ATOL", "CASES", "Case", "leaves", "make_inputs", "max_err", "run_flash"]


@dataclass(frozen=True)
class Case:
    dtype: str
    head_dim: int
    causal: bool = False
    padding: bool = False
    dropout_p: float = 0.0
    seqlen_q: int = 37
    seqlen_k: int = 70
    batch: int = 2
    heads: int = 2

    def __str__(self) -> str:
        flags = [f for f, on in (("causal", self.causal), ("pad", self.padding)) if on]
        drop = [f"p{self.dropout_p}"] if self.dropout_p else []
        return "-".join([self.dtype, f"d{self.head_dim}", f"q{self.seqlen_q}k{self.seqlen_k}", *flags, *drop])


# Each case is one fwd and one bwd spec; the other tests reuse these specs.
CASES = [
    Case("float16", 32),
    Case("bfloat16", 64, causal=True, seqlen_q=70, seqlen_k=37),  # bottom-right: first rows see no key
    Case("float32", 16, padding=True),
    Case("float32", 32, causal=True, padding=True, dropout_p=0.2, seqlen_q=45, seqlen_k=45),
    Case("float16", 32, causal=True, padding=True, dropout_p=0.17, seqlen_q=64, seqlen_k=64),
    Case("bfloat16", 16, dropout_p=0.3, seqlen_q=1, seqlen_k=33),
]


def make_inputs(case: Case, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    dt = DTYPES[case.dtype]
    q = torch.randn(case.batch, case.seqlen_q, case.heads, case.head_dim, generator=g).to(dt)
    k = torch.randn(case.batch, case.seqlen_k, case.heads, case.head_dim, generator=g).to(dt)
    v = torch.randn(case.batch, case.seqlen_k, case.heads, case.head_dim, generator=g).to(dt)
    do = torch.randn(case.batch, case.seqlen_q, case.heads, case.head_dim, generator=g).to(dt)
    mask = None
    if case.padding:
        mask = torch.rand(case.batch, case.seqlen_k, generator=g) > 0.3
        mask[0] = False  # batch 0: no key takes part -> zero rows and zero gradients
    return q, k, v, do, mask


def leaves(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_(True) for t in ts]


def run_flash(case: Case, q, k, v, do, mask, rng_seed: int = 0):
    """flash_attn_func + autograd after torch.manual_seed(rng_seed): (out, dq, dk, dv)."""
    ql, kl, vl = leaves(q, k, v)
    torch.manual_seed(rng_seed)
    out = flash_attn_func(ql, kl, vl, dropout_p=case.dropout_p, causal=case.causal, key_padding_mask=mask)
    out.backward(do)
    return out.detach(), ql.grad, kl.grad, vl.grad


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()
