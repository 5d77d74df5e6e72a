"""The mma family's codegen knobs: the code-shape choices that only trade speed, their legal ranges,
their starting points, and the one config record per spec that the templates read.

A :class:`CodegenKnob` names one constant of ``MmaFamily.template_context`` (``BWD_PIN``,
``BWD_CHUNK_SUB``, ``Q_IN_REGS``, ...), the values it may take, a legality formula over the
:class:`~fagen.families.FamilySpec` (divisibility, the register file, the layout it belongs to:
facts of the kernel's structure, not of one compiler) and a starting point (the hand-written rule
of :mod:`fagen.families.mma.rules`). :func:`codegen_config` makes the spec's
:class:`CodegenConfig` once: each knob's value and where it came from -- ``"table"`` (the stored
search's winner for the spec's :func:`class_key`, ``codegen_table.json``, written by
``fagen tune-codegen``), ``"start"`` (the starting point: no table entry for the class, another
NVRTC major, or an entry illegal for this spec) or ``"user"`` (``KernelSpec.codegen``, checked by
:func:`override_reason`, before the table and the start). A knob that does not apply to the spec's kernel
(the two-dimensional layout's knobs on the one-dimensional backward, ...) stays at its starting
point.
"""
from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

from fagen.arch import ARCHS
from fagen.families.base import FamilySpec
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

__all__ = ["CODEGEN_KNOBS", "REGISTER_FILE", "TABLE_PATH", "CodegenConfig", "CodegenKnob", "KnobValue",
           "class_key", "clear_table", "codegen_config", "forcing", "illegal_reason", "knobs_for", "load_table",
           "nvrtc_major", "override_reason", "start_values"]

#: Registers one thread can address (the launch bounds leave all of them to the mma kernels): fragments
#: a knob holds in registers beyond this cannot live there.
REGISTER_FILE = 255
#: The table the stored search writes and the family reads.
TABLE_PATH = Path(__file__).with_name("codegen_table.json")
#: Version of the table's layout.
TABLE_FORMAT = 1


def _reg_dim(fs: FamilySpec) -> int:
    return max(fs.head_dim, fs.dv)


def _cap(fs: FamilySpec) -> tuple[int, int]:
    return ARCHS[fs.arch].capability


def _two_d(fs: FamilySpec) -> bool:
    return bwd_2d(fs.head_dim, fs.flags, fs.block_r, fs.block_c, fs.num_warps, fs.dv)


def _one_d(fs: FamilySpec) -> bool:
    return fs.direction == "bwd" and not _two_d(fs)


@dataclass(frozen=True)
class CodegenKnob:
    """One code-shape choice of the mma family: the template constant ``constant`` takes a value of
    ``values``; ``applies`` says whether the spec's kernel has the choice at all (else the value is
    the starting point); ``legal`` returns why a value is illegal for the spec (None: legal);
    ``start`` is the starting point (a rule of fagen.families.mma.rules)."""

    name: str
    constant: str
    ctype: str  # "bool" or "int"
    direction: str
    values: tuple[int, ...]
    applies: Callable[[FamilySpec], bool]
    legal: Callable[[FamilySpec, int], str | None]
    start: Callable[[FamilySpec], int]
    help: str
    #: Why the stored search leaves the knob at its starting point (None: it searches it): a choice
    #: whose gain the tile-loop cost cannot see.
    unsearched: str | None = None


def _always(fs: FamilySpec, v: int) -> str | None:
    return None


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
_BY_NAME = {k.name: k for k in CODEGEN_KNOBS}


def _chunk_joint(fs: FamilySpec, values: Mapping[str, int]) -> str | None:
    """Legality across knobs: chunks per trip must divide the Q block's chunks of ``bwd_chunk_sub`` rows."""
    sub, unroll = values.get("bwd_chunk_sub", 1), values.get("bwd_chunk_unroll", 1)
    if unroll > 1 and fs.block_r % (16 * sub * unroll):
        return f"bwd_chunk_unroll={unroll} chunks of {16 * sub} rows do not divide the Q block's {fs.block_r} rows"
    return None


