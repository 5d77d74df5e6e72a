"""KernelSpec: the single source of truth for one specialised kernel module.

Compile-time flags live here as fields; everything else (the paper's tile,
the feasible tile, the smem layout, the procedural name) is derived from the
fields and never stored twice. Runtime values (batch, heads, seqlens, scale,
dropout p, seed/offset, strides) are kernel arguments, not fields.
"""
from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from .arch import ARCHS, arch_for_capability  # noqa: F401 - re-exported
# NUM_WARPS_CHOICES and Tile are re-exported here (the CLI and callers read them from fagen.spec).
from .families import (DEFAULT_NUM_WARPS, NUM_WARPS_CHOICES, Family, FamilySpec, Tile, families, family_names, feature_reason,
                       get_family, warp_choices)
from .layout import SmemLayout

Arch = Literal["sm_80", "sm_86", "sm_87", "sm_89", "sm_90", "sm_90a", "sm_100", "sm_103", "sm_110", "sm_120", "sm_121"]
DType = Literal["float16", "bfloat16", "float32", "float64"]
CausalAlign = Literal["bottom_right", "top_left"]
Direction = Literal["bwd", "fwd"]

#: Per-arch facts, read from the one table in fagen/arch.py (CUDA C++ Programming Guide,
#: "Technical Specifications per Compute Capability"; see docs/architecture.md):
#: maximum opt-in dynamic shared memory per block (bytes), shared memory per SM and resident limits.
ARCH_SMEM_OPTIN: dict[str, int] = {n: a.smem_optin_per_block for n, a in ARCHS.items()}
ARCH_SMEM_PER_SM: dict[str, int] = {n: a.smem_per_sm for n, a in ARCHS.items()}
ARCH_MAX_THREADS_PER_SM: dict[str, int] = {n: a.max_threads_per_sm for n, a in ARCHS.items()}
ARCH_MAX_BLOCKS_PER_SM: dict[str, int] = {n: a.max_blocks_per_sm for n, a in ARCHS.items()}
REGS_PER_SM = 65536  # every arch in the table (ArchInfo.regs_per_sm)
DTYPE_ITEMSIZE: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
DTYPE_SHORT: dict[str, str] = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}
DTYPE_CTYPE: dict[str, str] = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "float64": "double"}
HEAD_DIM_MIN, HEAD_DIM_MAX, HEAD_DIM_MULTIPLE = 8, 256, 8
#: Longest sequence the kernels take: 32-bit row indices with room for one more tile
#: (loop counters reach row + block size). The functional API and the autotuner check it.
SEQLEN_MAX = 2**31 - 2**16


#: (field, name suffix) of the boolean flags, in name order.
NAME_FLAGS: tuple[tuple[str, str], ...] = (
    ("causal", "causal"), ("key_padding", "kpad"), ("dropout", "dropout"), ("window", "win"), ("softcap", "softcap"),
    ("alibi", "alibi"), ("attn_mask", "mask"), ("bias", "bias"), ("bias_grad", "dbias"), ("varlen", "varlen"),
    ("deterministic", "det"), ("sinks", "sinks"))
#: Boolean flags that are optional features (a family lists those it implements).
FLAG_FEATURES = ("window", "softcap", "alibi", "attn_mask", "bias", "bias_grad", "varlen", "deterministic", "sinks")


Knobs = tuple[tuple[str, int], ...]


