"""Hopper family (sm_90a): a TMA producer warp feeding warpgroup MMAs (wgmma) through an mbarrier pipeline.

Forward: one CTA per (Q block, batch, head) of ``32 * num_warps + 128`` threads. The consumer
warpgroups (``num_warps / 4`` of them, 64 Q rows each: ``block_r = 16 * num_warps``) compute
S = Q K_j^T with ``wgmma`` from shared memory (both operands K-major, 128-byte swizzle),
the online softmax in registers and O += P V_j with ``wgmma`` taking P from registers and V_j
(MN-major) from shared memory. The last warpgroup is the producer: it gives its registers to
the consumers (``setmaxnreg``) and one elected lane of its first warp issues every TMA load:
Q once, then K_j / V_j into ``stages`` slots, K and V in pipelines of their own (FlashAttention-3's
``pipeline_k`` / ``pipeline_v``): each K_j slot and each V_j slot has a "full" mbarrier (1 arrival + the
tile's transaction bytes) and an "empty" one (every consumer thread arrives once its wgmma reading the
tile has retired), so S = Q K_j^T starts once K_j has landed (not K_j and V_j) and a K_j slot is
refilled once S has read it (not once P~ V_j has read V_j). The producer prefetches the three tensor
maps (``prefetch.tensormap``) before its first load. Rows past a sequence's end come from TMA's zero
fill and are masked.

Ping-pong (knob ``pingpong``, :data:`PINGPONG`; FlashAttention-3's ``UsePingPong``): with 1 the two consumer
warpgroups take turns issuing their GEMMs (``templates/wgmma/pingpong.cuh``: named barriers ``BAR_PP + wg``), so one
warpgroup's softmax runs under the other's S = Q K_j^T and P~ V_j. Each tile loop trip waits for its warpgroup's turn
before S and hands the turn over once P~ V is issued; warpgroup 1 hands it to warpgroup 0 before the loop, and
warpgroup 0 takes that last hand-over after it, so every barrier's arrivals are matched when the CTA ends. The two
warpgroups run the same trips (the K/V range is the CTA's Q block's, :func:`pingpong_reason`'s condition: two
consumer warpgroups, the forward). It reorders issue only (the outputs keep their bits); what it buys is a GPU
timing, so its default stays 0 (the runtime autotuner times both values). An elided knob: a spec at 0 does not list it.

Packed sequences (``varlen``: cu_seqlens, the seqlen arguments the max lengths), both directions:
the tensor maps are built per call over each packed tensor as one batch ([1, total, H, d],
:func:`packed_view`; one map per tensor, not per sequence) and a CTA places its boxes at its
sequence's first token (``cu_seqlens[b] + row``). A CTA whose block starts past its sequence's length
returns before any barrier. A box reaching past the sequence's end loads the next sequence's rows
(TMA zero-fills only past the packed tensor's end), so the kernels mask by the sequence's lengths
(``partials/masking.cuh``'s rule on ``fa_seq``'s len_q / len_k): keys past len_k take score -inf (P = 0),
rows past len_q are never stored (backward: lse -inf and D = 0 make their P^T and dS^T exact zeros,
their dQ_i rows exact zeros that the reduce-add adds to the next sequence's rows without changing
them). Those rows enter only multiplied by an exact zero, so a sequence's results do not depend on its
neighbours' finite values; the forward also zeroes its last V_j rows past len_k in shared memory
(after the loop), so its O and lse do not depend on them at all (a non-finite value, 0 x inf, reaches
the backward's neighbouring gradients). The tile loops issue what they issue without varlen
(``benchmarks/sass_cost.py``; docs/performance.md).

A v head dim of its own (``head_dim_v``, MLA: d = 192, dv = 128) is taken natively: S = Q K_j^T
has K = head_dim, O += P V_j has N = head_dim_v (the O accumulator, the V_j slots, their TMA boxes
and the epilogue are dv wide; Q_i's tile is max(d, dv) wide, O goes out through it); the forward
takes any pair of its head dims, the backward too (V_j, dO_i, dV~ and D of dv; a dim past 128 on the
split tile; :mod:`fagen.families.wgmma.bwd`). The tile counts both dims (shared memory) and the
registers the accumulators hold (:data:`FWD_ACC_REGS`, ``bwd.BWD_ACC_REGS``): a tile that cannot
fit is declined by name.

Softcap and ALiBi (``softcap``, ``alibi``), both directions, are the shared score modifications of
``templates/partials/score_mod.cuh``: S takes ``score_fwd`` (the scale, the cap, the slope times
the distance) before the online softmax, which then runs on the final scores (exp2 of s log2 e
less the row max, lse = m + log l) as the ``mma`` family's does, so the families agree; the
backward recomputes P^T from ``score_fwd`` of the raw S^T and takes the softcap's 1 - tanh^2 into
dS^T (``score_grad_raw``). Their per-element work needs registers: the forward's key block keeps
:func:`fwd_acc_regs` within :data:`FWD_SCORE_MOD_REGS` (d = 128: 128 keys; d = 256 and d = 64 with
dv = 256 are declined, so they go to ``mma``), the backward with ALiBi within ``bwd.BWD_ALIBI_REGS``
(d = 64: 64 x 64 on one warpgroup).

Dropout (``dropout``), both directions, draws the other families' keep bits: ``templates/wgmma/dropout.cuh``
on ``templates/partials/philox.cuh``'s Philox stream at the same (batch, head, row, col) counters (the
m64nNk16 accumulator's (row, 2 columns) pairs are mma.m16n8's, so one Philox call serves four elements of
a thread quad). The forward's m, l and lse are the undropped P~'s, O accumulates (P~ o Z) V and takes
1 / (1 - p) with 1 / l; the keep bits beside S, P~ and O keep :func:`fwd_acc_regs` within
:data:`FWD_DROPOUT_REGS` (d = 128: 128 keys; d = 256 is declined, so it goes to ``mma``). The backward:
:mod:`fagen.families.wgmma.bwd`.

The deterministic backward (``deterministic``) keeps the backward's one main kernel (no ``dq`` role):
dQ_i's reduce-adds take turns in ascending K/V block order at per-(Q block, batch, q head) counters
(``templates/wgmma/deterministic.cuh``; :mod:`fagen.families.wgmma.bwd`).

A bool mask and an additive bias (``attn_mask``, ``bias``; the backward's ``bias_grad``), both directions:
``templates/wgmma/mask_bias.cuh`` reads ``partials/masking.cuh``'s data mask and ``partials/score_mod.cuh``'s
bias per accumulator element at the positions inside the sequence (stride 0 = broadcast), never outside
both sequences. The forward's elements 4n and 4n + 1 are two adjacent keys of one row: a tile inside the
rows' bands and the sequences reads them with one 2-byte (mask) / 4-byte (bias) load where the key stride is 1
and the rows aligned (a warp vote), without bounds tests; the mask joins the mask math of every tile (never
full with a data mask: a row every key of which it drops is zero with lse -inf), the bias is the score
modification s = q.k scale + bias (``score_fwd`` with softcap / ALiBi). The other tiles and layouts test and
read per element in rolled loops (the tile's registers stay as they are). The reads beside S and O keep
:func:`fwd_acc_regs` within :data:`FWD_MASK_REGS` / :data:`FWD_BIAS_REGS` / :data:`FWD_MASK_BIAS_MIX_REGS`
(d = 128: 128 keys; d = 256: 64 keys with the mask alone, a bias or the mask beside another feature declined,
so it goes to ``mma``). The backward: :mod:`fagen.families.wgmma.bwd`.

Head dims: every multiple of 8 in 8..256, both directions, each computed in whole 128-byte panels
(:func:`padded_dim`: 64, 128, 192, 256). The tensor maps end at the real head dim, so the TMA loads
zero-fill the tiles' columns past it and the wgmmas at N = the padded dim compute exact zeros there; the
k loops over the head dim take ceil(d / 16) k16 steps (``HEAD_K16`` where d is an odd number of 8-column
groups: the last step's upper 8 columns are zero fill); O, dQ, dK and dV are stored for the real columns
only, and the tiles, register bounds and shared memory are the padded dim's. A padded head dim with softcap,
ALiBi or dropout is taken only where its kernel issues fewer instructions per real FLOP than ``mma``'s
(:mod:`fagen.families.wgmma.heads`, measured), declined by name otherwise.

What the templates do not implement yet is declined by name (``unsupported_reason``,
``features``), so ``KernelSpec(impl=None)`` resolves such specs to ``mma``. The backward is
:mod:`fagen.families.wgmma.bwd`.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from fagen.abi import FWD_MAIN, TENSORMAP, Role
from fagen.families.base import Constant, FamilyBase, FamilySpec, Knob, Launch, PairCost, Reason, sfu_tanh_fits
from fagen.families.codegen import CodegenConfig
from fagen.families.wgmma import bwd
from fagen.families.wgmma.codegen import CODEGEN
from fagen.families.wgmma.cost import pair_cost
from fagen.families.wgmma.heads import padded_reason
from fagen.families.wgmma.panels import PANEL, SWIZZLE, k16_steps, packed_view, padded_dim
from fagen.layout import SmemLayout, place

__all__ = ["ARCH", "FWD_ACC_REGS", "FWD_BIAS_REGS", "FWD_DROPOUT_REGS", "FWD_SOFTCAP_DROPOUT_REGS", "FWD_MASK_ALIBI_REGS", "FWD_MASK_BIAS_MIX_REGS", "FWD_MASK_REGS", "FWD_SCORE_MOD_REGS", "FWD_SCORE_MOD_WIDE_REGS", "HEAD_DIMS", "PINGPONG", "SOFTCAP_SFU", "STAGES", "SUPPORTED_DTYPES", "SWIZZLE", "WGMMA", "WgmmaFamily",
           "fwd_acc_regs", "fwd_regs_cap", "packed_view", "pingpong_reason", "padded_dim", "softcap_sfu_reason", "register_split", "pair_cost", "tensor_map_boxes"]

#: The one target: wgmma and setmaxnreg exist on sm_90a only.
ARCH = "sm_90a"
SUPPORTED_DTYPES = ("float16", "bfloat16")
#: Head dims taken whatever the features (``heads.NATIVE_HEAD_DIMS``); every other multiple of 8 in 8..256 is
#: taken in its padded tiles where that is cheaper than ``mma`` (:mod:`fagen.families.wgmma.heads`). Each smem
#: tile is whole 64-element (128-byte) swizzle panels wide (:func:`~fagen.families.wgmma.panels.padded_dim`);
#: d = 96 fills one and a half: its TMA loads zero-fill columns 96..127.
HEAD_DIMS = (64, 96, 128, 192, 256)
#: Keys per tile of the default forward (``default_tile``).
FWD_BLOCK_C = 192
#: fp32 registers per consumer thread a forward tile with a v head dim of its own may ask for: the O
#: accumulator (padded head_dim_v / 2), S (block_c / 2) and P~ packed (block_c / 8). 184 is the
#: default d = 128 tile's (128 x 192, no spill); ptxas spills 144 bytes at 192 (d = 64 x 256 keys)
#: and at 208 (d = 64, dv = 256 x 128 keys). Such a spec's default tile is shrunk to fit, an
#: explicit one beyond it declined (the head_dim = head_dim_v tiles are left as they were).
FWD_ACC_REGS = 184
#: fp32 registers per consumer thread (:func:`fwd_acc_regs`) a forward tile with softcap or ALiBi may ask
#: for: score_fwd per element (the softcap's IEEE division and tanhf, ALiBi's distance) needs
#: its temporaries beside them. benchmarks/sass_cost.py: 152 (d = 64 x 192 keys) and 144 (d = 128 x 128)
#: do not spill; 168 does (d = 96 x 192 keys: 1000 bytes with softcap, 12 with ALiBi's 64-bit distance of before,
#: 72 with its float one; d = 256 x 64 keys: 104 with ALiBi before), as does d = 128's default 184 (1000 / 12 before,
#: 16 with ALiBi's float distance). Such a spec's default tile is shrunk to
#: fit, a tile beyond it declined. ALiBi alone (no softcap, no bias) takes raw scores, q.k - (slope / scale)
#: |distance| (templates/wgmma/fwd.cu.j2's AF: the scale stays in exp2's FFMA), and needs no registers beyond the
#: plain tile's: d = 128 x 192 keys spills nothing (causal, varlen, sinks, top-left, bf16, dv = 64 too), nor d = 96
#: x 192 or d = 256 x 64 (causal + varlen, sinks, bf16, dv = 256 at d = 64 / 128); with key padding it does (212
#: bytes at d = 128 x 192 keys, 116 with a window at d = 256 x 64, 36 with a window and varlen): ALiBi beside a
#: window or key padding keeps this bound (and FWD_WIDE_O_REGS at head_dim_v 256).
FWD_SCORE_MOD_REGS = 160
#: The bound with softcap and ALiBi together at a head dim past 128 (S's k loop of 12 or 16 wgmmas):
#: d = 192, dv = 128 x 128 keys (144) spills 188 bytes; x 64 keys (104), d = 192 x 64 keys (136) do not.
FWD_SCORE_MOD_WIDE_REGS = 136
#: The bound with dropout (its keep bits and the Philox state beside S, P~ and O; with softcap / ALiBi
#: the tighter of the two): benchmarks/sass_cost.py: d = 128 x 192 keys (184) spills 620 bytes, x 128 keys
#: (144) none; d = 64 x 192 keys (152) and d = 192 x 64 keys (136) none; d = 256 x 64 keys (168) spills 48,
#: so d = 256 with dropout goes to ``mma``.
FWD_DROPOUT_REGS = 160
#: The bound with softcap and dropout together (softcap's exact tanhf in the forward, its temporaries beside
#: the keep bits and the Philox state): d = 64 x 192 keys (152) spills 40 bytes (fp16 and bf16), x 128 keys
#: (112) none; d = 96 / 128 x 128 keys (144) and d = 192 x 64 keys (136) none.
FWD_SOFTCAP_DROPOUT_REGS = 144
#: The bound with attn_mask (its row pointers and a tile's mask bytes, read two keys per load, beside S and O;
#: benchmarks/sass_cost.py): d = 64 x 192 keys (152) does not spill, d = 128 x 192 keys (184) spills 108 bytes,
#: x 128 keys (144) none; d = 256 x 64 keys (168, causal, key padding and varlen too) none, as d = 64, 128 and
#: 192 with dv = 256 x 64 keys (168).
FWD_MASK_REGS = 168
#: The bound with a bias (a tile's bias pairs beside S and O): d = 64 x 192 keys (152) spills 56 bytes, x 128
#: keys (112) none; d = 128 x 192 keys (184) spills 100, x 128 keys (144) none.
FWD_BIAS_REGS = 144
#: The bound with attn_mask or a bias beside another per-element feature (the other of the two, softcap, ALiBi,
#: dropout): d = 96 x 128 keys (144) spills 16 bytes with both, d = 64 x 192 keys (152) 100 with the mask,
#: softcap and dropout; d = 64 x 128 keys (112), d = 128 x 64 keys (104) and d = 192 x 64 keys (136) none.
FWD_MASK_BIAS_MIX_REGS = 136
#: The bound with the mask and ALiBi alone beside it (ALiBi on raw scores, FWD_SCORE_MOD_REGS): d = 128 x 128 keys
#: (144) spills nothing (causal + varlen, key padding, a window, sinks, bf16; d = 96 too), d = 64 x 192 keys (152)
#: 16 bytes. benchmarks/sass_cost.py, d = 128: 805 at 128 keys against 1006 at FWD_MASK_BIAS_MIX_REGS's 64.
FWD_MASK_ALIBI_REGS = 144
#: The bounds where the O accumulator is the wide one (padded head_dim_v 256: 128 fp32 registers per thread, so
#: even 64 keys take 168) with softcap, ALiBi, dropout or a bias: the key block shrinks in 16s below 64
#: (wgmma's N of S; O += P V_j in block_c / 16 k steps). benchmarks/sass_cost.py, d = 256, fp16 and bf16, with
#: and without causal + varlen, a window + key padding: 48 keys (158) do not spill with softcap, a bias, or the
#: mask beside one of them; they spill 32 bytes with dropout, 92 with ALiBi (a window, key padding; the 64-bit
#: distances of before), 60 with
#: softcap and ALiBi, 28 with the mask and ALiBi (causal, varlen); 32 keys (148) spill 64 with softcap, dropout and a bias (causal, varlen), 48 with ALiBi, dropout, the
#: mask and a bias, 24 with all five; 16 keys (138) none. 64 keys (168) spill 48 bytes with dropout, 104 with
#: ALiBi (before; now 40 with a window + key padding, else none). The bounds at smaller head dims above do not carry over: there S is the larger part, here O is.
#: One per-element feature but dropout (the mask alone keeps FWD_MASK_REGS: 64 keys, ALiBi alone without a window or
#: key padding too: FWD_SCORE_MOD_REGS). ALiBi beside a window or key padding is one of these: 48 keys spill nothing
#: (fp16, bf16), 64 keys 116 bytes:
FWD_WIDE_O_REGS = 158
#: ... dropout, or two per-element features or more:
FWD_WIDE_O_MIX_REGS = 148
#: ... dropout and a bias beside softcap or ALiBi:
FWD_WIDE_O_DROPOUT_BIAS_REGS = 138
STAGES = Knob("stages", "s", 2, (2, 3), "K_j / V_j slots of the TMA -> wgmma mbarrier pipeline")
#: FlashAttention-3's ping-pong of the two consumer warpgroups (:func:`pingpong_reason` says where it is legal);
#: elided at its default, so the specs that do not take it keep their names and sources.
PINGPONG = Knob("pingpong", "pp", 0, (0, 1), "the forward's two consumer warpgroups take turns issuing their GEMMs "
                "(named barriers; FlashAttention-3's UsePingPong)", elided=True, model_blind=True)
#: The forward's softcap tanh on the SFU (``tanh.approx.f32``, partials/score_mod.cuh's ``fa_tanh``): about
#: 2.4x fewer instructions per FLOP (d = 128: 1708 -> 719) where ptxas keeps it spill-free, a spill or stack
#: frame at d = 64 with causal, varlen, a window, a mask or a bias; so a searched choice, off by default
#: (:func:`softcap_sfu_reason` says where it is legal). The backward takes the SFU's tanh always.
SOFTCAP_SFU = Knob("softcap_sfu", "sfu", 0, (0, 1), "the forward's softcap tanh on the SFU (tanh.approx.f32) "
                   "instead of libm's tanhf: 1.5-1.7x faster forward on an H200, lse off by up to 2.7e-5 (beyond "
                   "flash-attn's criterion: set by a user, never by the autotuner)", elided=True, numerics=True)
#: Registers the producer warpgroup keeps after ``setmaxnreg.dec`` (the minimum PTX allows).
PRODUCER_REGS = 24
MAX_CONSUMER_REGS = 240
REGS_PER_SM = 65536
#: The forward's tensor-map parameters (the ABI's tensormap kind): Q, K and V, boxes of one
#: panel (64 elements of the head dim) x the block's rows, 128-byte swizzle.
FWD_TMA = (("q", "block_r"), ("k", "block_c"), ("v", "block_c"))
WG_FWD_MAIN = Role("main", FWD_MAIN.params + tuple((TENSORMAP, f"tma_{t}") for t, _ in FWD_TMA), "q", "block_r")


def register_split(num_warps: int, blocks_per_sm: int, producer: int = PRODUCER_REGS) -> tuple[int, int]:
    """(consumer, producer) registers per thread after ``setmaxnreg``: the producer keeps
    PRODUCER_REGS (or ``producer``), the consumers take what the launch leaves them (the registers one block
    owns, ``REGS_PER_SM / blocks_per_sm``, over its threads; at most MAX_CONSUMER_REGS), multiples of 8."""
    consumers = 32 * num_warps
    threads = consumers + 128
    launch = min(255, REGS_PER_SM // (threads * blocks_per_sm)) // 8 * 8
    consumer = min(MAX_CONSUMER_REGS, (launch * threads - producer * 128) // consumers // 8 * 8)
    return consumer, producer


def pingpong_reason(fs: FamilySpec) -> Reason | None:
    """Why the spec's ``pingpong`` value is illegal, or None: 1 needs the forward (``direction == "fwd"``) with
    two consumer warpgroups (``num_warps == 8``), the warpgroups whose GEMM phases it orders."""
    v = fs.knob_values.get(PINGPONG.name, PINGPONG.default)
    if v and (fs.direction != "fwd" or fs.num_warps != 8):
        return Reason("knobs", f"pingpong={v} needs the forward with two consumer warpgroups (direction='fwd', "
                               f"num_warps=8), got direction={fs.direction!r}, num_warps={fs.num_warps}")
    return None


def softcap_sfu_reason(fs: FamilySpec) -> Reason | None:
    """Why the spec's ``softcap_sfu`` value is illegal, or None: 1 needs the forward with softcap on 16-bit
    inputs (fp32 keeps the exact tanh; the backward takes the SFU's without the knob)."""
    v = fs.knob_values.get(SOFTCAP_SFU.name, SOFTCAP_SFU.default)
    if v and not (fs.direction == "fwd" and sfu_tanh_fits(fs)):
        return Reason("knobs", f"softcap_sfu={v} needs the forward with softcap on float16 / bfloat16 inputs, got "
                               f"direction={fs.direction!r}, softcap={fs.has('softcap')}, dtype={fs.dtype!r}")
    return None


def fwd_regs_cap(fs: FamilySpec) -> int | None:
    """The registers bound of the forward's tile (:func:`fwd_acc_regs`): with the wide O accumulator (padded
    head_dim_v 256) and softcap, ALiBi, dropout or a bias, FWD_WIDE_O_REGS, FWD_WIDE_O_MIX_REGS or
    FWD_WIDE_O_DROPOUT_BIAS_REGS; else FWD_SCORE_MOD_REGS with softcap or
    ALiBi, FWD_DROPOUT_REGS with dropout (FWD_SOFTCAP_DROPOUT_REGS beside softcap), FWD_MASK_REGS with attn_mask
    (FWD_MASK_ALIBI_REGS with ALiBi alone beside it, FWD_MASK_BIAS_MIX_REGS with another), FWD_BIAS_REGS with a bias (the
    tighter of those that apply), FWD_ACC_REGS with a v head dim of its own, none otherwise (the plain tiles
    are as they were)."""
    per_element = [f for f in ("softcap", "alibi", "dropout", "bias", "attn_mask") if fs.has(f)]
    # the mask alone (FWD_MASK_REGS), or ALiBi alone without a window or key padding (FWD_SCORE_MOD_REGS: raw scores,
    # the plain tile's registers): not the wide O accumulator's small key blocks
    edges = fs.has("window") or fs.has("key_padding")  # ALiBi on raw scores needs FWD_SCORE_MOD_REGS only beside these
    alibi_light = per_element == ["alibi"] and not edges
    if padded_dim(fs.dv) > 192 and per_element and per_element != ["attn_mask"] and not alibi_light:
        if fs.has("dropout") and fs.has("bias") and (fs.has("softcap") or fs.has("alibi")):
            return FWD_WIDE_O_DROPOUT_BIAS_REGS
        return FWD_WIDE_O_MIX_REGS if fs.has("dropout") or len(per_element) > 1 else FWD_WIDE_O_REGS
    caps = [FWD_DROPOUT_REGS] if fs.has("dropout") else []
    caps += [FWD_MASK_REGS] if fs.has("attn_mask") else []
    caps += [FWD_BIAS_REGS] if fs.has("bias") else []
    if per_element == ["alibi", "attn_mask"]:
        caps.append(FWD_MASK_ALIBI_REGS)
    elif (fs.has("attn_mask") or fs.has("bias")) and len(per_element) > 1:
        caps.append(FWD_MASK_BIAS_MIX_REGS)
    if fs.has("softcap") and fs.has("dropout"):
        caps.append(FWD_SOFTCAP_DROPOUT_REGS)
    if fs.has("softcap") and fs.has("alibi") and padded_dim(fs.head_dim) > 128:
        caps.append(FWD_SCORE_MOD_WIDE_REGS)
    elif fs.has("softcap") or (fs.has("alibi") and edges):
        caps.append(FWD_SCORE_MOD_REGS)  # ALiBi alone: only beside a window or key padding
    if caps:
        return min(caps)
    return FWD_ACC_REGS if fs.dv != fs.head_dim else None


def wide_o_small_keys(fs: FamilySpec) -> bool:
    """Whether the forward's default key block goes below 64 keys with the wide O accumulator (FWD_WIDE_O_REGS):
    where it issues fewer instructions per FLOP than ``mma``, i.e. with the mask or a bias, or dropout or ALiBi
    without softcap. benchmarks/sass_cost.py, d = 256, fp16, wgmma at its key block against mma's default,
    instructions per 1e6 FLOPs: a bias 633 / 1379, the mask and a bias 952 / 2579, softcap and a bias 849 / 2602,
    ALiBi and the mask 1219 / 1892, dropout 1282 / 1554, dropout and ALiBi 1622 / 1736, ALiBi 639 / 943 (48 keys;
    1107 at 32 keys with the 64-bit distances of before); but softcap 1151 / 990, softcap and ALiBi 1231 / 988,
    softcap and dropout 1898 / 1780 (48 or 32 keys: the per-tile work over fewer keys, and the exact tanhf).
    Those keep the 64-key default, which spills, so ``impl=None`` takes ``mma``; a key block the user names is
    still taken within the bounds."""
    if fs.has("attn_mask") or fs.has("bias"):
        return True
    return (fs.has("dropout") or fs.has("alibi")) and not fs.has("softcap")


def fwd_acc_regs(fs: FamilySpec, block_c: int | None = None) -> int:
    """fp32 registers per consumer thread of the forward's O accumulator, S and P~ (FWD_ACC_REGS)."""
    bc = fs.block_c if block_c is None else block_c
    return padded_dim(fs.dv) // 2 + bc // 2 + bc // 8


def tensor_map_boxes(fs: FamilySpec) -> dict[str, tuple[int, int, int, int]]:
    """The TMA box of each tensor-map parameter, torch order ([B, N, H, d]): one head, one panel."""
    rows = {"block_r": fs.block_r, "block_c": fs.block_c}
    return {f"tma_{t}": (1, rows[r], 1, PANEL) for t, r in FWD_TMA}


@dataclass(frozen=True)
class WgmmaFamily(FamilyBase):
    name: str = "wgmma"
    codegen_set: Any = CODEGEN  # its codegen knobs and table (fagen.families.wgmma.codegen)
    preference: int = 5  # preferred over mma where it applies (sm_90a only)
    tile_multiple: int = 64
    block_c_multiple: int = 16  # the forward's key block: wgmma's N of S (the backward's is 16 x num_warps)
    max_block_r: int = 128
    max_block_c: int = 256  # wgmma's N of S = Q K_j^T
    warp_choices: tuple[int, ...] = (4, 8)  # consumer warps: one or two warpgroups (the producer's is added)
    knobs: tuple[Knob, ...] = (STAGES, PINGPONG, SOFTCAP_SFU)
    math_unit: Literal["fp32", "tensor"] = "tensor"
    min_regs_per_thread: int = 255
    features: frozenset[str] = frozenset({"top_left", "window", "sinks", "head_dim_v", "softcap", "alibi",
                                          "dropout", "varlen", "deterministic", "attn_mask", "bias", "bias_grad"})

    def unsupported_reason(self, fs: FamilySpec) -> str | None:
        if fs.arch != ARCH:
            return f"arch={fs.arch}: wgmma and setmaxnreg need {ARCH}"
        if fs.direction == "bwd" and (why := bwd.unsupported_reason(fs)) is not None:
            return why
        if fs.dtype not in SUPPORTED_DTYPES:
            return f"dtype={fs.dtype}: wgmma here takes {' / '.join(SUPPORTED_DTYPES)} operands"
        return padded_reason(fs)

    def softcap_tanh_approx(self, fs: FamilySpec) -> bool:
        """The backward always; the forward where the user's knob ``softcap_sfu`` says so (:data:`SOFTCAP_SFU`:
        its lse leaves flash-attn's criterion)."""
        if fs.direction == "fwd":
            return bool(fs.knob_values.get(SOFTCAP_SFU.name, SOFTCAP_SFU.default)) and sfu_tanh_fits(fs)
        return super().softcap_tanh_approx(fs)

    def config_reason(self, fs: FamilySpec) -> Reason | None:
        if (bad := pingpong_reason(fs) or softcap_sfu_reason(fs)) is not None:
            return bad
        if fs.direction == "bwd":
            return super().config_reason(bwd.knobs_checked(fs)) or bwd.config_reason(fs)
        bad = super().config_reason(fs.with_tile(fs.block_r, 64)) if fs.block_c % 16 == 0 else None
        if bad is not None:
            return bad
        if fs.block_c % 16 or not 16 <= fs.block_c <= self.max_block_c:
            return Reason("block_c", f"block_c={fs.block_c} must be a multiple of 16 in 16..{self.max_block_c} "
                                     f"({self.name}: wgmma N of S = Q K_j^T, k16 steps of O += P V_j)")
        if fs.block_r != 16 * fs.num_warps:
            return Reason("block_r", f"block_r={fs.block_r} must be 16 x num_warps={fs.num_warps} "
                                     f"({self.name}: each consumer warpgroup owns 64 Q rows)")
        cap = fwd_regs_cap(fs)
        if cap is not None and (regs := fwd_acc_regs(fs)) > cap:
            what = f"head_dim_v={fs.dv}" if cap == FWD_ACC_REGS else "softcap / alibi"
            if fs.has("dropout"):
                what = "dropout" if not (fs.has("softcap") or fs.has("alibi")) else "softcap / alibi and dropout"
            if fs.has("attn_mask") or fs.has("bias"):
                what = " and ".join(([what] if cap != FWD_ACC_REGS and (fs.has("softcap") or fs.has("alibi")
                                                                         or fs.has("dropout")) else [])
                                    + [f for f in ("attn_mask", "bias") if fs.has(f)])
            return Reason("block_c", f"block_c={fs.block_c} with {what}: the O accumulator, S and P~ "
                                     f"take {regs} fp32 registers per consumer thread, more than {cap} "
                                     f"({self.name}: ptxas would spill)")
        return None

    def knob_default(self, knob: Knob, fs: FamilySpec) -> int:
        """The knobs' defaults; the backward's split tile takes three Q_i / dO_i stages where they fit, one where
        two do not (``bwd.split_stages``)."""
        if knob is STAGES and fs.direction == "bwd" and bwd.split_dkv(fs):
            return bwd.split_stages(fs)
        return knob.default

    def tile_caps(self, fs: FamilySpec) -> tuple[int, int]:
        """The backward's rule (fagen.families.wgmma.bwd); the forward's key block within its registers bound
        (:meth:`default_tile`: FWD_BLOCK_C shrunk within :func:`fwd_regs_cap`), so the explain page names the cap."""
        if fs.direction == "bwd":
            return bwd.default_block_r(fs), bwd.default_block_c(fs)
        return 16 * fs.num_warps, self.default_tile(fs, 0)[1] if fwd_regs_cap(fs) is not None else self.max_block_c

    def default_tile(self, fs: FamilySpec, sram_bytes: int) -> tuple[int, int] | None:
        """64 Q rows per consumer warpgroup x FWD_BLOCK_C keys (then shrunk by 64 until it fits):
        the per-tile work outside the per-element softmax (the O rescale, the row reductions'
        shuffles, the mbarrier handshake, descriptor set-up) spread over 1.5x the keys of a
        128-key tile (benchmarks/sass_cost.py: d64 854 -> 772, d128 474 -> 415 instructions per
        1e6 FLOPs), at no spill: S (96 fp32 per thread) + O (d / 2) + P~ fit the consumers' registers."""
        if fs.direction == "bwd":
            return self.tile_caps(fs)  # the backward's rule: fagen.families.wgmma.bwd
        bc = FWD_BLOCK_C  # a wide v head dim of its own, softcap / ALiBi: fewer keys, so the registers suffice
        cap = fwd_regs_cap(fs)
        while cap is not None and bc > self.tile_multiple and fwd_acc_regs(fs, bc) > cap:
            bc -= self.tile_multiple
        while cap is not None and wide_o_small_keys(fs) and bc > self.block_c_multiple and fwd_acc_regs(fs, bc) > cap:
            bc -= self.block_c_multiple  # the wide O accumulator (FWD_WIDE_O_REGS): below 64 keys, in 16s
        return 16 * fs.num_warps, bc

    def default_warps(self, fs: FamilySpec) -> int:
        """Two consumer warpgroups (FlashAttention-3's shape), both directions. Forward: each K_j /
        V_j tile the producer loads feeds 128 Q rows, half the K/V traffic of one warpgroup's 64,
        at no more issue per FLOP (benchmarks/sass_cost.py: d64 753 -> 748, d128 405 -> 402).
        Backward: FA3's tiles, 128 K/V rows per CTA (d64 128x128, d128 64x128: 448 / 314 against
        one warpgroup's 458 / 319). Each consumer stays at the setmaxnreg ceiling of MAX_CONSUMER_REGS.
        A backward at d = 64 with a wider v head dim: one (``bwd.default_warps``)."""
        return bwd.default_warps(fs) if fs.direction == "bwd" else 8

    def tile_work(self, fs: FamilySpec, role: str) -> dict[str, float] | None:
        """Per consumer warp and tile pair of the forward: its warpgroup's HGMMA m64nNk16 (each
        2 x 64 x N x 16 FLOPs, issued by all four warps of the warpgroup): S = Q K_j^T in
        head_dim / 16 of N = block_c, O += P V_j in block_c / 16 of N = head_dim."""
        if role != "main":
            return None
        if fs.direction == "bwd":
            return bwd.tile_work(fs)
        return {"HGMMA": k16_steps(fs.head_dim) + fs.block_c / 16}  # N of O += P V_j: head_dim_v

    def producer_work(self, fs: FamilySpec) -> dict[str, float] | None:
        """Per tile pair, what the producer warp issues (``fagen.autotune.sassloops.tile_loop`` with
        anchor UTMALDG walks its loop): one TMA load per 64-element panel of the two streamed
        tiles, K_j and V_j forward, Q_i and dO_i backward (whose lse_i / D_i are plain loads of
        the producer warp's lanes); V_j and dO_i are head_dim_v wide."""
        return {"UTMALDG": (padded_dim(fs.head_dim) + padded_dim(fs.dv)) / PANEL}

    def consumer_loops(self, fs: FamilySpec) -> tuple[tuple[dict[str, float], tuple[str, ...], int], ...] | None:
        """The consumer warps' tile loops of the main kernel, each as (work per warp and tile pair, the
        opcodes that pick the loop, warps running it) (``fagen.autotune.sassloops.measure_specialised``):
        one loop of every consumer warp, or the backward's split tile's two warpgroups' loops of their own
        (the dK~ warpgroup's holds the dS^T stmatrix, the dV~ warpgroup's the dQ_i staging stores; each
        walked with its own HGMMA work, ``bwd.split_tile_work``). None: a direction with no stated work."""
        work = self.tile_work(fs, "main")
        if work is None:
            return None
        if fs.direction == "bwd" and bwd.split_dkv(fs):
            dk_work, dv_work = bwd.split_tile_work(fs)
            return ((dk_work, ("STSM",), 4), (dv_work, ("STS",), 4))
        return ((work, ("HMMA", "HGMMA"), fs.num_warps),)

    def producer_warps(self, fs: FamilySpec) -> int:
        """Warps of the producer warpgroup that run its loop (one elected lane of the first; the
        other three leave at once)."""
        return 1

    def codegen_reason(self, fs: FamilySpec) -> str | None:
        """Why the spec's codegen knob settings (``KernelSpec.codegen``) are not accepted (the knob
        named, and why), or None (fagen.families.wgmma.codegen)."""
        return CODEGEN.override_reason(fs, dict(fs.codegen)) if fs.codegen else None

    def codegen_config(self, fs: FamilySpec) -> CodegenConfig:
        """The spec's codegen knobs (fagen.families.wgmma.codegen: the stored search's table for the
        spec's class, else the family's rules as starting points; the user's settings first)."""
        return CODEGEN.config(fs)

    def smem_layout(self, fs: FamilySpec) -> SmemLayout:
        stages = fs.knob_values.get(STAGES.name, STAGES.default)
        if fs.direction == "bwd":
            # the config record only where the knob exists (it applies to a bias alone): the layout is asked for
            # per candidate tile, the record's lookup finds the NVRTC major each time
            staged = fs.has("bias") and bool(self.codegen_config(fs).value("bias_smem"))
            return bwd.smem_layout(fs, stages, staged)
        if fs.direction != "fwd":
            raise ValueError(f"{self.name}: no {fs.direction!r} kernel")
        d, dv, e = padded_dim(fs.head_dim), padded_dim(fs.dv), fs.itemsize
        return place([
            ("q", "T", fs.block_r * max(d, dv), e, 1024),  # Q_i, then O_i on its way out: the wider of the two
            ("k", "T", stages * fs.block_c * d, e, 1024),
            ("v", "T", stages * fs.block_c * dv, e, 1024),
            ("bars", "unsigned long long", 1 + 4 * stages, 8),  # Q; K_j full, V_j full, K_j empty, V_j empty per slot
        ])

    def roles(self, fs: FamilySpec) -> tuple[Role, ...]:
        return bwd.roles(fs.has("deterministic")) if fs.direction == "bwd" else (WG_FWD_MAIN,)

    def launch(self, fs: FamilySpec, role: Role) -> Launch:
        if fs.direction == "bwd":
            return bwd.launch(fs, role)
        return Launch((fs.num_threads + 128, 1, 1), fs.block_r)

    def template_context(self, fs: FamilySpec) -> dict[str, Any]:
        layout = self.smem_layout(fs)
        from fagen.arch import ARCHS

        blocks = max(1, min(ARCHS[fs.arch].smem_per_sm // (layout.total_bytes + 1024),
                            REGS_PER_SM // (fs.num_threads * self.min_regs_per_thread)))
        consumer, producer = register_split(fs.num_warps, blocks, *bwd.producer_regs(fs))
        # PANELS_V only with a v head dim of its own (the templates name it then; other specs render as before)
        panels_v = (Constant("PANELS_V", "int", padded_dim(fs.dv) // PANEL, "128-byte swizzle panels across the v "
                             "head dim (V, O, dO, dV)"),) if fs.dv != fs.head_dim else ()
        # HEAD_K16 / HEAD_K16_V only at a head dim of an odd number of 8-column groups (other specs render as before)
        k16 = tuple(Constant(name, "int", k16_steps(d), f"k16 wgmmas of the k loop over {what} (the last one half "
                             "the TMA's zero fill)") for name, d, what in (("HEAD_K16", fs.head_dim, "the head dim"),
                                                                           ("HEAD_K16_V", fs.dv, "the v head dim"))
                    if d % 16 and (name == "HEAD_K16" or fs.dv != fs.head_dim))
        return {"strides": {}, "constants": (
            Constant("CONSUMER_WGS", "int", fs.num_warps // 4, "consumer warpgroups (64 Q rows each)"),
            Constant("PANELS", "int", padded_dim(fs.head_dim) // PANEL, "128-byte swizzle panels across the head dim"),
        ) + panels_v + k16 + (
            Constant("CONSUMER_REGS", "int", consumer, "registers per consumer thread after setmaxnreg.inc"),
            Constant("PRODUCER_REGS", "int", producer, "registers per producer thread after setmaxnreg.dec"),
        ) + (bwd.constants(fs, self.codegen_config(fs).values) if fs.direction == "bwd" else ())}

    def nvrtc_options(self, fs: FamilySpec) -> tuple[str, ...]:
        """``-prec-div=false`` with softcap: score_softcap's ``s_raw / softcap`` per element is then a
        reciprocal (hoisted) and a multiply, not the IEEE division whose out-of-line slow-path CALL
        clobbers the registers at every element (ptxas re-derived 1 / softcap and spilled around it);
        within 2 ulp of the division, far inside the 16-bit outputs' rounding. The forward only: the
        backward's one pass of P^T and dS^T then keeps more live and spills (d = 64: 476 bytes)."""
        return ("-prec-div=false",) if fs.has("softcap") and fs.direction == "fwd" else ()

    def templates(self, direction: str) -> tuple[str, ...]:
        return {"fwd": ("wgmma/fwd.cu.j2",), "bwd": ("wgmma/bwd.cu.j2",)}[direction]

    def pair_cost(self, fs: FamilySpec, sass: Mapping[str, int] | None = None) -> PairCost:
        return pair_cost(fs, sass)

    def tma_tensors(self, fs: FamilySpec) -> tuple[str, ...]:
        return ("q", "k", "v", "do") if fs.direction == "bwd" else ("q", "k", "v")

    def tensor_maps(self, fs: FamilySpec, role: Role, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """The role's tensor-map arguments (:class:`fagen.tma.TensorMapFields`) for the tensors by
        parameter name (q, k, v: [B, N, H, d], head dim contiguous)."""
        from fagen.tma import tensor_map_for

        if fs.direction == "bwd":
            return bwd.tensor_maps(fs, role, tensors)
        boxes = tensor_map_boxes(fs)
        out = {}
        for ctype, name in role.params:
            if ctype == TENSORMAP:
                x = tensors[name.removeprefix("tma_")]
                out[name] = tensor_map_for(packed_view(x) if fs.has("varlen") else x, boxes[name], swizzle=SWIZZLE)
        return out


WGMMA = WgmmaFamily()