def knobs_for(fs: FamilySpec) -> tuple[CodegenKnob, ...]:
    """The knobs of the spec's direction whose choice its kernel has (the others stay at their start)."""
    return tuple(k for k in CODEGEN_KNOBS if k.direction == fs.direction and k.applies(fs))


def start_values(fs: FamilySpec) -> dict[str, int]:
    """Every knob of the spec's direction at its starting point (today's rule)."""
    return {k.name: int(k.start(fs)) for k in CODEGEN_KNOBS if k.direction == fs.direction}


def illegal_reason(fs: FamilySpec, values: Mapping[str, int]) -> str | None:
    """Why the knob setting ``values`` (name -> value; missing knobs at their start) is illegal for
    ``fs``, or None. A knob the spec's kernel does not have must stay at its starting point."""
    full = {**start_values(fs), **values}
    own = {k.name for k in knobs_for(fs)}
    for name, v in full.items():
        k = _BY_NAME.get(name)
        if k is None or k.direction != fs.direction:
            return f"{name}: not a codegen knob of the {fs.direction} kernels"
        if v not in k.values:
            return f"{name}={v}: not one of {k.values}"
        if name not in own:
            if v != k.start(fs):
                return f"{name}={v}: the spec's kernel has no such choice"
            continue
        why = k.legal(fs, v)
        if why is not None:
            return f"{name}={v}: {why}"
    return _chunk_joint(fs, full) if fs.direction == "bwd" else None


def override_reason(fs: FamilySpec, values: Mapping[str, int]) -> str | None:
    """Why the user's knob setting ``values`` (``KernelSpec.codegen``; the other knobs at their start)
    is not accepted for ``fs``, naming the knob, or None: a name that is no knob of the spec's
    direction (the list of those), a knob its kernel does not have, a value outside the knob's
    values, or a value illegal for the spec (why)."""
    own = [k.name for k in CODEGEN_KNOBS if k.direction == fs.direction]
    for name in values:
        if name not in own:
            return f"{name!r} is not a codegen knob of the {fs.direction} kernels (those: {own})"
    have = {k.name for k in knobs_for(fs)}
    for name, v in values.items():
        if name not in have:
            return f"{name}={v}: the spec's kernel has no such choice (its knobs: {sorted(have)})"
    return illegal_reason(fs, values)


def nvrtc_major() -> int | None:
    """The CUDA major of the NVRTC compiles use (None when none is found), without compiling."""
    from fagen import nvrtc

    try:
        tk = nvrtc.chosen_toolkit()
        return tk.major if tk is not None else nvrtc.version()[0]
    except (OSError, RuntimeError, ImportError):  # no NVRTC on this machine: no table entry applies
        return None


def class_key(fs: FamilySpec, major: int | None = None) -> str:
    """The class whose specs share one knob setting: NVRTC major, arch, dtype, padded head dims (``p``
    after a head dim that is not its own padding), direction, the tile and warps, and the flags."""
    if major is None:
        major = nvrtc_major()
    dp = padded_dim(fs.head_dim)
    dims = f"d{dp}" + ("p" if dp != fs.head_dim else "")
    if fs.dv != fs.head_dim:
        dims += f"-dv{padded_dim(fs.dv)}" + ("p" if padded_dim(fs.dv) != fs.dv else "")
    flags = "+".join(sorted(fs.flags)) or "plain"
    knobs = "".join(f",{k}{v}" for k, v in fs.knobs)
    return (f"nvrtc{major}/{fs.arch}/{fs.dtype}/{dims}/{fs.direction}/"
            f"{fs.block_r}x{fs.block_c}w{fs.num_warps}{knobs}/{flags}")


_TABLE: dict[str, dict] = {}
_TABLE_LOCK = threading.Lock()


def load_table(path: Path | None = None) -> dict[str, dict]:
    """The stored search's table: class key -> {"values": {knob: value}, ...} (empty when absent)."""
    p = TABLE_PATH if path is None else Path(path)
    key = str(p)
    with _TABLE_LOCK:
        if key not in _TABLE:
            try:
                data = json.loads(p.read_text())
            except FileNotFoundError:
                data = {}
            entries = data.get("classes", {}) if data.get("format") == TABLE_FORMAT else {}
            _TABLE[key] = entries
        return _TABLE[key]


