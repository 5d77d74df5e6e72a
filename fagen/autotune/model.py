"""The CPU cost model: HBM traffic, FLOPs, occupancy and wave quantisation.

    t = max(bytes / BW / h, flops / peak / h, wavefronts / (SMs * clk) / h_smem, instrs / (4 * SMs * clk) / h) * q
        + launches * t_launch

bytes       HBM traffic of the paper's IO analysis (Theorem 2 / 5), counted per
            tile pair actually visited (causal skips tiles above the diagonal);
flops       the FLOPs of the visited tiles (masked elements inside a visited
            tile still cost);
wavefronts  shared-memory load wavefronts of the family's inner products,
            bank conflicts included (per-family cost function; SIMT: the
            4x4 register-tiled block_gemm of templates/partials/common.cuh);
instrs      issued warp instructions of those inner loops;
h           latency hiding at the achieved occupancy, per term: min(1, warps per
            SM / 16) for HBM, FP32 and issue; min(1, warps per SM x wavefronts
            per iteration / 32) for shared memory;
q           wave quantisation: waves * slots / blocks, slots = SMs * blocks per SM.

docs/autotune.md gives every formula and constant with its source.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from ..abi import ROLES
from ..families import get_family
from ..spec import (ARCH_MAX_BLOCKS_PER_SM, ARCH_MAX_THREADS_PER_SM, ARCH_SMEM_PER_SM, REGS_PER_SM,
                    KernelSpec)
from .candidates import Candidate

#: Shared memory the driver reserves per resident block on sm_80+ (CUDA C Programming Guide,
#: "Shared Memory" for compute capability 8.x / 9.x).
SMEM_RESERVED_PER_BLOCK = 1024
#: Registers are allocated per warp in units of 256 (CUDA Occupancy Calculator, cc 8.x/9.x).
REG_ALLOC_UNIT = 256
#: Resident warps per SM at which FMA / issue / memory latency is hidden (4 schedulers x 4 warps).
SATURATION_WARPS = 16
#: Shared-memory load latency in clocks: the smem pipe is busy when the resident warps keep
#: this many wavefronts in flight (each warp has one inner-loop iteration's loads in flight).
SMEM_LATENCY_CLOCKS = 32
#: Cost of one kernel launch on a busy stream (seconds).
LAUNCH_SECONDS = 4e-6
BWD_FLOP_FACTOR = 2.5  # backward = 2.5 x forward matmul FLOPs (FlashAttention paper, sec. 4)


@dataclass(frozen=True)
class Problem:
    """The runtime shape a choice is made for."""

    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int

    @classmethod
    def bucketed(cls, batch: int, heads: int, seqlen_q: int, seqlen_k: int | None = None) -> "Problem":
        """The representative problem: seqlens rounded up to a power of two."""
        return cls(batch, heads, seqlen_bucket(seqlen_q), seqlen_bucket(seqlen_q if seqlen_k is None else seqlen_k))


def seqlen_bucket(n: int) -> int:
    """Smallest power of two >= n (at least 16)."""
    return max(16, 1 << max(0, (n - 1).bit_length()))


@dataclass(frozen=True)
class DeviceModel:
    name: str
    sm_count: int
    clock_hz: float  # boost clock
    hbm_bytes_per_s: float
    fp32_lanes_per_sm: int  # FP32 FMA lanes per SM (64 on sm_80, 128 on sm_86/89/90)

    @property
    def fp32_flops_per_s(self) -> float:
        """SIMT FP32 peak: SMs x lanes x 2 FLOPs per FMA x clock."""
        return self.sm_count * self.fp32_lanes_per_sm * 2 * self.clock_hz


#: Per-arch defaults (the arch's flagship part); see docs/autotune.md for the sources.
ARCH_DEVICES: dict[str, DeviceModel] = {
    "sm_80": DeviceModel("A100 SXM4 80GB", 108, 1.410e9, 2.039e12, 64),  # 19.5 TFLOP/s FP32
    "sm_86": DeviceModel("GA102 (A40 / RTX A6000 class)", 84, 1.695e9, 0.936e12, 128),
    "sm_89": DeviceModel("RTX 4090", 128, 2.520e9, 1.008e12, 128),  # 82.6 TFLOP/s
    "sm_90": DeviceModel("H100 SXM5", 132, 1.980e9, 3.35e12, 128),  # 66.9 TFLOP/s
}
#: Named parts whose numbers differ from their arch's default (substring of the CUDA device name).
NAMED_DEVICES: tuple[tuple[str, DeviceModel], ...] = (
    ("H200", DeviceModel("H200 SXM", 132, 1.980e9, 4.8e12, 128)),
    ("H100 PCIe", DeviceModel("H100 PCIe", 114, 1.755e9, 2.0e12, 128)),
    ("A100-SXM4-40GB", DeviceModel("A100 SXM4 40GB", 108, 1.410e9, 1.555e12, 64)),
    ("A100-PCIE-40GB", DeviceModel("A100 PCIe 40GB", 108, 1.410e9, 1.555e12, 64)),
    ("RTX 3090", DeviceModel("RTX 3090", 82, 1.695e9, 0.936e12, 128)),
    ("RTX 4090", DeviceModel("RTX 4090", 128, 2.520e9, 1.008e12, 128)),
)


def device_model(arch: str, device_name: str | None = None, sm_count: int | None = None) -> DeviceModel:
    """Constants for ``arch``, refined by the CUDA device name and its real SM count when known."""
    dev = ARCH_DEVICES[arch]
    if device_name:
        dev = next((d for sub, d in NAMED_DEVICES if sub.lower() in device_name.lower()), dev)
    if sm_count:
        dev = replace(dev, sm_count=sm_count)
    return dev


@dataclass(frozen=True)
class Occupancy:
    blocks_per_sm: int
    warps_per_sm: int
    fraction: float  # resident warps / max warps per SM
    limiter: str  # "threads", "blocks", "registers" or "smem"


def occupancy(arch: str, num_warps: int, registers: int, smem_bytes: int) -> Occupancy:
    """Resident blocks per SM from threads, the block limit, registers and shared memory."""
    max_warps = ARCH_MAX_THREADS_PER_SM[arch] // 32
    regs_per_warp = math.ceil(max(registers, 1) * 32 / REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    limits = {
        "threads": max_warps // num_warps,
        "blocks": ARCH_MAX_BLOCKS_PER_SM[arch],
        "registers": REGS_PER_SM // (regs_per_warp * num_warps),
        "smem": ARCH_SMEM_PER_SM[arch] // (smem_bytes + SMEM_RESERVED_PER_BLOCK),
    }
    limiter = min(limits, key=lambda k: (limits[k], k))
    blocks = limits[limiter]
    return Occupancy(blocks, blocks * num_warps, blocks * num_warps / max_warps, limiter)


def _causal_pairs(nq: int, nk: int, br: int, bc: int, causal: bool) -> tuple[int, list[int], list[int]]:
    """Visited (i, j) tile pairs, Q rows visited per K/V block, K/V rows visited per Q block.

    Bottom-right causal alignment (col <= row + Nk - Nq), as in templates/partials/common.cuh.
    """
    tr, tc = math.ceil(nq / br), math.ceil(nk / bc)
    rows_per_col: list[int] = []
    for j in range(tc):
        first = max(0, j * bc - (nk - nq)) // br * br if causal else 0
        rows_per_col.append(max(0, nq - first))
    cols_per_row: list[int] = []
    for i in range(tr):
        end = max(0, min(nk, i * br + br + nk - nq)) if causal else nk
        cols_per_row.append(math.ceil(end / bc) * bc if end else 0)
    pairs = sum(math.ceil(r / br) for r in rows_per_col)
    return pairs, rows_per_col, cols_per_row


def hbm_bytes(spec: KernelSpec, p: Problem, block_r: int, block_c: int) -> float:
    """HBM bytes moved for one call (all kernels of the module)."""
    d, e, f32 = spec.head_dim, spec.itemsize, 4
    nq, nk = p.seqlen_q, p.seqlen_k
    pairs, rows_per_col, cols_per_row = _causal_pairs(nq, nk, block_r, block_c, spec.causal)
    kpm = nk if spec.key_padding else 0
    if spec.direction == "bwd":
        q_rows = sum(rows_per_col)  # Q, dO, lse, D re-read once per K/V block (Tc times)
        per_head = (
            2 * nk * d * e  # K_j, V_j read once
            + 2 * nk * d * e  # dK_j, dV_j written once
            + q_rows * (2 * d * e + 2 * f32)  # Q_i, dO_i, lse_i, D_i per visited K/V block
            + pairs * min(block_r, nq) * d * f32 * 2  # dQ accumulator read + written per tile pair
            + nq * (2 * d * e + f32 + d * f32)  # preprocess: read O, dO; write D; zero dQ acc
            + nq * d * (f32 + e)  # postprocess: read dQ acc, write dQ
            + kpm  # key-padding mask bytes
        )
    else:
        kv_rows = sum(cols_per_row)  # K/V re-read once per Q block (Tr times)
        per_head = nq * d * e + nq * d * e + nq * f32 + kv_rows * 2 * d * e + kpm
    return float(p.batch * p.heads * per_head)


def nominal_flops(spec: KernelSpec, p: Problem) -> float:
    """FLOPs for TFLOP/s reporting: 4 B H Nq Nk d (x 2.5 backward), halved for causal."""
    f = 4.0 * p.batch * p.heads * p.seqlen_q * p.seqlen_k * spec.head_dim
    if spec.direction == "bwd":
        f *= BWD_FLOP_FACTOR
    return f / 2 if spec.causal else f


def visited_flops(spec: KernelSpec, p: Problem, block_r: int, block_c: int) -> float:
    """FLOPs of the visited tile pairs (padding and masked elements inside them included)."""
    pairs, _, _ = _causal_pairs(p.seqlen_q, p.seqlen_k, block_r, block_c, spec.causal)
    f = 4.0 * p.batch * p.heads * pairs * block_r * block_c * spec.head_dim
    return f * BWD_FLOP_FACTOR if spec.direction == "bwd" else f


def main_grid_blocks(spec: KernelSpec, p: Problem) -> int:
    """Thread blocks of the main kernel's grid (the same rule as ``KernelInfo.grid``)."""
    role = next(r for r in ROLES[spec.direction] if r.name == "main")
    rows = {"block_r": spec.tile.block_r, "block_c": spec.tile.block_c, "num_warps": spec.num_warps}
    gx, gy, gz = role.grid(batch=p.batch, heads=p.heads, seqlen_q=p.seqlen_q, seqlen_k=p.seqlen_k,
                           rows=rows[role.rows_per_block])
    return gx * gy * gz


