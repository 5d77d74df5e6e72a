"""The Hopper family's backward (sm_90a): K_j / V_j resident in shared memory, Q_i / dO_i streamed
by TMA, every GEMM a ``wgmma``, dQ_i added to the fp32 ``dq_accum`` by one TMA reduce-add.

One CTA per (K/V block j, batch, kv head) of ``32 * num_warps + 128`` threads: ``num_warps / 4``
consumer warpgroups of 64 K/V rows each (``block_c = 16 * num_warps``) and a producer warpgroup
whose first warp streams Q_i, dO_i (TMA, 128-byte swizzle) and lse_i, D_i (plain loads by its
32 lanes, staged in shared memory as lse log2 e and D scale) through ``stages`` mbarrier slots.
Per Q block a consumer warpgroup computes S^T = K_w Q_i^T and dP^T = V_w dO_i^T (wgmma, both
operands K-major from smem), P^T and dS^T in registers, dV += P^T dO_i and dK += dS^T Q_i (wgmma,
A from registers, B MN-major from smem), stores dS^T to smem (stmatrix) and computes its share of
dQ_i = dS K_j (wgmma, A = dS MN-major, B = K_j MN-major), staged in fp32 in smem; one thread adds
the staged dQ_i to ``dq_accum`` with ``cp.reduce.async.bulk.tensor`` (no atomics in the compute
warps). The pre and post roles are the standard ones (``templates/partials/bwd_prepost.cu.j2``).

A v head dim of its own (``head_dim_v``, any pair of multiples of 8 up to 128; past 128 the split tile below): V_j, the dO_i slots and dV~ are
dv wide, dP^T = V_w dO_i^T runs its k loop over dv, the pre kernel's D = rowsum(dO o O) over dv;
S^T, dK~ and dQ_i keep d. The Q block is the wider dim's (:func:`default_block_r`), d = 64 with a
wider dv takes one consumer warpgroup (:func:`default_warps`), and a tile whose S^T / dP^T /
fragments / dK~ / dV~ exceed :data:`BWD_ACC_REGS` is declined by name.

Softcap and ALiBi (``templates/partials/score_mod.cuh``, ``ScoreParams`` per q head): P^T =
exp2(score_fwd(S^T) log2 e - lse log2 e) from the raw S^T; with softcap dS^T = P^T (dP^T - D) (1 - tanh^2)
(``score_grad_raw``) needs the raw S^T, so P^T and dS^T are one pass once dP^T has retired (no early
dV~, :func:`dv_early`); ALiBi keeps :func:`acc_regs` within :data:`BWD_ALIBI_REGS` (d = 64: 64 Q rows,
one consumer warpgroup).

Dropout (``templates/wgmma/dropout.cuh``, the other families' keep bits): the step's keep bits are
computed while S^T and dP^T run (the four lanes holding a Philox call's four keys transpose their bits in
two shuffles), P^T o Z goes into dV~'s A fragments, the dropped dP^T are zeroed and 1 / (1 - p) joins the
scale of dS^T = P^T (dP^T o Z / (1 - p) - D), dV~ takes 1 / (1 - p) before its epilogue; no early dV~. The
tile keeps :func:`acc_regs` within :data:`BWD_DROPOUT_REGS` (d = 64: 64 x 64 on one consumer warpgroup),
with ALiBi within :data:`BWD_DROPOUT_ALIBI_REGS` (d = 96 and 128 are declined).

Head dims past 128 (d = 192 / 256, or such a dv; or d = 96 / 128 with the mask or a bias beside another per-element
feature, :func:`one_acc_declines`; :func:`split_dkv`): FlashAttention-3's 64 x 64 tile on two
consumer warpgroups that both take the block's 64 K/V rows (``templates/wgmma/bwd_split.cu.j2``, selected by the
``SPLIT_DKV`` constant): warpgroup 0 computes S^T, dP^T, dS^T (stored for dQ_i) and dK~ += dS^T Q_i, warpgroup 1
S^T again, P^T, dV~ += P^T dO_i and all of dQ_i = dS K_j; each holds one accumulator (:func:`wide_regs` within
:data:`WIDE_REGS`). Shared memory (:func:`wide_smem`) takes three Q_i / dO_i stages where they fit, else two,
else one (:func:`split_stages`: three at d = 192 with dv = 128, two at d = 192, one at d = 256 with dv = 192 or 256).

Packed sequences (``varlen``): K_j / V_j, Q_i / dO_i and the dQ_i reduce-add at the sequence's first
token in maps over the packed tensors ([1, total, H, d]; the family's ``packed_view``); a K/V block
past len_k returns at once; lse_i / D_i of rows past len_q are -inf / 0 (not loaded), so those rows'
P^T, dS^T and staged dQ_i rows are exact zeros and the reduce-add leaves the next sequence's dq_accum
rows as they are (the module docstring of :mod:`fagen.families.wgmma`).

Deterministic (``templates/wgmma/deterministic.cuh``): the same kernel and roles (no ``dq`` kernel),
its main kernel taking ``dq_sem`` (``fagen.abi.DQ_SEM``: int32 per (Q block, batch, q head, copy), zeroed by
the launcher for every call) and a dq_accum of ``fagen.abi.DQ_COPIES`` partial sums per q head. The CTAs run
the highest K/V block first; without a causal mask or a window (and with n_kv <= n_q) K/V block j visits
its Q blocks rotated from Q block j, the adds after the wrap going to copy 1. Before the reduce-add of
(q head, Q block i) the producer's leader spins (``ld.acquire.gpu``) until the counter of its copy holds its
turn (top - j: the K/V blocks of its copy above j that reach i, which arrive before it), and after it waits
until the add is written (``cp.async.bulk.wait_group 0``) and passes the turn (``red.release.gpu.add``): each
copy of dQ_i sums its K/V blocks' tiles in descending order on every run. A CTA waits only on higher K/V blocks
of its (batch, kv head), i.e. lower linear block indices, so the ascending launch order keeps it deadlock-free.
The consumers' tile loop is the plain one. With ALiBi, a window and key padding at d = 128 the tile would
spill (56 bytes): declined by name (:func:`unsupported_reason`).

A bool mask, a bias and its gradient (``attn_mask``, ``bias``, ``bias_grad``; ``templates/wgmma/mask_bias.cuh``):
the thread's elements of S^T are two keys x the step's Q rows, so each is one read (the mask zeroes P^T, the
bias joins ``score_fwd``; the bias alone staged per warp in shared memory and read by ldmatrix, :func:`bias_smem`), at a pointer per key plus 32-bit step offsets on a tile without mask math (rows and
keys inside the sequences), per element with bounds tests in rolled loops otherwise. dBias = dL/ds = P^T (dP^T
- D) (D staged unscaled, the softmax scale applied after it; through the softcap's 1 - tanh^2 after it) is
stored per element with plain stores: each (b, h, row, key) is one step of one CTA. No early dV~
(:func:`dv_early`); the tile keeps :func:`acc_regs` within :data:`BWD_MASK_BIAS_REGS` (d = 64: 64 x 64 on one
consumer warpgroup) and, with another per-element feature beside it, within :data:`BWD_MASK_BIAS_MIX_REGS`
(d = 96 and 128 with such a mix take the split tile instead where it issues fewer than ``mma``,
:func:`one_acc_declines`). The split tile takes them too:
both warpgroups apply the mask / bias to S^T before P^T, warpgroup 0 stores dBias beside dS^T; within
:data:`WIDE_MASK_BIAS_REGS` (d = 192; dv = 256 with the mask only, :data:`WIDE_BIAS_DV_REGS`; d = 256 is
declined), the mask and a bias together and either with dropout and ALiBi declined by name; dBias with softcap
is stored by warpgroup 0's P^T pass (``wg_p`` with ``STORE_DB``, warpgroup 1's renders it false).

What the backward template does not implement is declined by name (:func:`unsupported_reason`),
so ``impl=None`` resolves such specs to ``mma``.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fagen.abi import BWD_MAIN, BWD_POST, BWD_PRE, DQ_COPIES, DQ_SEM, TENSORMAP, Role
from fagen.families.base import Constant, FamilySpec, Launch, Reason
from fagen.families.wgmma.heads import padded_reason
from fagen.families.wgmma.panels import k16_steps, packed_view, padded_dim
from fagen.layout import SmemLayout, place

__all__ = ["BWD_ACC_REGS", "BWD_ALIBI_REGS", "BWD_DROPOUT_ALIBI_REGS", "BWD_DROPOUT_REGS", "dropout_regs", "BWD_TMA", "DEFAULT_BLOCK_R", "acc_regs", "default_block_r", "default_warps", "DQ_GROUP", "DV_EARLY_REGS", "WG_BWD_DET_MAIN", "WG_BWD_MAIN", "bwd_tensor_map_boxes", "dq_split", "BWD_MASK_BIAS_MIX_REGS", "BWD_MASK_BIAS_REGS", "mask_bias_regs", "softcap_rcp",
           "WIDE_BIAS_DV_REGS", "WIDE_MASK_BIAS_REGS", "bias_smem",
           "dq_staging_view", "dv_early", "smem_layout", "tile_work", "unsupported_reason"]

#: Flags the backward template implements (everything else is declined by name).
BWD_FLAGS = frozenset({"causal", "top_left", "window", "key_padding", "softcap", "alibi", "dropout", "varlen",
                       "deterministic", "attn_mask", "bias", "bias_grad"})
#: Q rows per streamed block (block_r) by padded head dim: FlashAttention-3's 128 x 128 at d = 64, 64 x 128 at
#: d = 96 and 128 (every head dim computes in its padded dim's tiles, padded_dim: d = 8 .. 64 as 64, 72 .. 128
#: as 128; past 128 the split tile).
DEFAULT_BLOCK_R = {64: 128, 96: 64, 128: 64}
#: Head dims past 128 (Gemma's 256, MLA's 192 with head_dim_v 128): the split tile (:func:`split_dkv`).
WIDE_HEAD_DIMS = (192, 256)
#: The backward's tensor-map parameters: (parameter, tensor argument, rows of the box, smem swizzle).
#: q, do: one panel (64 elements) x block_r rows; k, v: one panel x block_c rows; dq_accum (fp32):
#: the staging tile, no swizzle, over :func:`dq_staging_view` (DQ_GROUP columns x block_r rows x
#: head_dim / DQ_GROUP groups: one reduce-add per step).
BWD_TMA = (("tma_q", "q", "block_r", 128), ("tma_k", "k", "block_c", 128), ("tma_v", "v", "block_c", 128),
           ("tma_do", "do", "block_r", 128), ("tma_dqa", "dq_accum", "block_r", 0))
#: fp32 columns of one dQ_i staging group (32 bytes): a warp's 8-byte stores of an accumulator
#: fragment (8 rows x 8 columns) fill 256 contiguous bytes, so they meet no bank conflict.
DQ_GROUP = 8
WG_BWD_MAIN = Role("main", BWD_MAIN.params + tuple((TENSORMAP, name) for name, *_ in BWD_TMA), "k", "block_c",
                   grid_heads="kv")
#: The deterministic backward's main kernel: WG_BWD_MAIN and the dQ turn counters (``fagen.abi.DQ_SEM``);
#: no dq role (dQ_i's reduce-adds take their turns, ``templates/wgmma/deterministic.cuh``).
WG_BWD_DET_MAIN = Role("main", WG_BWD_MAIN.params + (DQ_SEM,), "k", "block_c", grid_heads="kv")


def unsupported_reason(fs: FamilySpec) -> str | None:
    """Why the backward template cannot take the spec (the common checks are the family's)."""
    extra = sorted(fs.flags - BWD_FLAGS)
    if extra:
        return f"{extra[0]}: the wgmma backward does not implement it yet (implemented: {sorted(BWD_FLAGS)})"
    if (why := padded_reason(fs)) is not None:
        return why
    if (not split_dkv(fs) and fs.head_dim > 96 and all(fs.has(f) for f in ("deterministic", "alibi", "window",
                                                                          "key_padding"))):
        return (f"deterministic with alibi, window and key_padding at head_dim={fs.head_dim}: the wgmma backward's "
                f"64 x 128 tile would spill (56 bytes at head_dim=128)")
    if split_dkv(fs):
        wide = max(padded_dim(fs.head_dim), padded_dim(fs.dv)) > 128
        which = (f"the wgmma backward's split tile (head_dim={fs.head_dim}, head_dim_v={fs.dv}: "
                 f"{'past 128' if wide else 'no one-accumulator tile fits its features'})")
        if wide and fs.has("attn_mask") and fs.has("bias"):
            return (f"attn_mask with bias: {which} would spill (both operands' pointers beside S^T, dP^T and dK~: 16 "
                    f"to 72 bytes at head_dim=160 and 192, 24 to 32 at head_dim=64, head_dim_v=192)")
        if not wide and fs.has("bias") and fs.has("alibi"):
            return f"bias with alibi beside attn_mask: {which} would spill (84 bytes at head_dim=128)"
        if not wide and fs.has("dropout") and (why := _narrow_dropout_spill(fs)) is not None:
            return f"dropout beside {'attn_mask' if fs.has('attn_mask') else 'bias'} with {why}: {which} would spill"
        mb = "bias" if fs.has("bias") else "attn_mask" if wide and fs.has("attn_mask") else None
        if mb and fs.has("dropout") and fs.has("alibi"):
            return (f"{mb} with dropout and alibi: {which} would spill (up to 140 bytes at head_dim=192, 232 at "
                    f"head_dim_v=256)")
        return wide_reason(fs)
    return None


def _narrow_dropout_spill(fs: FamilySpec) -> str | None:
    """What makes the split tile at d = 96 / 128 (:func:`one_acc_declines`) spill beside dropout and the mask or a
    bias, or None. benchmarks/sass_cost.py over 384 such specs (d = 96, 128, d / dv = 64 / 128 and 128 / 64, fp16
    and bf16, with and without causal + varlen, a window + key padding, the deterministic order): 27 spill, 8 to
    196 bytes, every one with dropout: with a window or key padding (8 to 88 bytes), the deterministic order
    beside softcap or ALiBi (160 / 196), a v head dim of its own with varlen or the deterministic order (32 to
    124); none of the 80 others with dropout."""
    if fs.has("window") or fs.has("key_padding"):
        return "a window or key padding (8 to 88 bytes)"
    if fs.has("deterministic") and (fs.has("softcap") or fs.has("alibi")):
        return "the deterministic order and softcap or alibi (160 to 196 bytes)"
    if fs.dv != fs.head_dim and (fs.has("varlen") or fs.has("deterministic")):
        return f"head_dim_v={fs.dv} and varlen or the deterministic order (32 to 124 bytes)"
    return None


def default_block_r(fs: FamilySpec) -> int:
    """The Q rows of the default tile: DEFAULT_BLOCK_R of the wider head dim (a v head dim of its own
    counts: its dO_i slots, dP^T's k loop and dV~'s registers)."""
    if split_dkv(fs):
        return WIDE_BLOCK
    br = min(DEFAULT_BLOCK_R.get(padded_dim(fs.head_dim), 64), DEFAULT_BLOCK_R.get(padded_dim(fs.dv), 64))
    if (cap := one_acc_cap(fs)) is not None and _acc_regs(fs, br) > cap:  # d = 64: 64 Q rows, one warpgroup
        return 64  # (default_warps): ALiBi, dropout, the mask or a bias
    return br


def default_block_c(fs: FamilySpec) -> int:
    """The K/V rows of the default tile: 64 per consumer warpgroup, or the split tile's 64 (:func:`split_dkv`)."""
    return WIDE_BLOCK if split_dkv(fs) else 16 * fs.num_warps


def config_reason(fs: FamilySpec) -> Reason | None:
    if split_dkv(fs):
        return wide_config_reason(fs)
    if fs.block_c != 16 * fs.num_warps:
        return Reason("block_c", f"block_c={fs.block_c} must be 16 x num_warps={fs.num_warps} "
                                 f"(wgmma backward: each consumer warpgroup owns 64 K/V rows)")
    if fs.block_r not in (64, 128):
        return Reason("block_r", f"block_r={fs.block_r} must be 64 or 128 (wgmma backward: m64 tiles of dQ_i, "
                                 f"N = block_r of S^T)")
    if dq_split(fs)[1] % 64:
        return Reason("block_r", f"block_r={fs.block_r} with num_warps={fs.num_warps} at head_dim={fs.head_dim}: "
                                 f"the {fs.num_warps // 4} consumer warpgroups cannot split dQ_i's "
                                 f"{padded_dim(fs.head_dim)} columns into 64-column wgmmas (wgmma backward)")
    for cap, label, beside in one_acc_bounds(fs):
        if (regs := acc_regs(fs)) > cap:
            return Reason("block_r", f"block_r={fs.block_r} with head_dim={fs.head_dim}{label}: S^T, dP^T, their "
                                     f"fragments, dK~ and dV~ take {regs} fp32 registers per consumer thread, more than "
                                     f"{cap}{beside} (wgmma backward: ptxas would spill)")
    return None


#: fp32 registers per consumer thread a backward tile with a v head dim of its own may ask for
#: (:func:`acc_regs`): 256 is d = 64's 128 x 128 tile (no spill); d = 64, dv = 128 at 128 Q rows
#: (288) spills 752 bytes. The head_dim = head_dim_v tiles are left as they were.
BWD_ACC_REGS = 256
#: The same bound with ALiBi (its distance per element of P^T, partials/score_mod.cuh's alibi_dist): d = 64's
#: 128 x 128 tile (256) spills 88 bytes (24 with the 64-bit distances of before), d = 128's
#: 64 x 128 (224) none; d = 64 takes 64 Q rows on one warpgroup.
BWD_ALIBI_REGS = 224
#: The bound with dropout (the step's keep bits, computed while S^T and dP^T run, and the Philox state;
#: no early dV~, :func:`dv_early`): d = 64's 128 x 128 tile (256) spills 184 bytes, 64 x 64 on one
#: warpgroup (160) none; d = 96's and d = 128's 64 x 128 (224) none.
BWD_DROPOUT_REGS = 224
#: With dropout and ALiBi together: d = 128's 64 x 128 (224) spills 40 bytes (with ALiBi's float distance as with
#: its 64-bit one before), d = 96's none now (8 before), d = 64's 64 x 64 (160) none; d = 96 shares d = 128's bound
#: (the same registers by acc_regs), so d = 96 and 128 with both go to ``mma``.
BWD_DROPOUT_ALIBI_REGS = 160
#: The bound with attn_mask or a bias (their per-key pointers, a step's reads, dBias's stores; no early dV~,
#: :func:`dv_early`): d = 64's 128 x 128 tile (256) spills 48 bytes with the mask, 64 x 64 on one warpgroup
#: (160) none; d = 128's 64 x 128 (224) none with the mask or a bias (through shared memory, :func:`bias_smem`; 12
#: bytes when read per element) and 48 with its gradient (the four dS^T stmatrix addresses reloaded once per step):
#: left as they are, no smaller Q block exists and ``mma`` issues 3.1x the instructions.
BWD_MASK_BIAS_REGS = 224
#: The bound with attn_mask or a bias beside another per-element feature (the other of the two, softcap, ALiBi,
#: dropout): d = 128's 64 x 128 tile (224) spills 124 bytes with the mask, a bias and its gradient, 436 with
#: softcap beside them, 72 with dropout and a bias, 8 with dropout and the mask (d = 96 alike); d = 64's 64 x 64
#: (160) none. So d = 96 and 128 with such a mix go to ``mma``.
BWD_MASK_BIAS_MIX_REGS = 160


def mask_bias_regs(fs: FamilySpec) -> int:
    """The registers bound (:func:`acc_regs`) of a tile with attn_mask or a bias: BWD_MASK_BIAS_MIX_REGS with
    another per-element feature beside it, else BWD_MASK_BIAS_REGS."""
    mix = sum(fs.has(f) for f in ("attn_mask", "bias", "softcap", "alibi", "dropout")) > 1
    return BWD_MASK_BIAS_MIX_REGS if mix else BWD_MASK_BIAS_REGS


def dropout_regs(fs: FamilySpec) -> int:
    """The registers bound (:func:`acc_regs`) of a tile with dropout: BWD_DROPOUT_ALIBI_REGS with ALiBi, else
    BWD_DROPOUT_REGS."""
    return BWD_DROPOUT_ALIBI_REGS if fs.has("alibi") else BWD_DROPOUT_REGS


def acc_regs(fs: FamilySpec) -> int:
    """fp32 registers per consumer thread of the backward's S^T and dP^T (block_r / 2 each), the P^T and
    dS^T fragments (block_r / 4 each) and the dK~, dV~ accumulators (padded head dims / 2)."""
    return _acc_regs(fs, fs.block_r)


def _acc_regs(fs: FamilySpec, block_r: int) -> int:
    return block_r + block_r // 2 + (padded_dim(fs.head_dim) + padded_dim(fs.dv)) // 2


def default_warps(fs: FamilySpec) -> int:
    """Two consumer warpgroups (the family's rule), but one where the default Q block (64 rows) at
    d = 64 leaves two warpgroups no 64-column share of dQ_i (d = 64 with a wider v head dim)."""
    if split_dkv(fs):
        return 8
    return 4 if padded_dim(fs.head_dim) == 64 and default_block_r(fs) == 64 else 8


def dq_split(fs: FamilySpec) -> tuple[int, int]:
    """(m64 tiles of dQ_i, head-dim columns) each consumer warpgroup computes: the Q rows are split
    between the warpgroups while there are enough m64 tiles, else the (padded) head dim."""
    wgs, mtiles, d = fs.num_warps // 4, fs.block_r // 64, padded_dim(fs.head_dim)
    if split_dkv(fs):  # the dV~ warpgroup computes all of dQ_i
        return mtiles, d
    if mtiles >= wgs:
        return mtiles // wgs, d
    return 1, d * mtiles // wgs


def smem_layout(fs: FamilySpec, stages: int, staged_bias: bool = False) -> SmemLayout:
    """The backward's shared memory; ``staged_bias``: the bias staged per consumer warp (codegen knob
    ``bias_smem``, starting at :func:`bias_smem`)."""
    d, dv, e, br, bc = padded_dim(fs.head_dim), padded_dim(fs.dv), fs.itemsize, fs.block_r, fs.block_c
    return place([
        ("k", "T", bc * d, e, 1024),
        ("v", "T", bc * dv, e, 1024),  # V_j, dO_i: the v head dim (head_dim_v)
        ("q", "T", stages * br * d, e, 1024),
        ("dout", "T", stages * br * dv, e, 1024),
        ("ds", "T", bc * br, e, 1024),
        ("dq", "float", br * fs.head_dim, 4, 128),  # head_dim / DQ_GROUP groups of block_r x DQ_GROUP
        ("lse", "float", stages * br, 4),
        ("dlt", "float", stages * br, 4),
        ("bars", "unsigned long long", 3 + 2 * stages, 8),
        # a step's (q head, first row; deterministic: its turn counter and turn) from its loads to its dQ_i reduce-add
        ("dqc", "int", (4 if fs.has("deterministic") else 2) * stages, 4),
        ("exact", "int", stages, 4),  # a step has a huge row: its P takes lse_lo (partials/common.cuh)
        ("lse_lo", "float", br, 4),  # an exact step's rows' lse_lo (0 where none), staged by the consumers
    ] + ([("bias", "T", bc * br, e, 128)] if staged_bias else []))  # per warp: its 16 keys x block_r Q rows


def bias_smem(fs: FamilySpec) -> bool:
    """Whether the backward stages the bias in shared memory (``templates/wgmma/mask_bias.cuh``, BIAS_SMEM): each
    consumer warp copies its 16 keys x block_r Q rows (16-byte cp.async where aligned) and reads them in S^T's layout
    with ldmatrix.trans, four elements an instruction with no per-element address (the per-element loads held 32
    values and their addresses beside S^T, dP^T, dK~ and dV~: ptxas spilled). Where the bias is the only score
    modification (with softcap / ALiBi score_fwd reads it) and on the one-accumulator tiles (not :func:`split_dkv`)."""
    return fs.has("bias") and not (fs.has("softcap") or fs.has("alibi")) and not split_dkv(fs)


def roles(deterministic: bool = False) -> tuple[Role, ...]:
    return (BWD_PRE, WG_BWD_DET_MAIN if deterministic else WG_BWD_MAIN, BWD_POST)


def launch(fs: FamilySpec, role: Role) -> Launch:
    if role.name == "main":
        return Launch((fs.num_threads + 128, 1, 1), fs.block_c)
    return Launch((fs.num_threads, 1, 1), fs.num_warps)  # pre / post: one warp per row


#: fp32 registers per consumer thread the early dV~ wgmma may keep live (of CONSUMER_REGS = 240):
#: S^T and dP^T (block_r), the P^T fragments (block_r / 4), dK~ and dV~ ((head_dim + head_dim_v) / 2);
#: above it ptxas spills.
DV_EARLY_REGS = 208


def dv_early(fs: FamilySpec) -> bool:
    """Whether dV~ += P^T dO_i is issued before dS^T is computed (overlapping it), not with dK~."""
    if fs.has("softcap"):  # P^T and dS^T in one pass once dP^T retired (dS^T needs q.k for 1 - tanh^2)
        return False
    if fs.has("dropout"):  # the keep bits and the Philox state beside them: ptxas would spill
        return False
    if fs.has("attn_mask") or fs.has("bias"):  # the mask / bias / dBias pointers beside them: ptxas would spill
        return False
    return fs.block_r + fs.block_r // 4 + (padded_dim(fs.head_dim) + padded_dim(fs.dv)) // 2 <= DV_EARLY_REGS


def softcap_rcp(fs: FamilySpec) -> bool:
    """Whether softcap's tanh takes its argument as q.k (scale / softcap), one multiply per element, rather than the
    IEEE division of q.k scale by softcap (about ten instructions with its check and out-of-line slow path): the
    codegen knob ``softcap_rcp``'s starting point, the split tile's (:func:`split_dkv`). benchmarks/sass_cost.py,
    fp16, instructions per 1e6 FLOPs, division -> multiply: d = 192 1455 -> 455, d = 256 causal 1125 -> 377, 0 spills;
    the one-accumulator tile spills with the multiply (d = 128: 56 bytes, 112 causal + varlen, 124 with dropout;
    d = 64: 496), its division keeping ptxas's schedule of P^T and dS^T within the registers, so it keeps the
    division, as d = 256 with dropout does (8 bytes with the multiply, bf16 and fp16). The backward's tanh is the SFU's (``tanh.approx``, 2^-11 relative), far coarser than either argument."""
    return fs.has("softcap") and split_dkv(fs) and not (fs.has("dropout") and padded_dim(fs.head_dim) > 192)


def constants(fs: FamilySpec, knobs: Mapping[str, int]) -> tuple[Constant, ...]:
    """The backward's template constants; ``knobs``: the spec's codegen knob values
    (fagen.families.wgmma.codegen)."""
    mt, cols = dq_split(fs)
    wide = (Constant("SPLIT_DKV", "bool", True, "warpgroup 0 holds dK~, warpgroup 1 dV~ and computes dQ_i "
                     "(head dims past 128)"),
            Constant("DQ_LAG", "int", dq_lag(fs), "steps between a step's loads and the reduce-add of an earlier "
                     "step's dQ_i")) if split_dkv(fs) else ()
    return wide + (
        Constant("DQ_MT", "int", mt, "m64 tiles of dQ_i per consumer warpgroup"),
        Constant("DQ_COLS", "int", cols, "head-dim columns of dQ_i per consumer warpgroup"),
        Constant("DQ_GROUP", "int", DQ_GROUP, "fp32 columns per dQ_i staging group (one TMA reduce-add box)"),
        Constant("DV_EARLY", "bool", bool(knobs["dv_early"]), "dV~ += P^T dO_i issued while dP^T is in flight"),
        Constant("DS_ROW_XOR", "bool", bool(knobs["ds_row_xor"]), "dS^T's stmatrix addresses: one held address "
                 "XORed per k step"),
        Constant("LSE_ROWS_ROLLED", "bool", bool(knobs["lse_rows_rolled"]), "the producer's lse_i / D_i rows in a "
                 "rolled loop"),
    ) + ((Constant("BIAS_SMEM", "bool", True, "the bias staged in shared memory per consumer warp, read by "
                   "ldmatrix"),) if knobs["bias_smem"] else ()) + (
        (Constant("SOFTCAP_RCP", "bool", True, "softcap's tanh argument as q.k (scale / softcap): one multiply, no "
                  "division"),) if knobs.get("softcap_rcp") else ()) + (
        (Constant("ALIBI_FOLD", "bool", True, "P^T's exp2 argument with ALiBi: the scale in the exponent's FFMA"),)
        if knobs.get("alibi_fold") else ()) + (
        (Constant("DQ_COPIES", "int", DQ_COPIES, "partial sums of dQ per q head in dq_accum, each added to in an "
                  "order of its own (fagen.abi.DQ_COPIES)"),) if fs.has("deterministic") else ())


def bwd_tensor_map_boxes(fs: FamilySpec) -> dict[str, tuple[int, ...]]:
    """The TMA box of each tensor-map parameter, torch order ([B, N, H, d]; dq_accum's over
    :func:`dq_staging_view`)."""
    rows = {"block_r": fs.block_r, "block_c": fs.block_c}
    out: dict[str, tuple[int, ...]] = {name: (1, rows[r], 1, 64) for name, _, r, swz in BWD_TMA if swz}
    out["tma_dqa"] = (1, 1, fs.head_dim // DQ_GROUP, fs.block_r, DQ_GROUP)  # over dq_staging_view
    return out


def dq_staging_view(dq_accum: Any) -> Any:
    """``dq_accum`` ([B, Nq, H, d] fp32, head dim contiguous) as the 5-D view its tensor map
    takes: [B, H, d / DQ_GROUP, Nq, DQ_GROUP] (torch order), i.e. innermost first DQ_GROUP columns,
    then rows, then column groups -- the order of the staging tile in shared memory, so one
    reduce-add of box (DQ_GROUP, block_r, d / DQ_GROUP) takes the whole tile. Its outer strides
    are not monotonic (rows before column groups), which tensor maps allow."""
    b, n, h, d = dq_accum.shape
    sb, sn, sh, _ = dq_accum.stride()
    return dq_accum.as_strided((b, h, d // DQ_GROUP, n, DQ_GROUP), (sb, sh, DQ_GROUP, sn, 1))


def tensor_maps(fs: FamilySpec, role: Role, tensors: Mapping[str, Any]) -> dict[str, Any]:
    from fagen.tma import tensor_map_for

    if role.name != "main":
        return {}
    boxes = bwd_tensor_map_boxes(fs)
    view = {"dq_accum": dq_staging_view}
    packed = packed_view if fs.has("varlen") else (lambda x: x)  # varlen: [total, H, d] as [1, total, H, d]
    return {name: tensor_map_for(view.get(arg, lambda x: x)(packed(tensors[arg])), boxes[name], swizzle=swz)
            for name, arg, _, swz in BWD_TMA}


def tile_work(fs: FamilySpec) -> dict[str, float]:
    """Per consumer warp and tile pair: HGMMA instructions (S^T: d/16, dP^T: dv/16; dV and dK:
    block_r/16 each, per warpgroup; dQ_i: block_c/16 per m64 tile and 64 columns of the warpgroup's
    share) — every warp of a warpgroup issues each of its wgmmas."""
    d, dv, br, bc = 16 * k16_steps(fs.head_dim), 16 * k16_steps(fs.dv), fs.block_r, fs.block_c
    mt, cols = dq_split(fs)
    if split_dkv(fs):  # per warp of either warpgroup, on average: S^T twice, dP^T, dV~, dK~, dQ_i
        return {"HGMMA": (2 * d + dv) / 32 + br / 16 + (cols // 64) * bc / 32}
    return {"HGMMA": (d + dv) / 16 + 2 * br / 16 + mt * (cols // 64) * bc / 16}


# ---- the wide tile: head dims past 128 -------------------------------------------------------------
#: Q rows x K/V rows of the wide tile (FlashAttention-3's 64 x 64 at d = 256; a consumer warpgroup
#: holds a whole accumulator of d / 2 fp32 registers per thread, so neither holds both).
WIDE_BLOCK = 64
#: fp32 registers per consumer thread the wide tile's dK~ warpgroup may ask for (:func:`wide_regs`): S^T,
#: dP^T (block_r / 2 each), the dS^T fragments (block_r / 4) and dK~ (padded head_dim / 2): 208 at d = 256
#: (benchmarks/sass_cost.py: no spill at d = 256 with causal, softcap, ALiBi, dropout, varlen, a window, key
#: padding, each and softcap with ALiBi or dropout; 176 at d = 192, and the dV~ warpgroup's 176 at dv = 256).
WIDE_REGS = 208
#: The bound with dropout and ALiBi together (the keep bits and ALiBi's distances beside them):
#: d = 256's dK~ warpgroup (208) spilled 32 bytes causal (re-measured at NVRTC 13: none plain or causal, 16 bytes
#: with causal and varlen, 140 with a window, key padding and the deterministic order; with ALiBi's float distance
#: none plain, 128 with causal and varlen, 124 with a window, key padding and the deterministic order); d = 192's (176) and
#: dv = 256's dV~ warpgroup (176) none, with softcap and causal too. So d = 256 with both goes to ``mma``.
WIDE_DROPOUT_ALIBI_REGS = 176


#: The bound with attn_mask or a bias (their per-key pointers, a step's reads, dBias's stores in the dK~
#: warpgroup; benchmarks/sass_cost.py): d = 192's dK~ warpgroup (176) does not spill with the mask, a bias or a
#: bias with its gradient, causal, a window, key padding, varlen, deterministic, or beside softcap, ALiBi or
#: dropout (d = 192, dv = 128); dv = 256's dV~ warpgroup (176) neither with the mask (a bias:
#: :data:`WIDE_BIAS_DV_REGS`); d = 256's dK~
#: warpgroup (208) spills 64 bytes with the mask causal, 48 with a bias. So d = 256 with either goes to ``mma``.
#: Declined by name (:func:`unsupported_reason`): the mask and a bias together (16 to 72 bytes at d = 160 and 192,
#: 212 at d = 128, dv = 256) and either beside dropout and ALiBi (up to 140 bytes at d = 192). dBias
#: with softcap: none at d = 96, 128, 160 and 192 (dv 128 to 192; causal + varlen, a window + key padding).
WIDE_MASK_BIAS_REGS = 176
#: The dV~ warpgroup's bound with a bias (:func:`wide_regs`, its second): dv = 256's 176 spills 8 bytes at
#: d = 128 and 444 at d = 192 with the bias and its gradient (with the mask, causal: none); dv = 192's 144 none.
WIDE_BIAS_DV_REGS = 144


#: Registers the split tile's producer warpgroup keeps after ``setmaxnreg.dec`` (the family's 24 spill 16 bytes
#: in its lse_i / D_i loads at d = 192 causal); the consumers keep 232 (:func:`wide_regs` at most 208).
SPLIT_PRODUCER_REGS = 32


def producer_regs(fs: FamilySpec) -> tuple[int, ...]:
    """The producer's registers where the backward's tile asks for its own (the split tile's
    SPLIT_PRODUCER_REGS), else none (the family's PRODUCER_REGS)."""
    return (SPLIT_PRODUCER_REGS,) if fs.direction == "bwd" and split_dkv(fs) else ()


def split_dkv(fs: FamilySpec) -> bool:
    """The wide tile: a head dim past 128, where dK~ and dV~ of 64 K/V rows (d / 2 + dv / 2 fp32 registers
    per thread of a warpgroup, 256 at d = 256) do not fit one warpgroup beside S^T and dP^T. Two consumer
    warpgroups share the block's 64 K/V rows: warpgroup 0 computes S^T, dP^T, dS^T (into shared memory)
    and dK~ += dS^T Q_i; warpgroup 1 computes S^T again, P^T and dV~ += P^T dO_i, then dQ_i = dS K_j over
    the whole head dim (S^T twice: no exchange of P^T through shared memory)."""
    return max(padded_dim(fs.head_dim), padded_dim(fs.dv)) > 128 or one_acc_declines(fs)


def one_acc_bounds(fs: FamilySpec) -> list[tuple[int, str, str]]:
    """The registers bounds (:func:`acc_regs`) of the one-accumulator tile that the spec's features set, in the
    order :func:`config_reason` checks them, each with what its message names: (bound, the features after the
    head dim, what the registers sit beside). ALiBi's, dropout's, the mask's / bias's, a v head dim's."""
    out = [(BWD_ALIBI_REGS, " and alibi", "")] if fs.has("alibi") else []
    if fs.has("dropout"):
        out.append((dropout_regs(fs), ", dropout" + (" and alibi" if fs.has("alibi") else ""), " beside the keep bits"))
    if fs.has("attn_mask") or fs.has("bias"):
        what = " and ".join(f for f in ("attn_mask", "bias", "softcap", "alibi", "dropout") if fs.has(f))
        out.append((mask_bias_regs(fs), f" and {what}", " beside the mask / bias pointers"))
    if fs.dv != fs.head_dim:
        out.append((BWD_ACC_REGS, f", head_dim_v={fs.dv}", ""))
    return out


def one_acc_cap(fs: FamilySpec) -> int | None:
    """The tightest of :func:`one_acc_bounds` (None: no bound)."""
    return min((cap for cap, _, _ in one_acc_bounds(fs)), default=None)


def one_acc_declines(fs: FamilySpec) -> bool:
    """Whether a spec with the mask or a bias takes the split tile at a head dim the one-accumulator tile covers:
    no one-accumulator tile takes it (even its smallest Q block, 64 rows, exceeds :func:`one_acc_cap`: d = 96 and
    128 with the mask or a bias beside softcap, ALiBi, dropout or each other). The split tile's warpgroups hold one
    accumulator each (:func:`wide_regs`: 144 / 112 at d = 128), 0 spills (what spills there is declined by name,
    :func:`unsupported_reason`: a bias with ALiBi beside the mask, some dropout mixes, :func:`_narrow_dropout_spill`). benchmarks/sass_cost.py, d = 128, bf16, instructions per 1e6 FLOPs: the mask and a
    bias with dBias 1070, the mask with softcap 1620, with ALiBi 1333, with dropout 1442 (mma: 2036), a bias with
    dropout and dBias 1515 (mma: 2340); ``mma`` takes no mask beside softcap, ALiBi or a bias at d = 128 (those went
    to ``simt``). Without the mask, a bias beside softcap or ALiBi (mma takes those: softcap and a bias 2341 against
    mma's 1554, with dBias 3111 / 2111, ALiBi and a bias with dBias 2445 / 1987), or without either (dropout with
    ALiBi, the deterministic order with ALiBi) the split tile, which computes S^T and the per-element work in both
    warpgroups, issues more than mma (dropout and ALiBi: 1774 against 1543; with softcap 2615 against 1578):
    those stay declined."""
    if not fs.has("attn_mask") and not (fs.has("bias") and not fs.has("softcap") and not fs.has("alibi")):
        return False
    cap = one_acc_cap(fs)
    return cap is not None and _acc_regs(fs, WIDE_BLOCK) > cap


def wide_regs(fs: FamilySpec) -> tuple[int, int]:
    """fp32 registers per thread of the wide tile's (dK~, dV~) warpgroups: S^T + dP^T + dS^T's fragments +
    dK~, and S^T + P^T's fragments + dV~ (dQ_i's 32 once S^T and P^T are dead)."""
    br = fs.block_r
    return br + br // 4 + padded_dim(fs.head_dim) // 2, br // 2 + br // 4 + padded_dim(fs.dv) // 2


def wide_smem(fs: FamilySpec, stages: int) -> int:
    """Shared-memory bytes of the wide tile's big buffers (the layout adds < 2 KiB): K_j and V_j
    (block_c x (d + dv)), ``stages`` slots of Q_i and dO_i (block_r x (d + dv)), dS^T (block_c x block_r) in
    16 bits, the fp32 dQ_i staging tile (block_r x d)."""
    d, dv, e = padded_dim(fs.head_dim), padded_dim(fs.dv), fs.itemsize
    return e * (WIDE_BLOCK * (d + dv) + stages * WIDE_BLOCK * (d + dv) + WIDE_BLOCK * WIDE_BLOCK) + 4 * WIDE_BLOCK * d


#: Shared memory a CTA of the family may take (sm_90a's 227 KiB opt-in).
WIDE_SMEM = 227 * 1024 - 2048


def split_stages(fs: FamilySpec) -> int:
    """The split tile's default Q_i / dO_i stages: 3 where they fit :data:`WIDE_SMEM` (padded head dims 192 / 64
    or 128, 128 / 192, 64 / 192 or 256: benchmarks/sass_cost.py counts fewer instructions per FLOP on every
    such row measured, d = 192 / dv = 128 376 -> 365, with the features too, 0 spills), else the family's 2
    where they fit, else 1 (d = 256 with dv = 192 or 256: 264 KiB with two, 200 KiB with one at dv = 256; the
    producer then loads step i + 1 once step i's slot is read, overlapping step i's dQ_i: :func:`dq_lag`;
    FlashAttention-3 keeps one dO_i stage at d = 256)."""
    return next((n for n in (3, 2) if wide_smem(fs, n) <= WIDE_SMEM), 1)


def knobs_checked(fs: FamilySpec) -> FamilySpec:
    """``fs`` as the family's knob check sees it: the split tile's one stage (:func:`split_stages`) is taken
    as the family's smallest choice (the knob's choices are 2 and 3 for every other tile)."""
    from dataclasses import replace

    knobs = dict(fs.knobs)
    if split_dkv(fs) and knobs.get("stages") == 1 == split_stages(fs):
        return replace(fs, knobs=tuple(sorted({**knobs, "stages": 2}.items())))
    return fs


def dq_lag(fs: FamilySpec) -> int:
    """Steps the split tile's producer is ahead of the dQ_i it reduce-adds: the family's stages - 1, but 1 with one
    stage (the loads of step i + 1 are issued once step i's slot is read, then step i's dQ_i is added, so the loads
    overlap step i's dQ_i)."""
    return max(dict(fs.knobs).get("stages", split_stages(fs)) - 1, 1)


def wide_reason(fs: FamilySpec) -> str | None:
    """Why the wide tile cannot take the spec's head dims (its stages, else :func:`split_stages`)."""
    stages = dict(fs.knobs).get("stages", split_stages(fs))
    if (need := wide_smem(fs, stages)) > WIDE_SMEM:
        return (f"head_dim={fs.head_dim}, head_dim_v={fs.dv}: the wgmma backward's 64 x 64 tile needs {need} bytes of "
                f"shared memory (K_j, V_j, {stages} Q_i / dO_i stage{'s' if stages > 1 else ''}, dS^T, the fp32 dQ_i "
                f"staging), more than {WIDE_SMEM}")
    return None


def wide_config_reason(fs: FamilySpec) -> Reason | None:
    """The split tile's rules: two consumer warpgroups, 64 x 64, the registers within their bound."""
    if fs.num_warps != 8:
        return Reason("num_warps", f"num_warps={fs.num_warps} must be 8 at head_dim={fs.head_dim}, head_dim_v={fs.dv} "
                                   f"(wgmma backward: a dK~ and a dV~ warpgroup)")
    if fs.block_c != WIDE_BLOCK:
        return Reason("block_c", f"block_c={fs.block_c} must be {WIDE_BLOCK} at head_dim={fs.head_dim}, "
                                 f"head_dim_v={fs.dv} (wgmma backward: both warpgroups take the block's 64 K/V rows)")
    if fs.block_r != WIDE_BLOCK:
        return Reason("block_r", f"block_r={fs.block_r} must be {WIDE_BLOCK} at head_dim={fs.head_dim}, "
                                 f"head_dim_v={fs.dv} (wgmma backward: registers of the dK~ warpgroup)")
    cap = WIDE_DROPOUT_ALIBI_REGS if fs.has("dropout") and fs.has("alibi") else WIDE_REGS
    what = " with dropout and alibi" if cap == WIDE_DROPOUT_ALIBI_REGS else ""
    if fs.has("attn_mask") or fs.has("bias"):
        cap = min(cap, WIDE_MASK_BIAS_REGS)
        what = " with " + " and ".join(f for f in ("attn_mask", "bias", "softcap", "alibi", "dropout") if fs.has(f))
    if fs.has("bias") and (regs := wide_regs(fs)[1]) > WIDE_BIAS_DV_REGS:
        return Reason("block_r", f"block_r={fs.block_r} at head_dim={fs.head_dim}, head_dim_v={fs.dv}{what}: the dV~ "
                                 f"warpgroup's {regs} fp32 registers per thread, more than {WIDE_BIAS_DV_REGS} beside the "
                                 f"bias (wgmma backward: ptxas would spill)")
    if (regs := max(wide_regs(fs))) > cap:
        return Reason("block_r", f"block_r={fs.block_r} at head_dim={fs.head_dim}, head_dim_v={fs.dv}{what}: {regs} "
                                 f"fp32 registers per consumer thread, more than {cap} (wgmma backward: ptxas would spill)")
    return None


def split_tile_work(fs: FamilySpec) -> tuple[dict[str, float], dict[str, float]]:
    """Per warp and tile pair of the split tile's (dK~, dV~) warpgroups: HGMMA of S^T (d / 16), dP^T (dv / 16)
    and dK~ (block_r / 16); of S^T, dV~ (block_r / 16) and dQ_i (d / 64 chunks of block_c / 16)."""
    d, dv, br, bc = 16 * k16_steps(fs.head_dim), 16 * k16_steps(fs.dv), fs.block_r, fs.block_c
    return ({"HGMMA": (d + dv) / 16 + br / 16}, {"HGMMA": d / 16 + br / 16 + (padded_dim(d) // 64) * bc / 16})
