"""Portable SIMT family: FMA math with fp32 accumulation (fp64 for float64), any dtype, sm_80+."""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fagen.abi import Role
from fagen.families import FamilyBase, PairCost, lds_wavefronts, register
from fagen.layout import SmemLayout, align_up, place

if TYPE_CHECKING:  # pragma: no cover
    from fagen.spec import KernelSpec

F32 = 4


def acc_type(itemsize: int) -> tuple[str, int]:
    """The accumulator C type and its size: double for a float64 spec (itemsize 8), else float."""
    return ("double", 8) if itemsize == 8 else ("float", F32)
#: Register tile of one thread in ``block_gemm`` (templates/simt/gemm.cuh): TM x TN accumulators,
#: TM loads of A and TN loads of B per k step.
GEMM_TM, GEMM_TN = 4, 4


@dataclass(frozen=True)
class SimtFamily(FamilyBase):
    name: str = "simt"
    preference: int = 100  # the portable fallback: any family that supports a spec is preferred
    tile_multiple: int = 16
    max_block_r: int = 128
    max_block_c: int = 128
    features: frozenset[str] = frozenset({"top_left", "window", "softcap", "alibi", "attn_mask", "bias", "bias_grad",
                                          "varlen", "deterministic", "float64"})

    def strides(self, head_dim: int, itemsize: int, block_c: int) -> dict[str, int]:
        """Padded smem row strides (elements): a row of a dtype tile is an odd number of 32-bit
        words and a row of the P/S tile an odd number of floats, so a warp reading one column
        across consecutive rows touches 32 different banks."""
        return {"LD": head_dim + 4 // itemsize, "P_LD": block_c + 1}

    def template_context(self, spec: "KernelSpec") -> dict[str, Any]:
        return {"strides": self.strides(spec.head_dim, spec.itemsize, spec.tile.block_c),
                "acc": acc_type(spec.itemsize)[0]}

    def smem_layout(self, direction: str, head_dim: int, itemsize: int, block_r: int, block_c: int,
                    knobs: Mapping[str, int] | None = None) -> SmemLayout:
        d, br, bc = head_dim, block_r, block_c
        st = self.strides(head_dim, itemsize, block_c)
        ld, p_ld = st["LD"], st["P_LD"]
        acc, asz = acc_type(itemsize)
        if direction == "bwd":
            # Algorithm 4: K_j, V_j and the dK~_j, dV~_j accumulators stay on chip
            # for the whole inner loop; Q_i, dO_i, lse_i, D_i and P_ij/dS_ij per step.
            # dK~, dV~ come last: the deterministic dq kernel uses the layout up to them.
            return place([
                ("k", "T", bc * ld, itemsize),
                ("v", "T", bc * ld, itemsize),
                ("q", "T", br * ld, itemsize),
                ("do_", "T", br * ld, itemsize),
                ("p", acc, br * p_ld, asz),
                ("lse", acc, br, asz),
                ("delta", acc, br, asz),
                ("dk", acc, bc * d, asz),
                ("dv", acc, bc * d, asz),
            ])
        if direction == "fwd":
            # Forward (online softmax): Q_i and the O_i accumulator stay on chip,
            # K_j, V_j and S_ij/P_ij per step, row stats m_i, l_i and the rescale factor.
            return place([
                ("q", "T", br * ld, itemsize),
                ("o", acc, br * d, asz),
                ("k", "T", bc * ld, itemsize),
                ("v", "T", bc * ld, itemsize),
                ("s", acc, br * p_ld, asz),
                ("m", acc, br, asz),
                ("l", acc, br, asz),
                ("alpha", acc, br, asz),
            ])
        raise ValueError(f"unknown direction {direction!r}")

    def role_smem_bytes(self, spec: "KernelSpec", role: Role) -> int:
        """The dq kernel carves the backward layout but never touches dK~, dV~ (its tail)."""
        if role.name == "dq":
            return align_up(next(b.offset for b in spec.smem_layout.buffers if b.name == "dk"))
        return super().role_smem_bytes(spec, role)

    def templates(self, direction: str) -> tuple[str, ...]:
        return {"bwd": ("simt/bwd.cu.j2",), "fwd": ("simt/fwd.cu.j2",)}[direction]

    # ------------------------------------------------------------------ autotuner cost
    def pair_cost(self, spec: "KernelSpec", block_r: int, block_c: int,
                  sass: Mapping[str, int] | None = None) -> PairCost:
        """The templates' five (backward; seven with the deterministic dq kernel's recomputation)
        or two (forward) block_gemm calls per tile pair."""
        d, t = spec.head_dim, spec.itemsize
        st = self.strides(d, t, block_c)
        ld, p_ld = st["LD"], st["P_LD"]
        cvt = spec.dtype != "float32"
        w = spec.num_warps

        def tile(row: int, col: int) -> int:  # Q, K, V, dO: [rows][LD] of T
            return (row * ld + col) * t

        def p_rc(r: int, c: int) -> int:  # P / dS / S: [B_r][P_LD] of float
            return (r * p_ld + c) * F32

        br, bc = block_r, block_c
        qk = _block_gemm(br, bc, d, w, tile, tile, cvt, cvt)  # S = Q K^T and dP = dO V^T
        if spec.direction == "bwd":
            dv_dk = _block_gemm(bc, d, br, w, lambda c, r: p_rc(r, c), lambda x, r: tile(r, x), False, cvt)
            dq = _block_gemm(br, d, bc, w, p_rc, lambda x, c: tile(c, x), False, cvt)
            if getattr(spec, "deterministic", False):
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


SIMT = register(SimtFamily())
