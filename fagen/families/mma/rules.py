"""The mma family's decisions, stated once: what lives in registers, the strides, the dq kernel's
sub-steps. The family's ``template_context`` emits them as constants (templates/mma/ receives
them), its smem layout and its cost model (fagen.families.mma.cost) use the same functions.

Each rule is one of two kinds. A legality fact (the register file, shared memory, divisibility, the
layout a kernel has) says what a kernel can be. A starting point says where a search begins: the
code-shape rules (``bwd_pin``, ``bwd_split_mask``, ``bwd_chunk_sub``, ``bwd_chunk_unroll``,
``bwd_2d_fresh``, ``bwd_2d_pin``, ``lse_now``, ``dq_2d``, ``fwd_q_in_regs``, ``fwd_half_copy``,
``fwd_half_step``, ``fwd_dropout_16bit_sum``) start the family's codegen knobs
(fagen.families.mma.codegen: the stored search, ``fagen tune-codegen``, decides per class, a user
setting, ``KernelSpec.codegen``, before it), the default tile and warps (``bwd_wide_warps``,
``fwd_default_block_c``) start the runtime autotuner's search. The measurements behind the starting
points are in docs/autotune.md ("Starting points and why")."""
from __future__ import annotations

from fagen.families.base import Knob, k16_padded

STAGES = Knob("stages", "s", 2, (1, 2), "cp.async pipeline depth of the streamed tiles (Q/dO backward, K/V forward): "
              "2 prefetches the next step while computing this one, 1 halves their shared memory")
#: dK~/dV~ live in registers up to this padded head dim, in smem beyond it.
MAX_REG_ACC_DIM = 128
#: The backward holds the K_j / V_j A-fragments in registers up to this padded head dim.
MAX_REG_KV_DIM = 64
#: The forward holds the Q_i A-fragments in registers up to this padded head dim.
MAX_REG_Q_DIM = 128
SUPPORTED_DTYPES = ("float16", "bfloat16")
#: Registers the backward step holds besides its dK~/dV~ accumulators when attn_mask meets a score
#: modification (softcap, ALiBi, bias): the one-pass elementwise branch keeps the mask addressing and
#: the ScoreParams live together: with the dK~/dV~ accumulators past the register file, the spec is
#: declined (``MmaFamily.combination_reason``, a legality fact).
MASKED_SCORE_MOD_STEP_REGS = 146


#: Q rows the backward streams per step by default when two blocks of that tile fit the shared
#: memory (the K/V block is the warps' 16 rows each), else BWD_SHORT_STREAM_ROWS.
BWD_STREAM_ROWS = 128
BWD_SHORT_STREAM_ROWS = 64
#: Warps per SM the backward's default tile keeps resident: BWD_STREAM_ROWS Q rows when that many
#: warps' blocks of it fit the shared memory.
BWD_RESIDENT_WARPS = 8
#: The backward's warps where ``bwd_wide_warps`` holds (else 4).
BWD_WIDE_WARPS = 8


#: Starting point of the backward's warps on compute capability 8.0 past d = 64: per-element features
#: whose state beside the 8-warp tile's fragments starts at 4 warps, unless one of the excluded flags
#: is also set (those start at 8); the runtime autotuner's search decides.
BWD_SM80_NARROW_FLAGS = frozenset({"key_padding", "alibi", "bias"})
BWD_SM80_NARROW_EXCLUDED_FLAGS = frozenset({"dropout", "deterministic"})


def bwd_wide_warps(head_dim: int, flags: frozenset[str] = frozenset(),
                   capability: tuple[int, int] | None = None) -> bool:
    """Backward, starting point of the warps: BWD_WIDE_WARPS (128 K/V rows per CTA) up to padded head
    dim MAX_REG_ACC_DIM, where dK~ / dV~ live in registers (legality: past it they are in smem), but
    4 for a window together with varlen past d = 64, and past d = 64 on compute capability 8.0 with
    BWD_SM80_NARROW_FLAGS and none of BWD_SM80_NARROW_EXCLUDED_FLAGS. The runtime autotuner's search
    decides among the candidates."""
    dp = padded_dim(head_dim)
    if (capability == (8, 0) and dp > 64 and flags & BWD_SM80_NARROW_FLAGS
            and not flags & BWD_SM80_NARROW_EXCLUDED_FLAGS):
        return False
    return dp <= MAX_REG_ACC_DIM and not ({"window", "varlen"} <= flags and dp > 64)


