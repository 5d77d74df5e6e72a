"""Kernel families: everything that differs between kernel implementations.

A family is looked up by ``KernelSpec.impl`` and owns, for the specs it
supports: which (tile, warps, knobs) it accepts (``config_reason``), its
shared-memory layout with per-buffer alignment (``smem_layout``), its kernel
roles and launch geometry (``roles``, ``launch``), its NVRTC options, its
templates (which include the family's own partials), its extra knobs (e.g.
pipeline stages; they enter the spec's name and cache key through
``KernelSpec.knobs``) and its autotuner cost function (``pair_cost``).

``KernelSpec.impl`` defaults to the preferred family (lowest ``preference``,
then name) that supports the spec. Families subclass :class:`FamilyBase`,
which supplies the defaults, and register themselves with :func:`register`.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol, runtime_checkable

from ..abi import Role, roles_for
from ..layout import SmemLayout

if TYPE_CHECKING:  # pragma: no cover
    from ..spec import KernelSpec

NUM_WARPS_CHOICES = (1, 2, 4, 8)
#: Spec features a family must list in ``features`` to take a spec that uses them
#: (KernelSpec.features): each names a flag (or "top_left" for causal_align, "float64" for the dtype).
FEATURES = ("top_left", "window", "softcap", "alibi", "attn_mask", "bias", "bias_grad", "varlen", "deterministic",
            "float64")
#: Registers per thread the launch bounds leave by default (KernelSpec.min_blocks_per_sm).
MIN_REGS_PER_THREAD = 128


@dataclass(frozen=True)
class Knob:
    """An extra compile-time choice of a family (e.g. pipeline stages)."""

    name: str  # key in KernelSpec.knobs
    abbrev: str  # in the spec's name: ``_{abbrev}{value}``, e.g. "s" -> "_s2"
    default: int
    choices: tuple[int, ...]  # accepted values; the autotuner tries each
    help: str = ""


class Reason(NamedTuple):
    """Why a family rejects a configuration: the spec field to blame and the message."""

    field: str
    message: str


@dataclass(frozen=True)
class Launch:
    """How one kernel role is launched: threads per block and the rows of its tiled seqlen per block."""

    block: tuple[int, int, int]
    rows_per_block: int


@dataclass(frozen=True)
class PairCost:
    """On-chip work of one visited (Q block, K/V block) tile pair, summed over the block's warps."""

    lds_wavefronts: float  # shared-memory load wavefronts (1 per SM per clock)
    warp_instructions: float  # issued warp instructions (1 per scheduler per clock, 4 per SM)
    warp_iterations: float  # inner-loop iterations summed over warps (one dependent math op each)
    busiest_warp_iterations: float = 0.0  # of the busiest warp (0: work spread evenly over the warps)
    atomics: float = 0.0  # fp32 atomic adds to global memory (dQ), element count

    @property
    def wavefronts_per_iteration(self) -> float:
        return self.lds_wavefronts / self.warp_iterations if self.warp_iterations else 0.0

    def warp_balance(self, num_warps: int) -> float:
        """Mean / max work per warp: 1 when every warp is busy, 1/num_warps when one warp works alone."""
        if not self.busiest_warp_iterations or not num_warps:
            return 1.0
        return min(1.0, self.warp_iterations / (num_warps * self.busiest_warp_iterations))


def lds_wavefronts(addrs: list[int]) -> int:
    """Wavefronts of one warp-wide 4-byte shared-memory load: the most distinct words in one bank."""
    words: dict[int, set[int]] = {}
    for a in addrs:
        w = a // 4
        words.setdefault(w % 32, set()).add(w)
    return max((len(v) for v in words.values()), default=0)


