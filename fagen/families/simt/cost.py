"""The SIMT family's autotuner cost: the ``block_gemm`` calls of one visited tile pair."""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from fagen.families.base import FamilySpec, PairCost, lds_wavefronts
from fagen.families.simt.rules import F32, GEMM_TM, GEMM_TN, smem_strides


def pair_cost(fs: FamilySpec, sass: Mapping[str, int] | None = None) -> PairCost:
    """The templates' five (backward; seven with the deterministic dq kernel's recomputation)
    or two (forward) block_gemm calls per tile pair."""
    d, t = fs.head_dim, fs.itemsize
    br, bc = fs.block_r, fs.block_c
    st = smem_strides(d, t, bc)
    ld, p_ld = st["LD"], st["P_LD"]
    cvt = fs.dtype != "float32"
    w = fs.num_warps

    def tile(row: int, col: int) -> int:  # Q, K, V, dO: [rows][LD] of T
        return (row * ld + col) * t

    def p_rc(r: int, c: int) -> int:  # P / dS / S: [B_r][P_LD] of float
        return (r * p_ld + c) * F32

    qk = _block_gemm(br, bc, d, w, tile, tile, cvt, cvt)  # S = Q K^T and dP = dO V^T
    if fs.direction == "bwd":
        dv_dk = _block_gemm(bc, d, br, w, lambda c, r: p_rc(r, c), lambda x, r: tile(r, x), False, cvt)
        dq = _block_gemm(br, d, bc, w, p_rc, lambda x, c: tile(c, x), False, cvt)
        if fs.has("deterministic"):
            # main: S, dV, dP, dK; the dq kernel recomputes S and dP for dQ_i += dS_ij K_j (plain stores)
            steps = [qk, dv_dk, qk, dv_dk, qk, qk, dq]
            atomics = 0
        else:
            steps = [qk, dv_dk, qk, dq, dv_dk]
            atomics = br * d  # dQ_i += dS_ij K_j: one fp32 atomic per element (Algorithm 4 line 21)
    else:
        pv = _block_gemm(br, d, bc, w, p_rc, lambda x, c: tile(c, x), False, cvt)  # O += P V
        steps = [qk, pv]
        atomics = 0
    return PairCost(sum(c.lds_wavefronts for c in steps), sum(c.warp_instructions for c in steps),
                    sum(c.warp_iterations for c in steps), sum(c.busiest_warp_iterations for c in steps),
                    atomics)


def _block_gemm(m: int, n: int, k: int, num_warps: int, a: Callable[[int, int], int],
                b: Callable[[int, int], int], cvt_a: bool, cvt_b: bool) -> PairCost:
    """``block_gemm<M, N, K>``: thread t owns rows m0 + i*RM and columns n0 + j*RN (RM = M/TM,
    RN = N/TN, m0 = t / RN, n0 = t % RN) and loads TM A values and TN B values per k step; the
    block's threads take the RM*RN micro-tiles in strides of NUM_THREADS, so with a small tile
    some warps stay idle and with a large one warp 0 does the most rounds.
    ``a(row, kk)`` / ``b(col, kk)`` give the byte address of the operand in shared memory."""
    rm, rn = max(1, m // GEMM_TM), max(1, n // GEMM_TN)
    threads = rm * rn
    lanes = range(min(32, threads))
    wf = 0
    for i in range(GEMM_TM):
        wf += lds_wavefronts([a(t // rn + i * rm, 0) for t in lanes])
    for j in range(GEMM_TN):
        wf += lds_wavefronts([b(t % rn + j * rn, 0) for t in lanes])
    steps = math.ceil(threads / 32) * k  # warp-iterations over all warps
    busiest = math.ceil(threads / (32 * num_warps)) * k  # warp 0's rounds x k
    instr = GEMM_TM * GEMM_TN + GEMM_TM + GEMM_TN + GEMM_TM * cvt_a + GEMM_TN * cvt_b + 2  # fma, lds, cvt, loop
    return PairCost(steps * wf, steps * instr, steps, busiest)
