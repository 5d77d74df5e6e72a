"""The wgmma family's autotuner cost: the work of one visited tile pair of its forward."""
from __future__ import annotations

from collections.abc import Mapping

from fagen.families.base import FamilySpec, PairCost

#: Bytes of shared memory one SM reads per clock (one 128-byte wavefront).
WAVEFRONT_BYTES = 128
#: Producer warp instructions per K_j / V_j slot besides its TMA loads: the wait for a free slot,
#: arrive.expect_tx, the coordinates and the loop (benchmarks/sass_cost.py's producer rows: 30-48).
PRODUCER_OVERHEAD = 40
#: Consumer warp instructions per tile pair outside the per-element softmax, the O rescale and the
#: wgmmas: the mbarrier wait and arrive, descriptor moves (one uniform add and move per operand),
#: the row reductions' shuffles and alpha, the loop (benchmarks/sass_cost.py: 2-3 per wgmma + ~30).
CONSUMER_OVERHEAD = 30
#: Consumer warp instructions per score a thread holds: FMNMX (row extreme), FFMA (scale folded),
#: MUFU.EX2, FADD (row sum), half an F2FP (the packed pair of P~).
PER_SCORE = 4.5
#: With dropout, per score besides: a quarter of a Philox4x32-10 call (ten rounds of two IMAD.WIDE and
#: two LOP3), the compares against the threshold, the pair's shuffle and the select of P~ o Z
#: (benchmarks/sass_cost.py, d128 x 128 keys: 1523 walked instructions per warp against 483 plain).
DROPOUT_PER_SCORE = 16.0


def pair_cost(fs: FamilySpec, sass: Mapping[str, int] | None = None) -> PairCost:
    """One visited tile pair of the forward, summed over the block's warps. ``sass``: the walked
    consumer tile loop's opcode counts per warp (``Family.tile_work`` and
    ``fagen.autotune.sassloops.walked_loop_mix``), when the disassembler gave them; else the
    counts are estimated from the tile. wgmma reads its shared-memory operands itself: each
    consumer warpgroup reads its 64 rows of Q_i, K_j and V_j once per pair (no ldmatrix); the
    producer warp issues (d + dv) / 64 TMA loads per pair (dv: the v head dim)."""
    d, dv, br, bc = fs.head_dim, fs.dv, fs.block_r, fs.block_c
    wgs = fs.num_warps // 4
    hgmma = -(-d // 16) + bc // 16  # per consumer warp: S = Q K^T (N = block_c), O += P~ V (N = head_dim_v)
    scores = bc // 2  # per thread: 64 rows x block_c over the warpgroup's 128 threads
    if sass:
        per_warp = float(sum(sass.values()))
    else:
        per_score = PER_SCORE + (DROPOUT_PER_SCORE if fs.has("dropout") else 0.0)
        per_warp = hgmma * 3 + per_score * scores + dv // 2 + CONSUMER_OVERHEAD
    producer = (d + dv) // 64 + PRODUCER_OVERHEAD
    smem_bytes = wgs * (64 * d + bc * d + bc * dv) * fs.itemsize
    return PairCost(lds_wavefronts=smem_bytes / WAVEFRONT_BYTES, warp_instructions=fs.num_warps * per_warp + producer,
                    warp_iterations=float(fs.num_warps * hgmma), busiest_warp_iterations=0.0, atomics=0.0)