#: The head dim rounded up to the MMA k extent (16); the extra columns are zero.
padded_dim = k16_padded


def acc_in_smem(head_dim: int, head_dim_v: int = 0) -> bool:
    """Backward: dK~/dV~ accumulators in smem (fragment order) instead of registers: past padded head
    dim MAX_REG_ACC_DIM, of the wider of head_dim and ``head_dim_v`` (0: head_dim's): the register file
    holds the accumulators of one head dim up to MAX_REG_ACC_DIM beside the step's fragments (not of
    their sum: d = 64 beside dv = 192 takes dv = 192's smem accumulators)."""
    return padded_dim(max(head_dim, head_dim_v)) > MAX_REG_ACC_DIM


def kv_in_regs(head_dim: int) -> bool:
    """Backward: the K_j / V_j A-fragments held in registers over the inner loop."""
    return padded_dim(head_dim) <= MAX_REG_KV_DIM


def q_in_regs(head_dim: int) -> bool:
    """Forward: the Q_i A-fragments held in registers over the inner loop."""
    return padded_dim(head_dim) <= MAX_REG_Q_DIM


#: The forward's warps may own 32 Q rows (two m16 tiles: each V fragment feeds 4 HMMAs) up to this
#: padded head dim; beyond it the O accumulator of 32 rows would not fit the registers.
MAX_WIDE_WARP_Q_DIM = 128


#: The forward's default K/V step up to this padded head dim is FWD_WIDE_BLOCK_C keys.
MAX_WIDE_STEP_DIM = 128
FWD_WIDE_BLOCK_C = 128
#: ... and FWD_WIDEST_BLOCK_C keys up to MAX_WIDEST_STEP_DIM on the compute capabilities of
#: FWD_WIDEST_STEP_CAPABILITIES for specs without FWD_WIDEST_EXCLUDED_FLAGS (the per-element features,
#: and a window: its two bounds per row beside the half step's second copy of the step). A starting
#: point of the default tile; the runtime autotuner's search decides.
MAX_WIDEST_STEP_DIM = 64
FWD_WIDEST_BLOCK_C = 256
FWD_WIDEST_STEP_CAPABILITIES = frozenset({(8, 0), (9, 0)})
#: Past FWD_WIDE_BLOCK_C keys the forward steps the tile's first half alone where the block needs no
#: more (``fwd_half_step``); its dropout keep bits of a fragment row pair are at most 64 (``FWD_MAX_DROPOUT_BLOCK_C``).
FWD_MAX_DROPOUT_BLOCK_C = 128


#: Spec flags whose per-element work (the data masks' loads, the keep bits, score modifications)
#: needs registers beside the fragments; the forward's default tile is narrower with them.
FWD_DATA_MASK_FLAGS = frozenset({"key_padding", "attn_mask"})
FWD_WIDE_WARP_EXCLUDED_FLAGS = FWD_DATA_MASK_FLAGS | {"dropout", "softcap", "alibi", "bias"}
FWD_WIDEST_EXCLUDED_FLAGS = FWD_WIDE_WARP_EXCLUDED_FLAGS | {"window"}


#: With an additive bias the forward's default step is 64 keys up to this padded head dim, 32 beyond
#: it (a starting point: its per-element loads take registers beside the keys of S).
FWD_BIAS_WIDE_STEP_DIM = 96


def fwd_widest_step(head_dim: int, capability: tuple[int, int] | None, flags: frozenset[str] = frozenset()) -> bool:
    """Forward: does the default step FWD_WIDEST_BLOCK_C keys? Up to padded head dim MAX_WIDEST_STEP_DIM
    on FWD_WIDEST_STEP_CAPABILITIES without per-element features or a window: O's rescale (one multiply per
    accumulator element a step), the row reductions, the copy set-up and the barrier are per step,
    so 256 keys halve them per FLOP beside 128 (benchmarks/sass_cost.py, d = 64: 1060 against 1141
    instructions per 1e6 FLOPs on sm_80, 1064 against 1109 for 32-row warps on sm_90; d = 32: 1690
    against 1823 / 1698 against 1715). The block's last step takes half the tile where that covers its
    keys (``fwd_half_step``), so causal's diagonal and short sequences do no more tensor-core work than
    with 128 keys."""
    return (padded_dim(head_dim) <= MAX_WIDEST_STEP_DIM and capability in FWD_WIDEST_STEP_CAPABILITIES
            and not flags & FWD_WIDEST_EXCLUDED_FLAGS)


