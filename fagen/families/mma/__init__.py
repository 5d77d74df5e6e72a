"""Tensor-core family: mma.sync m16n8k16 (fp32 accumulate), ldmatrix, cp.async; fp16/bf16, sm_80+.

Backward: one CTA per (K/V block, batch, head), 16 K/V rows per warp (``block_c = 16 *
num_warps``); Q_i / dO_i / lse_i / D_i stream through a two-stage cp.async pipeline. At d = 128 on the
64 x 128 / 8-warp tile (``rules.bwd_2d``) the main kernel is FlashAttention-2's two-dimensional warp
layout instead (templates/mma/bwd_2d.cu.j2: S / dP / dQ_i in 32 x 32 blocks per warp, dK~ / dV~ in
32 keys x 64 columns, P and dS through shared memory).
Forward: one CTA per (Q block, batch, head), 16 or 32 Q rows per warp (``block_r`` up to 32 x
``num_warps``; by default 16); K_j / V_j stream through two stages, up to 256 keys a step (the default
at d <= 64 on sm_80 / sm_90, ``rules.fwd_widest_step``; a block's last step takes half the tile where
that covers its keys, ``rules.fwd_half_step``). The deterministic backward adds a ``dq``
kernel: one CTA per (Q block, batch, q head), 16 Q rows per warp (a Q block wider than the
warps in passes), K_j / V_j streamed in ascending order through the main kernel's K/V tiles and
Q/dO stage 1, S/dP/dS recomputed in sub-steps of ``dq_key_chunk`` keys and dQ_i accumulated in
fp32 registers, stored once without atomics. Every smem row has ``DPAD + 8``
elements (DPAD: the head dim rounded up to 16), an odd number of 16-byte units, so the
8 rows an ``ldmatrix`` phase reads fall in 8 different bank groups.

A v head dim of its own (``head_dim_v``, the feature "head_dim_v"; MLA: d = 192, dv = 128) in every
kernel role: V_j, dO_i, O and the O / dV~ accumulators, D = rowsum(dO o O) and their smem rows are
``HEAD_DIM_V`` wide (``DPAD_V``, row stride ``LD_V = DPAD_V + 8``), Q / K / dQ / dK ``HEAD_DIM``; the
smem layout (hence the tile choice and the autotuner's candidates) counts each, and the register
rules take the wider of the two (``_reg_dim``). The two-dimensional backward layout keeps one width:
such a spec's main kernel is the 16-K/V-rows-per-warp one. A spec with head_dim_v equal to head_dim
renders the very same source as one without.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from fagen.abi import Role
from fagen.arch import ARCHS
from fagen.families.base import (
    DEFAULT_NUM_WARPS,
    Constant,
    FamilyBase,
    FamilySpec,
    Knob,
    PairCost,
    Reason,
)
from fagen.families.mma.codegen import CODEGEN, CODEGEN_KNOBS, CodegenConfig, codegen_config, override_reason
from fagen.families.mma.cost import pair_cost
from fagen.families.mma.rules import (
    BWD_RESIDENT_WARPS,
    BWD_SHORT_STREAM_ROWS,
    BWD_STREAM_ROWS,
    BWD_WIDE_WARPS,
    DQ_FRAG_REGS,
    FWD_MAX_DROPOUT_BLOCK_C,
    FWD_WIDE_BLOCK_C,
    FWD_WIDE_WARP_EXCLUDED_FLAGS,
    MASKED_SCORE_MOD_STEP_REGS,
    MAX_REG_ACC_DIM,
    MAX_REG_KV_DIM,
    MAX_REG_Q_DIM,
    MAX_WIDE_WARP_Q_DIM,
    STAGES,
    SUPPORTED_DTYPES,
    acc_in_smem,
    bwd_2d,
    bwd_chunk_sub,
    bwd_chunk_unroll,
    bwd_do_stages,
    bwd_split_mask,
    bwd_wide_warps,
    dq_cols_at_once,
    dq_key_chunk,
    dq_warps_per_row_tile,
    dq_kv_stages,
    dq_rows,
    ds_ld,
    fwd_default_block_c,
    fwd_half_step,
    fwd_hold,
    fwd_m_tiles,
    fwd_s_split,
    fwd_q_in_regs,
    kv_in_regs,
    lse_now,
    padded_dim,
    q_in_regs,
)
from fagen.layout import SmemLayout, align_up, place

__all__ = ["DQ_FRAG_REGS", "MASKED_SCORE_MOD_STEP_REGS", "MAX_REG_ACC_DIM", "MAX_REG_KV_DIM", "MAX_REG_Q_DIM",
           "MAX_WIDE_WARP_Q_DIM", "MMA", "STAGES", "SUPPORTED_DTYPES", "MmaFamily", "acc_in_smem", "bwd_chunk_sub", "bwd_chunk_unroll",
           "bwd_split_mask", "dq_key_chunk", "dq_kv_stages", "dq_rows", "ds_ld", "fwd_default_block_c",
           "fwd_half_step", "fwd_m_tiles", "fwd_q_in_regs", "kv_in_regs", "lse_now", "padded_dim",
           "pair_cost", "q_in_regs"]

F32 = 4
CODEGEN_KNOB = {k.name: k for k in CODEGEN_KNOBS}


def _reg_dim(fs: FamilySpec) -> int:
    """The head dim the register rules (warps, default step, fragments in registers, chunk code) take:
    the wider of q/k's and v's (one and the same without ``head_dim_v``)."""
    return max(fs.head_dim, fs.dv)
#: Warps of the forward's default where its 16-row warps' 128-row Q block fits (``default_warps``).
FWD_WIDE_WARPS = 8


@dataclass(frozen=True)
class MmaFamily(FamilyBase):
    name: str = "mma"
    codegen_set: Any = CODEGEN  # its codegen knobs and table (fagen.families.mma.codegen)
    preference: int = 10  # preferred over the portable SIMT family wherever it applies
    tile_multiple: int = 16
    max_block_r: int = 128
    max_block_c: int = 256
    math_unit: Literal["fp32", "tensor"] = "tensor"
    knobs: tuple[Knob, ...] = (STAGES,)
    #: Spec features the templates implement (the masking rule's window and top-left alignment, the
    #: score modifications of partials/score_mod.cuh and dBias, varlen's packed sequences; GQA needs no
    #: flag), the bool attn_mask and the deterministic backward (its ``dq`` kernel). The combinations
    #: ``combination_reason`` declines take SIMT. Attention sinks: the forward's epilogue.
    features: frozenset[str] = frozenset({"window", "top_left", "softcap", "alibi", "attn_mask", "bias", "bias_grad",
                                          "varlen", "deterministic", "sinks", "head_dim_v"})
    #: Register budget per thread the launch bounds must leave (KernelSpec.min_blocks_per_sm): the
    #: fragments of S/P, dP/dS and the dK~/dV~ (or O) accumulators live in registers, so ptxas gets
    #: the whole register file rather than spilling to reach an occupancy.
    min_regs_per_thread: int = 255

    def unsupported_reason(self, fs: FamilySpec) -> str | None:
        dtype, arch = fs.dtype, fs.arch
        if dtype not in SUPPORTED_DTYPES:
            return (f"dtype={dtype} has no tensor-core path here (mma.sync m16n8k16 takes float16/bfloat16 "
                    "operands); use impl='simt'")
        if arch not in ARCHS or not ARCHS[arch].mma_sync:  # pragma: no cover - every spec arch has it
            return f"arch={arch}: mma.sync m16n8k16 with bf16 and cp.async need sm_80+"
        return None

    def combination_reason(self, fs: FamilySpec) -> str | None:
        """Register budget of the backward: its dK~/dV~ accumulators live in registers up to
        MAX_REG_ACC_DIM and take ``padded_dim`` of them; beside them, attn_mask together with a score
        modification needs MASKED_SCORE_MOD_STEP_REGS more. Where the sum passes the launch bounds'
        ``min_regs_per_thread`` (the registers the launch bounds leave a thread) the step's state
        does not fit, so the spec takes SIMT (impl=None) instead."""
        dp = (padded_dim(fs.head_dim) + padded_dim(fs.dv)) // 2  # dK~ / dV~: DPAD / 2 + DPAD_V / 2 registers
        score_mod = fs.has("softcap") or fs.has("alibi") or fs.has("bias")
        dims = f"head_dim={fs.head_dim}" + (f", head_dim_v={fs.dv}" if fs.dv != fs.head_dim else "")
        if (fs.direction == "bwd" and fs.has("attn_mask") and score_mod
                and not acc_in_smem(fs.head_dim, fs.dv) and dp + MASKED_SCORE_MOD_STEP_REGS > self.min_regs_per_thread):
            return (f"attn_mask with softcap/alibi/bias in the backward at {dims}: the dK~/dV~ "
                    f"accumulators ({dp} registers) and the masked score step ({MASKED_SCORE_MOD_STEP_REGS}) "
                    f"exceed {self.min_regs_per_thread} registers per thread")
        return None

    def config_reason(self, fs: FamilySpec) -> Reason | None:
        bad = super().config_reason(fs)
        if bad is not None:
            return bad
        # Each warp owns 16 rows of the CTA's own block (K/V rows backward, Q rows forward); a forward
        # warp may own 32 (two m16 tiles) up to padded head dim MAX_WIDE_WARP_Q_DIM.
        direction, num_warps = fs.direction, fs.num_warps
        if fwd_half_step(fs.block_c):  # past 128 keys: the forward without dropout only, in whole half steps
            limit, why = None, ""
            if direction == "bwd":
                limit, why = FWD_WIDE_BLOCK_C, "the backward's K/V block is its warps' 16 rows each"
            elif fs.has("dropout"):
                limit, why = FWD_MAX_DROPOUT_BLOCK_C, "the forward's dropout keep bits of a fragment row pair take 64 bits"
            if limit is not None:
                return Reason("block_c", f"block_c={fs.block_c} must be at most {limit} here ({self.name}: {why}; "
                                         f"{self.max_block_c} is the forward's limit without dropout)")
            if fs.block_c % 32:
                return Reason("block_c", f"block_c={fs.block_c} past {FWD_WIDE_BLOCK_C} must be a multiple of 32 "
                                         f"({self.name}: the forward's half step is whole k16 chunks of keys)")
        field, rows = ("block_c", fs.block_c) if direction == "bwd" else ("block_r", fs.block_r)
        if direction == "fwd" and rows > 16 * num_warps and padded_dim(_reg_dim(fs)) <= MAX_WIDE_WARP_Q_DIM:
            if rows > 32 * num_warps or rows % 32:
                return Reason(field, f"{field}={rows} must be at most 16 rows per warp x num_warps={num_warps}, or a "
                                     f"multiple of 32 up to 32 rows per warp ({self.name}: each warp owns 16 or 32 "
                                     "rows of the Q block)")
            return None
        if rows > 16 * num_warps:
            return Reason(field, f"{field}={rows} exceeds 16 rows per warp x num_warps={num_warps} "
                                 f"({self.name}: each warp owns 16 rows of the {'K/V' if direction == 'bwd' else 'Q'} block)")
        return None

    def tile_caps(self, fs: FamilySpec) -> tuple[int, int]:
        """Default tiles: the backward's warp-owned K/V block is 16 rows per warp, its streamed Q block
        at most BWD_STREAM_ROWS (``default_tile``). The forward's Q block is 16 rows per warp (at most
        max_block_r), streaming fwd_default_block_c keys per step (256 where ``fwd_widest_step`` holds
        and the tile fits the arch's shared memory, 128 up to d = 128, 64 beyond or with a data mask
        past d = 64)."""
        if fs.direction == "bwd":
            return BWD_STREAM_ROWS, 16 * fs.num_warps
        return min(16 * fs.num_warps, self.max_block_r), self._fwd_block_c(fs)

    def default_tile(self, fs: FamilySpec, sram_bytes: int) -> tuple[int, int] | None:
        """Backward: BWD_STREAM_ROWS Q rows per step x the warps' 16 K/V rows each when two such blocks
        fit sram_bytes (so an SM keeps two blocks' warps resident, as with the paper tile): a longer Q
        block spreads the per-step work (barriers, the copies' set-up, lse/D staging) over more
        tensor-core work (benchmarks/sass_cost.py, docs/performance.md); else BWD_SHORT_STREAM_ROWS.
        Forward: the caps (the tile issuing the fewest instructions per FLOP, docs/performance.md).
        Both are then shrunk until one block fits."""
        if fs.direction != "bwd":
            return self.tile_caps(fs)
        if fs.dv != fs.head_dim:
            # a v head dim of its own: the Q block of the wider dim's spec (the registers' measure),
            # shrunk then to fit this one
            return self.default_tile(dataclasses.replace(fs, head_dim=_reg_dim(fs), head_dim_v=0), sram_bytes)
        bc = 16 * fs.num_warps
        need = self.smem_layout(fs.with_tile(BWD_STREAM_ROWS, bc)).total_bytes
        blocks = max(1, BWD_RESIDENT_WARPS // fs.num_warps)
        return (BWD_STREAM_ROWS if blocks * need <= sram_bytes else BWD_SHORT_STREAM_ROWS), bc

    def default_warps(self, fs: FamilySpec) -> int:
        """The starting point of the warps (the runtime autotuner's search decides). Forward:
        FWD_WIDE_WARPS warps of 16 rows where their 128-row Q block fits the arch's shared memory beside
        its default K/V step (each K_j / V_j tile copied once for twice the rows); 4 where the 128-row
        block would shrink (its warps would idle) and with the per-element features of
        FWD_WIDE_WARP_EXCLUDED_FLAGS (their state takes registers beside the 8-warp tile). Backward: BWD_WIDE_WARPS where
        ``bwd_wide_warps`` says (128 K/V rows per CTA: each Q_i / dO_i tile copied, and each dQ_i
        row reduced, once for twice the keys: FlashAttention-2's 128 x 128 / 8 warps at d = 64,
        64 x 128 / 8 at d = 128) and their block of BWD_SHORT_STREAM_ROWS Q rows fits the arch's
        shared memory (else warps would idle beside a shrunk K/V block)."""
        if fs.direction == "bwd":
            if not bwd_wide_warps(_reg_dim(fs), fs.flags, ARCHS[fs.arch].capability):
                return DEFAULT_NUM_WARPS
            fits = self._fits_arch(fs, BWD_SHORT_STREAM_ROWS, 16 * BWD_WIDE_WARPS)
            return BWD_WIDE_WARPS if fits else DEFAULT_NUM_WARPS
        if fs.flags & FWD_WIDE_WARP_EXCLUDED_FLAGS:  # their per-element state beside 8 warps' tile
            return DEFAULT_NUM_WARPS
        fits = self._fits_arch(fs, 16 * FWD_WIDE_WARPS, self._fwd_block_c(fs))
        return FWD_WIDE_WARPS if fits else DEFAULT_NUM_WARPS

    def _fwd_block_c(self, fs: FamilySpec) -> int:
        """The forward's default keys per step (``fwd_default_block_c``): the widest step where one
        block of its 16-row warps' tile fits the arch's shared memory, else the next rule's."""
        cap = ARCHS[fs.arch].capability
        bc = fwd_default_block_c(_reg_dim(fs), fs.flags, cap)
        if bc > FWD_WIDE_BLOCK_C and not self._fits_arch(fs, 16 * FWD_WIDE_WARPS, bc):
            bc = fwd_default_block_c(_reg_dim(fs), fs.flags)
        return bc

    def _fits_arch(self, fs: FamilySpec, block_r: int, block_c: int) -> bool:
        """Does one block of this tile fit the arch's opt-in shared memory per block?"""
        return self.smem_layout(fs.with_tile(block_r, block_c)).total_bytes <= ARCHS[fs.arch].smem_optin_per_block

    def nvrtc_options(self, fs: FamilySpec) -> tuple[str, ...]:
        """``-default-device``: the backward's chunk step is a generic lambda (one body for the full and
        the partial tiles), which NVRTC 12 otherwise takes for a host function and refuses."""
        return ("-default-device",)

    def tile_work(self, fs: FamilySpec, role: str) -> dict[str, float] | None:
        """Per warp and tile pair of the main kernel: HMMA.16816 (5 GEMMs backward, 4 deterministic,
        2 forward, of 2 Br Bc DPAD FLOPs each; the forward one more per 16 x 16 of P~ for its row sums,
        two with dropout), 16-byte cp.async of the streamed tiles (Q_i and dO_i
        backward, K_j and V_j forward) and, backward with atomics, the dQ reductions (one fp32 add
        per element of dQ_i: vector pairs on sm_90 at an even head dim, ``RED``s on sm_80)."""
        if role != "main":
            return None
        w, dp, dpv = fs.num_warps, padded_dim(fs.head_dim), padded_dim(fs.dv)
        det = fs.has("deterministic")
        # GEMMs over the head dim / over the v head dim (S, dK~, dQ / O, dP, dV~)
        gemms, gemms_v = (1, 1) if fs.direction == "fwd" else (2 if det else 3, 2)
        hmma = (gemms * dp + gemms_v * dpv) * 2 * fs.block_r * fs.block_c / 4096
        if fs.direction == "fwd":  # l = rowsum(P~) as P~ times a ones column: one per m16 x k16 (dropout: per row half)
            hmma += fs.block_r * fs.block_c / 256 * (2 if fs.has("dropout") else 1)
        work = {"HMMA": hmma / w,
                "LDGSTS": (fs.block_c if fs.direction == "fwd" else fs.block_r) * (dp + dpv) / 8 / 32 / w}
        if fs.direction == "bwd" and not det:
            sm90 = ARCHS[fs.arch].capability >= (9, 0)
            vec = sm90 and fs.head_dim % 2 == 0
            work["REDG" if sm90 else "RED"] = fs.block_r * fs.head_dim / (2 if vec else 1) / 32 / w
        return work

    def codegen_reason(self, fs: FamilySpec) -> str | None:
        """Why the spec's codegen knob settings (``KernelSpec.codegen``) are not accepted (the knob
        named, and why), or None (fagen.families.mma.codegen.override_reason)."""
        return override_reason(fs, dict(fs.codegen)) if fs.codegen else None

    def codegen_config(self, fs: FamilySpec) -> CodegenConfig:
        """The spec's codegen knobs (fagen.families.mma.codegen: the stored search's table for the
        spec's class, else the starting points), one record per spec."""
        return codegen_config(fs)

    def template_context(self, fs: FamilySpec) -> dict[str, Any]:
        """The smem row strides and the templates' decisions (Constant): which fragments and
        accumulators live in registers, when the next step's lse/delta are stored, and the
        deterministic dq kernel's rows per pass, K/V stages and key sub-step."""
        d, t = fs.head_dim, fs.tile
        assert t is not None
        dp = padded_dim(d)
        strides = {"LD": dp + 8}
        consts = [Constant("DPAD", "int", dp, "head dim padded to the MMA k extent (zero columns)")]
        split = fs.dv != d  # a v head dim of its own: declared only then (the same source otherwise)
        if split:
            strides["LD_V"] = padded_dim(fs.dv) + 8
            consts.append(Constant("DPAD_V", "int", padded_dim(fs.dv), "v head dim padded to the MMA k extent"))
        rd = _reg_dim(fs)  # the register rules' head dim: the wider of the two
        config = self.codegen_config(fs)  # the codegen knobs: the stored search's table, else the rules

        def knob(*names: str) -> list[Constant]:
            out = []
            for name in names:
                k = CODEGEN_KNOB[name]
                v = config.value(name)
                out.append(Constant(k.constant, k.ctype, bool(v) if k.ctype == "bool" else v, k.help))
            return out

        if fs.direction == "bwd":
            strides["DS_LD"] = ds_ld(t.block_r)
            two_d = bwd_2d(d, fs.flags, t.block_r, t.block_c, fs.num_warps, fs.dv)
            consts += [
                Constant("BWD_2D", "bool", two_d,
                         "FlashAttention-2's two-dimensional warp layout (P and dS through shared memory)"),
                *knob("bwd_2d_fresh", "bwd_2d_pin"),
                Constant("DO_STAGES", "int", self._do_stages(fs) if two_d else 0,
                         "two-dimensional layout: dO_i buffers (1: the next one copied after dV~)"),
                Constant("ACC_IN_SMEM", "bool", acc_in_smem(d, fs.dv), "dK~/dV~ accumulators in smem instead of registers"),
                Constant("KV_IN_REGS", "bool", kv_in_regs(rd), "K_j / V_j A-fragments held in registers"),
                *knob("lse_now"),
                *knob("bwd_pin", "bwd_split_mask", "bwd_chunk_sub", "bwd_chunk_unroll"),
                *knob("dq_2d"),
                Constant("DQ_WPM", "int", dq_warps_per_row_tile(d, t.block_r, fs.num_warps),
                         "dQ_i tiles otherwise: warps sharing a 16-row tile"),
                Constant("DQ_NCC", "int", dq_cols_at_once(d, t.block_r, fs.num_warps),
                         "dQ_i tiles otherwise: 16-column tiles accumulated at a time"),
                Constant("DO_LATE", "bool", two_d and fs.knob_values.get(STAGES.name, STAGES.default) > 1
                         and self._do_stages(fs) == 1, "two-dimensional layout: the next dO_i copied after dV~"),
            ]
            if fs.has("deterministic"):
                stages = fs.knob_values.get(STAGES.name, STAGES.default)
                consts += [
                    Constant("DQ_ROWS", "int", dq_rows(t.block_r, fs.num_warps), "dq kernel: Q rows per pass"),
                    Constant("DQ_KV_STAGES", "int", dq_kv_stages(stages, t.block_r, t.block_c),
                             "dq kernel: K_j / V_j stages (stage 1 in Q_i / dO_i stage 1)"),
                    Constant("DQ_FRAG_REGS", "int", DQ_FRAG_REGS, "dq kernel: registers of S/dP and the dQ accumulator"),
                    Constant("DQ_KC", "int", dq_key_chunk(d, t.block_c), "dq kernel: keys per sub-step"),
                ]
        else:
            consts += [
                Constant("WARP_M_TILES", "int", fwd_m_tiles(t.block_r, fs.num_warps),
                         "m16 tiles of Q rows per warp (2: 32-row warps)"),
                Constant("FWD_S_SPLIT", "bool", fwd_s_split(t.block_r, fs.num_warps),
                         "S one m16 tile after the other (32-row warps)"),
                Constant("FWD_HOLD", "bool", fwd_hold(t.block_r, fs.num_warps, fs.flags),
                         "lane offsets and flags held over the K/V loop"),
                *knob("fwd_q_in_regs", "fwd_half_copy", "fwd_half_step", "fwd_dropout_16bit_sum"),
            ]
        return {"strides": strides, "constants": tuple(consts)}

    def smem_layout(self, fs: FamilySpec) -> SmemLayout:
        direction, head_dim, itemsize, block_r, block_c = fs.direction, fs.head_dim, fs.itemsize, fs.block_r, fs.block_c
        dp, dpv = padded_dim(head_dim), padded_dim(fs.dv)
        ld, ld_v = dp + 8, dpv + 8  # Q / K rows; V / dO rows (the v head dim's)
        stages = fs.knob_values.get(STAGES.name, STAGES.default)
        if direction == "bwd" and bwd_2d(head_dim, fs.flags, block_r, block_c, fs.num_warps, fs.dv):
            return self._bwd_2d_layout(fs, self._do_stages(fs))
        if direction == "bwd":
            entries = [
                ("k", "T", block_c * ld, itemsize),
                ("v", "T", block_c * ld_v, itemsize),
                ("q", "T", stages * block_r * ld, itemsize),
                ("do_", "T", stages * block_r * ld_v, itemsize),
                ("ds", "T", block_c * ds_ld(block_r), itemsize),
                ("lse", "float", stages * block_r, F32),
                ("delta", "float", stages * block_r, F32),
            ]
            if acc_in_smem(head_dim, fs.dv):
                entries += [("dk", "float", block_c * dp, F32), ("dv", "float", block_c * dpv, F32)]
            return place(entries)
        if direction == "fwd":
            return place([
                ("q", "T", block_r * ld, itemsize),
                ("k", "T", stages * block_c * ld, itemsize),
                ("v", "T", stages * block_c * ld_v, itemsize),
            ])
        raise ValueError(f"unknown direction {direction!r}")

    def _bwd_2d_layout(self, fs: FamilySpec, do_stages: int) -> SmemLayout:
        """The two-dimensional backward's shared memory with ``do_stages`` dO_i buffers: K_j, V_j, the Q_i
        stages, the dO_i buffers, P and dS (rows of block_c + 8), the lse_i / D_i stages."""
        stages = fs.knob_values.get(STAGES.name, STAGES.default)
        ld, ldp, itemsize = padded_dim(fs.head_dim) + 8, fs.block_c + 8, fs.itemsize
        return place([("k", "T", fs.block_c * ld, itemsize), ("v", "T", fs.block_c * ld, itemsize),
                      ("q", "T", stages * fs.block_r * ld, itemsize), ("do_", "T", do_stages * fs.block_r * ld, itemsize),
                      ("p", "T", fs.block_r * ldp, itemsize), ("ds", "T", fs.block_r * ldp, itemsize),
                      ("lse", "float", stages * fs.block_r, F32), ("delta", "float", stages * fs.block_r, F32)])

    def _do_stages(self, fs: FamilySpec) -> int:
        """The two-dimensional backward's dO_i buffers (``rules.bwd_do_stages``): one per stage when the
        layout with them fits the arch's opt-in shared memory per block."""
        stages = fs.knob_values.get(STAGES.name, STAGES.default)
        fits = self._bwd_2d_layout(fs, stages).total_bytes <= ARCHS[fs.arch].smem_optin_per_block
        return bwd_do_stages(stages, fits)

    def role_smem_bytes(self, fs: FamilySpec, role: Role) -> int:
        """The deterministic dq kernel carves the backward layout but uses its K/V tiles and Q/dO
        stages only (K_j/V_j stage 1 in Q/dO stage 1): the prefix up to dS^T."""
        if role.name == "dq":
            return align_up(next(b.offset for b in self.smem_layout(fs).buffers if b.name == "ds"))
        return super().role_smem_bytes(fs, role)

    def templates(self, direction: str) -> tuple[str, ...]:
        return {"bwd": ("mma/bwd.cu.j2",), "fwd": ("mma/fwd.cu.j2",)}[direction]

    def pair_cost(self, fs: FamilySpec, sass: Mapping[str, int] | None = None) -> PairCost:
        return pair_cost(fs, sass)


MMA = MmaFamily()
