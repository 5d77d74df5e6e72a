"""Portable SIMT family: FP32 FMA math, fp32 accumulation, any dtype, sm_80+."""
from __future__ import annotations

from dataclasses import dataclass

from ..layout import SmemLayout, place
from . import register

F32 = 4


@dataclass(frozen=True)
class SimtFamily:
    name: str = "simt"
    tile_multiple: int = 16
    max_block_r: int = 128
    max_block_c: int = 128

    def unsupported_reason(self, direction: str, head_dim: int, dtype: str, arch: str) -> str | None:
        return None  # every head_dim / dtype / arch the spec admits

    def strides(self, head_dim: int, itemsize: int, block_c: int) -> dict[str, int]:
        """Padded smem row strides (elements): a row of a dtype tile is an odd number of 32-bit
        words and a row of the P/S tile an odd number of floats, so a warp reading one column
        across consecutive rows touches 32 different banks."""
        return {"LD": head_dim + 4 // itemsize, "P_LD": block_c + 1}

    def smem_layout(self, direction: str, head_dim: int, itemsize: int, block_r: int, block_c: int) -> SmemLayout:
        d, br, bc = head_dim, block_r, block_c
        st = self.strides(head_dim, itemsize, block_c)
        ld, p_ld = st["LD"], st["P_LD"]
        if direction == "bwd":
            # Algorithm 4: K_j, V_j and the dK~_j, dV~_j accumulators stay on chip
            # for the whole inner loop; Q_i, dO_i, lse_i, D_i and P_ij/dS_ij per step.
            return place([
                ("k", "T", bc * ld, itemsize),
                ("v", "T", bc * ld, itemsize),
                ("dk", "float", bc * d, F32),
                ("dv", "float", bc * d, F32),
                ("q", "T", br * ld, itemsize),
                ("do_", "T", br * ld, itemsize),
                ("p", "float", br * p_ld, F32),
                ("lse", "float", br, F32),
                ("delta", "float", br, F32),
            ])
        if direction == "fwd":
            # Forward (online softmax): Q_i and the O_i accumulator stay on chip,
            # K_j, V_j and S_ij/P_ij per step, row stats m_i, l_i and the rescale factor.
            return place([
                ("q", "T", br * ld, itemsize),
                ("o", "float", br * d, F32),
                ("k", "T", bc * ld, itemsize),
                ("v", "T", bc * ld, itemsize),
                ("s", "float", br * p_ld, F32),
                ("m", "float", br, F32),
                ("l", "float", br, F32),
                ("alpha", "float", br, F32),
            ])
        raise ValueError(f"unknown direction {direction!r}")

    def templates(self, direction: str) -> tuple[str, ...]:
        return {"bwd": ("simt/bwd.cu.j2",), "fwd": ("simt/fwd.cu.j2",)}[direction]


SIMT = register(SimtFamily())
