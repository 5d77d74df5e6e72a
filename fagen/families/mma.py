"""Tensor-core family: mma.sync m16n8k16 (fp32 accumulate), ldmatrix, cp.async; fp16/bf16, sm_80+.

Backward: one CTA per (K/V block, batch, head), 16 K/V rows per warp (``block_c = 16 *
num_warps``); Q_i / dO_i / lse_i / D_i stream through a two-stage cp.async pipeline.
Forward: one CTA per (Q block, batch, head), 16 Q rows per warp (``block_r = 16 *
num_warps``); K_j / V_j stream through two stages. The deterministic backward adds a ``dq``
kernel: one CTA per (Q block, batch, q head), 16 Q rows per warp (a Q block wider than the
warps in passes), K_j / V_j streamed in ascending order through the main kernel's K/V tiles and
Q/dO stage 1, S/dP/dS recomputed in sub-steps of ``dq_key_chunk`` keys and dQ_i accumulated in
fp32 registers, stored once without atomics. Every smem row has ``DPAD + 8``
elements (DPAD: the head dim rounded up to 16), an odd number of 16-byte units, so the
8 rows an ``ldmatrix`` phase reads fall in 8 different bank groups.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ..abi import Role
from ..layout import SmemLayout, align_up, place
from . import FamilyBase, Knob, PairCost, Reason, register

if TYPE_CHECKING:  # pragma: no cover
    from ..spec import KernelSpec

F32 = 4
STAGES = Knob("stages", "s", 2, (1, 2), "cp.async pipeline depth of the streamed tiles (Q/dO backward, K/V forward): "
              "2 prefetches the next step while computing this one, 1 halves their shared memory")
#: Q rows the backward streams per step by default when two blocks of that tile fit the shared
#: memory (the K/V block is the warps' 16 rows each), else BWD_SHORT_STREAM_ROWS.
BWD_STREAM_ROWS = 128
BWD_SHORT_STREAM_ROWS = 64
#: dK~/dV~ live in registers up to this padded head dim, in smem beyond it.
MAX_REG_ACC_DIM = 128
SUPPORTED_DTYPES = ("float16", "bfloat16")
#: Registers the backward step holds besides its dK~/dV~ accumulators when attn_mask meets a score
#: modification (softcap, ALiBi, bias): the one-pass elementwise branch keeps the mask addressing and
#: the ScoreParams live together. Measured with ptxas (sm_90, every flag on): 242 registers at d = 96,
#: whose accumulators take 96.
MASKED_SCORE_MOD_STEP_REGS = 146


def padded_dim(head_dim: int) -> int:
    """The head dim rounded up to the MMA k extent (16); the extra columns are zero."""
    return -(-head_dim // 16) * 16


#: Registers the deterministic dq kernel's S/dP fragments and dQ accumulator may take together.
DQ_FRAG_REGS = 160


def dq_key_chunk(head_dim: int, block_c: int) -> int:
    """Keys per sub-step of the deterministic dq kernel (templates/mma/bwd.cu.j2 ``DQ_KC``): the
    widest multiple of 16 dividing block_c, at most 64, with padded_dim / 2 + keys <= DQ_FRAG_REGS."""
    for c in range(min(block_c, 64), 15, -16):
        if block_c % c == 0 and padded_dim(head_dim) // 2 + c <= DQ_FRAG_REGS:
            return c
    return 16


@dataclass(frozen=True)
class MmaFamily(FamilyBase):
    name: str = "mma"
    preference: int = 10  # preferred over the portable SIMT family wherever it applies
    tile_multiple: int = 16
    max_block_r: int = 128
    max_block_c: int = 128
    math_unit: Literal["fp32", "tensor"] = "tensor"
    knobs: tuple[Knob, ...] = (STAGES,)
    #: Spec features the templates implement (the masking rule's window and top-left alignment, the
    #: score modifications of partials/score_mod.cuh and dBias, varlen's packed sequences; GQA needs no
    #: flag), the bool attn_mask and the deterministic backward (its ``dq`` kernel). The combinations
    #: ``combination_reason`` declines take SIMT.
    features: frozenset[str] = frozenset({"window", "top_left", "softcap", "alibi", "attn_mask", "bias", "bias_grad",
                                          "varlen", "deterministic"})
    #: Register budget per thread the launch bounds must leave (KernelSpec.min_blocks_per_sm): the
    #: fragments of S/P, dP/dS and the dK~/dV~ (or O) accumulators live in registers, so ptxas gets
    #: the whole register file rather than spilling to reach an occupancy.
    min_regs_per_thread: int = 255

    def unsupported_reason(self, direction: str, head_dim: int, dtype: str, arch: str) -> str | None:
        if dtype not in SUPPORTED_DTYPES:
            return (f"dtype={dtype} has no tensor-core path here (mma.sync m16n8k16 takes float16/bfloat16 "
                    "operands); use impl='simt'")
        if arch < "sm_80":  # pragma: no cover - the spec admits sm_80+ only
            return f"arch={arch}: mma.sync m16n8k16 with bf16 and cp.async need sm_80+"
        return None

    def combination_reason(self, spec: "KernelSpec") -> str | None:
        """Register budget of the backward: its dK~/dV~ accumulators live in registers up to
        MAX_REG_ACC_DIM and take ``padded_dim`` of them; beside them, attn_mask together with a score
        modification needs MASKED_SCORE_MOD_STEP_REGS more. Where the sum passes the launch bounds'
        ``min_regs_per_thread`` ptxas spills, so the spec takes SIMT (impl=None) instead."""
        dp = padded_dim(spec.head_dim)
        if (spec.direction == "bwd" and spec.attn_mask and (spec.softcap or spec.alibi or spec.bias)
                and dp <= MAX_REG_ACC_DIM and dp + MASKED_SCORE_MOD_STEP_REGS > self.min_regs_per_thread):
            return (f"attn_mask with softcap/alibi/bias in the backward at head_dim={spec.head_dim}: the dK~/dV~ "
                    f"accumulators ({dp} registers) and the masked score step ({MASKED_SCORE_MOD_STEP_REGS}) "
                    f"exceed {self.min_regs_per_thread} registers per thread")
        return None

    def config_reason(self, direction: str, head_dim: int, dtype: str, arch: str, block_r: int, block_c: int,
                      num_warps: int, knobs: Mapping[str, int]) -> Reason | None:
        bad = super().config_reason(direction, head_dim, dtype, arch, block_r, block_c, num_warps, knobs)
        if bad is not None:
            return bad
        # Each warp owns 16 rows of the CTA's own block (K/V rows backward, Q rows forward).
        field, rows = ("block_c", block_c) if direction == "bwd" else ("block_r", block_r)
        if rows > 16 * num_warps:
            return Reason(field, f"{field}={rows} exceeds 16 rows per warp x num_warps={num_warps} "
                                 f"({self.name}: each warp owns 16 rows of the {'K/V' if direction == 'bwd' else 'Q'} block)")
        return None

    def tile_caps(self, direction: str, head_dim: int, num_warps: int) -> tuple[int, int]:
        """Default tiles: the warp-owned block is 16 rows per warp; the streamed one at most
        BWD_STREAM_ROWS in the backward (``default_tile``), 64 in the forward (two stages of it double the smem, and the
        forward's S/P fragments grow with it), 32 in the forward beyond d = 128, where the O
        accumulator takes half the registers."""
        own = 16 * num_warps
        if direction == "bwd":
            return BWD_STREAM_ROWS, own
        return own, 64 if padded_dim(head_dim) <= MAX_REG_ACC_DIM else 32

    def default_tile(self, direction: str, head_dim: int, itemsize: int, sram_bytes: int, num_warps: int,
                     knobs: Mapping[str, int]) -> tuple[int, int] | None:
        """Backward: BWD_STREAM_ROWS Q rows per step x the warps' 16 K/V rows each when two such blocks
        fit sram_bytes (so an SM keeps two blocks' warps resident, as with the paper tile): a longer Q
        block spreads the per-step work (barriers, the copies' set-up, lse/D staging) over more
        tensor-core work (benchmarks/sass_cost.py, docs/performance.md); else BWD_SHORT_STREAM_ROWS.
        Both are then shrunk until one block fits. Forward: the paper point."""
        if direction != "bwd":
            return None
        bc = 16 * num_warps
        need = self.smem_layout(direction, head_dim, itemsize, BWD_STREAM_ROWS, bc, knobs).total_bytes
        return (BWD_STREAM_ROWS if 2 * need <= sram_bytes else BWD_SHORT_STREAM_ROWS), bc

    def template_context(self, spec: "KernelSpec") -> dict[str, Any]:
        return {"strides": {"LD": padded_dim(spec.head_dim) + 8}, "dq_frag_regs": DQ_FRAG_REGS,
                "dq_key_chunk": dq_key_chunk(spec.head_dim, spec.tile.block_c)}

    def smem_layout(self, direction: str, head_dim: int, itemsize: int, block_r: int, block_c: int,
                    knobs: Mapping[str, int] | None = None) -> SmemLayout:
        dp = padded_dim(head_dim)
        ld = dp + 8
        stages = (knobs or {}).get(STAGES.name, STAGES.default)
        if direction == "bwd":
            entries = [
                ("k", "T", block_c * ld, itemsize),
                ("v", "T", block_c * ld, itemsize),
                ("q", "T", stages * block_r * ld, itemsize),
                ("do_", "T", stages * block_r * ld, itemsize),
                ("ds", "T", block_c * (block_r + 8), itemsize),
                ("lse", "float", stages * block_r, F32),
                ("delta", "float", stages * block_r, F32),
            ]
            if dp > MAX_REG_ACC_DIM:
                entries += [("dk", "float", block_c * dp, F32), ("dv", "float", block_c * dp, F32)]
            return place(entries)
        if direction == "fwd":
            return place([
                ("q", "T", block_r * ld, itemsize),
                ("k", "T", stages * block_c * ld, itemsize),
                ("v", "T", stages * block_c * ld, itemsize),
            ])
        raise ValueError(f"unknown direction {direction!r}")

    def role_smem_bytes(self, spec: "KernelSpec", role: Role) -> int:
        """The deterministic dq kernel carves the backward layout but uses its K/V tiles and Q/dO
        stages only (K_j/V_j stage 1 in Q/dO stage 1): the prefix up to dS^T."""
        if role.name == "dq":
            return align_up(next(b.offset for b in spec.smem_layout.buffers if b.name == "ds"))
        return super().role_smem_bytes(spec, role)

    def templates(self, direction: str) -> tuple[str, ...]:
        return {"bwd": ("mma/bwd.cu.j2",), "fwd": ("mma/fwd.cu.j2",)}[direction]

    # ------------------------------------------------------------------ autotuner cost
    def tile_work(self, spec: "KernelSpec", role: str) -> dict[str, float] | None:
        """Per warp and tile pair of the main kernel: HMMA.16816 (5 GEMMs backward, 4 deterministic,
        2 forward, of 2 Br Bc DPAD FLOPs each), 16-byte cp.async of the streamed tiles (Q_i and dO_i
        backward, K_j and V_j forward) and, backward with atomics, the dQ reductions (one fp32 add
        per element of dQ_i: vector pairs on sm_90 at an even head dim, ``RED``s on sm_80)."""
        if role != "main":
            return None
        t, w, dp = spec.tile, spec.num_warps, padded_dim(spec.head_dim)
        gemms = 2 if spec.direction == "fwd" else 4 if spec.deterministic else 5
        work = {"HMMA": gemms * 2 * t.block_r * t.block_c * dp / 4096 / w,
                "LDGSTS": 2 * (t.block_c if spec.direction == "fwd" else t.block_r) * dp / 8 / 32 / w}
        if spec.direction == "bwd" and not spec.deterministic:
            vec = spec.arch >= "sm_90" and spec.head_dim % 2 == 0
            work["REDG" if spec.arch >= "sm_90" else "RED"] = t.block_r * spec.head_dim / (2 if vec else 1) / 32 / w
        return work

    def pair_cost(self, spec: "KernelSpec", block_r: int, block_c: int,
                  sass: Mapping[str, int] | None = None) -> PairCost:
        """One visited tile pair of the templates, counted per warp: mma.sync m16n8k16 (one
        dependent math op each), ldmatrix.x4 (4 conflict-free wavefronts each: 8 rows of 16 B
        in 8 different bank groups), the dS^T stores, and the element-wise work on the
        accumulators (exp2, mask, dropout, conversions). The model takes the issued
        instructions from the kernel's own SASS when it has it; these counts are its fallback
        and the source of the shared-memory and warp-balance terms."""
        dp, w = padded_dim(spec.head_dim), spec.num_warps
        kd = dp // 16  # k16 steps across the head dim
        if spec.direction == "bwd":
            active = block_c // 16  # warps owning K/V rows
            chunks = block_r // 16  # 16 Q rows at a time
            kv_ldsm = 0 if dp <= 64 else 2 * kd  # K/V A-fragments from registers up to d = 64
            hmma = chunks * 8 * kd  # S^T, dP^T, dV~, dK~
            ldsm = chunks * (kv_ldsm + 2 * kd + 2 * kd)
            elementwise = chunks * 8 * (12 + (20 if spec.dropout else 0))  # 8 elements per lane per chunk
            units = chunks * kd  # dQ: (16 Q rows x 16 columns) tiles shared by all warps
            if getattr(spec, "deterministic", False):
                # main: S^T, dP^T, dV~, dK~ (no dS^T, no dQ); the dq kernel (16 Q rows per warp) recomputes
                # S = Q K^T and dP = dO V^T and adds dQ += dS K: 3 of the pair's 7 GEMMs, 3 ldmatrix.x4
                # per (k16 step, 16 keys) (K, V, K^T) and Q, dO once per (k16 step, key sub-step), its
                # element-wise work on S/dP.
                nc = block_c // 16
                dq_hmma = chunks * 6 * nc * kd  # 3 GEMMs of 16 x 16nc x 16kd: 2 n8 tiles per (16 keys, k16 step)
                sub_steps = block_c // dq_key_chunk(spec.head_dim, block_c)
                dq_ldsm = chunks * (sub_steps * 2 * kd + 2 * nc * kd + nc * kd)
                busiest = hmma + math.ceil(chunks / w) * 6 * nc * kd
                total_hmma = active * hmma + dq_hmma
                total_ldsm = active * ldsm + dq_ldsm
                instr = total_hmma + total_ldsm + 2 * active * elementwise
                return PairCost(lds_wavefronts=4.0 * total_ldsm, warp_instructions=float(instr),
                                warp_iterations=float(total_hmma), busiest_warp_iterations=float(busiest), atomics=0.0)
            dq_hmma, dq_ldsm = units * 2 * (block_c // 16), units * 2 * (block_c // 16)
            busiest = hmma + math.ceil(units / w) * 2 * (block_c // 16)
            stores = active * chunks * 4  # dS^T, 4 x 32-bit per lane per chunk
            total_hmma = active * hmma + dq_hmma
            total_ldsm = active * ldsm + dq_ldsm
            instr = total_hmma + total_ldsm + stores + active * elementwise + dq_hmma * 2  # + dQ atomics
            return PairCost(lds_wavefronts=4.0 * total_ldsm + stores + active * chunks * 4,
                            warp_instructions=float(instr), warp_iterations=float(total_hmma),
                            busiest_warp_iterations=float(busiest), atomics=float(block_r * spec.head_dim))
        active = block_r // 16  # warps owning Q rows
        q_ldsm = 0 if dp <= 128 else kd  # Q A-fragments from registers up to d = 128
        hmma = kd * (block_c // 8) + (block_c // 16) * (dp // 8)  # S = Q K^T, O += P V
        ldsm = q_ldsm + kd * (block_c // 16) + (block_c // 16) * kd
        elementwise = (block_c // 8) * 4 * (10 + (10 if spec.dropout else 0)) + (dp // 8) * 4  # softmax, O rescale
        return PairCost(lds_wavefronts=4.0 * active * ldsm, warp_instructions=float(active * (hmma + ldsm + elementwise)),
                        warp_iterations=float(active * hmma), busiest_warp_iterations=float(hmma), atomics=0.0)


MMA = register(MmaFamily())
