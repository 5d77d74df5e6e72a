"""Codegen knobs, family-neutral: the code-shape choices of a family that only trade speed, their legal
ranges, their starting points, and the one config record per spec that the family's templates read.

A family states its knobs as one :class:`CodegenSet` (``fagen.families.mma.codegen.CODEGEN``,
``fagen.families.wgmma.codegen.CODEGEN``): each :class:`CodegenKnob` names one constant of the family's
``template_context``, the values it may take, a legality formula over the :class:`FamilySpec` (facts of
the kernel's structure: divisibility, the register file, the layout it belongs to -- not of one compiler)
and a starting point (a hand-written rule). :meth:`CodegenSet.config` makes the spec's
:class:`CodegenConfig` once: each knob's value and where it came from -- ``"table"`` (the stored search's
winner for the spec's :func:`class_key`, the family's ``codegen_table.json``, written by ``fagen
tune-codegen``), ``"start"`` (the starting point: no table entry for the class, another NVRTC major, or an
entry illegal for this spec) or ``"user"`` (``KernelSpec.codegen``, checked by
:meth:`CodegenSet.override_reason`, before the table and the start). A knob that does not apply to the
spec's kernel stays at its starting point.
"""
from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path

from fagen.families.base import FamilySpec, k16_padded

__all__ = ["TABLE_FORMAT", "CodegenConfig", "CodegenKnob", "CodegenSet", "KnobValue", "always_legal", "class_key",
           "clear_tables", "forcing", "nvrtc_major"]

#: Version of the tables' layout.
TABLE_FORMAT = 1


def always_legal(fs: FamilySpec, v: int) -> str | None:
    """The legality of a knob every value of which every spec that has it may take."""
    return None


@dataclass(frozen=True)
class CodegenKnob:
    """One code-shape choice of a family: the template constant ``constant`` takes a value of ``values``;
    ``applies`` says whether the spec's kernel has the choice at all (else the value is the starting
    point); ``legal`` returns why a value is illegal for the spec (None: legal); ``start`` is the starting
    point (a hand-written rule)."""

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


@dataclass(frozen=True)
class KnobValue:
    name: str
    constant: str
    value: int
    source: str  # "table", "start", "user" or "search"
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
    dp = k16_padded(fs.head_dim)
    dims = f"d{dp}" + ("p" if dp != fs.head_dim else "")
    if fs.dv != fs.head_dim:
        dims += f"-dv{k16_padded(fs.dv)}" + ("p" if k16_padded(fs.dv) != fs.dv else "")
    flags = "+".join(sorted(fs.flags)) or "plain"
    knobs = "".join(f",{k}{v}" for k, v in fs.knobs)
    return (f"nvrtc{major}/{fs.arch}/{fs.dtype}/{dims}/{fs.direction}/"
            f"{fs.block_r}x{fs.block_c}w{fs.num_warps}{knobs}/{flags}")


_TABLES: dict[str, dict[str, dict]] = {}
_TABLE_LOCK = threading.Lock()
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


def _load(path: Path) -> dict[str, dict]:
    key = str(path)
    with _TABLE_LOCK:
        if key not in _TABLES:
            try:
                data = json.loads(path.read_text())
            except FileNotFoundError:
                data = {}
            _TABLES[key] = data.get("classes", {}) if data.get("format") == TABLE_FORMAT else {}
        return _TABLES[key]


def clear_tables() -> None:
    """Forget the loaded tables and the config records made from them (every family's)."""
    with _TABLE_LOCK:
        _TABLES.clear()
    _config.cache_clear()


