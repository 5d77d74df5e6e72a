"""Portable SIMT family: FMA math with fp32 accumulation (fp64 for float64), any dtype, sm_80+."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fagen.abi import Role
from fagen.families.base import FamilyBase, FamilySpec, PairCost
from fagen.families.simt.cost import pair_cost
from fagen.families.simt.rules import F32, GEMM_TM, GEMM_TN, acc_type, smem_strides
from fagen.layout import SmemLayout, align_up, place

__all__ = ["F32", "GEMM_TM", "GEMM_TN", "SIMT", "SimtFamily", "acc_type", "pair_cost", "smem_strides"]


@dataclass(frozen=True)
class SimtFamily(FamilyBase):
    name: str = "simt"
    preference: int = 100  # the portable fallback: any family that supports a spec is preferred
    tile_multiple: int = 16
    max_block_r: int = 128
    max_block_c: int = 128
    features: frozenset[str] = frozenset({"top_left", "window", "softcap", "alibi", "attn_mask", "bias", "bias_grad",
                                          "varlen", "deterministic", "float64", "sinks", "head_dim_v"})

    def template_context(self, fs: FamilySpec) -> dict[str, Any]:
        return {"strides": smem_strides(fs.head_dim, fs.itemsize, fs.block_c, fs.dv), "acc": acc_type(fs.itemsize)[0]}

    def smem_layout(self, fs: FamilySpec) -> SmemLayout:
        direction, itemsize = fs.direction, fs.itemsize
        d, dv, br, bc = fs.head_dim, fs.dv, fs.block_r, fs.block_c
        st = smem_strides(d, itemsize, bc, dv)
        ld, ld_v, p_ld = st["LD"], st["LD_V"], st["P_LD"]
        acc, asz = acc_type(itemsize)
        if direction == "bwd":
            # Algorithm 4: K_j, V_j and the dK~_j, dV~_j accumulators stay on chip
            # for the whole inner loop; Q_i, dO_i, lse_i, D_i and P_ij/dS_ij per step.
            # dK~, dV~ come last: the deterministic dq kernel uses the layout up to them.
            return place([
                ("k", "T", bc * ld, itemsize),
                ("v", "T", bc * ld_v, itemsize),
                ("q", "T", br * ld, itemsize),
                ("do_", "T", br * ld_v, itemsize),
                ("p", acc, br * p_ld, asz),
                ("lse", acc, br, asz),
                ("delta", acc, br, asz),
                ("lse_lo", acc, br, asz),  # a huge row's lse correction (natural log; abi: lse_lo)
                ("dk", acc, bc * d, asz),
                ("dv", acc, bc * dv, asz),
            ])
        if direction == "fwd":
            # Forward (online softmax): Q_i and the O_i accumulator stay on chip,
            # K_j, V_j and S_ij/P_ij per step, row stats m_i, l_i and the rescale factor.
            return place([
                ("q", "T", br * ld, itemsize),
                ("o", acc, br * dv, asz),
                ("k", "T", bc * ld, itemsize),
                ("v", "T", bc * ld_v, itemsize),
                ("s", acc, br * p_ld, asz),
                ("m", acc, br, asz),
                ("l", acc, br, asz),
                ("alpha", acc, br, asz),
            ])
        raise ValueError(f"unknown direction {direction!r}")

    def role_smem_bytes(self, fs: FamilySpec, role: Role) -> int:
        """The dq kernel carves the backward layout but never touches dK~, dV~ (its tail)."""
        if role.name == "dq":
            return align_up(next(b.offset for b in self.smem_layout(fs).buffers if b.name == "dk"))
        return super().role_smem_bytes(fs, role)

    def templates(self, direction: str) -> tuple[str, ...]:
        return {"bwd": ("simt/bwd.cu.j2",), "fwd": ("simt/fwd.cu.j2",)}[direction]

    def pair_cost(self, fs: FamilySpec, sass: Mapping[str, int] | None = None) -> PairCost:
        return pair_cost(fs, sass)


SIMT = SimtFamily()
