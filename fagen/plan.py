"""One module plan per spec: what the spec's family decides for it, asked once.

A :class:`ModulePlan` holds, for one :class:`~fagen.spec.KernelSpec`, the family object, the
:class:`~fagen.families.FamilySpec` every family method takes, the module's entry points
(:class:`KernelInfo`: the family's roles, launch geometry and each role's dynamic smem), and,
computed on first use, the smem layout, the family's NVRTC options, its templates and the
inputs it reads through tensor maps. :func:`plan_of` builds it once per spec (memoised by the
frozen spec and the registered family object), and the stages downstream -- render, compile,
the launchers, the functional layer, the autotuner, explain and the CLI -- read it instead of
asking the family again.
"""
from __future__ import annotations

import functools
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .abi import Role, is_tensormap
from .families import Family, FamilySpec
from .layout import SmemLayout
from .spec import KernelSpec

__all__ = ["KernelInfo", "ModulePlan", "clear_plans", "plan_of"]


@dataclass(frozen=True)
class KernelInfo:
    """One entry point of a rendered module and how to launch it."""

    name: str
    role: Role
    params: tuple[tuple[str, str], ...]  # concrete (ctype, name), dtype substituted
    block: tuple[int, int, int]
    smem_bytes: int  # dynamic shared memory per block
    rows_per_block: int

    @property
    def threads(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]

    @functools.cached_property
    def has_tensormaps(self) -> bool:
        """Whether a parameter is of the tensor-map kind (:data:`fagen.abi.TENSORMAP`)."""
        return any(is_tensormap(ctype) for ctype, _ in self.params)

    def grid(self, batch: int, heads: int, seqlen_q: int, seqlen_k: int,
             heads_kv: int | None = None) -> tuple[int, int, int]:
        return self.role.grid(batch=batch, heads=heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k, rows=self.rows_per_block,
                              heads_kv=heads_kv)


def _concrete(params: tuple[tuple[str, str], ...], ctype: str) -> tuple[tuple[str, str], ...]:
    return tuple((t.replace("T*", f"{ctype}*") if "T*" in t else t, n) for t, n in params)


@dataclass(frozen=True, eq=False)
class ModulePlan:
    """The family's decisions for one spec (see the module docstring); never built twice for a
    spec while its family stays registered (:func:`plan_of`)."""

    spec: KernelSpec
    family: Family
    family_spec: FamilySpec
    kernels: tuple[KernelInfo, ...]  # in launch order
    by_role: Mapping[str, KernelInfo] = field(repr=False)

    def kernel(self, role: str) -> KernelInfo:
        """The entry point of ``role`` (KeyError naming it when the module has none)."""
        return self.by_role[role]

    @functools.cached_property
    def smem_layout(self) -> SmemLayout:
        return self.family.smem_layout(self.family_spec)

    @functools.cached_property
    def nvrtc_options(self) -> tuple[str, ...]:
        """The family's own NVRTC options (the compiler adds the arch and its defaults)."""
        return tuple(self.family.nvrtc_options(self.family_spec))

    @functools.cached_property
    def templates(self) -> tuple[str, ...]:
        """The templates rendered, in order, into the module's one translation unit."""
        return tuple(self.family.templates(self.spec.direction))

    @functools.cached_property
    def codegen(self) -> Any:
        """The family's codegen config record of the spec (``codegen_config``: each code-shape knob's
        value and its source), or None for a family without codegen knobs."""
        make = getattr(self.family, "codegen_config", None)
        return None if make is None else make(self.family_spec)

    @functools.cached_property
    def tma_tensors(self) -> tuple[str, ...]:
        """The inputs the family reads through tensor maps (``Family.tma_tensors``)."""
        return tuple(self.family.tma_tensors(self.family_spec))

    def tensor_maps(self, kernel: KernelInfo, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """The tensor-map arguments of one launch of ``kernel`` (none for most kernels)."""
        if not kernel.has_tensormaps:
            return {}
        return self.family.tensor_maps(self.family_spec, kernel.role, tensors)


def _build(spec: KernelSpec, fam: Family) -> ModulePlan:
    fs = spec.family_spec
    kernels = []
    for role in fam.roles(fs):
        launch = fam.launch(fs, role)
        kernels.append(KernelInfo(f"{spec.name}_{role.name}", role, _concrete(role.params, spec.ctype),
                                  launch.block, fam.role_smem_bytes(fs, role), launch.rows_per_block))
    return ModulePlan(spec, fam, fs, tuple(kernels), {k.role.name: k for k in kernels})


_PLANS: dict[tuple[KernelSpec, int], ModulePlan] = {}
_PLANS_MAX = 4096
_LOCK = threading.Lock()


def plan_of(spec: KernelSpec) -> ModulePlan:
    """The plan of ``spec``, built on the first call for the spec and its registered family (a
    family registered anew under the same name gets a plan of its own)."""
    fam = spec.family
    key = (spec, id(fam))
    plan = _PLANS.get(key)
    if plan is None or plan.family is not fam:
        plan = _build(spec, fam)
        with _LOCK:
            old = _PLANS.get(key)
            if old is not None and old.family is fam:  # another thread built it meanwhile: one plan
                return old
            if len(_PLANS) >= _PLANS_MAX:
                _PLANS.clear()
            _PLANS[key] = plan
    return plan


def clear_plans() -> None:
    """Forget every plan (the next :func:`plan_of` of a spec asks its family again)."""
    with _LOCK:
        _PLANS.clear()
