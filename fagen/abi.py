"""Kernel ABI: the parameter list and grid rule of every kernel role.

Emitted into the templates (signatures) and used by the launchers (argument
packing by name), so the order is stated exactly once. ``ROLES`` are the roles a
family launches unless it says otherwise (``Family.roles``); the block dims and
rows per block of each role come from ``Family.launch``.
Layouts: q, o, do, dq [B, Nq, H, d]; k, v, dk, dv [B, Nk, H_kv, d] with element
strides (batch, seq, head) and a contiguous last dim; lse and delta float32
[B, H, Nq] (strides stride_lse_b, stride_lse_h, contiguous along Nq); dq_accum
float32 [B, Nq, H, d] contiguous; kpm uint8 [B, Nk] contiguous (1 = the key takes part).

Feature parameters (``FEATURE_PARAMS``) are always present; the spec's flags decide
whether a kernel reads them, and :func:`neutral_args` gives the values a launcher passes
when a feature is off: ``heads_kv`` (GQA: q head h reads kv head h / (heads / heads_kv));
``cu_seqlens_q/k`` (varlen: int32 [B + 1]; the seqlen args then hold the max lengths and
q/k/v/o/... are packed [total, H, d], row r of sequence b at token cu_seqlens[b] + r;
lse/delta [H, total_q]: stride_lse_b = 0, stride_lse_h = total_q, element
b*stride_lse_b + h*stride_lse_h + (varlen ? cu_seqlens_q[b] : 0) + r);
``window_left/right`` (-1 = unbounded); ``softcap`` (> 0); ``alibi_slopes`` fp32, slope of
(b, h) at b*stride_alibi_b + h; ``mask`` uint8 (1 = take part) and ``bias`` (the spec's
dtype), element b*stride_b + h*stride_h + r*stride_q + c*stride_k (stride 0 = broadcast);
``dbias`` fp32 [B, H, Nq, Nk] written with bias_grad; ``row_offset``/``col_offset`` (0 = off)
are added to the row and column of the dropout keep-mask (Philox counter) only, so a kernel
running a block of a longer sequence (a ring attention step) drops exactly what the whole
sequence's kernel drops there; ``sinks`` fp32 [H] (attention sinks, forward: one logit per q
head in every row's softmax denominator). ``dlse`` (the pre kernel, nullable: null = none) fp32
in lse's layout: the gradient of lse, subtracted from D. ``lse_lo`` (nullable: null = none) fp32 in
lse's layout: what the fp32 lse cannot hold of a row whose scores are huge (|lse log2 e| >= 2^10),
written by the forward, read by the backward: the row's exact lse log2 e minus the backward's
fp32 value of it (templates/partials/common.cuh, ``fa_bwd_lse2`` / ``fa_lse_lo``); 0 for every
other row. Without it the backward bounds such rows' P by 1 (finite, not exact). fagen/masking.py and
templates/partials/{masking,score_mod}.cuh state the semantics.

Grids: the backward's main kernel runs one CTA per (K/V block, batch, kv head) and loops over
the q heads of its group (``grid_heads="kv"``: no atomics on dK/dV); the deterministic backward
(``roles_for("bwd", deterministic=True)``) adds the ``dq`` role, one CTA per (Q block, batch,
q head), visiting the K/V blocks in a fixed order and storing dq_accum without atomics (the
``wgmma`` family instead orders its main kernel's dQ adds with turn counters, :data:`DQ_SEM`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

T = "T"  # placeholder for the spec's dtype, substituted at render time

#: The tensor-map parameter kind: a tiled TMA descriptor passed by value. On a GPU it is the
#: driver's 128-byte ``CUtensorMap`` (``cuTensorMapEncodeTiled``); on the CPU emulator the
#: same logical fields in fagen's own 128-byte struct. The launchers take a
#: :class:`fagen.tma.TensorMapFields` for it (:func:`fagen.tma.tensor_map_fields` computes
#: the fields for both); templates/wgmma/hopper.cuh defines ``FaTensorMap``.
TENSORMAP = "const __grid_constant__ FaTensorMap"


def is_tensormap(ctype: str) -> bool:
    """True for the tensor-map parameter kind (:data:`TENSORMAP`)."""
    return " ".join(ctype.split()) == TENSORMAP


def _strides(t: str) -> list[tuple[str, str]]:
    return [("long long", f"stride_{t}_b"), ("long long", f"stride_{t}_s"), ("long long", f"stride_{t}_h")]


_DROPOUT = [("unsigned long long", "seed"), ("unsigned long long", "offset"),
            ("unsigned int", "drop_threshold"), ("float", "rp_keep")]


def _bhqk(t: str) -> list[tuple[str, str]]:
    return [("long long", f"stride_{t}_{x}") for x in "bhqk"]


#: Appended to every main kernel (forward, backward, dq), in this order.
FEATURE_PARAMS: tuple[tuple[str, str], ...] = tuple(
    [("int", "heads_kv"), ("const int*", "cu_seqlens_q"), ("const int*", "cu_seqlens_k"),
     ("int", "window_left"), ("int", "window_right"), ("float", "softcap"),
     ("const float*", "alibi_slopes"), ("long long", "stride_alibi_b"),
     ("const unsigned char*", "mask")] + _bhqk("mask")
    + [("const T*", "bias")] + _bhqk("bias")
    + [("long long", "stride_lse_b"), ("long long", "stride_lse_h")]
    + [("int", "row_offset"), ("int", "col_offset")]
    + [("const float*", "sinks"), ("float*", "lse_lo")])
#: Appended after FEATURE_PARAMS to the backward main and dq kernels.
DBIAS_PARAMS: tuple[tuple[str, str], ...] = tuple([("float*", "dbias")] + _bhqk("dbias"))


def neutral_args(*, heads: int, seqlen_q: int, null: Any = 0, direction: str = "bwd") -> dict[str, Any]:
    """The feature parameters' values when their features are off (pointers ``null``: 0 for the
    launchers, None for ``fagen.emulator.run_sanitized``; window -1, softcap 0, zero strides,
    heads_kv = heads, lse strides of a contiguous [B, H, Nq]); the dbias ones for ``direction="bwd"``."""
    out: dict[str, Any] = {}
    for ctype, name in FEATURE_PARAMS + (DBIAS_PARAMS if direction == "bwd" else ()):
        out[name] = null if "*" in ctype else 0.0 if ctype == "float" else 0
    out.update(heads_kv=heads, window_left=-1, window_right=-1, stride_lse_b=heads * seqlen_q, stride_lse_h=seqlen_q)
    return out


@dataclass(frozen=True)
class Role:
    name: str  # suffix of the kernel's entry point
    params: tuple[tuple[str, str], ...]  # (ctype, name); ctype may contain "T"
    grid_seq: str  # "q" or "k": which seqlen the grid's x dimension tiles
    rows_per_block: str  # "block_r", "block_c" or "num_warps" (FamilyBase.launch's default rule)
    grid_heads: str = "q"  # "q" or "kv": the grid's z dimension is heads or heads_kv

    def grid(self, *, batch: int, heads: int, seqlen_q: int, seqlen_k: int, rows: int,
             heads_kv: int | None = None) -> tuple[int, int, int]:
        """(x, y, z) = (blocks over the tiled seqlen, batch, heads or heads_kv); varlen passes the
        max seqlens (blocks past a sequence's end return at once). ``heads_kv`` defaults to heads."""
        n = seqlen_q if self.grid_seq == "q" else seqlen_k
        z = heads if self.grid_heads == "q" or heads_kv is None else heads_kv
        return (max(1, -(-n // rows)), batch, z)


BWD_PRE = Role(
    "pre",
    tuple([("const T*", "o"), ("const T*", "do_"), ("float*", "delta"), ("float*", "dq_accum"),
           ("int", "heads"), ("int", "seqlen_q")] + _strides("o") + _strides("do")
          + [("const int*", "cu_seqlens_q"), ("long long", "stride_lse_b"), ("long long", "stride_lse_h"),
             ("const float*", "dlse")]),
    "q", "num_warps",
)
BWD_MAIN = Role(
    "main",
    tuple([("const T*", "q"), ("const T*", "k"), ("const T*", "v"), ("const T*", "do_"),
           ("const float*", "lse"), ("const float*", "delta"), ("const unsigned char*", "kpm"),
           ("float*", "dq_accum"), ("T*", "dk"), ("T*", "dv"),
           ("int", "heads"), ("int", "seqlen_q"), ("int", "seqlen_k")]
          + _strides("q") + _strides("k") + _strides("v") + _strides("do") + _strides("dk") + _strides("dv")
          + [("float", "scale")] + _DROPOUT + list(FEATURE_PARAMS) + list(DBIAS_PARAMS)),
    "k", "block_c", grid_heads="kv",  # one CTA per (K/V block, batch, kv head): loops over the q-head group
)
#: Deterministic backward only: dQ with Q outer (one CTA per (Q block, batch, q head), K/V blocks in a
#: fixed order, plain stores into dq_accum); the main kernel then computes dK/dV only.
BWD_DQ = Role("dq", BWD_MAIN.params, "q", "block_r")
BWD_POST = Role(
    "post",
    tuple([("const float*", "dq_accum"), ("T*", "dq"), ("int", "heads"), ("int", "seqlen_q")] + _strides("dq")
          + [("const int*", "cu_seqlens_q")]),
    "q", "num_warps",
)
FWD_MAIN = Role(
    "main",
    tuple([("const T*", "q"), ("const T*", "k"), ("const T*", "v"), ("const unsigned char*", "kpm"),
           ("T*", "o"), ("float*", "lse"), ("int", "heads"), ("int", "seqlen_q"), ("int", "seqlen_k")]
          + _strides("q") + _strides("k") + _strides("v") + _strides("o")
          + [("float", "scale")] + _DROPOUT + list(FEATURE_PARAMS)),
    "q", "block_r",
)

ROLES: dict[str, tuple[Role, ...]] = {"bwd": (BWD_PRE, BWD_MAIN, BWD_POST), "fwd": (FWD_MAIN,)}
#: A deterministic backward's dQ turn counters where a family orders its dQ adds in the main kernel
#: (``wgmma``): int32, one per (Q block of the main kernel's block_r rows, batch, q head, copy), element
#: ((i * batch + b) * heads + h) * DQ_COPIES + c (varlen: Q blocks of the max length), zeroed by the
#: launcher for every call (:func:`dq_sem_count` elements), never shared between calls.
DQ_SEM = ("int*", "dq_sem")
#: The fp32 dQ accumulator of a main kernel taking :data:`DQ_SEM` holds DQ_COPIES partial sums per q head:
#: [B, Nq, H * DQ_COPIES, d] (varlen [total_q, H * DQ_COPIES, d]), copy c of head h at h * DQ_COPIES + c.
#: Each copy takes its adds in an order of its own (a K/V block's visits before and after they wrap
#: around, ``templates/wgmma/deterministic.cuh``); the pre kernel zeroes every copy and the post kernel
#: sums them in ascending c. Any other backward's: one copy, [B, Nq, H, d].
DQ_COPIES = 2


def dq_sem_count(batch: int, heads: int, seqlen_q: int, block_r: int) -> int:
    """Elements of the ``dq_sem`` buffer (:data:`DQ_SEM`) of a call."""
    return batch * heads * max(1, -(-seqlen_q // block_r)) * DQ_COPIES


#: The roles of a deterministic backward (launch order): dq runs after main.
DETERMINISTIC_BWD_ROLES: tuple[Role, ...] = (BWD_PRE, BWD_MAIN, BWD_DQ, BWD_POST)


def roles_for(direction: str, deterministic: bool = False) -> tuple[Role, ...]:
    """The standard roles of a direction (the deterministic backward adds ``dq``)."""
    if deterministic and direction == "bwd":
        return DETERMINISTIC_BWD_ROLES
    return ROLES[direction]
