"""The family protocol: what the pipeline asks of a kernel family, and the values it passes.

Every method of :class:`Family` takes one frozen :class:`FamilySpec` (direction, head dim,
dtype, compile-time flags, tile, warps, knobs, arch) that ``KernelSpec.family_spec`` builds, so
the families never see a ``KernelSpec``: ``fagen.spec`` imports ``fagen.families``, never the
reverse. :class:`FamilyBase` supplies the defaults a family overrides.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Protocol, runtime_checkable

from fagen.abi import Role, is_tensormap, roles_for
from fagen.layout import SmemLayout

#: Warps per block a family accepts unless it says otherwise (``Family.warp_choices``).
NUM_WARPS_CHOICES = (1, 2, 4, 8)
#: Warps per block of a spec that names none, unless its family says otherwise (``Family.default_warps``).
DEFAULT_NUM_WARPS = 4
#: Spec features a family must list in ``features`` to take a spec that uses them
#: (FamilySpec.features): each names a flag (or "top_left" for causal_align, "float64" for the dtype).
FEATURES = ("top_left", "window", "softcap", "alibi", "attn_mask", "bias", "bias_grad", "varlen", "deterministic",
            "float64", "sinks", "head_dim_v")
#: Registers per thread the launch bounds leave by default (KernelSpec.min_blocks_per_sm).
MIN_REGS_PER_THREAD = 128


@dataclass(frozen=True)
class Tile:
    block_r: int
    block_c: int


@dataclass(frozen=True)
class FamilySpec:
    """The spec as a family sees it (built by ``KernelSpec.family_spec``).

    ``flags`` holds every compile-time flag that is on, by its KernelSpec field name (causal,
    key_padding, dropout, window, softcap, alibi, attn_mask, bias, bias_grad, varlen,
    deterministic) and "top_left" for ``causal_align="top_left"``. ``tile`` is None while the
    pipeline asks whether a family takes the spec at all (before a tile is chosen)."""

    direction: str
    head_dim: int
    dtype: str
    arch: str
    flags: frozenset[str] = frozenset()
    tile: Tile | None = None
    num_warps: int = 4
    knobs: tuple[tuple[str, int], ...] = ()
    head_dim_v: int = 0  # the head dim of v, o, do, dv; 0: head_dim (the feature "head_dim_v" when it differs)
    codegen: tuple[tuple[str, int], ...] = ()  # the user's codegen knob settings (KernelSpec.codegen), sorted

    @property
    def dv(self) -> int:
        """The head dim of v (and o, dO, dV): ``head_dim_v``, else ``head_dim``."""
        return self.head_dim_v or self.head_dim

    def has(self, flag: str) -> bool:
        return flag in self.flags

    @property
    def features(self) -> frozenset[str]:
        """The optional features (FEATURES) the spec compiles in: a family takes the spec only if
        its ``features`` holds them all."""
        out = self.flags & frozenset(FEATURES)
        if self.dv != self.head_dim:
            out = out | {"head_dim_v"}
        return out | {"float64"} if self.dtype == "float64" else out

    @property
    def itemsize(self) -> int:
        """Bytes per element of the dtype (float16 -> 2, ..., float64 -> 8)."""
        return int(re.sub(r"\D", "", self.dtype)) // 8

    @property
    def num_threads(self) -> int:
        return 32 * self.num_warps

    @property
    def block_r(self) -> int:
        return self._tile().block_r

    @property
    def block_c(self) -> int:
        return self._tile().block_c

    @property
    def knob_values(self) -> dict[str, int]:
        return dict(self.knobs)

    def with_tile(self, block_r: int, block_c: int, **changes: Any) -> "FamilySpec":
        """The same spec with this tile (and any other field changed)."""
        return dataclasses.replace(self, tile=Tile(block_r, block_c), **changes)

    def _tile(self) -> Tile:
        if self.tile is None:
            raise ValueError("this FamilySpec has no tile yet (FamilySpec.with_tile gives one)")
        return self.tile


@dataclass(frozen=True)
class Knob:
    """An extra compile-time choice of a family (e.g. pipeline stages)."""

    name: str  # key in KernelSpec.knobs
    abbrev: str  # in the spec's name: ``_{abbrev}{value}``, e.g. "s" -> "_s2"
    default: int
    choices: tuple[int, ...]  # accepted values; the autotuner tries each
    help: str = ""
    #: True: a spec at the default value does not list the knob (``KernelSpec.knobs``: not in its name, its
    #: source's header or its cache key), so the specs a knob added later leaves at its default keep what they were.
    elided: bool = False
    #: True: the cost model cannot see what the knob buys (only a GPU timing can): the runtime autotuner times
    #: each of its values beside every candidate it picks to time (``fagen.autotune.tuner.tune``).
    model_blind: bool = False
    #: True: a value other than the default changes results beyond flash-attn's accuracy criterion (e.g. an
    #: approximate instruction whose error reaches an fp32 output): only a user sets it; the autotuner keeps the
    #: default (``fagen.autotune.candidates``).
    numerics: bool = False


class Reason(NamedTuple):
    """Why a family rejects a configuration: the spec field to blame and the message."""

    field: str
    message: str


@dataclass(frozen=True)
class Constant:
    """A decision the family made in Python, emitted as ``constexpr {ctype} {name} = {literal};``
    (partials/header.cuh.j2) and given to the templates under its name (a Jinja branch may read it)."""

    name: str  # C++ identifier, upper case
    ctype: str  # "int" or "bool"
    value: int | bool
    doc: str  # the line comment

    @property
    def literal(self) -> str:
        if isinstance(self.value, bool):
            return "true" if self.value else "false"
        return str(int(self.value))


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


def k16_padded(head_dim: int) -> int:
    """The head dim rounded up to the MMA k extent (16); the extra columns are zero."""
    return -(-head_dim // 16) * 16


def lds_wavefronts(addrs: list[int]) -> int:
    """Wavefronts of one warp-wide 4-byte shared-memory load: the most distinct words in one bank."""
    words: dict[int, set[int]] = {}
    for a in addrs:
        w = a // 4
        words.setdefault(w % 32, set()).add(w)
    return max((len(v) for v in words.values()), default=0)


@runtime_checkable
class Family(Protocol):
    """What the pipeline asks of a kernel family (see FamilyBase for the defaults). Every method
    takes the family-facing :class:`FamilySpec`; those that need a tile get one with it set."""

    name: str
    preference: int  # lower = preferred when the spec does not name its impl
    tile_multiple: int  # the quantum of block_r and block_c (block_c: see FamilyBase.block_c_multiple)
    max_block_r: int
    max_block_c: int
    warp_choices: tuple[int, ...]  # accepted num_warps
    knobs: tuple[Knob, ...]
    math_unit: Literal["fp32", "tensor"]  # which peak the autotuner's FLOP term uses
    min_regs_per_thread: int  # register budget per thread the launch bounds must leave
    features: frozenset[str]  # the spec features (FEATURES) its templates implement
    #: Folder of the family's templates (what ``templates`` names as "<name>/..." is read there);
    #: None: ``templates/<name>/`` of the project.
    template_dir: str | None

    def unsupported_reason(self, fs: FamilySpec) -> str | None:
        """Why this family cannot implement the spec's direction, head dim, dtype, arch at all, or None."""

    def combination_reason(self, fs: FamilySpec) -> str | None:
        """Why this family declines the spec's combination of features it implements one by one
        (e.g. a register budget), or None."""

    def config_reason(self, fs: FamilySpec) -> Reason | None:
        """Why this (tile, warps, knobs) is not accepted, or None."""

    def knob_default(self, knob: Knob, fs: FamilySpec) -> int:
        """The value of ``knob`` for a spec that does not set it (``knob.default`` unless the spec needs another)."""

    def smem_layout(self, fs: FamilySpec) -> SmemLayout:
        """Exact dynamic-smem layout of the kernel that uses the most shared memory."""

    def tile_caps(self, fs: FamilySpec) -> tuple[int, int]:
        """Largest (block_r, block_c) a default tile starts from, before shrinking to fit smem."""

    def default_tile(self, fs: FamilySpec, sram_bytes: int) -> tuple[int, int] | None:
        """The (block_r, block_c) a spec without block_r / block_c starts from (then capped by
        ``tile_caps`` and shrunk until it fits sram_bytes), or None for Algorithm 4's paper point."""

    def default_warps(self, fs: FamilySpec) -> int:
        """num_warps of a spec that names none (``fs`` carries DEFAULT_NUM_WARPS): one of
        ``warp_choices``, the shape this family's kernels issue least per unit of work with."""

    def tile_work(self, fs: FamilySpec, role: str) -> dict[str, float] | None:
        """SASS opcode -> warp instructions one (average) warp of the ``role`` kernel must issue per
        tile pair of ``fs.tile`` (tensor-core instructions, 16-byte copies, reductions), from which
        ``fagen.autotune.sassloops.tile_loop`` solves the trip counts of the tile loop's nested
        loops; None: the cost model scales the whole main loop instead."""

    def template_context(self, fs: FamilySpec) -> dict[str, Any]:
        """The family's decisions for its templates: ``strides`` (named smem row strides, emitted as
        constexprs) and ``constants`` (a tuple of :class:`Constant`, emitted after them and each also
        given to the templates by name); other keys are extra Jinja values (e.g. a C++ type name).
        Templates never read the spec: what they branch on is decided here."""

    def templates(self, direction: str) -> tuple[str, ...]:
        """Template files ("<name>/file", under the family's template folder) rendered, in order."""

    def roles(self, fs: FamilySpec) -> tuple[Role, ...]:
        """The kernels of the module, in launch order (parameter lists from fagen.abi); the
        deterministic backward adds the ``dq`` role."""

    def role_smem_bytes(self, fs: FamilySpec, role: Role) -> int:
        """Dynamic shared memory (bytes) one role is launched with."""

    def launch(self, fs: FamilySpec, role: Role) -> Launch:
        """Block dims and rows per block of one role."""

    def nvrtc_options(self, fs: FamilySpec) -> tuple[str, ...]:
        """Options added to the compiler's defaults (-arch, -std, -Xptxas=-v)."""

    def tensor_maps(self, fs: FamilySpec, role: Role, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """The tensor-map arguments (ABI kind tensormap, :class:`fagen.tma.TensorMapFields`) of one
        launch of ``role``, from the launch's tensors by parameter name (q, k, v, ...); the
        launchers call it only for a role that has such parameters."""

    def tma_tensors(self, fs: FamilySpec) -> tuple[str, ...]:
        """The launch's input tensors (q, k, v, do) the kernels read through tensor maps: the
        launchers pass a contiguous copy of one whose layout no tensor map describes
        (:func:`fagen.tma.layout_fits`: a broadcast, a stride not a multiple of 16 bytes), so a
        family takes every layout the others take."""

    def pair_cost(self, fs: FamilySpec, sass: Mapping[str, int] | None = None) -> PairCost | None:
        """Autotuner cost of one visited tile pair of ``fs.tile``; ``sass`` is the static opcode mix
        of the main kernel's main loop when the disassembler is installed (the model already derives
        the issue term from it). None: modelled by HBM traffic, FLOPs, SASS issue and dQ atomics."""


def sfu_tanh_fits(fs: FamilySpec) -> bool:
    """Whether softcap's tanh may run on the SFU (``tanh.approx.f32``, 2^-11 relative) instead of libm's
    ``tanhf``: softcap on 16-bit inputs, whose own rounding is as coarse (FlashAttention-2/3 do the same);
    fp32 and fp64 keep the exact one (partials/score_mod.cuh's ``fa_tanh``). Where it may run by default
    is :meth:`FamilyBase.softcap_tanh_approx`'s (the backward only)."""
    return fs.has("softcap") and fs.dtype in ("float16", "bfloat16")


@dataclass(frozen=True)
class FamilyBase:
    """Defaults every family inherits; override what differs."""

    name: str = ""
    preference: int = 100
    #: The family's codegen knobs (a fagen.families.codegen.CodegenSet), None without any.
    codegen_set: Any = None
    tile_multiple: int = 16
    #: The quantum of a block_c the spec may name, where the streamed block takes finer steps than the owned
    #: one (optional: a family without it has tile_multiple; its config_reason says which a direction takes).
    block_c_multiple: int = 16
    max_block_r: int = 128
    max_block_c: int = 128
    warp_choices: tuple[int, ...] = NUM_WARPS_CHOICES
    knobs: tuple[Knob, ...] = ()
    math_unit: Literal["fp32", "tensor"] = "fp32"
    min_regs_per_thread: int = MIN_REGS_PER_THREAD
    features: frozenset[str] = frozenset()
    template_dir: str | None = None

    def unsupported_reason(self, fs: FamilySpec) -> str | None:
        return None

    def combination_reason(self, fs: FamilySpec) -> str | None:
        return None

    def softcap_tanh_approx(self, fs: FamilySpec) -> bool:
        """Softcap's tanh on the SFU in the backward where :func:`sfu_tanh_fits` (a family may take it in
        fewer places). Not in the forward: its lse is an fp32 output, and on a GPU the SFU's tanh moved it by
        up to 2.7e-5 against flash-attn's criterion of about 3.6e-6 (fp16 / bf16, d = 64..256); the gradients,
        compared in the inputs' dtype, keep their criterion with it."""
        return fs.direction == "bwd" and sfu_tanh_fits(fs)

    def codegen_reason(self, fs: FamilySpec) -> str | None:
        """Why the spec's codegen knob settings (``fs.codegen``, tile set) are not accepted, or None:
        a family without codegen knobs takes none."""
        return f"impl={self.name!r} has no codegen knobs" if fs.codegen else None

    def config_reason(self, fs: FamilySpec) -> Reason | None:
        q = self.tile_multiple
        for field, v, limit in (("block_r", fs.block_r, self.max_block_r), ("block_c", fs.block_c, self.max_block_c)):
            if v < q or v % q or v > limit:
                return Reason(field, f"{field}={v} must be a multiple of {q} in {q}..{limit} ({self.name} template limit)")
        if fs.num_warps not in self.warp_choices:
            return Reason("num_warps", f"num_warps must be one of {self.warp_choices}, got {fs.num_warps}")
        knobs = fs.knob_values
        for knob in self.knobs:
            v = knobs.get(knob.name, knob.default)
            if v not in knob.choices:
                return Reason("knobs", f"{knob.name}={v} must be one of {knob.choices} ({self.name})")
        return None

    def knob_default(self, knob: Knob, fs: FamilySpec) -> int:
        return knob.default

    def smem_layout(self, fs: FamilySpec) -> SmemLayout:  # pragma: no cover - every family has one
        raise NotImplementedError

    def tile_caps(self, fs: FamilySpec) -> tuple[int, int]:
        return self.max_block_r, self.max_block_c

    def default_tile(self, fs: FamilySpec, sram_bytes: int) -> tuple[int, int] | None:
        return None

    def default_warps(self, fs: FamilySpec) -> int:
        return DEFAULT_NUM_WARPS

    def tile_work(self, fs: FamilySpec, role: str) -> dict[str, float] | None:
        return None

    def template_context(self, fs: FamilySpec) -> dict[str, Any]:
        return {"strides": {}, "constants": ()}

    def templates(self, direction: str) -> tuple[str, ...]:  # pragma: no cover - every family has some
        raise NotImplementedError

    def roles(self, fs: FamilySpec) -> tuple[Role, ...]:
        return roles_for(fs.direction, fs.has("deterministic"))

    def role_smem_bytes(self, fs: FamilySpec, role: Role) -> int:
        """Dynamic shared memory of one role: the whole layout for the main and dq kernels, none for
        the others. A family whose dq kernel uses a prefix of the layout returns less."""
        return self.smem_layout(fs).total_bytes if role.name in ("main", "dq") else 0

    def launch(self, fs: FamilySpec, role: Role) -> Launch:
        rows = {"block_r": fs.block_r, "block_c": fs.block_c, "num_warps": fs.num_warps}[role.rows_per_block]
        return Launch((fs.num_threads, 1, 1), rows)

    def nvrtc_options(self, fs: FamilySpec) -> tuple[str, ...]:
        return ()

    def tensor_maps(self, fs: FamilySpec, role: Role, tensors: Mapping[str, Any]) -> dict[str, Any]:
        if any(is_tensormap(ctype) for ctype, _ in role.params):
            raise NotImplementedError(f"{self.name}: role {role.name!r} takes tensor maps but the family builds none")
        return {}

    def tma_tensors(self, fs: FamilySpec) -> tuple[str, ...]:
        return ()

    def pair_cost(self, fs: FamilySpec, sass: Mapping[str, int] | None = None) -> PairCost | None:
        return None


def feature_reason(family: Family, wanted: frozenset[str]) -> str | None:
    """Why ``family`` cannot compile these spec features (FamilySpec.features) in, or None."""
    have = frozenset(family.features)
    missing = sorted(set(wanted) - have)
    if not missing:
        return None
    return f"its templates do not implement {', '.join(missing)} yet (implemented: {sorted(have) or 'none'})"

