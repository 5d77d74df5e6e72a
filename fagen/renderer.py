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

from .abi import Role
from .algorithm4 import ALG4
from .families import Constant, Family, family_names, get_family
from .spec import KernelSpec


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
    out = []
    for name in family_names():
        folder = get_family(name).template_dir
        if folder is not None:
            out.append((name, str(folder)))
    return tuple(out)


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

    def grid(self, batch: int, heads: int, seqlen_q: int, seqlen_k: int,
             heads_kv: int | None = None) -> tuple[int, int, int]:
        return self.role.grid(batch=batch, heads=heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k, rows=self.rows_per_block,
                              heads_kv=heads_kv)


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
    """The module's entry points: the family's roles, launch geometry and each role's dynamic smem
    (Family.role_smem_bytes: the main kernel gets the whole layout)."""
    fam, fs = get_family(spec.impl), spec.family_spec
    out = []
    for role in fam.roles(fs):
        launch = fam.launch(fs, role)
        smem = fam.role_smem_bytes(fs, role)
        out.append(KernelInfo(f"{spec.name}_{role.name}", role, _concrete(role.params, spec.ctype),
                              launch.block, smem, launch.rows_per_block))
    return tuple(out)


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
        "HAS_ALIBI": spec.alibi, "HAS_ATTN_MASK": spec.attn_mask, "HAS_BIAS": spec.bias,
        "HAS_BIAS_GRAD": spec.bias_grad, "IS_VARLEN": spec.varlen, "IS_DETERMINISTIC": spec.deterministic,
        "HAS_SINKS": spec.sinks, "SRAM_BYTES": spec.sram_bytes,
    }


def template_context(spec: KernelSpec, kernels: tuple[KernelInfo, ...] | None = None) -> dict[str, Any]:
    """Everything the templates see: the spec's constants (:func:`spec_constants`), the
    family's decisions (Family.template_context: ``strides``, ``constants`` and extra values; each
    Constant also under its name), the smem layout, the knobs and the kernels. No ``spec``."""
    fam: Family = get_family(spec.impl)
    kernels = kernel_infos(spec) if kernels is None else kernels
    ctx: dict[str, Any] = {
        "module_name": spec.name,
        "module_json": spec.model_dump_json(),  # the KernelSpec, for the header comment
        "T": spec.ctype,
        "layout": spec.smem_layout,
        "knobs": spec.knob_values,
        "kernels": {k.role.name: k for k in kernels},
        **spec_constants(spec),
    }
    extra = fam.template_context(spec.family_spec)
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
    fam = get_family(spec.impl)
    kernels = kernel_infos(spec)
    ctx = template_context(spec, kernels)
    parts = [env.get_template(name).render(**ctx) for name in fam.templates(spec.direction)]
    return Rendered(spec, "".join(parts), kernels)
