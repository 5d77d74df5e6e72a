"""Kernel families: everything that differs between kernel implementations.

A family is one Python package, ``fagen/families/<name>/`` (its ``Family`` object, its cost
model, anything else family-specific), one template folder, ``templates/<name>/`` (its kernel
templates and device headers), and one line in :data:`BUILTIN_FAMILIES`. It is looked up by
``KernelSpec.impl`` and owns, for the specs it supports: which (tile, warps, knobs) it accepts
(``config_reason``), its shared-memory layout with per-buffer alignment (``smem_layout``), its
kernel roles and launch geometry (``roles``, ``launch``), its NVRTC options, its templates and
the decisions they receive (``template_context``), its extra knobs (e.g. pipeline stages; they
enter the spec's name and cache key through ``KernelSpec.knobs``) and its autotuner cost
function (``pair_cost``). The protocol (:mod:`fagen.families.base`) passes every method one
:class:`FamilySpec` that ``KernelSpec.family_spec`` builds.

``KernelSpec.impl`` defaults to the preferred family (lowest ``preference``, then name) that
supports the spec. Families subclass :class:`FamilyBase`, which supplies the defaults; a family
outside this package is added with :func:`register`.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

from fagen.families.base import (DEFAULT_NUM_WARPS, FEATURES, MIN_REGS_PER_THREAD, NUM_WARPS_CHOICES, Constant, Family, FamilyBase,
                                 FamilySpec, Knob, Launch, PairCost, Reason, Tile, feature_reason, lds_wavefronts)
from fagen.families.mma import MMA
from fagen.families.simt import SIMT
from fagen.families.wgmma import WGMMA

__all__ = ["DEFAULT_NUM_WARPS", "FEATURES", "MIN_REGS_PER_THREAD", "NUM_WARPS_CHOICES", "BUILTIN_FAMILIES", "Constant", "Family",
           "FamilyBase", "FamilySpec", "Knob", "Launch", "PairCost", "Reason", "Tile", "default_family",
           "families", "family_names", "feature_reason", "get_family", "lds_wavefronts", "register", "registered_only", "unregister",
           "warp_choices"]

#: The built-in families, one line each.
BUILTIN_FAMILIES: tuple[Family, ...] = (
    SIMT,
    MMA,
    WGMMA,
)

_REGISTRY: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Make ``family`` available as ``KernelSpec(impl=family.name)`` (and to ``impl=None``)."""
    if not isinstance(family, Family):
        raise TypeError(f"register() takes a Family (see fagen.families.base.Family), got {type(family).__name__}")
    _REGISTRY[family.name] = family
    return family


def unregister(name: str) -> None:
    """Remove a registered family (KeyError naming it when there is none)."""
    if name not in _REGISTRY:
        raise KeyError(f"no kernel family {name!r}; registered: {family_names()}")
    del _REGISTRY[name]


@contextlib.contextmanager
def registered_only(*families: Family) -> Iterator[None]:
    """Inside the block the registry holds exactly ``families`` (then the previous registry again):
    which family ``impl=None`` resolves to with a given set, a family tried alone."""
    for family in families:
        if not isinstance(family, Family):
            raise TypeError(f"registered_only() takes Family objects, got {type(family).__name__}")
    saved = dict(_REGISTRY)
    _REGISTRY.clear()
    _REGISTRY.update({f.name: f for f in families})
    try:
        yield
    finally:
        _REGISTRY.clear()
        _REGISTRY.update(saved)


def get_family(name: str) -> Family:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"no kernel family {name!r}; registered: {family_names()}") from None


def families() -> tuple[Family, ...]:
    """The registered families in preference order (lowest ``preference``, then name)."""
    return tuple(sorted(_REGISTRY.values(), key=lambda f: (f.preference, f.name)))


def family_names() -> tuple[str, ...]:
    """Registered families in preference order."""
    return tuple(f.name for f in families())


def warp_choices() -> tuple[int, ...]:
    """Every num_warps some registered family accepts (each family checks its own)."""
    return tuple(sorted({w for f in _REGISTRY.values() for w in f.warp_choices}))


def default_family(fs: FamilySpec) -> str | None:
    """The preferred family that supports the spec's direction, head dim, dtype and arch, or None."""
    for name in family_names():
        if _REGISTRY[name].unsupported_reason(fs) is None:
            return name
    return None


for _family in BUILTIN_FAMILIES:
    register(_family)