@runtime_checkable
class Family(Protocol):
    """What the pipeline asks of a kernel family (see FamilyBase for the defaults)."""

    name: str
    preference: int  # lower = preferred when the spec does not name its impl
    tile_multiple: int
    max_block_r: int
    max_block_c: int
    knobs: tuple[Knob, ...]
    math_unit: Literal["fp32", "tensor"]  # which peak the autotuner's FLOP term uses
    min_regs_per_thread: int  # register budget per thread the launch bounds must leave
    features: frozenset[str]  # the spec features (FEATURES) its templates implement

    def unsupported_reason(self, direction: str, head_dim: int, dtype: str, arch: str) -> str | None:
        """Why this family cannot implement the spec at all, or None."""

    def config_reason(self, direction: str, head_dim: int, dtype: str, arch: str, block_r: int, block_c: int,
                      num_warps: int, knobs: Mapping[str, int]) -> Reason | None:
        """Why this (tile, warps, knobs) is not accepted, or None."""

    def smem_layout(self, direction: str, head_dim: int, itemsize: int, block_r: int, block_c: int,
                    knobs: Mapping[str, int]) -> SmemLayout:
        """Exact dynamic-smem layout of the kernel that uses the most shared memory."""

    def tile_caps(self, direction: str, head_dim: int, num_warps: int) -> tuple[int, int]:
        """Largest (block_r, block_c) a default tile starts from, before shrinking to fit smem."""

    def default_tile(self, direction: str, head_dim: int, itemsize: int, sram_bytes: int, num_warps: int,
                     knobs: Mapping[str, int]) -> tuple[int, int] | None:
        """The (block_r, block_c) a default tile starts from, or None for Algorithm 4's paper point."""

    def tile_work(self, spec: "KernelSpec", role: str) -> dict[str, float] | None:
        """Per warp and tile pair, the opcode counts the ``role`` kernel must issue (or None)."""

    def template_context(self, spec: "KernelSpec") -> dict[str, Any]:
        """Extra Jinja context; must hold ``strides``: named smem row strides emitted as constexprs."""

    def templates(self, direction: str) -> tuple[str, ...]:
        """Template files (under templates/) rendered, in order, for this direction."""

    def roles(self, direction: str, deterministic: bool = False) -> tuple[Role, ...]:
        """The kernels of the module, in launch order (parameter lists from fagen.abi); the
        deterministic backward adds the ``dq`` role."""

    def role_smem_bytes(self, spec: "KernelSpec", role: Role) -> int:
        """Dynamic shared memory (bytes) one role is launched with."""

    def launch(self, spec: "KernelSpec", role: Role) -> Launch:
        """Block dims and rows per block of one role."""

    def nvrtc_options(self, spec: "KernelSpec") -> tuple[str, ...]:
        """Options added to the compiler's defaults (-arch, -std, -Xptxas=-v)."""

    def pair_cost(self, spec: "KernelSpec", block_r: int, block_c: int,
                  sass: Mapping[str, int] | None = None) -> PairCost | None:
        """Autotuner cost of one visited tile pair; ``sass`` is the static opcode mix of the main
        kernel's main loop when the disassembler is installed (the model already derives the
        issue term from it). None: modelled by HBM traffic, FLOPs, SASS issue and dQ atomics."""


