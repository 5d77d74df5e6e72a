"""The mma family's codegen knobs: the code-shape choices that only trade speed, their legal ranges and
their starting points (the hand-written rules of :mod:`fagen.families.mma.rules`), as one
:class:`~fagen.families.codegen.CodegenSet` (:data:`CODEGEN`; the config record, the table lookup and
the user's settings are :mod:`fagen.families.codegen`'s). The module-level functions are
:data:`CODEGEN`'s methods.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from fagen.arch import ARCHS
from fagen.families.base import FamilySpec
from fagen.families.codegen import (
    TABLE_FORMAT,
    CodegenConfig,
    CodegenKnob,
    CodegenSet,
    KnobValue,
    class_key,
    forcing,
    nvrtc_major,
)
from fagen.families.codegen import always_legal as _always
from fagen.families.codegen import clear_tables as clear_table
from fagen.families.mma.rules import (
    FWD_WIDE_BLOCK_C,
    MAX_REG_Q_DIM,
    bwd_2d,
    bwd_2d_fresh,
    bwd_2d_pin,
    bwd_chunk_sub,
    bwd_chunk_unroll,
    bwd_pin,
    bwd_split_mask,
    dq_2d,
    fwd_dropout_16bit_sum,
    fwd_half_copy,
    fwd_half_step,
    fwd_m_tiles,
    fwd_q_in_regs,
    lse_now,
    padded_dim,
)

__all__ = ["CODEGEN", "CODEGEN_KNOBS", "TABLE_FORMAT", "REGISTER_FILE", "TABLE_PATH", "CodegenConfig", "CodegenKnob", "KnobValue",
           "class_key", "clear_table", "codegen_config", "forcing", "illegal_reason", "knobs_for", "load_table",
           "nvrtc_major", "override_reason", "start_values"]

#: Registers one thread can address (the launch bounds leave all of them to the mma kernels): fragments
#: a knob holds in registers beyond this cannot live there.
REGISTER_FILE = 255
#: The table the stored search writes and the family reads.
TABLE_PATH = Path(__file__).with_name("codegen_table.json")


def _reg_dim(fs: FamilySpec) -> int:
    return max(fs.head_dim, fs.dv)


def _cap(fs: FamilySpec) -> tuple[int, int]:
    return ARCHS[fs.arch].capability


def _two_d(fs: FamilySpec) -> bool:
    return bwd_2d(fs.head_dim, fs.flags, fs.block_r, fs.block_c, fs.num_warps, fs.dv)


def _one_d(fs: FamilySpec) -> bool:
    return fs.direction == "bwd" and not _two_d(fs)


def _chunk_sub_legal(fs: FamilySpec, v: int) -> str | None:
    if fs.block_r % (16 * v):
        return f"{v} sub-chunks of 16 rows do not divide the Q block's {fs.block_r} rows"
    return None


def _chunks(fs: FamilySpec, sub: int) -> int:
    return fs.block_r // (16 * sub)


def _split_legal(fs: FamilySpec, v: int) -> str | None:
    if v and fs.block_r % 32:
        return f"the split chunk code takes pairs of 16-row chunks: the Q block's {fs.block_r} rows are not"
    return None


def _unroll_legal(fs: FamilySpec, v: int) -> str | None:
    if v > 1 and _chunks(fs, 1) % v:
        return f"{v} chunks per trip do not divide the Q block's {_chunks(fs, 1)} chunks"
    return None


def _dq_2d_legal(fs: FamilySpec, v: int) -> str | None:
    if v and not dq_2d(fs.head_dim, fs.block_r, fs.num_warps):
        return (f"32 x 32 blocks, one per warp, do not tile dQ_i ({fs.block_r} Q rows, head dim {fs.head_dim}, "
                f"{fs.num_warps} warps: whole k16 steps, 32-row blocks, as many blocks as warps)")
    return None


def _q_regs_legal(fs: FamilySpec, v: int) -> str | None:
    if not v:
        return None
    if fwd_m_tiles(fs.block_r, fs.num_warps) != 1:
        return "32-row warps read Q_i from shared memory (their A-fragments are not held)"
    dp, dpv = padded_dim(fs.head_dim), padded_dim(fs.dv)
    regs = dp // 4 + fs.block_c // 2 + dpv // 2
    if regs > REGISTER_FILE:
        return f"Q, S and O fragments take {regs} registers, past the {REGISTER_FILE} a thread has"
    if dp > MAX_REG_Q_DIM:
        return f"padded head dim {dp} past MAX_REG_Q_DIM ({MAX_REG_Q_DIM})"
    return None


def _half_copy_legal(fs: FamilySpec, v: int) -> str | None:
    if v and not (fwd_half_copy(fs.head_dim, fs.num_warps) and fwd_half_copy(fs.dv, fs.num_warps)):
        return "a row's 16-byte chunks do not divide half the threads (whole warps per half)"
    return None


def _half_step_legal(fs: FamilySpec, v: int) -> str | None:
    if v and fs.block_c % 32:
        return f"half of {fs.block_c} keys is not whole k16 chunks"
    if v and fs.has("dropout") and fs.block_c > FWD_WIDE_BLOCK_C:
        return "dropout's keep bits of a fragment row pair hold at most FWD_MAX_DROPOUT_BLOCK_C keys"
    return None


CODEGEN_KNOBS: tuple[CodegenKnob, ...] = (
    CodegenKnob("bwd_2d_fresh", "BWD_2D_FRESH", "bool", "bwd", (0, 1), _two_d, _always,
                lambda fs: int(_two_d(fs) and bwd_2d_fresh(_cap(fs), fs.flags)),
                "two-dimensional layout: the K/V and Q/dO k-major lane offsets derived afresh each step"),
    CodegenKnob("bwd_2d_pin", "BWD_2D_PIN", "bool", "bwd", (0, 1), _two_d, _always,
                lambda fs: int(_two_d(fs) and bwd_2d_pin(_cap(fs), fs.flags)),
                "two-dimensional layout: the lanes' offsets and pointers pinned before the loop (fa_pin)"),
    CodegenKnob("lse_now", "LSE_NOW", "bool", "bwd", (0, 1), lambda fs: fs.direction == "bwd", _always,
                lambda fs: int(lse_now(fs.flags)),
                "the next step's lse_i / D_i stored at once, not at the step's end"),
    CodegenKnob("bwd_pin", "BWD_PIN", "bool", "bwd", (0, 1),
                lambda fs: _one_d(fs) and fs.dv == fs.head_dim, _always,
                lambda fs: int(_one_d(fs) and fs.dv == fs.head_dim and bwd_pin(fs.head_dim, fs.flags, _cap(fs))),
                "the lanes' fragment offsets and dS^T pointer pinned before the loop (fa_pin)"),
    CodegenKnob("bwd_split_mask", "BWD_SPLIT_MASK", "bool", "bwd", (0, 1), _one_d, _split_legal,
                lambda fs: int(bwd_split_mask(_reg_dim(fs), fs.flags, fs.block_r)),
                "separate chunk code for fully visible and partial tiles"),
    CodegenKnob("bwd_chunk_sub", "BWD_CHUNK_SUB", "int", "bwd", (1, 2), _one_d, _chunk_sub_legal,
                lambda fs: bwd_chunk_sub(_reg_dim(fs), fs.flags, fs.block_r),
                "16-Q-row sub-chunks per chunk of the chunk loop"),
    CodegenKnob("bwd_chunk_unroll", "BWD_CHUNK_UNROLL", "int", "bwd", (1, 2), _one_d, _unroll_legal,
                lambda fs: bwd_chunk_unroll(_reg_dim(fs), fs.flags, fs.block_r, _cap(fs)),
                "chunks per trip of the chunk loop"),
    CodegenKnob("dq_2d", "DQ_2D", "bool", "bwd", (0, 1), lambda fs: _one_d(fs) and not fs.has("deterministic"),
                _dq_2d_legal, lambda fs: int(dq_2d(fs.head_dim, fs.block_r, fs.num_warps)),
                "dQ_i += dS K_j in 32 x 32 blocks, one per warp"),
    CodegenKnob("fwd_q_in_regs", "Q_IN_REGS", "bool", "fwd", (0, 1), lambda fs: fs.direction == "fwd", _q_regs_legal,
                lambda fs: int(fwd_q_in_regs(fs.head_dim, fs.block_r, fs.num_warps, fs.block_c, fs.flags, fs.dv)),
                "Q_i A-fragments held in registers"),
    CodegenKnob("fwd_half_copy", "FWD_HALF_COPY", "bool", "fwd", (0, 1), lambda fs: fs.direction == "fwd",
                _half_copy_legal,
                lambda fs: int(fwd_half_copy(fs.head_dim, fs.num_warps) and fwd_half_copy(fs.dv, fs.num_warps)),
                "each half of the threads copies one of K_j / V_j"),
    CodegenKnob("fwd_half_step", "FWD_HALF_STEP", "bool", "fwd", (0, 1), lambda fs: fs.direction == "fwd",
                _half_step_legal, lambda fs: int(fwd_half_step(fs.block_c)),
                "a block's last step over at most half the tile's keys steps that half alone",
                unsearched="its gain is the tensor-core work of a block's last step (causal diagonal, short "
                           "sequences), which the steady-state tile loop does not run"),
    CodegenKnob("fwd_dropout_16bit_sum", "FWD_DROPOUT_L16", "bool", "fwd", (0, 1),
                lambda fs: fs.direction == "fwd" and fs.has("dropout"), _always,
                lambda fs: int(fwd_dropout_16bit_sum(_reg_dim(fs), fs.flags, _cap(fs))),
                "dropout: O divided by the row sum of the 16-bit P~ of every key (not the fp32 sum)",
                unsearched="it chooses O's normaliser (the 16-bit gradients' accuracy), not only speed: a search "
                           "ranked by cost would always take the fp32 sum"),
)


def _chunk_joint(fs: FamilySpec, values: Mapping[str, int]) -> str | None:
    """Legality across knobs: chunks per trip must divide the Q block's chunks of ``bwd_chunk_sub`` rows."""
    sub, unroll = values.get("bwd_chunk_sub", 1), values.get("bwd_chunk_unroll", 1)
    if unroll > 1 and fs.block_r % (16 * sub * unroll):
        return f"bwd_chunk_unroll={unroll} chunks of {16 * sub} rows do not divide the Q block's {fs.block_r} rows"
    return None


#: The mma family's codegen knobs and its table.
CODEGEN = CodegenSet("mma", CODEGEN_KNOBS, TABLE_PATH, joint=lambda fs, v: _chunk_joint(fs, v) if fs.direction == "bwd"
                     else None)

knobs_for = CODEGEN.knobs_for
start_values = CODEGEN.start_values
illegal_reason = CODEGEN.illegal_reason
override_reason = CODEGEN.override_reason


def load_table(path: Path | None = None) -> dict[str, dict]:
    """The stored search's table: class key -> {"values": {knob: value}, ...} (empty when absent)."""
    return CODEGEN.load_table(path)


def codegen_config(fs: FamilySpec, *, table: Path | None = None, major: int | None | str = "current") -> CodegenConfig:
    """The spec's codegen config record (:meth:`fagen.families.codegen.CodegenSet.config`)."""
    return CODEGEN.config(fs, table=table, major=major)
