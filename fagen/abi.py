"""Kernel ABI: the parameter list and grid rule of every kernel role.

Emitted into the templates (signatures) and used by the launchers (argument
packing by name), so the order is stated exactly once. ``ROLES`` are the roles a
family launches unless it says otherwise (``Family.roles``); the block dims and
rows per block of each role come from ``Family.launch``.
Layouts: q, o, do, dq [B, Nq, H, d]; k, v, dk, dv [B, Nk, H, d] with element
strides (batch, seq, head) and a contiguous last dim; lse and delta float32
[B, H, Nq] contiguous; dq_accum float32 [B, Nq, H, d] contiguous; kpm uint8
[B, Nk] contiguous (1 = the key takes part).
"""
from __future__ import annotations

from dataclasses import dataclass

T = "T"  # placeholder for the spec's dtype, substituted at render time


def _strides(t: str) -> list[tuple[str, str]]:
    return [("long long", f"stride_{t}_b"), ("long long", f"stride_{t}_s"), ("long long", f"stride_{t}_h")]


_DROPOUT = [("unsigned long long", "seed"), ("unsigned long long", "offset"),
            ("unsigned int", "drop_threshold"), ("float", "rp_keep")]


@dataclass(frozen=True)
class Role:
    name: str  # suffix of the kernel's entry point
    params: tuple[tuple[str, str], ...]  # (ctype, name); ctype may contain "T"
    grid_seq: str  # "q" or "k": which seqlen the grid's x dimension tiles
    rows_per_block: str  # "block_r", "block_c" or "num_warps" (FamilyBase.launch's default rule)

    def grid(self, *, batch: int, heads: int, seqlen_q: int, seqlen_k: int, rows: int) -> tuple[int, int, int]:
        n = seqlen_q if self.grid_seq == "q" else seqlen_k
        return (max(1, -(-n // rows)), batch, heads)


BWD_PRE = Role(
    "pre",
    tuple([("const T*", "o"), ("const T*", "do_"), ("float*", "delta"), ("float*", "dq_accum"),
           ("int", "heads"), ("int", "seqlen_q")] + _strides("o") + _strides("do")),
    "q", "num_warps",
)
BWD_MAIN = Role(
    "main",
    tuple([("const T*", "q"), ("const T*", "k"), ("const T*", "v"), ("const T*", "do_"),
           ("const float*", "lse"), ("const float*", "delta"), ("const unsigned char*", "kpm"),
           ("float*", "dq_accum"), ("T*", "dk"), ("T*", "dv"),
           ("int", "heads"), ("int", "seqlen_q"), ("int", "seqlen_k")]
          + _strides("q") + _strides("k") + _strides("v") + _strides("do") + _strides("dk") + _strides("dv")
          + [("float", "scale")] + _DROPOUT),
    "k", "block_c",
)
BWD_POST = Role(
    "post",
    tuple([("const float*", "dq_accum"), ("T*", "dq"), ("int", "heads"), ("int", "seqlen_q")] + _strides("dq")),
    "q", "num_warps",
)
FWD_MAIN = Role(
    "main",
    tuple([("const T*", "q"), ("const T*", "k"), ("const T*", "v"), ("const unsigned char*", "kpm"),
           ("T*", "o"), ("float*", "lse"), ("int", "heads"), ("int", "seqlen_q"), ("int", "seqlen_k")]
          + _strides("q") + _strides("k") + _strides("v") + _strides("o")
          + [("float", "scale")] + _DROPOUT),
    "q", "block_r",
)

ROLES: dict[str, tuple[Role, ...]] = {"bwd": (BWD_PRE, BWD_MAIN, BWD_POST), "fwd": (FWD_MAIN,)}
