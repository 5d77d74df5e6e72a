"""The CPU cost model: HBM and L2 traffic, FLOPs, exponentials, shared memory, issue slots,
dQ atomics, occupancy.

    t = max(dram / BW / h, bytes / L2_BW / h, flops / peak / h, exps / mufu_rate / h,
            wavefronts / (SMs * clk) / h_smem, instrs / (4 * SMs * clk) / h,
            atomics / atomic_rate) * q + launches * t_launch

bytes       the memory traffic of the paper's IO analysis (Theorem 2 / 5), counted per
            tile pair actually visited (``fagen.masking.tile_counts``: closed form,
            so the model costs the same at N = 2**40 as at N = 1024); all of it
            passes through the L2;
dram        the part of it that reaches HBM: the tiles a kernel re-reads (K/V in the
            forward, Q/dO/lse/D in the backward) hit the L2 while the (batch, head)s
            whose blocks are resident together keep their re-read set within its
            effective capacity (``l2_hit_fraction``);
exps        one exponential per score of a visited tile pair (MUFU.EX2, 16 per SM and
            clock: the throughput table of the CUDA C Programming Guide);
flops       the FLOPs of the visited tiles (masked elements inside a visited
            tile still cost), summed over the kernels of the module (``kernel_gemms``:
            the deterministic backward's dq kernel recomputes S and dP), at the
            peak of the family's math unit (FP32 FMA lanes for SIMT, tensor cores
            for ``math_unit == "tensor"``);
wavefronts  shared-memory load wavefronts of one tile pair, bank conflicts
            included (the family's ``pair_cost``);
instrs      issued warp instructions: from the kernels' own SASS when the
            disassembler is installed (each kernel's main loop once per tile pair,
            its innermost loops as often as that kernel's FLOPs, known exactly,
            require: ``sassloops``; the main kernel and, deterministic backward,
            the dq kernel), else the family's ``pair_cost`` (which counts both);
atomics     fp32 atomic adds of dQ (Algorithm 4 line 21) at the L2's rate;
h           latency hiding at the achieved occupancy: min(1, busy warps per SM / 16),
            where busy warps = resident warps x the family's warp balance (a tile
            too small for the block leaves warps idle); for shared memory
            min(1, busy warps x wavefronts per iteration / 32);
q           wave quantisation: waves * slots / blocks, slots = SMs * blocks per SM,
            per kernel with its own grid, weighted by the kernel's share of the GEMMs.

docs/autotune.md gives every formula and constant with its source.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from ..choices import seqlen_bucket
from ..errors import InputError
from ..families import PairCost, get_family, lds_wavefronts  # noqa: F401 (lds_wavefronts: re-export)
from ..masking import tile_counts
from ..plan import plan_of
from ..spec import (ARCH_MAX_BLOCKS_PER_SM, ARCH_MAX_THREADS_PER_SM, ARCH_SMEM_PER_SM, REGS_PER_SM, SEQLEN_MAX,
                    KernelSpec)
from .candidates import Candidate
from .sassloops import LoopMix, dynamic_instructions

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
#: Reported backward FLOPs = 2.5 x forward (five matmuls vs two; FlashAttention paper, sec. 4): the
#: convention TFLOP/s figures use, also for the deterministic backward (whose dq kernel recomputes
#: S and dP: the model's ``visited_flops`` counts that work, the reported figure does not).
BWD_FLOP_FACTOR = 2.5
#: fp32 atomic adds the L2 retires per SM per clock (an estimate: one 32-byte sector per L2 slice
#: per clock, about as many slices as SMs, and warps' dQ adds coalesce 8 floats to a sector at best).
ATOMICS_PER_SM_CLOCK = 4
#: L2 read bandwidth per SM and clock: the A100 whitepaper's 5120 bytes/clk over its 108 SMs, taken
#: for every arch (an estimate the GPU check calibrates).
L2_BYTES_PER_SM_CLOCK = 5120 / 108
#: Share of the L2 that holds a kernel's re-read tiles; the rest holds the streamed ones (and, on a
#: split L2, the other partition's copies). An estimate.
L2_EFFECTIVE = 0.5
#: Exponentials (MUFU.EX2) per SM and clock on sm_80..sm_120 (CUDA C Programming Guide, arithmetic
#: instruction throughput: "base-2 exponential" 16 per clock per SM).
EXP_PER_SM_CLOCK = 16
#: FLOPs of one warp-wide math instruction, and its SASS opcode, per math unit.
MATH_OPCODE = {"fp32": "FFMA", "tensor": "HMMA"}
FLOPS_PER_MATH_INSTRUCTION = {"fp32": 2 * 32, "tensor": 2 * 16 * 8 * 16}  # FFMA x 32 lanes; HMMA.16816
#: The largest runtime sizes the kernels take (int32 lengths, fagen.spec.SEQLEN_MAX; grid y / z =
#: batch / heads).
MAX_SEQLEN = SEQLEN_MAX
MAX_GRID_YZ = 65535


@dataclass(frozen=True)
class Workload:
    """The runtime shape a tuning choice is made for (the functional API's validated shape is
    ``fagen.functional.Problem``)."""

    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    heads_kv: int | None = None  # K/V heads (GQA / MQA); None: as many as ``heads``

    def __post_init__(self) -> None:
        for name, v, hi in (("batch", self.batch, MAX_GRID_YZ), ("heads", self.heads, MAX_GRID_YZ),
                            ("seqlen_q", self.seqlen_q, 2 * MAX_SEQLEN), ("seqlen_k", self.seqlen_k, 2 * MAX_SEQLEN)):
            check_size(name, v, hi)
        if self.heads_kv is not None:
            check_size("heads_kv", self.heads_kv, self.heads)
            if self.heads % self.heads_kv:
                raise InputError("heads_kv", f"a divisor of heads ({self.heads})", self.heads_kv)

    @classmethod
    def bucketed(cls, batch: int, heads: int, seqlen_q: int, seqlen_k: int | None = None,
                 heads_kv: int | None = None) -> "Workload":
        """The representative workload: seqlens rounded up to a power of two."""
        for name, v in (("seqlen", seqlen_q), ("seqlen_k", seqlen_k)):
            if v is not None:
                check_size(name, v, MAX_SEQLEN)
        return cls(batch, heads, seqlen_bucket(seqlen_q), seqlen_bucket(seqlen_q if seqlen_k is None else seqlen_k),
                   heads_kv)


def check_size(name: str, v: object, hi: int) -> int:
    """``v`` as an int in 1..hi, else an InputError naming ``name``."""
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
        raise InputError(name, f"an integer in 1..{hi}", v)
    return v


@dataclass(frozen=True)
class DeviceModel:
    name: str
    sm_count: int
    clock_hz: float  # boost clock
    hbm_bytes_per_s: float
    fp32_lanes_per_sm: int  # FP32 FMA lanes per SM (64 on sm_80, 128 on sm_86/89/90)
    tensor_flops_per_s: float  # dense fp16/bf16 tensor-core peak with fp32 accumulation
    l2_bytes: int  # L2 capacity

    @property
    def l2_bytes_per_s(self) -> float:
        """L2 bandwidth: SMs x L2_BYTES_PER_SM_CLOCK x clock (estimate)."""
        return self.sm_count * L2_BYTES_PER_SM_CLOCK * self.clock_hz

    @property
    def exps_per_s(self) -> float:
        """Exponentials per second: SMs x EXP_PER_SM_CLOCK x clock."""
        return self.sm_count * EXP_PER_SM_CLOCK * self.clock_hz

    @property
    def fp32_flops_per_s(self) -> float:
        """SIMT FP32 peak: SMs x lanes x 2 FLOPs per FMA x clock."""
        return self.sm_count * self.fp32_lanes_per_sm * 2 * self.clock_hz

    @property
    def atomics_per_s(self) -> float:
        """fp32 atomic adds per second the L2 retires (estimate, ATOMICS_PER_SM_CLOCK)."""
        return self.sm_count * ATOMICS_PER_SM_CLOCK * self.clock_hz

    def math_flops_per_s(self, unit: str) -> float:
        return self.tensor_flops_per_s if unit == "tensor" else self.fp32_flops_per_s


#: Per-arch defaults (the arch's flagship part); see docs/autotune.md for the sources.
ARCH_DEVICES: dict[str, DeviceModel] = {
    "sm_80": DeviceModel("A100 SXM4 80GB", 108, 1.410e9, 2.039e12, 64, 312e12, 40 * 2**20),  # 19.5 TFLOP/s FP32
    "sm_86": DeviceModel("GA102 (A40 / RTX A6000 class)", 84, 1.695e9, 0.936e12, 128, 149.7e12, 6 * 2**20),
    "sm_89": DeviceModel("RTX 4090", 128, 2.520e9, 1.008e12, 128, 165.2e12, 72 * 2**20),  # 82.6 TFLOP/s
    "sm_90": DeviceModel("H100 SXM5", 132, 1.980e9, 3.35e12, 128, 989.4e12, 50 * 2**20),  # 66.9 TFLOP/s
    "sm_100": DeviceModel("B200", 148, 1.965e9, 8.0e12, 128, 2250e12, 126 * 2**20),  # datasheet dense fp16 (tcgen05)
    "sm_120": DeviceModel("RTX 5090", 170, 2.407e9, 1.792e12, 128, 209.5e12, 96 * 2**20),  # 104.8 TFLOP/s
}
#: Archs without constants of their own use a sibling's (scaled by the device's real SM count
#: when tuning on it): same SM generation, same shared-memory class.
ARCH_DEVICE_FALLBACK: dict[str, str] = {"sm_87": "sm_86", "sm_90a": "sm_90", "sm_103": "sm_100",
                                        "sm_110": "sm_100", "sm_121": "sm_120"}
#: Named parts whose numbers differ from their arch's default (substring of the CUDA device name).
NAMED_DEVICES: tuple[tuple[str, DeviceModel], ...] = (
    ("H200", DeviceModel("H200 SXM", 132, 1.980e9, 4.8e12, 128, 989.4e12, 50 * 2**20)),
    ("H100 PCIe", DeviceModel("H100 PCIe", 114, 1.755e9, 2.0e12, 128, 756.5e12, 50 * 2**20)),
    ("A100-SXM4-40GB", DeviceModel("A100 SXM4 40GB", 108, 1.410e9, 1.555e12, 64, 312e12, 40 * 2**20)),
    ("A100-PCIE-40GB", DeviceModel("A100 PCIe 40GB", 108, 1.410e9, 1.555e12, 64, 312e12, 40 * 2**20)),
    ("RTX 3090", DeviceModel("RTX 3090", 82, 1.695e9, 0.936e12, 128, 71e12, 6 * 2**20)),
    ("RTX 4090", DeviceModel("RTX 4090", 128, 2.520e9, 1.008e12, 128, 165.2e12, 72 * 2**20)),
)


def device_model(arch: str, device_name: str | None = None, sm_count: int | None = None) -> DeviceModel:
    """Constants for ``arch``, refined by the CUDA device name and its real SM count when known."""
    dev = ARCH_DEVICES[ARCH_DEVICE_FALLBACK.get(arch, arch)]
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


def launch_warps(spec: KernelSpec) -> int:
    """Warps of the main kernel's block as launched (a warp-specialised family adds its producer
    warpgroup to ``num_warps``)."""
    return max(1, plan_of(spec).kernel("main").threads // 32)


def hbm_bytes(spec: KernelSpec, p: Workload, block_r: int, block_c: int) -> float:
    """HBM bytes moved for one call (all kernels of the module)."""
    d, e, f32 = spec.head_dim, spec.itemsize, 4
    nq, nk = p.seqlen_q, p.seqlen_k
    tc = tile_counts(nq, nk, block_r, block_c, spec.causal, spec.key_padding,
                     top_left=spec.causal_align == "top_left", attn_mask=spec.attn_mask)
    kpm = nk if spec.key_padding else 0
    kv_share = (p.heads_kv or p.heads) / p.heads  # GQA: one K/V head per group of q heads
    if spec.direction == "bwd":
        per_head = (
            2 * nk * d * e * kv_share  # K_j, V_j read once (per K/V head)
            + 2 * nk * d * e * kv_share  # dK_j, dV_j written once
            + tc["rows_visited"] * (2 * d * e + 2 * f32)  # Q_i, dO_i, lse_i, D_i per visited tile pair
            + (nq * (2 * d * e + 2 * f32)  # deterministic: the dq kernel reads Q, dO, lse, D once,
               + tc["cols_visited"] * 2 * d * e  # K_j, V_j per visited tile pair
               + nq * d * f32 + kpm  # stores dQ acc once (no atomics); key-padding mask again
               if dq_kernel(spec) else
               nq * d * f32 * 2)  # else the dQ atomics reduce in L2 (the "atomics" term); the
            # accumulator reaches HBM about once per head, read and written back
            + nq * (2 * d * e + f32 + d * f32)  # preprocess: read O, dO; write D; zero dQ acc
            + nq * d * (f32 + e)  # postprocess: read dQ acc, write dQ
            + kpm  # key-padding mask bytes
        )
    else:
        # K_j, V_j re-read once per visited tile pair; Q read and O, lse written once
        per_head = nq * d * e + nq * d * e + nq * f32 + tc["cols_visited"] * 2 * d * e + kpm
    return float(p.batch * p.heads * per_head)


def reread_bytes(spec: KernelSpec, p: Workload, block_r: int, block_c: int) -> tuple[float, float]:
    """(bytes, working set): the part of ``hbm_bytes`` that re-reads a tile another visited pair of
    the same (batch, head) read before -- K_j, V_j per pair in the forward (and the deterministic
    backward's dq kernel), Q_i, dO_i, lse_i, D_i per pair in the backward -- beyond the first read,
    and the bytes one (batch, head) keeps re-reading (what must stay in the L2 for the re-reads to
    hit it; the backward's fp32 dQ accumulator, which the atomics keep there, included)."""
    d, e, f32 = spec.head_dim, spec.itemsize, 4
    nq, nk = p.seqlen_q, p.seqlen_k
    tc = tile_counts(nq, nk, block_r, block_c, spec.causal, spec.key_padding,
                     top_left=spec.causal_align == "top_left", attn_mask=spec.attn_mask)
    kv_share = (p.heads_kv or p.heads) / p.heads
    kv_once, kv_pairs = 2 * nk * d * e * kv_share, tc["cols_visited"] * 2 * d * e
    if spec.direction == "fwd":
        again, working = max(0.0, kv_pairs - kv_once), kv_once
    else:
        row = 2 * d * e + 2 * f32
        again = max(0.0, tc["rows_visited"] * row - nq * row)
        working = nq * row + (0 if dq_kernel(spec) else nq * d * f32)
        if dq_kernel(spec):
            again += max(0.0, kv_pairs - kv_once)
            working = max(working, kv_once)
    return float(p.batch * p.heads * again), float(working)


def l2_hit_fraction(spec: KernelSpec, p: Workload, dev: DeviceModel, slots: int) -> float:
    """Share of the re-reads the L2 serves: blocks launch in grid order, (batch, head) slowest, so
    the ``slots`` resident blocks span ceil(slots / blocks per head) + 1 (batch, head)s; their
    re-read sets (``reread_bytes``) share L2_EFFECTIVE of the L2. 1 when they fit, else the share
    that does (an LRU over a cyclic working set keeps about that much)."""
    bt = spec.tile
    _, working = reread_bytes(spec, p, bt.block_r, bt.block_c)
    heads = p.batch * p.heads
    per_head = max(1, main_grid_blocks(spec, p) // heads)
    live = min(heads, math.ceil(slots / per_head) + 1)
    need = live * working
    return 1.0 if need <= 0 else min(1.0, L2_EFFECTIVE * dev.l2_bytes / need)


def dq_kernel(spec: KernelSpec) -> bool:
    """Whether the backward has a dq kernel (the deterministic backward of a family with the ``dq`` role,
    which recomputes S and dP there); ``wgmma``'s deterministic backward orders its dQ reduce-adds in the
    main kernel instead, so the model takes it as the atomic backward's work."""
    if spec.direction != "bwd" or not getattr(spec, "deterministic", False):
        return False
    return any(k.role.name == "dq" for k in plan_of(spec).kernels)


def kernel_gemms(spec: KernelSpec) -> dict[str, int]:
    """Tile products (2 B_r B_c d FLOPs each) per visited tile pair, per kernel of the module:
    forward S = Q K^T and O += P V; backward S, dP, dV, dK and dQ (Algorithm 4); the
    deterministic backward's main kernel S, dP, dV, dK and its dq kernel S, dP (recomputed)
    and dQ += dS K -- seven instead of five."""
    if spec.direction == "fwd":
        return {"main": 2}
    if dq_kernel(spec):
        return {"main": 4, "dq": 3}
    return {"main": 5}


def nominal_flops(spec: KernelSpec, p: Workload) -> float:
    """FLOPs for TFLOP/s reporting: 4 B H Nq Nk d (x 2.5 backward, deterministic or not: the
    standard convention, so throughputs compare across modes), halved for causal."""
    f = 4.0 * p.batch * p.heads * p.seqlen_q * p.seqlen_k * spec.head_dim
    if spec.direction == "bwd":
        f *= BWD_FLOP_FACTOR
    return f / 2 if spec.causal else f


def visited_pairs(spec: KernelSpec, p: Workload, block_r: int, block_c: int) -> int:
    """Tile pairs the kernels visit, all (batch, head)s (``fagen.masking.tile_counts``)."""
    tc = tile_counts(p.seqlen_q, p.seqlen_k, block_r, block_c, spec.causal, spec.key_padding,
                     top_left=spec.causal_align == "top_left", attn_mask=spec.attn_mask)
    return tc["visited"] * p.batch * p.heads


def visited_flops(spec: KernelSpec, p: Workload, block_r: int, block_c: int) -> float:
    """FLOPs the kernels spend on the visited tile pairs (padding and masked elements inside
    them included): 2 B_r B_c d per tile product, ``kernel_gemms`` products per pair (7/2 of
    the forward's for the deterministic backward, 5/2 otherwise)."""
    gemms = sum(kernel_gemms(spec).values())
    return 2.0 * visited_pairs(spec, p, block_r, block_c) * block_r * block_c * spec.head_dim * gemms


def grid_blocks(spec: KernelSpec, p: Workload, role: str = "main") -> int:
    """Thread blocks of one kernel's grid (the family's launch geometry, ``KernelInfo.grid``)."""
    info = plan_of(spec).kernel(role)
    gx, gy, gz = info.grid(p.batch, p.heads, p.seqlen_q, p.seqlen_k, p.heads_kv)
    return gx * gy * gz


def main_grid_blocks(spec: KernelSpec, p: Workload) -> int:
    """Thread blocks of the main kernel's grid."""
    return grid_blocks(spec, p, "main")


def simt_pair_cost(spec: KernelSpec, br: int, bc: int) -> PairCost:
    """The SIMT family's cost of one tile pair (``fagen.families.simt``)."""
    return get_family("simt").pair_cost(spec.family_spec.with_tile(br, bc))  # type: ignore[return-value]


def as_loop_mix(loop: LoopMix | Mapping[str, int] | None) -> LoopMix | None:
    """A LoopMix; a plain opcode -> count mapping is a main loop without nested loops."""
    if loop is None or isinstance(loop, LoopMix):
        return loop
    return LoopMix(tuple(sorted(loop.items())), ())


def sass_issue_instructions(spec: KernelSpec, block_r: int, block_c: int,
                            loop: LoopMix | Mapping[str, int] | None,
                            dq_loop: LoopMix | Mapping[str, int] | None = None) -> float | None:
    """Warp instructions the module's kernels issue per visited tile pair, from their SASS: each
    warp of a kernel issues that kernel's FLOPs (``kernel_gemms``) / FLOPS_PER_MATH_INSTRUCTION /
    warps math instructions per pair, and the kernel's main-loop mix says how many instructions
    come with them (``sassloops.dynamic_instructions``). ``loop`` is the main kernel's mix,
    ``dq_loop`` the deterministic backward's dq kernel's. None when a kernel's mix is missing or
    has no math instruction (the model then uses the family's ``pair_cost`` for all kernels)."""
    plan = plan_of(spec)
    unit = plan.family.math_unit
    loops = {"main": as_loop_mix(loop), "dq": as_loop_mix(dq_loop)}
    threads = {k.role.name: k.threads for k in plan.kernels}
    total = 0.0
    for role, gemms in kernel_gemms(spec).items():
        mix = loops[role]
        if mix is None:
            return None
        warps = max(1, threads[role] // 32)
        flops = 2.0 * block_r * block_c * spec.head_dim * gemms
        per_warp = dynamic_instructions(mix, MATH_OPCODE[unit], flops / FLOPS_PER_MATH_INSTRUCTION[unit] / warps)
        if per_warp is None:
            return None
        total += per_warp * warps
    return total


@dataclass(frozen=True)
class Prediction:
    seconds: float
    hbm_bytes: float  # the IO analysis' traffic (``hbm_bytes``); ``dram_bytes`` of it reach HBM
    flops: float
    occupancy: Occupancy
    blocks: int
    waves: int
    wave_factor: float
    bound: str  # "hbm", "l2", "math", "exp", "smem", "issue", "atomics" or "occupancy"
    terms: dict[str, float]  # seconds of each roofline term at full occupancy, before quantisation
    dram_bytes: float = 0.0  # the traffic that misses the L2 (``l2_hit_fraction`` of the re-reads hit)

    @property
    def ms(self) -> float:
        return self.seconds * 1e3


def wave_factor(spec: KernelSpec, p: Workload, slots: int) -> float:
    """Wave quantisation of the module: per kernel with tile-pair work (``kernel_gemms``),
    waves * slots / blocks of its own grid, weighted by its share of the GEMMs (the kernels run
    one after the other, each taking its share of the limiting term). The dq kernel launches
    the main kernel's block with at most its shared memory: the same slots."""
    gemms = kernel_gemms(spec)
    q = 0.0
    for role, n in gemms.items():
        blocks = grid_blocks(spec, p, role)
        q += n * math.ceil(blocks / slots) * slots / blocks
    return q / sum(gemms.values())


def predict(spec: KernelSpec, p: Workload, registers: int, dev: DeviceModel,
            sass_loop: LoopMix | Mapping[str, int] | None = None,
            dq_sass_loop: LoopMix | Mapping[str, int] | None = None) -> Prediction:
    """Predicted wall time of one call of ``spec``'s module on workload ``p``; ``sass_loop`` is the
    main kernel's main-loop SASS mix (``sassloops.main_loop_mix``) when known, ``dq_sass_loop``
    the deterministic backward's dq kernel's (both needed for the SASS issue term)."""
    t = spec.tile
    plan = plan_of(spec)
    fam = plan.family
    occ = occupancy(spec.arch, launch_warps(spec), registers, spec.smem_bytes)
    blocks = main_grid_blocks(spec, p)
    launches = len(plan.kernels)
    traffic = hbm_bytes(spec, p, t.block_r, t.block_c)
    flops = visited_flops(spec, p, t.block_r, t.block_c)
    if occ.blocks_per_sm == 0:
        return Prediction(math.inf, traffic, flops, occ, blocks, 0, math.inf, "occupancy", {}, traffic)
    slots = dev.sm_count * occ.blocks_per_sm
    waves = math.ceil(blocks / slots)
    q = wave_factor(spec, p, slots)
    loop = as_loop_mix(sass_loop)
    pc = fam.pair_cost(plan.family_spec, None if loop is None else loop.merged())
    balance = pc.warp_balance(spec.num_warps) if pc is not None else 1.0
    busy_warps = occ.warps_per_sm * balance  # warps with work: a small tile leaves some idle
    hide = min(1.0, busy_warps / SATURATION_WARPS)
    n = visited_pairs(spec, p, t.block_r, t.block_c)
    again, _ = reread_bytes(spec, p, t.block_r, t.block_c)
    dram = traffic - l2_hit_fraction(spec, p, dev, slots) * again
    terms = {"hbm": dram / dev.hbm_bytes_per_s, "l2": traffic / dev.l2_bytes_per_s,
             "math": flops / dev.math_flops_per_s(fam.math_unit)}
    if spec.dtype != "float64":  # one exponential per score (float64 computes it in software: issue)
        exps = n * t.block_r * t.block_c * (2 if dq_kernel(spec) else 1)
        terms["exp"] = exps / dev.exps_per_s
    hidden = {k: v / hide for k, v in terms.items()}
    sm_clocks = dev.sm_count * dev.clock_hz
    from_sass = sass_issue_instructions(spec, t.block_r, t.block_c, sass_loop, dq_sass_loop)
    if from_sass is not None:
        terms["issue"] = n * from_sass / (4 * sm_clocks)
    elif pc is not None:
        terms["issue"] = n * pc.warp_instructions / (4 * sm_clocks)
    if "issue" in terms:
        hidden["issue"] = terms["issue"] / hide
    if pc is not None:
        terms["smem"] = n * pc.lds_wavefronts / sm_clocks
        smem_hide = min(1.0, busy_warps * pc.wavefronts_per_iteration / SMEM_LATENCY_CLOCKS) or 1.0
        hidden["smem"] = terms["smem"] / smem_hide
    atomics = pc.atomics if pc is not None and pc.atomics else (
        t.block_r * spec.head_dim if spec.direction == "bwd" and not dq_kernel(spec)
        else 0)  # dQ_i += dS_ij K_j (Algorithm 4 line 21); a backward with a dq kernel has none
    if atomics:
        terms["atomics"] = n * atomics / dev.atomics_per_s
        hidden["atomics"] = terms["atomics"]
    bound = max(hidden, key=lambda k: (hidden[k], k))
    seconds = hidden[bound] * q + launches * LAUNCH_SECONDS
    return Prediction(seconds, traffic, flops, occ, blocks, waves, q, bound, terms, dram)


def ceiling_tflops(spec: KernelSpec, p: Workload, registers: int, dev: DeviceModel,
                   sass_loop: LoopMix | Mapping[str, int] | None = None,
                   dq_sass_loop: LoopMix | Mapping[str, int] | None = None) -> float:
    """The model's predicted throughput (nominal FLOPs / predicted time), TFLOP/s."""
    return nominal_flops(spec, p) / predict(spec, p, registers, dev, sass_loop, dq_sass_loop).seconds / 1e12


def score(cands: list[Candidate], p: Workload, dev: DeviceModel) -> list[Candidate]:
    """Fill occupancy and predicted_ms of every ok candidate (others unchanged)."""
    out = []
    for c in cands:
        if c.status == "ok" and c.spec is not None and c.registers is not None:
            pred = predict(c.spec, p, c.registers, dev, c.sass_loop, c.dq_sass_loop)
            c = replace(c, occupancy=round(pred.occupancy.fraction, 4), predicted_ms=round(pred.ms, 6),
                        bound=pred.bound)
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