@dataclass(frozen=True)
class FamilyBase:
    """Defaults every family inherits; override what differs."""

    name: str = ""
    preference: int = 100
    tile_multiple: int = 16
    max_block_r: int = 128
    max_block_c: int = 128
    knobs: tuple[Knob, ...] = ()
    math_unit: Literal["fp32", "tensor"] = "fp32"
    min_regs_per_thread: int = MIN_REGS_PER_THREAD
    features: frozenset[str] = frozenset()

    def unsupported_reason(self, direction: str, head_dim: int, dtype: str, arch: str) -> str | None:
        return None

    def combination_reason(self, spec: "KernelSpec") -> str | None:
        """Why this family declines the spec's combination of features it implements one by one, or None."""
        return None

    def config_reason(self, direction: str, head_dim: int, dtype: str, arch: str, block_r: int, block_c: int,
                      num_warps: int, knobs: Mapping[str, int]) -> Reason | None:
        q = self.tile_multiple
        for field, v, limit in (("block_r", block_r, self.max_block_r), ("block_c", block_c, self.max_block_c)):
            if v < q or v % q or v > limit:
                return Reason(field, f"{field}={v} must be a multiple of {q} in {q}..{limit} ({self.name} template limit)")
        if num_warps not in NUM_WARPS_CHOICES:
            return Reason("num_warps", f"num_warps must be one of {NUM_WARPS_CHOICES}, got {num_warps}")
        for knob in self.knobs:
            v = knobs.get(knob.name, knob.default)
            if v not in knob.choices:
                return Reason("knobs", f"{knob.name}={v} must be one of {knob.choices} ({self.name})")
        return None

    def smem_layout(self, direction: str, head_dim: int, itemsize: int, block_r: int, block_c: int,
                    knobs: Mapping[str, int]) -> SmemLayout:  # pragma: no cover - every family has one
        raise NotImplementedError

    def tile_caps(self, direction: str, head_dim: int, num_warps: int) -> tuple[int, int]:
        return self.max_block_r, self.max_block_c

    def tile_work(self, spec: "KernelSpec", role: str) -> dict[str, float] | None:
        """SASS opcode -> warp instructions one (average) warp of the ``role`` kernel must issue per
        tile pair (its tensor-core instructions, 16-byte copies, reductions), from which
        ``fagen.autotune.sassloops.tile_loop`` solves the trip counts of the tile loop's nested
        loops; None: the cost model scales the whole main loop instead."""
        return None

    def default_tile(self, direction: str, head_dim: int, itemsize: int, sram_bytes: int, num_warps: int,
                     knobs: Mapping[str, int]) -> tuple[int, int] | None:
        """The tile a spec without block_r / block_c starts from (then capped by ``tile_caps`` and
        shrunk until it fits sram_bytes), or None for Algorithm 4's paper point."""
        return None

    def template_context(self, spec: "KernelSpec") -> dict[str, Any]:
        return {"strides": {}}

    def templates(self, direction: str) -> tuple[str, ...]:  # pragma: no cover - every family has some
        raise NotImplementedError

    def roles(self, direction: str, deterministic: bool = False) -> tuple[Role, ...]:
        return roles_for(direction, deterministic)

    def role_smem_bytes(self, spec: "KernelSpec", role: Role) -> int:
        """Dynamic shared memory of one role: the spec's layout for the main and dq kernels, none for
        the others. A family whose dq kernel uses a prefix of the layout returns less."""
        return spec.smem_bytes if role.name in ("main", "dq") else 0

    def launch(self, spec: "KernelSpec", role: Role) -> Launch:
        t = spec.tile
        rows = {"block_r": t.block_r, "block_c": t.block_c, "num_warps": spec.num_warps}[role.rows_per_block]
        return Launch((spec.num_threads, 1, 1), rows)

    def nvrtc_options(self, spec: "KernelSpec") -> tuple[str, ...]:
        return ()

    def pair_cost(self, spec: "KernelSpec", block_r: int, block_c: int,
                  sass: Mapping[str, int] | None = None) -> PairCost | None:
        return None


_REGISTRY: dict[str, Family] = {}


def register(family: Family) -> Family:
    _REGISTRY[family.name] = family
    return family


def get_family(name: str) -> Family:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"no kernel family {name!r}; registered: {family_names()}") from None


def family_names() -> tuple[str, ...]:
    """Registered families in preference order."""
    return tuple(f.name for f in sorted(_REGISTRY.values(), key=lambda f: (f.preference, f.name)))


def feature_reason(family: Family, wanted: frozenset[str]) -> str | None:
    """Why ``family`` cannot compile these spec features (KernelSpec.features) in, or None."""
    have = frozenset(getattr(family, "features", frozenset()))
    missing = sorted(set(wanted) - have)
    if not missing:
        return None
    return f"its templates do not implement {', '.join(missing)} yet (implemented: {sorted(have) or 'none'})"


def combination_reason(family: Family, spec: "KernelSpec") -> str | None:
    """Why ``family`` declines this combination of features it implements one by one (its
    ``combination_reason``, e.g. a register budget), or None."""
    decline = getattr(family, "combination_reason", None)
    return decline(spec) if decline is not None else None


def default_family(direction: str, head_dim: int, dtype: str, arch: str) -> str | None:
    """The preferred family that supports these fields, or None."""
    for name in family_names():
        if _REGISTRY[name].unsupported_reason(direction, head_dim, dtype, arch) is None:
            return name
    return None


from . import simt as _simt  # noqa: E402,F401  (registers itself)
from . import mma as _mma  # noqa: E402,F401  (registers itself)