def clear_table() -> None:
    """Forget the loaded table(s) and the config records made from them."""
    with _TABLE_LOCK:
        _TABLE.clear()
    _config.cache_clear()


@dataclass(frozen=True)
class KnobValue:
    name: str
    constant: str
    value: int
    source: str  # "table", "start" or "user"
    start: int


@dataclass(frozen=True)
class CodegenConfig:
    """The codegen knobs of one spec: each knob's value and its source, and the class it was looked
    up under (``note`` says why the table was not used, if it was not)."""

    class_key: str
    knobs: tuple[KnobValue, ...]
    note: str = ""

    def value(self, name: str) -> int:
        return next(k.value for k in self.knobs if k.name == name)

    @property
    def values(self) -> dict[str, int]:
        return {k.name: k.value for k in self.knobs}

    def as_dict(self) -> dict:
        return {"class": self.class_key, "note": self.note,
                "knobs": {k.name: {"value": k.value, "source": k.source, "start": k.start, "constant": k.constant}
                          for k in self.knobs}}


@functools.lru_cache(maxsize=4096)
def _config(fs: FamilySpec, major: int | None, table_path: str) -> CodegenConfig:
    start = start_values(fs)
    key = class_key(fs, major)
    entry = load_table(Path(table_path)).get(key)
    note = ""
    found: dict[str, int] = {}
    if major is None:
        note = "no NVRTC found: starting points"
    elif entry is None:
        rest = key.split("/", 1)[1]
        others = sorted(k.split("/", 1)[0] for k in load_table(Path(table_path)) if k.split("/", 1)[1] == rest)
        note = (f"class {key} not in the table" + (f" (searched with {', '.join(others)} only)" if others else "")
                + ": starting points")
    else:
        found = {k: int(v) for k, v in entry.get("values", {}).items()}
        why = illegal_reason(fs, found)
        if why is not None:
            note, found = f"the table's entry is illegal for this spec ({why}): starting points", {}
        own = {k.name for k in knobs_for(fs)}  # a knob the kernel does not have: its start, said so
        found = {k: v for k, v in found.items() if k in own}
    user = dict(fs.codegen)  # checked by KernelSpec (override_reason): before the table and the start
    if user and found and illegal_reason(fs, {**found, **user}) is not None:
        why = illegal_reason(fs, {**found, **user})
        note, found = f"the table's entry is illegal beside the user's settings ({why}): starting points", {}
    found = {k: v for k, v in found.items() if k not in user}
    knobs = tuple(KnobValue(k.name, k.constant, user.get(k.name, found.get(k.name, start[k.name])),
                            "user" if k.name in user else "table" if k.name in found else "start", start[k.name])
                  for k in CODEGEN_KNOBS if k.direction == fs.direction)
    return CodegenConfig(key, knobs, note)


_FORCED: ContextVar[Mapping[str, int] | None] = ContextVar("fagen_codegen_forced", default=None)


@contextmanager
def forcing(values: Mapping[str, int]) -> Iterator[None]:
    """Within the block, every spec's config takes ``values`` (knob -> value, the others at their
    start; source ``"search"``): how the stored search renders a setting it tries. Memoised renders
    and plans are not consulted by the search (``fagen.renderer.render_with``)."""
    token = _FORCED.set(dict(values))
    try:
        yield
    finally:
        _FORCED.reset(token)


def codegen_config(fs: FamilySpec, *, table: Path | None = None, major: int | None | str = "current") -> CodegenConfig:
    """The spec's codegen config record (memoised per spec, NVRTC major and table): ``table`` (default:
    the shipped one), ``major`` the NVRTC major the lookup is for (default: the one compiles use)."""
    forced = _FORCED.get()
    if forced is not None:
        start = start_values(fs)
        return CodegenConfig(class_key(fs), tuple(
            KnobValue(k.name, k.constant, int(forced.get(k.name, start[k.name])),
                      "search" if k.name in forced else "start", start[k.name])
            for k in CODEGEN_KNOBS if k.direction == fs.direction), "a setting the stored search tries")
    return _config(fs, nvrtc_major() if major == "current" else major, str(TABLE_PATH if table is None else table))
