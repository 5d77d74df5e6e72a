"""The SIMT family's decisions, stated once: the accumulator type, the padded smem row strides and
the register tile of ``block_gemm``; its template context, smem layout and cost model use them."""
from __future__ import annotations

F32 = 4
#: Register tile of one thread in ``block_gemm`` (templates/simt/tiles.cuh): TM x TN accumulators,
#: TM loads of A and TN loads of B per k step.
GEMM_TM, GEMM_TN = 4, 4


def acc_type(itemsize: int) -> tuple[str, int]:
    """The accumulator C type and its size: double for a float64 spec (itemsize 8), else float."""
    return ("double", 8) if itemsize == 8 else ("float", F32)


def smem_strides(head_dim: int, itemsize: int, block_c: int, head_dim_v: int = 0) -> dict[str, int]:
    """Padded smem row strides (elements): a row of a dtype tile is an odd number of 32-bit
    words and a row of the P/S tile an odd number of floats, so a warp reading one column
    across consecutive rows touches 32 different banks. ``LD_V``: the V / dO tiles' (head dim
    ``head_dim_v``, 0 = ``head_dim``)."""
    return {"LD": head_dim + 4 // itemsize, "LD_V": (head_dim_v or head_dim) + 4 // itemsize, "P_LD": block_c + 1}