def fwd_default_block_c(head_dim: int, flags: frozenset[str] = frozenset(),
                        capability: tuple[int, int] | None = None) -> int:
    """Forward: the default keys per K/V step. FWD_WIDEST_BLOCK_C where ``fwd_widest_step`` holds;
    else FWD_WIDE_BLOCK_C up to padded head dim MAX_WIDE_STEP_DIM:
    O's rescale, the copy set-up, the row reductions and the barrier are per step, so 128 keys
    amortise them over twice the tensor-core work of 64; beyond d = 64 a data mask (key padding,
    attn_mask) takes 64 (its per-element loads take registers beside the keys of S). 64 beyond
    MAX_WIDE_STEP_DIM (the shared-memory fit shrinks it where two K/V stages of 64 keys do not fit),
    32 there with a data mask or dropout (their per-element state beside the O accumulator's DPAD / 2
    registers). The starting point of the runtime autotuner's search of the tile."""
    dp = padded_dim(head_dim)
    if fwd_widest_step(head_dim, capability, flags):
        return FWD_WIDEST_BLOCK_C
    if "bias" in flags:  # its per-element loads take registers beside the keys of S: FWD_BIAS_WIDE_STEP_DIM
        return 64 if dp <= FWD_BIAS_WIDE_STEP_DIM else 32
    if dp <= 64:
        return FWD_WIDE_BLOCK_C
    if dp <= MAX_WIDE_STEP_DIM:
        return 64 if flags & FWD_DATA_MASK_FLAGS else FWD_WIDE_BLOCK_C
    return 32 if flags & (FWD_DATA_MASK_FLAGS | {"dropout"}) else 64


def fwd_half_step(block_c: int) -> bool:
    """Forward: past FWD_WIDE_BLOCK_C keys, a step whose block needs at most the tile's first half
    (the last one of a causal diagonal or of a sequence shorter than the tile) runs as a step of
    block_c / 2 keys (``FWD_HALF_STEP``: the step's code instantiated for both widths)."""
    return block_c > FWD_WIDE_BLOCK_C


def fwd_m_tiles(block_r: int, num_warps: int) -> int:
    """Forward: m16 tiles of Q rows per warp (``WARP_M_TILES``): 2 (32 rows) when the Q block has
    more rows than 16 per warp, else 1."""
    return 2 if block_r > 16 * num_warps else 1


