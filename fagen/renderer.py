"""Render a KernelSpec into CUDA C++ source (Jinja2, StrictUndefined).

Python decides the specialisation; templates stay thin and receive constexprs:
the context (:func:`template_context`) holds no spec, only named constants (the
spec's sizes and flags, the family's decisions), the smem layout, the knobs and
the kernels' signatures. Output is byte-identical across runs for the same spec.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import jinja2

from .algorithm4 import ALG4
from .families import Constant, families
from .plan import KernelInfo, plan_of
from .spec import KernelSpec

__all__ = ["KernelInfo", "Rendered", "environment", "kernel_infos", "render", "render_with", "spec_constants",
           "template_context", "templates_dir"]


def templates_dir() -> Path:
    """templates/ of the source tree, or its copy mapped into the installed package."""
    try:
        packaged = resources.files("fagen") / "_templates"
        if packaged.is_dir():
            return Path(str(packaged))
    except (ModuleNotFoundError, TypeError):  # pragma: no cover
        pass
    return Path(__file__).resolve().parent.parent / "templates"


def _family_folders() -> tuple[tuple[str, str], ...]:
    """(name, folder) of the registered families whose templates live outside templates/."""
    return tuple((fam.name, str(fam.template_dir)) for fam in families() if fam.template_dir is not None)


def environment() -> jinja2.Environment:
    """The Jinja environment: templates/ (partials and the built-in families' folders), and each
    registered family with a ``template_dir`` of its own under its name ("<name>/...")."""
    return _env_for(_family_folders())


@functools.lru_cache(maxsize=8)
def _env_for(folders: tuple[tuple[str, str], ...]) -> jinja2.Environment:
    base = jinja2.FileSystemLoader(str(templates_dir()))
    loader: jinja2.BaseLoader = base
    if folders:
        loader = jinja2.ChoiceLoader([jinja2.PrefixLoader({n: jinja2.FileSystemLoader(f) for n, f in folders}), base])
    env = jinja2.Environment(
        loader=loader,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.globals["alg4"] = lambda line: f"// Algorithm 4 line {line}: {ALG4[line]}"
    return env


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


def kernel_infos(spec: KernelSpec) -> tuple[KernelInfo, ...]:
    """The module's entry points: the family's roles, launch geometry and each role's dynamic smem
    (Family.role_smem_bytes: the main kernel gets the whole layout), from the spec's one plan
    (:func:`fagen.plan.plan_of`)."""
    return plan_of(spec).kernels


def spec_constants(spec: KernelSpec) -> dict[str, Any]:
    """The constants every family's module declares (partials/header.cuh.j2), by their C++ names:
    the spec's sizes and flags, the launch bound's blocks per SM, and the family's name."""
    t = spec.tile
    return {
        "family": spec.impl,
        "HEAD_DIM": spec.head_dim, "HEAD_DIM_V": spec.head_dim_v or spec.head_dim, "BLOCK_R": t.block_r, "BLOCK_C": t.block_c, "NUM_WARPS": spec.num_warps,
        "MIN_BLOCKS_PER_SM": spec.min_blocks_per_sm,
        "IS_CAUSAL": spec.causal, "HAS_KEY_PADDING": spec.key_padding, "HAS_DROPOUT": spec.dropout,
        "IS_TOP_LEFT": spec.causal_align == "top_left", "HAS_WINDOW": spec.window, "HAS_SOFTCAP": spec.softcap,
        "SOFTCAP_TANH_APPROX": bool(getattr(spec.family, "softcap_tanh_approx", lambda _fs: False)(spec.family_spec)),
        "HAS_ALIBI": spec.alibi, "HAS_ATTN_MASK": spec.attn_mask, "HAS_BIAS": spec.bias,
        "HAS_BIAS_GRAD": spec.bias_grad, "IS_VARLEN": spec.varlen, "IS_DETERMINISTIC": spec.deterministic,
        "HAS_SINKS": spec.sinks, "SRAM_BYTES": spec.sram_bytes,
    }


def template_context(spec: KernelSpec, kernels: tuple[KernelInfo, ...] | None = None) -> dict[str, Any]:
    """Everything the templates see: the spec's constants (:func:`spec_constants`), the
    family's decisions (Family.template_context: ``strides``, ``constants`` and extra values; each
    Constant also under its name), the smem layout, the knobs and the kernels. No ``spec``."""
    plan = plan_of(spec)
    kernels = plan.kernels if kernels is None else kernels
    ctx: dict[str, Any] = {
        "module_name": spec.name,
        "module_json": spec.model_dump_json(),  # the KernelSpec, for the header comment
        "T": spec.ctype,
        "layout": plan.smem_layout,
        "knobs": spec.knob_values,
        "kernels": {k.role.name: k for k in kernels},
        **spec_constants(spec),
    }
    extra = plan.family.template_context(plan.family_spec)
    constants: tuple[Constant, ...] = tuple(extra.get("constants", ()))
    extra = {**extra, "constants": constants}
    extra.setdefault("strides", {})
    named = {c.name: c.value for c in constants}
    declared = set(extra["strides"]) | set(named)  # C++ names the header declares
    clash = sorted((set(extra) | declared) & set(ctx) | set(named) & set(extra) | set(extra["strides"]) & set(named))
    if clash or len(named) != len(constants):
        raise ValueError(f"family {spec.impl!r}: template context names {clash or 'a constant twice'} more than once")
    return {**ctx, **extra, **named}


@functools.lru_cache(maxsize=256)
def render(spec: KernelSpec) -> Rendered:
    """Render ``spec`` into one CUDA translation unit with all its entry points."""
    return _render(spec, environment())


def render_with(spec: KernelSpec, templates: Mapping[str, str]) -> Rendered:
    """``spec`` rendered with the given template texts (name under templates/ -> Jinja text) in place
    of those files: a template variant tried without touching the tree (mutation tests, experiments).
    Not memoised; the other templates are the installed ones."""
    base = environment()
    env = base.overlay(loader=jinja2.ChoiceLoader([jinja2.DictLoader(dict(templates)), base.loader]))
    return _render(spec, env)


def _render(spec: KernelSpec, env: jinja2.Environment) -> Rendered:
    plan = plan_of(spec)
    ctx = template_context(spec, plan.kernels)
    parts = [env.get_template(name).render(**ctx) for name in plan.templates]
    return Rendered(spec, "".join(parts), plan.kernels)