def paper_tile(sram_bytes: int, itemsize: int, head_dim: int) -> tuple[int, int]:
    """Algorithm 4 line 2 with M in elements: (B_r, B_c) = (min(ceil(M/4d), d), ceil(M/4d))."""
    block_c = math.ceil((sram_bytes // itemsize) / (4 * head_dim))
    return min(block_c, head_dim), block_c


def _field_error(field: str, kind: str, message: str, value: Any) -> ValidationError:
    return ValidationError.from_exception_data(
        "KernelSpec",
        [InitErrorDetails(type=PydanticCustomError(kind, message), loc=(field,), input=value)],
    )


class KernelSpec(BaseModel):
    """One specialised FlashAttention kernel module (compile-time choices only)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    direction: Direction = Field("bwd", description="bwd: Algorithm 4 backward; fwd: forward with online softmax")
    head_dim: int = Field(..., description="d: multiple of 8 in 8..256")
    head_dim_v: int | None = Field(None, description="the head dim of v, o, dO and dV when it differs from d's "
                                   "(a multiple of 8 in 8..256; None: d)")
    dtype: DType = "float16"
    causal: bool = False
    key_padding: bool = False
    dropout: bool = False
    causal_align: CausalAlign = Field("bottom_right", description="alignment of causal, window and alibi when Nq != Nk: "
                                      "bottom_right (flash-attn, shift Nk - Nq) or top_left (torch SDPA, shift 0)")
    window: bool = Field(False, description="sliding window (window_left, window_right runtime; -1 = unbounded)")
    softcap: bool = Field(False, description="scores become softcap * tanh(s / softcap) (softcap > 0 runtime)")
    alibi: bool = Field(False, description="ALiBi bias -slope * |i + shift - j| (fp32 slopes [H] or [B, H] runtime)")
    attn_mask: bool = Field(False, description="bool attention mask (uint8, 1 = take part) with broadcast strides")
    bias: bool = Field(False, description="additive float bias of the spec's dtype with broadcast strides")
    bias_grad: bool = Field(False, description="backward also writes dBias (needs bias)")
    varlen: bool = Field(False, description="packed variable-length sequences (cu_seqlens runtime)")
    deterministic: bool = Field(False, description="backward whose dQ sums in a fixed order (bit-reproducible): a "
                               "separate dq kernel (mma, simt) or dQ adds taking turns (wgmma)")
    sinks: bool = Field(False, description="forward: attention sinks, one fp32 logit per q head in every row's softmax "
                        "denominator (sinks runtime); the backward needs no flag (lse includes the sink)")
    arch: Arch = "sm_90"
    sram_bytes: int = Field(None, validate_default=True, description="M in bytes; default: the arch's opt-in max")  # type: ignore[assignment]
    block_r: int | None = Field(None, description="override of B_r (rows of Q per tile)")
    block_c: int | None = Field(None, description="override of B_c (rows of K/V per tile)")
    num_warps: int | None = Field(None, description="warps per block (wgmma: consumer warps); default: the family's choice")
    #: Resolved at validation (never None on a built spec): the family, and its knobs with defaults filled in
    #: (a ``Knob.elided`` knob at its default is left out).
    impl: str | None = Field(None, description="kernel family; default: the preferred family that supports the spec")
    knobs: Knobs | None = Field(None, description="the family's extra knobs (name -> int); default: the family's defaults")
    codegen: Knobs | None = Field(None, description="the family's codegen knobs set by the user (name -> int), before "
                                  "the stored search's table and the starting points; default: none (in the name "
                                  "and the cache key only when given)")

    # ----------------------------------------------------------------- fields
    @field_validator("head_dim")
    @classmethod
    def _check_head_dim(cls, v: int) -> int:
        if not (HEAD_DIM_MIN <= v <= HEAD_DIM_MAX) or v % HEAD_DIM_MULTIPLE:
            raise ValueError(f"head_dim must be a multiple of {HEAD_DIM_MULTIPLE} in {HEAD_DIM_MIN}..{HEAD_DIM_MAX}, got {v}")
        return v

    @field_validator("head_dim_v")
    @classmethod
    def _check_head_dim_v(cls, v: int | None, info: Any) -> int | None:
        if v is None:
            return v
        if not (HEAD_DIM_MIN <= v <= HEAD_DIM_MAX) or v % HEAD_DIM_MULTIPLE:
            raise ValueError(f"head_dim_v must be a multiple of {HEAD_DIM_MULTIPLE} in {HEAD_DIM_MIN}..{HEAD_DIM_MAX}, got {v}")
        return None if v == info.data.get("head_dim") else v  # the same as d: no separate dim

    @field_validator("sram_bytes", mode="before")
    @classmethod
    def _default_sram(cls, v: Any, info: Any) -> Any:
        if v is None:
            arch = info.data.get("arch")
            return ARCH_SMEM_OPTIN.get(arch, 0) if arch else v
        return v

    @field_validator("sram_bytes")
    @classmethod
    def _check_sram(cls, v: int, info: Any) -> int:
        arch = info.data.get("arch")
        limit = ARCH_SMEM_OPTIN.get(arch) if arch else None
        if v <= 0:
            raise ValueError(f"sram_bytes must be positive, got {v}")
        if limit is not None and v > limit:
            raise ValueError(f"sram_bytes={v} exceeds the {arch} opt-in shared memory limit of {limit} bytes per block")
        return v

    @field_validator("num_warps")
    @classmethod
    def _check_warps(cls, v: int | None) -> int | None:
        if v is None:
            return v
        choices = warp_choices()  # of every registered family; the spec's family checks its own
        if v not in choices:
            raise ValueError(f"num_warps must be one of {choices}, got {v}")
        return v

    @field_validator("impl")
    @classmethod
    def _check_impl(cls, v: str | None) -> str | None:
        if v is not None and v not in family_names():
            raise ValueError(f"impl must be one of {family_names()}, got {v!r}")
        return v

    @field_validator("knobs", mode="before")
    @classmethod
    def _knobs_as_pairs(cls, v: Any) -> Any:
        if isinstance(v, Mapping):
            return tuple(sorted(v.items()))
        return v

    @field_validator("knobs")
    @classmethod
    def _check_knobs(cls, v: Knobs | None) -> Knobs | None:
        if v is None:
            return v
        names = [k for k, _ in v]
        if len(set(names)) != len(names):
            raise ValueError(f"knobs must name each knob once, got {names}")
        return tuple(sorted(v))

    @field_validator("codegen", mode="before")
    @classmethod
    def _codegen_as_pairs(cls, v: Any) -> Any:
        if isinstance(v, Mapping):
            v = tuple(sorted(v.items()))
        return v or None  # none given: the field is absent (name, cache key and JSON as without it)

    @field_validator("codegen")
    @classmethod
    def _check_codegen(cls, v: Knobs | None) -> Knobs | None:
        if v is None:
            return v
        names = [k for k, _ in v]
        if len(set(names)) != len(names):
            raise ValueError(f"codegen must name each knob once, got {names}")
        return tuple(sorted(v))

    @model_serializer(mode="wrap")
    def _drop_absent_codegen(self, handler: Any) -> Any:
        out = handler(self)
        if self.codegen is None and isinstance(out, dict):
            out.pop("codegen", None)  # a spec without codegen settings dumps (and hashes) as before the field
        return out

    @model_validator(mode="after")
    def _check_flags(self) -> "KernelSpec":
        if self.bias_grad and not self.bias:
            raise _field_error("bias_grad", "flags", "bias_grad needs bias=True (dBias is the gradient of that bias)", True)
        if self.bias_grad and self.direction != "bwd":
            raise _field_error("bias_grad", "flags", "bias_grad applies to the backward (direction='bwd') only", True)
        if self.deterministic and self.direction != "bwd":
            raise _field_error("deterministic", "flags", "deterministic applies to the backward only (every forward "
                               "kernel is deterministic: no atomics); use direction='bwd'", True)
        if self.sinks and self.direction != "fwd":
            raise _field_error("sinks", "flags", "sinks applies to the forward only (the backward reads the sink "
                               "through lse and needs no flag); use direction='fwd'", True)
        if self.causal_align == "top_left" and not (self.causal or self.window or self.alibi):
            raise _field_error("causal_align", "flags", "causal_align='top_left' changes only causal, window or alibi "
                               "kernels; set one of them or keep 'bottom_right'", self.causal_align)
        return self

    @model_validator(mode="after")
    def _check_feasible(self) -> "KernelSpec":
        # impl and knobs are resolved here and stored, so the name and cache key carry them.
        if self.impl is not None:
            err = self._fit(self.family)
            if err is not None:
                raise err
            return self
        # impl=None: the first family in preference order that implements the spec as given
        # (its tile, warps and knobs included).
        knobs, warps, tried, unsupported = self.knobs, self.num_warps, [], []
        for fam in families():
            name = fam.name
            self._resolve_warps(fam, warps)
            why = _family_reason(fam, self._family_spec(None))
            if why:
                unsupported.append(f"{name}: {why}")
                continue
            err = self._fit(fam)
            if err is None:
                return self
            tried.append((name, err))
            object.__setattr__(self, "knobs", knobs)
        object.__setattr__(self, "num_warps", warps if warps is not None else DEFAULT_NUM_WARPS)
        if not tried:
            raise _field_error("impl", "unsupported", "no registered kernel family implements this spec ("
                               + "; ".join(unsupported) + ")", None)
        first = tried[0][1].errors()[0]
        why = "; ".join(f"{name}: {e.errors()[0]['msg']}" for name, e in tried)
        raise _field_error(str(first["loc"][0]), str(first["type"]), f"no kernel family accepts this spec ({why})",
                           first.get("input"))

    def _fit(self, fam: Family) -> ValidationError | None:
        """Resolve impl and knobs for ``fam`` and check the spec against it; the error, or None."""
        object.__setattr__(self, "impl", fam.name)
        if self.num_warps is None:
            self._resolve_warps(fam, None)
        why = _family_reason(fam, self._family_spec(None))
        if why:
            return _field_error("impl", "unsupported", f"impl={self.impl!r} cannot implement this spec: {why}", self.impl)
        given = dict(self.knobs or ())
        unknown = sorted(set(given) - {k.name for k in fam.knobs})
        if unknown:
            known = [k.name for k in fam.knobs]
            return _field_error("knobs", "knob", f"impl={self.impl!r} has no knob {unknown[0]!r} (its knobs: {known})",
                                self.knobs)
        fs0 = self._family_spec(None)
        default = getattr(fam, "knob_default", lambda k, _fs: k.default)  # a family outside FamilyBase: the knob's
        values = {k.name: given.get(k.name, default(k, fs0)) for k in fam.knobs}
        object.__setattr__(self, "knobs", tuple(sorted((k.name, values[k.name]) for k in fam.knobs  # Knob.elided
                                                       if not (getattr(k, "elided", False) and values[k.name] == k.default))))
        for field in ("block_r", "block_c"):
            v = getattr(self, field)
            limit = fam.max_block_r if field == "block_r" else fam.max_block_c
            q = fam.tile_multiple if field == "block_r" else getattr(fam, "block_c_multiple", fam.tile_multiple)
            if v is not None and (v < q or v % q or v > limit):
                return _field_error(field, "tile", f"{field}={v} must be a multiple of {q} in {q}..{limit} "
                                                   f"({self.impl} template limit)", v)
        try:
            tile = _resolve_tile(*self._tile_key())
        except _Infeasible as e:
            return _field_error(e.field, "smem", str(e), getattr(self, e.field))
        bad = fam.config_reason(self._family_spec(tile))
        if bad is not None and getattr(self, bad.field) is None and bad.field in ("block_r", "block_c"):
            # the family's own default tile does not fit: the family cannot take the spec as given
            return _field_error("impl", "unsupported", f"impl={self.impl!r} cannot implement this spec at its default "
                                f"tile {tile.block_r}x{tile.block_c}: {bad.message}; pass block_r / block_c to choose another",
                                self.impl)
        if bad is not None:
            return _field_error(bad.field, "config", f"{bad.message} (impl={self.impl!r})", getattr(self, bad.field))
        if self.codegen is not None:
            check = getattr(fam, "codegen_reason", None)  # a family outside FamilyBase: no codegen knobs
            why = check(self._family_spec(tile)) if check is not None else f"impl={self.impl!r} has no codegen knobs"
            if why is not None:
                return _field_error("codegen", "codegen", f"codegen: {why}", dict(self.codegen))
        return None

    def _resolve_warps(self, fam: Family, given: int | None) -> None:
        """num_warps as given, else the family's default for the spec (``Family.default_warps``)."""
        object.__setattr__(self, "num_warps", DEFAULT_NUM_WARPS if given is None else given)
        if given is None:
            object.__setattr__(self, "num_warps", fam.default_warps(self._family_spec(None)))

    # ---------------------------------------------------------------- derived
    @property
    def features(self) -> frozenset[str]:
        """The optional features the spec compiles in (fagen.families.FEATURES): a family takes
        the spec only if its ``features`` holds them all."""
        return self._family_spec(None).features

    @property
    def family_spec(self) -> FamilySpec:
        """What the spec's family sees of it (fagen.families.FamilySpec), its tile included: the one
        value every Family method takes."""
        return self._family_spec(self.tile)

    def _family_spec(self, tile: Tile | None) -> FamilySpec:
        flags = {f for f, _ in NAME_FLAGS if getattr(self, f)}
        if self.causal_align == "top_left":
            flags.add("top_left")
        return FamilySpec(self.direction, self.head_dim, self.dtype, self.arch, frozenset(flags), tile, self.num_warps,
                          tuple(self.knobs or ()), head_dim_v=self.head_dim_v or 0, codegen=tuple(self.codegen or ()))

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def ctype(self) -> str:
        return DTYPE_CTYPE[self.dtype]

    @property
    def sram_elems(self) -> int:
        """M counted in elements of dtype (Algorithm 4 line 2)."""
        return self.sram_bytes // self.itemsize

    @property
    def paper_block_c(self) -> int:
        """Algorithm 4 line 2: B_c = ceil(M / 4d)."""
        return paper_tile(self.sram_bytes, self.itemsize, self.head_dim)[1]

    @property
    def paper_block_r(self) -> int:
        """Algorithm 4 line 2: B_r = min(ceil(M / 4d), d)."""
        return paper_tile(self.sram_bytes, self.itemsize, self.head_dim)[0]

    @property
    def tile(self) -> Tile:
        """The feasible tile (override, or the paper's point made feasible)."""
        return _resolve_tile(*self._tile_key())

    @property
    def num_threads(self) -> int:
        return 32 * self.num_warps

    @property
    def knob_values(self) -> dict[str, int]:
        """The family's knobs with their values (defaults filled in; a ``Knob.elided`` knob at its default absent)."""
        return dict(self.knobs or ())

    @property
    def family(self) -> Family:
        """The registered family of ``impl`` (``fagen.plan.plan_of`` holds what it decides for the spec)."""
        return get_family(self.impl)  # type: ignore[arg-type]

    @property
    def smem_layout(self) -> SmemLayout:
        return self.family.smem_layout(self.family_spec)

    @property
    def smem_bytes(self) -> int:
        return self.smem_layout.total_bytes

    @property
    def min_blocks_per_sm(self) -> int:
        """Second __launch_bounds__ argument: the blocks per SM the smem footprint allows
        (1 KB reserved per block), capped so each thread keeps a budget of at least
        MIN_REGS_PER_THREAD registers -- ptxas then neither aims for an occupancy smem
        forbids nor spills to reach one."""
        by_smem = ARCH_SMEM_PER_SM[self.arch] // (self.smem_bytes + 1024)
        budget = self.family.min_regs_per_thread  # families.MIN_REGS_PER_THREAD unless the family asks for more
        by_regs = REGS_PER_SM // (self.num_threads * budget)
        return max(1, min(by_smem, by_regs))

    @property
    def name(self) -> str:
        """Procedural name, e.g. fa_bwd_d64_fp16_causal_dropout_br64_bc128_w4_simt_sm90; a family's
        knobs follow the warps as ``_{abbrev}{value}`` (e.g. ``_w4_s2_mma``), then codegen knobs the spec
        sets as ``_cg_{name}{value}`` (e.g. ``_s2_cg_fwd_q_in_regs0_mma``). Feature flags add
        ``_tl _win _softcap _alibi _mask _bias _dbias _varlen _det _sinks`` after ``_causal _kpad _dropout``."""
        flags = [abbrev for field, abbrev in NAME_FLAGS if getattr(self, field)]
        if self.causal_align == "top_left":
            flags.insert(int(self.causal), "tl")  # right after _causal
        flag_part = "".join(f"_{f}" for f in flags)
        t = self.tile
        m = "" if self.sram_bytes == ARCH_SMEM_OPTIN[self.arch] else f"_m{self.sram_bytes}"
        values = self.knob_values
        knob_part = "".join(f"_{k.abbrev}{values[k.name]}" for k in self.family.knobs if k.name in values)
        knob_part += "".join(f"_cg_{k}{v}" for k, v in self.codegen or ())  # the user's codegen settings
        return (
            f"fa_{self.direction}_d{self.head_dim}{f'_dv{self.head_dim_v}' if self.head_dim_v else ''}"
            f"_{DTYPE_SHORT[self.dtype]}{flag_part}"
            f"_br{t.block_r}_bc{t.block_c}_w{self.num_warps}{knob_part}_{self.impl}_{self.arch.replace('_', '')}{m}"
        )

    @property
    def cache_key(self) -> str:
        """Stable digest of the spec's canonical JSON (the compile cache also hashes the source)."""
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:32]

    def replace(self, **changes: Any) -> "KernelSpec":
        """A new, re-validated spec with some fields changed. The family stays unless ``impl`` is
        given (``impl=None``: the default family of the new fields); a new family starts from its
        own knob defaults (and no codegen settings) unless ``knobs`` (``codegen``) is given."""
        fields = {**self.model_dump(), **changes}
        if "impl" in changes and "knobs" not in changes and changes["impl"] != self.impl:
            fields["knobs"] = None
        if "impl" in changes and "codegen" not in changes and changes["impl"] != self.impl:
            fields["codegen"] = None
        return KernelSpec(**fields)

    def without_tiles(self) -> dict[str, Any]:
        """The spec's fields minus the tuning choices (tile, warps, family, knobs, codegen knobs)."""
        return self.model_dump(exclude={"block_r", "block_c", "num_warps", "impl", "knobs", "codegen"})

    def _tile_key(self) -> tuple[Family, FamilySpec, int, int | None, int | None]:
        assert self.impl is not None
        return (self.family, self._family_spec(None), self.sram_bytes, self.block_r, self.block_c)


class _Infeasible(Exception):
    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(message)


def _family_reason(fam: Family, fs: FamilySpec) -> str | None:
    """Why ``fam`` cannot take the spec at all (before its tile), or None."""
    return fam.unsupported_reason(fs) or feature_reason(fam, fs.features) or fam.combination_reason(fs)


@functools.lru_cache(maxsize=4096)
def _resolve_tile(fam: Family, fs: FamilySpec, sram: int, br_over: int | None, bc_over: int | None) -> Tile:
    """Paper point -> multiple of the tile quantum -> capped -> shrunk until the smem footprint fits M."""
    q = fam.tile_multiple
    qc = getattr(fam, "block_c_multiple", q)  # a finer key block where the family takes one (its default tile)
    d, itemsize = fs.head_dim, fs.itemsize

    def footprint(br: int, bc: int) -> int:
        return fam.smem_layout(fs.with_tile(br, bc)).total_bytes

    if br_over is not None and bc_over is not None:
        need = footprint(br_over, bc_over)
        if need > sram:
            field = "block_c" if bc_over >= br_over else "block_r"
            raise _Infeasible(field, f"tile block_r={br_over} x block_c={bc_over} needs {need} bytes of shared memory, more than sram_bytes={sram}")
        return Tile(br_over, bc_over)
    paper_r, paper_c = fam.default_tile(fs, sram) or paper_tile(sram, itemsize, d)
    cap_r, cap_c = fam.tile_caps(fs)
    br = br_over if br_over is not None else min(max(q, paper_r // q * q), cap_r)
    bc = bc_over if bc_over is not None else min(max(q, paper_c // q * q) if paper_c >= q else max(qc, paper_c // qc * qc), cap_c)
    while footprint(br, bc) > sram:
        # shrink the free dimension that is larger (B_c first on ties), one quantum at a time
        can_c = bc_over is None and bc > q
        can_r = br_over is None and br > q
        if can_c and (bc >= br or not can_r):
            bc -= q
        elif can_r:
            br -= q
        else:
            field = "block_r" if br_over is not None else "block_c"
            raise _Infeasible(
                field,
                f"no tile fits sram_bytes={sram}: the smallest ({br}x{bc}) needs {footprint(br, bc)} bytes of shared memory",
            )
    return Tile(br, bc)