def fwd_half_copy(head_dim: int, num_warps: int) -> bool:
    """Forward: each half of the CTA's threads copies one of K_j / V_j per step (``FWD_HALF_COPY``:
    each warp sets up one copy a step instead of two) when the 16-byte chunks of a row divide half
    the threads (padded head dims 32, 64, 128, 256). Elsewhere (d = 96, 192: idle threads in each
    pass) every thread copies both: the halves there cost more than they save (benchmarks/sass_cost.py,
    d = 96: 1015 against 1025 instructions per 1e6 FLOPs on sm_80; d = 64 on sm_90: 1114 against 1132)."""
    threads = 32 * num_warps
    return num_warps % 2 == 0 and (threads // 2) % (padded_dim(head_dim) // 8) == 0


def fwd_dropout_16bit_sum(head_dim: int, flags: frozenset[str], capability: tuple[int, int] | None = None) -> bool:
    """Forward with dropout: O divided by the row sum of the 16-bit P~ that P~ V reads, every key's
    (``FWD_DROPOUT_L16``: each row half's P~ packed a second time before the keep mask, times a ones
    column), as without dropout, rather than by the fp32 sum; lse keeps the fp32 sum either way. The
    starting point of the knob ``fwd_dropout_16bit_sum``: on, except on compute capability 8.0 with a
    window and varlen at padded head dim 128 (the second pack beside the window's bounds, the
    sequence's offsets and that head dim's fragments)."""
    if "dropout" not in flags:
        return False
    return not (capability == (8, 0) and {"window", "varlen"} <= flags and padded_dim(head_dim) == 128)


#: The forward holds the Q_i A-fragments in registers when they, the S fragments and the O
#: accumulator of a 16-row warp take at most this many registers per lane together.
FWD_FRAG_REGS = 128


def fwd_q_in_regs(head_dim: int, block_r: int, num_warps: int, block_c: int = 64,
                  flags: frozenset[str] = frozenset(), head_dim_v: int = 0) -> bool:
    """Forward: the Q_i A-fragments held in registers (16-row warps up to MAX_REG_Q_DIM whose Q, S and O
    fragments -- DPAD / 4 + block_c / 2 + DPAD / 2 registers -- fit FWD_FRAG_REGS; else Q is read from
    smem per k step, one ldmatrix per 16 x 16: d = 128 with 128 keys would hold 160; a data mask's
    per-element addressing takes registers too). The starting point of the knob ``fwd_q_in_regs``; its
    legality is 16-row warps (32-row warps read Q from smem, their O accumulator and S fragments take
    the registers) and Q, S and O fragments within the register file. The O accumulator is
    ``head_dim_v``'s (0: head_dim's)."""
    dp = padded_dim(head_dim)
    fits = dp // 4 + block_c // 2 + padded_dim(head_dim_v or head_dim) // 2 <= FWD_FRAG_REGS and not flags & FWD_DATA_MASK_FLAGS
    return q_in_regs(head_dim) and fwd_m_tiles(block_r, num_warps) == 1 and fits


def ds_ld(block_r: int) -> int:
    """Row stride (elements) of the backward's dS^T tile: block_r + 8, ldmatrix conflict-free."""
    return block_r + 8


#: Registers the deterministic dq kernel's S/dP fragments and dQ accumulator may take together.
DQ_FRAG_REGS = 160


def dq_key_chunk(head_dim: int, block_c: int) -> int:
    """Keys per sub-step of the deterministic dq kernel (``DQ_KC``; the template static_asserts the
    rule's bounds): the widest multiple of 16 dividing block_c, at most 64, with
    padded_dim / 2 + keys <= DQ_FRAG_REGS."""
    for c in range(min(block_c, 64), 15, -16):
        if block_c % c == 0 and padded_dim(head_dim) // 2 + c <= DQ_FRAG_REGS:
            return c
    return 16


#: Padded head dims at which the backward's main kernel starts with separate chunk code for fully
#: visible and partial tiles (BWD_SPLIT_MASK) and, without dropout, two 16-Q-row chunks per trip
#: (BWD_CHUNK_UNROLL = 2): the starting points of the knobs ``bwd_split_mask`` and
#: ``bwd_chunk_unroll``, the search decides.
BWD_SPLIT_CHUNK_DIMS = (32, 64, 128)
SCORE_MOD_FLAGS = frozenset({"softcap", "alibi", "bias"})


def bwd_split_mask(head_dim: int, flags: frozenset[str], block_r: int) -> bool:
    """Backward: fully visible tiles run chunk code with no mask code at all, partial ones their own
    (``BWD_SPLIT_MASK``), at BWD_SPLIT_CHUNK_DIMS without a score modification and with a Q block of
    whole pairs of 16-row chunks (legality: the split code takes pairs); elsewhere one chunk code tests
    the mask under a branch. The starting point of the knob ``bwd_split_mask``."""
    if {"window", "varlen"} <= flags and padded_dim(head_dim) > 64:
        return False  # starts off: the window's bands beside varlen's offsets take registers
    return padded_dim(head_dim) in BWD_SPLIT_CHUNK_DIMS and not flags & SCORE_MOD_FLAGS and block_r % 32 == 0


#: Padded head dims past MAX_REG_KV_DIM whose backward takes 32-row chunks (``bwd_chunk_sub``).
BWD_WIDE_CHUNK_DIMS = (96, 128)


def bwd_chunk_sub(head_dim: int, flags: frozenset[str], block_r: int) -> int:
    """Backward: 16-Q-row sub-chunks per chunk of the main kernel (``BWD_CHUNK_SUB``): 2 at padded head
    dims BWD_WIDE_CHUNK_DIMS, where the K_j / V_j A-fragments are read from smem per chunk
    (``kv_in_regs`` off), without dropout, the deterministic backward, a score modification, a data
    mask (key padding, attn_mask) or varlen, on Q blocks of whole 32-row chunks: each
    A-fragment then feeds the S^T / dP^T tiles of 32 Q rows, one ldmatrix per 4 HMMAs instead of 2
    (at d = 128 in the registers the two unrolled 16-row chunks took); else 1. The starting point of
    the knob ``bwd_chunk_sub``; its legality is sub-chunks of 16 rows dividing the Q block."""
    dp = padded_dim(head_dim)
    if flags & ({"dropout", "deterministic", "varlen"} | SCORE_MOD_FLAGS):
        return 1  # their per-row state (varlen's lengths, the keep bits, ...) takes registers beside 32 rows
    if flags & {"key_padding", "attn_mask"}:
        return 1  # their per-element loads take registers beside 32 rows of S^T / dP^T
    return 2 if dp in BWD_WIDE_CHUNK_DIMS and not kv_in_regs(head_dim) and block_r % 32 == 0 else 1


def bwd_chunk_unroll(head_dim: int, flags: frozenset[str], block_r: int,
                     capability: tuple[int, int] | None = None) -> int:
    """Backward: chunks per trip of the chunk loop (``BWD_CHUNK_UNROLL``): 2 (half the loop
    overhead, constant offsets within a trip) with split chunk code, without dropout and outside the
    deterministic backward, for 16-row chunks (``bwd_chunk_sub`` 1), else 1; on compute capability 9.x
    past d = 64 a data mask (key padding, attn_mask) starts at 1 (its per-element loads beside two
    unrolled chunks). The starting point of the knob ``bwd_chunk_unroll``; its legality is chunks per
    trip dividing the Q block's chunks."""
    if bwd_chunk_sub(head_dim, flags, block_r) > 1:
        return 1
    if capability is not None and capability[0] == 9 and flags & FWD_DATA_MASK_FLAGS and padded_dim(head_dim) > 64:
        return 1
    return 2 if bwd_split_mask(head_dim, flags, block_r) and not flags & {"dropout", "deterministic"} else 1


#: Spec flags the two-dimensional backward layout (``bwd_2d``) takes: the masking rule's bands and
#: bounds (tested per element on partial tiles) and packed sequences.
BWD_2D_FLAGS = frozenset({"causal", "window", "top_left", "varlen"})
#: The tile and warps of the two-dimensional layout: FlashAttention-2's at d = 128.
BWD_2D_TILE = (64, 128, 8)
BWD_2D_DIM = 128


def bwd_2d(head_dim: int, flags: frozenset[str], block_r: int, block_c: int, num_warps: int,
           head_dim_v: int = 0) -> bool:
    """Backward: FlashAttention-2's two-dimensional warp layout (``BWD_2D``, templates/mma/bwd_2d.cu.j2)
    for head dim BWD_2D_DIM on the BWD_2D_TILE tile (Q rows x K/V rows, warps) with no flag outside
    BWD_2D_FLAGS: the 8 warps split S / dP and dQ_i into 32 x 32 blocks and dK~ / dV~ into 32 keys x
    64 columns, P and dS go through shared memory, and each fragment a warp reads feeds 4 HMMAs (0.45
    ldmatrix per HMMA against 0.6 with 16 K/V rows per warp). Not with a v head dim of its own
    (``head_dim_v`` other than 0 or head_dim: the layout's dK~ / dV~ blocks are one width)."""
    return (head_dim == BWD_2D_DIM and head_dim_v in (0, head_dim) and (block_r, block_c, num_warps) == BWD_2D_TILE
            and not flags - BWD_2D_FLAGS)


def bwd_do_stages(stages: int, fits_two: bool) -> int:
    """Backward, two-dimensional layout: dO_i's buffers (``DO_STAGES``): one per stage when they fit the
    arch's shared memory beside P and dS (sm_90: 171 KiB), else one (sm_80's 163 KiB: the next dO_i
    is copied once every warp is done with this one, after dV~)."""
    return stages if fits_two else 1


def bwd_2d_fresh(capability: tuple[int, int], flags: frozenset[str]) -> bool:
    """Two-dimensional backward: the lane offsets of the K_j / V_j B fragments (S, dP) and of the Q_i / dO_i
    k-major B fragments (dV~, dK~) derived afresh from the thread index every step (``BWD_2D_FRESH``)
    rather than held over the loop, before sm_90 with varlen (dO_i's late copy and the sequence's
    offsets take registers of the S / dP phase there); elsewhere held. The starting point of the knob
    ``bwd_2d_fresh``, the search decides."""
    return capability < (9, 0) and "varlen" in flags


def bwd_2d_pin(capability: tuple[int, int], flags: frozenset[str]) -> bool:
    """Two-dimensional backward: the lanes' fragment offsets and pointers into shared memory and their
    first S-block row and column computed once, before the loop, and pinned there (``BWD_2D_PIN``,
    partials/mma.cuh's ``fa_pin``: through a shuffle the compiler cannot recompute), where the compiler
    otherwise re-derived them from the thread index every step, except with varlen from sm_100 on (the
    sequence's offsets take the registers the pinned values hold). The starting point of the knob
    ``bwd_2d_pin``, the search decides."""
    return capability < (10, 0) or "varlen" not in flags


#: Flags with which the 16-K/V-rows-per-warp backward pins its lane offsets (``bwd_pin``).
BWD_PIN_FLAGS = frozenset({"causal", "window", "top_left"})


def bwd_pin(head_dim: int, flags: frozenset[str], capability: tuple[int, int]) -> bool:
    """Backward with 16 K/V rows per warp: the lane offsets of the K_j / V_j / Q_i fragments and the
    lane's dS^T pointer pinned before the loop (``BWD_PIN``, partials/mma.cuh's ``fa_pin``) before
    sm_90 at head dim 64 with no flag outside BWD_PIN_FLAGS (else re-derived from the thread index
    every chunk); not with varlen or per-element features (their state takes the registers the pinned
    values hold). The starting point of the knob ``bwd_pin``, the search decides."""
    return capability < (9, 0) and head_dim == 64 and not flags - BWD_PIN_FLAGS


def lse_now(flags: frozenset[str]) -> bool:
    """Backward: the next step's lse_i / D_i are stored at once rather than held in registers over
    the step and stored at its end (the load's latency hidden) when the score modifications or
    attn_mask need those registers. The starting point of the knob ``lse_now``."""
    return bool(flags & {"softcap", "alibi", "bias", "attn_mask"})


def dq_rows(block_r: int, num_warps: int) -> int:
    """Q rows per pass of the deterministic dq kernel: 16 per warp, at most the Q block."""
    return min(block_r, 16 * num_warps)


def dq_kv_stages(stages: int, block_r: int, block_c: int) -> int:
    """K_j / V_j stages of the dq kernel: stage 1 lives in the Q_i / dO_i stage 1 buffers, so two
    only with two stages and a K/V block no taller than the Q block."""
    return 2 if stages > 1 and block_c <= block_r else 1


def dq_2d(head_dim: int, block_r: int, num_warps: int) -> bool:
    """The 1-D main kernel's dQ_i += dS K_j in (32 Q rows x 32 columns) blocks, one per warp (DQ_2D): where
    the Q block and a head dim of whole k16 steps tile the warps that way (per k16 step of the keys a warp
    reads two dS and two K_j fragments for 8 HMMAs: 0.5 ldmatrix per HMMA, against 5 per 8 at 16 x 64). The
    starting point of the knob ``dq_2d`` (the one-dimensional, non-deterministic main kernel's); its legality
    is that tiling."""
    dp = padded_dim(head_dim)
    return head_dim == dp and block_r % 32 == 0 and dp % 32 == 0 and (block_r // 32) * (dp // 32) == num_warps


def dq_warps_per_row_tile(head_dim: int, block_r: int, num_warps: int) -> int:
    """The 1-D main kernel's dQ tiles otherwise (DQ_WPM): warps sharing one 16-row tile of dQ_i when the warps
    outnumber the row tiles and split its 16-column tiles evenly, else 1 (a warp takes whole row tiles)."""
    mt, nct = block_r // 16, padded_dim(head_dim) // 16
    return num_warps // mt if num_warps > mt and num_warps % mt == 0 and nct % (num_warps // mt) == 0 else 1


def dq_cols_at_once(head_dim: int, block_r: int, num_warps: int) -> int:
    """16-column tiles of dQ_i a warp accumulates at a time (DQ_NCC, 2 DQ_NCC x 4 fp32 registers): 4, 2 or 1,
    the largest dividing its share of a row tile."""
    ncw = padded_dim(head_dim) // 16 // dq_warps_per_row_tile(head_dim, block_r, num_warps)
    return 4 if ncw % 4 == 0 else 2 if ncw % 2 == 0 else 1


def fwd_s_split(block_r: int, num_warps: int) -> bool:
    """Forward: 32-row warps (``WARP_M_TILES`` 2) compute S one m16 tile after the other (``FWD_S_SPLIT``:
    each Q fragment read from smem per k step, the K fragments the same for both, which ptxas keeps), so
    the first tile's scores are complete before the second's start and the live S fragments fit 255
    registers beside O."""
    return fwd_m_tiles(block_r, num_warps) == 2


def fwd_hold(block_r: int, num_warps: int, flags: frozenset[str]) -> bool:
    """Forward: the lane offsets and flags held in registers over the K/V loop (``FWD_HOLD``, fwd_opaque:
    not re-derived every step) only where the registers allow it, 16-row warps without a score
    modification. Elsewhere the compiler places them (held, they do not fit the register file beside
    32-row warps' fragments or a bias's; the measurements are docs/autotune.md's)."""
    return fwd_m_tiles(block_r, num_warps) == 1 and not flags & SCORE_MOD_FLAGS