@dataclass(frozen=True, eq=False)
class CodegenSet:
    """A family's codegen knobs and the table its stored search writes (``table``); ``joint`` states
    legality across knobs (None: none). Hashed by identity (one per family)."""

    family: str
    knobs: tuple[CodegenKnob, ...]
    table: Path
    joint: Callable[[FamilySpec, Mapping[str, int]], str | None] | None = None
    _by_name: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._by_name.update({k.name: k for k in self.knobs})

    def knob(self, name: str) -> CodegenKnob:
        return self._by_name[name]

    def own(self, direction: str) -> tuple[CodegenKnob, ...]:
        """Every knob of ``direction``'s kernels (had by the spec's kernel or not)."""
        return tuple(k for k in self.knobs if k.direction == direction)

    def knobs_for(self, fs: FamilySpec) -> tuple[CodegenKnob, ...]:
        """The knobs of the spec's direction whose choice its kernel has (the others stay at their start)."""
        return tuple(k for k in self.own(fs.direction) if k.applies(fs))

    def start_values(self, fs: FamilySpec) -> dict[str, int]:
        """Every knob of the spec's direction at its starting point."""
        return {k.name: int(k.start(fs)) for k in self.own(fs.direction)}

    def illegal_reason(self, fs: FamilySpec, values: Mapping[str, int]) -> str | None:
        """Why the knob setting ``values`` (name -> value; missing knobs at their start) is illegal for
        ``fs``, or None. A knob the spec's kernel does not have must stay at its starting point."""
        full = {**self.start_values(fs), **values}
        have = {k.name for k in self.knobs_for(fs)}
        for name, v in full.items():
            k = self._by_name.get(name)
            if k is None or k.direction != fs.direction:
                return f"{name}: not a codegen knob of the {fs.direction} kernels"
            if v not in k.values:
                return f"{name}={v}: not one of {k.values}"
            if name not in have:
                if v != k.start(fs):
                    return f"{name}={v}: the spec's kernel has no such choice"
                continue
            why = k.legal(fs, v)
            if why is not None:
                return f"{name}={v}: {why}"
        return self.joint(fs, full) if self.joint is not None else None

    def override_reason(self, fs: FamilySpec, values: Mapping[str, int]) -> str | None:
        """Why the user's knob setting ``values`` (``KernelSpec.codegen``; the other knobs at their start)
        is not accepted for ``fs``, naming the knob, or None: a name that is no knob of the spec's
        direction (the list of those), a knob its kernel does not have, a value outside the knob's
        values, or a value illegal for the spec (why)."""
        own = [k.name for k in self.own(fs.direction)]
        for name in values:
            if name not in own:
                return f"{name!r} is not a codegen knob of the {fs.direction} kernels (those: {own})"
        have = {k.name for k in self.knobs_for(fs)}
        for name, v in values.items():
            if name not in have:
                return f"{name}={v}: the spec's kernel has no such choice (its knobs: {sorted(have)})"
        return self.illegal_reason(fs, values)

    def load_table(self, path: Path | None = None) -> dict[str, dict]:
        """The stored search's table: class key -> {"values": {knob: value}, ...} (empty when absent)."""
        return _load(self.table if path is None else Path(path))

    def config(self, fs: FamilySpec, *, table: Path | None = None, major: int | None | str = "current") -> CodegenConfig:
        """The spec's codegen config record (memoised per spec, NVRTC major and table): ``table`` (default:
        the family's), ``major`` the NVRTC major the lookup is for (default: the one compiles use)."""
        forced = _FORCED.get()
        if forced is not None:
            start = self.start_values(fs)
            return CodegenConfig(class_key(fs), tuple(
                KnobValue(k.name, k.constant, int(forced.get(k.name, start[k.name])),
                          "search" if k.name in forced else "start", start[k.name])
                for k in self.own(fs.direction)), "a setting the stored search tries")
        return _config(self, fs, nvrtc_major() if major == "current" else major,
                       str(self.table if table is None else table))


@functools.lru_cache(maxsize=4096)
def _config(cs: CodegenSet, fs: FamilySpec, major: int | None, table_path: str) -> CodegenConfig:
    start = cs.start_values(fs)
    key = class_key(fs, major)
    table = _load(Path(table_path))
    entry = table.get(key)
    note = ""
    found: dict[str, int] = {}
    if major is None:
        note = "no NVRTC found: starting points"
    elif entry is None:
        rest = key.split("/", 1)[1]
        others = sorted(k.split("/", 1)[0] for k in table if k.split("/", 1)[1] == rest)
        note = (f"class {key} not in the table" + (f" (searched with {', '.join(others)} only)" if others else "")
                + ": starting points")
    else:
        found = {k: int(v) for k, v in entry.get("values", {}).items()}
        why = cs.illegal_reason(fs, found)
        if why is not None:
            note, found = f"the table's entry is illegal for this spec ({why}): starting points", {}
        have = {k.name for k in cs.knobs_for(fs)}  # a knob the kernel does not have: its start, said so
        found = {k: v for k, v in found.items() if k in have}
    user = dict(fs.codegen)  # checked by KernelSpec (override_reason): before the table and the start
    if user and found and cs.illegal_reason(fs, {**found, **user}) is not None:
        why = cs.illegal_reason(fs, {**found, **user})
        note, found = f"the table's entry is illegal beside the user's settings ({why}): starting points", {}
    found = {k: v for k, v in found.items() if k not in user}
    knobs = tuple(KnobValue(k.name, k.constant, user.get(k.name, found.get(k.name, start[k.name])),
                            "user" if k.name in user else "table" if k.name in found else "start", start[k.name])
                  for k in cs.own(fs.direction))
    return CodegenConfig(key, knobs, note)
