"""Render a KernelSpec into CUDA C++ source (Jinja2, StrictUndefined).

Python decides the specialisation; templates stay thin and receive constexprs.
Output is byte-identical across runs for the same spec.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import jinja2

from .abi import ROLES, Role
from .families import get_family
from .spec import KernelSpec

#: Algorithm 4 line -> what the generated block implements (shown in docs, used in comments).
ALG4 = {
    1: "set the RNG state to R = (seed, offset)",
    2: "block sizes B_c, B_r (compiled in from the spec)",
    6: "for each K/V block j (one thread block per (j, batch, head))",
    7: "load K_j, V_j from HBM to SRAM",
    8: "initialise dK~_j = dV~_j = 0 on SRAM",
    9: "for each Q block i",
    10: "load Q_i, dO_i, lse_i (= m_i + log l_i), D_i to SRAM",
    11: "S_ij = tau Q_i K_j^T",
    12: "S_ij^masked = mask(S_ij)",
    13: "P_ij = diag(l_i)^-1 exp(S_ij^masked - m_i) = exp(S_ij - lse_i)",
    14: "Z_ij = Philox keep-mask (replayed, not stored)",
    15: "P_ij^dropped = P_ij o Z_ij / (1 - p)",
    16: "dV~_j += (P_ij^dropped)^T dO_i",
    17: "dP_ij^dropped = dO_i V_j^T",
    18: "dP_ij = dP_ij^dropped o Z_ij / (1 - p)",
    19: "D_i = rowsum(dO_i o O_i) (precomputed by the preprocess kernel, eq. 13)",
    20: "dS_ij = P_ij o (dP_ij - D_i)",
    21: "dQ_i += tau dS_ij K_j (fp32 atomics in HBM)",
    22: "dK~_j += tau dS_ij^T Q_i",
    24: "write dK_j, dV_j to HBM",
}


def templates_dir() -> Path:
    """templates/ of the source tree, or its copy mapped into the installed package."""
    try:
        packaged = resources.files("fagen") / "_templates"
        if packaged.is_dir():
            return Path(str(packaged))
    except (ModuleNotFoundError, TypeError):  # pragma: no cover
        pass
    return Path(__file__).resolve().parent.parent / "templates"


@functools.lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.globals["alg4"] = lambda line: f"// Algorithm 4 line {line}: {ALG4[line]}"
    return env


@dataclass(frozen=True)
class KernelInfo:
    """One entry point of a rendered module and how to launch it."""

    name: str
    role: Role
    params: tuple[tuple[str, str], ...]  # concrete (ctype, name), dtype substituted
    block: tuple[int, int, int]
    smem_bytes: int  # dynamic shared memory per block
    rows_per_block: int

    def grid(self, batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> tuple[int, int, int]:
        return self.role.grid(batch=batch, heads=heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k, rows=self.rows_per_block)


@dataclass(frozen=True)
class Rendered:
    spec: KernelSpec
    source: str
    kernels: tuple[KernelInfo, ...]

    def kernel(self, role: str) -> KernelInfo:
        for k in self.kernels:
            if k.role.name == role:
                return k
        raise KeyError(role)


def _concrete(params: tuple[tuple[str, str], ...], ctype: str) -> tuple[tuple[str, str], ...]:
    return tuple((t.replace("T*", f"{ctype}*") if "T*" in t else t, n) for t, n in params)


def kernel_infos(spec: KernelSpec) -> tuple[KernelInfo, ...]:
    t = spec.tile
    rows = {"block_r": t.block_r, "block_c": t.block_c, "num_warps": spec.num_warps}
    out = []
    for role in ROLES[spec.direction]:
        smem = spec.smem_bytes if role.name == "main" else 0
        out.append(KernelInfo(f"{spec.name}_{role.name}", role, _concrete(role.params, spec.ctype),
                              (spec.num_threads, 1, 1), smem, rows[role.rows_per_block]))
    return tuple(out)


@functools.lru_cache(maxsize=256)
def render(spec: KernelSpec) -> Rendered:
    """Render ``spec`` into one CUDA translation unit with all its entry points."""
    fam = get_family(spec.impl)
    kernels = kernel_infos(spec)
    ctx = {
        "spec": spec,
        "spec_json": spec.model_dump_json(),
        "T": spec.ctype,
        "tile": spec.tile,
        "layout": spec.smem_layout,
        "strides": fam.strides(spec.head_dim, spec.itemsize, spec.tile.block_c),
        "kernels": {k.role.name: k for k in kernels},
    }
    parts = [_env().get_template(name).render(**ctx) for name in fam.templates(spec.direction)]
    return Rendered(spec, "".join(parts), kernels)