@dataclass(frozen=True)
class PairCost:
    """On-chip work of one (Q block, K/V block) tile pair, summed over the block's warps."""

    lds_wavefronts: float  # shared-memory load wavefronts (1 per SM per clock)
    warp_instructions: float  # issued warp instructions (1 per scheduler per clock, 4 per SM)
    warp_iterations: float  # inner-loop iterations of one warp (one dependent FMA each)

    @property
    def wavefronts_per_iteration(self) -> float:
        return self.lds_wavefronts / self.warp_iterations if self.warp_iterations else 0.0


#: Address of lane ``e``'s operand at inner index 0, in bytes from the buffer start.
_Addr = Callable[[int], int]


def lds_wavefronts(addrs: list[int]) -> int:
    """Wavefronts of one warp-wide shared-memory load: the most distinct 4-byte words in one bank."""
    words: dict[int, set[int]] = {}
    for a in addrs:
        w = a // 4
        words.setdefault(w % 32, set()).add(w)
    return max((len(v) for v in words.values()), default=0)


#: Register tile of one thread in the SIMT ``block_gemm`` (templates/partials/common.cuh):
#: TM x TN accumulators, TM loads of A and TN loads of B per k step.
GEMM_TM, GEMM_TN = 4, 4


def _block_gemm(m: int, n: int, k: int, a: Callable[[int, int], int], b: Callable[[int, int], int],
                cvt_a: bool, cvt_b: bool) -> PairCost:
    """``block_gemm<M, N, K>``: thread t owns rows m0 + i*RM and columns n0 + j*RN (RM = M/TM,
    RN = N/TN, m0 = t / RN, n0 = t % RN) and loads TM A values and TN B values per k step.
    ``a(row, kk)`` / ``b(col, kk)`` give the byte address of the operand in shared memory."""
    rm, rn = max(1, m // GEMM_TM), max(1, n // GEMM_TN)
    threads = rm * rn
    lanes = range(min(32, threads))
    wf = 0
    for i in range(GEMM_TM):
        wf += lds_wavefronts([a(t // rn + i * rm, 0) for t in lanes])
    for j in range(GEMM_TN):
        wf += lds_wavefronts([b(t % rn + j * rn, 0) for t in lanes])
    steps = math.ceil(threads / 32) * k
    instr = GEMM_TM * GEMM_TN + GEMM_TM + GEMM_TN + GEMM_TM * cvt_a + GEMM_TN * cvt_b + 2  # fma, lds, cvt, loop
    return PairCost(steps * wf, steps * instr, steps)


def _simt_strides(spec: KernelSpec, bc: int) -> tuple[int, int]:
    """Row strides (elements) of the dtype tiles and of the P/S tile, from the family when it pads."""
    fam = get_family(spec.impl)
    strides = getattr(fam, "strides", None)
    if strides is None:
        return spec.head_dim, bc
    st = strides(spec.head_dim, spec.itemsize, bc)
    return int(st["LD"]), int(st["P_LD"])


def simt_pair_cost(spec: KernelSpec, br: int, bc: int) -> PairCost:
    """The SIMT templates' five (backward) or two (forward) block_gemm calls per tile pair."""
    d, t, f = spec.head_dim, spec.itemsize, 4
    ld, p_ld = _simt_strides(spec, bc)
    cvt = spec.dtype != "float32"

    def tile(row: int, col: int) -> int:  # Q, K, V, dO: [rows][LD] of T
        return (row * ld + col) * t

    def p_rc(r: int, c: int) -> int:  # P / dS / S: [B_r][P_LD] of float
        return (r * p_ld + c) * f

    qk = _block_gemm(br, bc, d, tile, tile, cvt, cvt)  # S = Q K^T and dP = dO V^T
    if spec.direction == "bwd":
        dv_dk = _block_gemm(bc, d, br, lambda c, r: p_rc(r, c), lambda x, r: tile(r, x), False, cvt)  # dV, dK
        dq = _block_gemm(br, d, bc, p_rc, lambda x, c: tile(c, x), False, cvt)  # dQ
        steps = [qk, dv_dk, qk, dq, dv_dk]
    else:
        pv = _block_gemm(br, d, bc, p_rc, lambda x, c: tile(c, x), False, cvt)  # O += P V
        steps = [qk, pv]
    return PairCost(sum(c.lds_wavefronts for c in steps), sum(c.warp_instructions for c in steps),
                    sum(c.warp_iterations for c in steps))


#: Family -> on-chip cost of one tile pair. A family without an entry is modelled by its FLOPs alone.
FAMILY_COSTS: dict[str, Callable[[KernelSpec, int, int], PairCost]] = {"simt": simt_pair_cost}


@dataclass(frozen=True)
class Prediction:
    seconds: float
    hbm_bytes: float
    flops: float
    occupancy: Occupancy
    blocks: int
    waves: int
    wave_factor: float
    bound: str  # "hbm", "fp32", "smem", "issue" or "occupancy"
    terms: dict[str, float]  # seconds of each roofline term at full occupancy, before quantisation

    @property
    def ms(self) -> float:
        return self.seconds * 1e3


def predict(spec: KernelSpec, p: Problem, registers: int, dev: DeviceModel) -> Prediction:
    """Predicted wall time of one call of ``spec``'s module on problem ``p``."""
    t = spec.tile
    occ = occupancy(spec.arch, spec.num_warps, registers, spec.smem_bytes)
    blocks = main_grid_blocks(spec, p)
    launches = len(ROLES[spec.direction])
    traffic = hbm_bytes(spec, p, t.block_r, t.block_c)
    flops = visited_flops(spec, p, t.block_r, t.block_c)
    if occ.blocks_per_sm == 0:
        return Prediction(math.inf, traffic, flops, occ, blocks, 0, math.inf, "occupancy", {})
    slots = dev.sm_count * occ.blocks_per_sm
    waves = math.ceil(blocks / slots)
    q = waves * slots / blocks
    hide = min(1.0, occ.warps_per_sm / SATURATION_WARPS)
    terms = {"hbm": traffic / dev.hbm_bytes_per_s, "fp32": flops / dev.fp32_flops_per_s}
    hidden = {"hbm": terms["hbm"] / hide, "fp32": terms["fp32"] / hide}
    cost_fn = FAMILY_COSTS.get(spec.impl)
    if cost_fn is not None:
        pairs, _, _ = _causal_pairs(p.seqlen_q, p.seqlen_k, t.block_r, t.block_c, spec.causal)
        pc = cost_fn(spec, t.block_r, t.block_c)
        n = pairs * p.batch * p.heads
        sm_clocks = dev.sm_count * dev.clock_hz
        terms["smem"] = n * pc.lds_wavefronts / sm_clocks
        terms["issue"] = n * pc.warp_instructions / (4 * sm_clocks)
        smem_hide = min(1.0, occ.warps_per_sm * pc.wavefronts_per_iteration / SMEM_LATENCY_CLOCKS)
        hidden["smem"] = terms["smem"] / smem_hide
        hidden["issue"] = terms["issue"] / hide
    bound = max(hidden, key=lambda k: (hidden[k], k))
    seconds = hidden[bound] * q + launches * LAUNCH_SECONDS
    return Prediction(seconds, traffic, flops, occ, blocks, waves, q, bound, terms)


def score(cands: list[Candidate], p: Problem, dev: DeviceModel) -> list[Candidate]:
    """Fill occupancy and predicted_ms of every ok candidate (others unchanged)."""
    out = []
    for c in cands:
        if c.status == "ok" and c.spec is not None and c.registers is not None:
            pred = predict(c.spec, p, c.registers, dev)
            c = replace(c, occupancy=round(pred.occupancy.fraction, 4), predicted_ms=round(pred.ms, 6))
        out.append(c)
    return out


def rank(cands: list[Candidate]) -> list[Candidate]:
    """Ok candidates by predicted time (ties: higher occupancy, then the candidate key), then the
    rejected ones by key. Deterministic: the order depends on nothing but the candidates."""
    ok = [c for c in cands if c.status == "ok" and c.predicted_ms is not None]
    rest = [c for c in cands if not (c.status == "ok" and c.predicted_ms is not None)]
    ok.sort(key=lambda c: (c.predicted_ms, -(c.occupancy or 0.0), c.key))  # type: ignore[arg-type]
    rest.sort(key=lambda c: c.key)
    return ok + rest
