"""The mma family's autotuner cost: the work of one visited tile pair of its templates."""
from __future__ import annotations

import math
from collections.abc import Mapping

from fagen.families.base import FamilySpec, PairCost
from fagen.families.mma.rules import (bwd_2d, bwd_chunk_sub, dq_2d, dq_key_chunk, fwd_half_copy, fwd_m_tiles, fwd_q_in_regs,
                                      kv_in_regs, padded_dim)

def pair_cost(fs: FamilySpec, sass: Mapping[str, int] | None = None) -> PairCost:
    """One visited tile pair of the templates, counted per warp: mma.sync m16n8k16 (one
    dependent math op each), ldmatrix.x4 (4 conflict-free wavefronts each: 8 rows of 16 B
    in 8 different bank groups), the dS^T stores, and the element-wise work on the
    accumulators (exp2, mask, dropout, conversions). The model takes the issued
    instructions from the kernel's own SASS when it has it; these counts are its fallback
    and the source of the shared-memory and warp-balance terms."""
    block_r, block_c = fs.block_r, fs.block_c
    dp, w = padded_dim(fs.head_dim), fs.num_warps
    dpv = padded_dim(fs.dv)  # the v head dim's (V, dO, O, dV~): head_dim's without head_dim_v
    kd, kdv = dp // 16, dpv // 16  # k16 steps across the head dim, the v head dim
    rd = max(fs.head_dim, fs.dv)  # the register rules' head dim
    if fs.direction == "bwd" and bwd_2d(fs.head_dim, fs.flags, block_r, block_c, w, fs.dv):
        # FlashAttention-2's two-dimensional layout (templates/mma/bwd_2d.cu.j2), per warp: S and dP in
        # 32 x 32 blocks (2 A + 2 B ldmatrix per k16 step of each), dV~ and dK~ in 32 keys x dp / 2 columns
        # (2 A + dp / 32 B per 16 Q rows of each), dQ_i in 32 x 32 (2 + 2 per 16 keys); P and dS stored
        # as 32-bit pairs (16 each); per score of the 32 x 32 block P (one FFMA + MUFU), dS (one FFMA +
        # FMUL), its share of the packs and the lse / D loads (~7); the dQ_i reductions (one per element).
        hmma = 10 * block_r * block_c * dp / 4096 / w
        ldsm = 8 * kd + 2 * (2 + dp // 32) * (block_r // 16) + 4 * (block_c // 16)
        stores = 2 * (32 * 32) // 64
        elementwise = 32 * 32 // 32 * 7
        instr = w * (hmma + ldsm + stores + elementwise) + block_r * fs.head_dim / 32
        return PairCost(lds_wavefronts=w * (4.0 * ldsm + stores), warp_instructions=float(instr),
                        warp_iterations=float(w * hmma), busiest_warp_iterations=float(hmma),
                        atomics=float(block_r * fs.head_dim))
    if fs.direction == "bwd":
        active = block_c // 16  # warps owning K/V rows
        chunks = block_r // 16  # 16 Q rows at a time
        # K/V A-fragments from registers (KV_IN_REGS) or read once per chunk of BWD_CHUNK_SUB 16-row sub-chunks
        sub = bwd_chunk_sub(rd, fs.flags, block_r)
        kv_ldsm = 0 if kv_in_regs(rd) else (kd + kdv) / sub
        hmma = chunks * 4 * (kd + kdv)  # S^T, dK~ (head dim); dP^T, dV~ (v head dim)
        ldsm = chunks * (kv_ldsm + (kd + kdv) + (kd + kdv))
        # 8 elements per lane per chunk, each: P = exp2 (one FFMA + MUFU), dS (one FFMA + FMUL), its share of
        # the P / dS packs, the lse / D loads and the chunk's addressing (constant offsets from per-step lane
        # pointers, two chunks per trip: ~7 measured in the SASS at d = 64 and 128); fully visible tiles
        # carry no mask math.
        elementwise = chunks * 8 * (7 + (20 if fs.has("dropout") else 0))
        units = chunks * kd  # dQ: (16 Q rows x 16 columns) tiles shared by all warps
        if fs.has("deterministic"):
            # main: S^T, dP^T, dV~, dK~ (no dS^T, no dQ); the dq kernel (16 Q rows per warp) recomputes
            # S = Q K^T and dP = dO V^T and adds dQ += dS K: 3 of the pair's 7 GEMMs, 3 ldmatrix.x4
            # per (k16 step, 16 keys) (K, V, K^T) and Q, dO once per (k16 step, key sub-step), its
            # element-wise work on S/dP.
            nc = block_c // 16
            dq_hmma = chunks * 2 * nc * (2 * kd + kdv)  # 3 GEMMs of 16 x 16nc x 16kd: 2 n8 tiles per (16 keys, k16 step)
            sub_steps = block_c // dq_key_chunk(fs.head_dim, block_c)
            dq_ldsm = chunks * (sub_steps * (kd + kdv) + nc * (kd + kdv) + nc * kd)
            busiest = hmma + math.ceil(chunks / w) * 2 * nc * (2 * kd + kdv)
            total_hmma = active * hmma + dq_hmma
            total_ldsm = active * ldsm + dq_ldsm
            instr = total_hmma + total_ldsm + 2 * active * elementwise
            return PairCost(lds_wavefronts=4.0 * total_ldsm, warp_instructions=float(instr),
                            warp_iterations=float(total_hmma), busiest_warp_iterations=float(busiest), atomics=0.0)
        dq_hmma, dq_ldsm = units * 2 * (block_c // 16), units * 2 * (block_c // 16)
        if dq_2d(fs.head_dim, block_r, w):  # DQ_2D: 32 x 32 per warp, 2 + 2 ldmatrix per 8 HMMAs
            dq_ldsm = dq_hmma // 2
        busiest = hmma + math.ceil(units / w) * 2 * (block_c // 16)
        stores = active * chunks * 4  # dS^T, 4 x 32-bit per lane per chunk
        total_hmma = active * hmma + dq_hmma
        total_ldsm = active * ldsm + dq_ldsm
        instr = total_hmma + total_ldsm + stores + active * elementwise + dq_hmma * 2  # + dQ atomics
        return PairCost(lds_wavefronts=4.0 * total_ldsm + stores + active * chunks * 4,
                        warp_instructions=float(instr), warp_iterations=float(total_hmma),
                        busiest_warp_iterations=float(busiest), atomics=float(block_r * fs.head_dim))
    mt = fwd_m_tiles(block_r, w)  # m16 tiles of Q rows per warp (WARP_M_TILES)
    active = -(-block_r // (16 * mt))  # warps owning Q rows
    # Q A-fragments from registers (Q_IN_REGS) or one ldmatrix per (k16 step, m16 tile); a warp's K and
    # V fragments feed its mt m16 tiles.
    q_ldsm = 0 if fwd_q_in_regs(fs.head_dim, block_r, w, block_c, fs.flags, fs.dv) else mt * kd
    hmma = mt * (kd * (block_c // 8) + (block_c // 16) * (dpv // 8))  # S = Q K^T, O += P V
    ldsm = q_ldsm + kd * (block_c // 16) + (block_c // 16) * kdv
    # per score: max, FFMA, exp2, sum and half a pack (5; dropout's keep bits 10 more); per O element one
    # rescale multiply a step; per 16-byte K/V chunk 2 (its source one wide multiply-add off the thread's
    # row pointer, the cp.async), per step ~25 for the barrier, stage and loop bookkeeping and ~15 per
    # copy a warp sets up (one with FWD_HALF_COPY, where each half of the threads copies one tensor, else
    # two); l = rowsum(P~): one HMMA per 16 keys and m16 tile (dropout: two, one per row half, and a
    # second pack of P~ before the keep mask).
    chunks = block_c * (dp // 8 + dpv // 8) / (32 * w)  # 16-byte cp.async per warp (K_j and V_j)
    ones = mt * (block_c // 16) * (6 if fs.has("dropout") else 1)  # dropout: 2 HMMAs and a lane's 4 more packs
    copies = 1 if fwd_half_copy(fs.head_dim, w) and fwd_half_copy(fs.dv, w) else 2
    elementwise = (mt * ((block_c // 8) * 4 * (5 + (10 if fs.has("dropout") else 0)) + (dpv // 8) * 4)
                   + 2 * chunks + 25 + 15 * copies + ones)
    return PairCost(lds_wavefronts=4.0 * active * ldsm, warp_instructions=float(active * (hmma + ldsm + elementwise)),
                    warp_iterations=float(active * hmma), busiest_warp_iterations=float(hmma), atomics=0.0)
