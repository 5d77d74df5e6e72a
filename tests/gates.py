"""Template mutations for the synchronisation tests: a spec's module rendered with one template's
text replaced, and every synchronisation site of a template behind a racecheck gate
(``fagen_emu_race_gate(i) ? call : (void)0``, see docs/emulator.md) so that one build skips each
site in turn (``EmuModule.race_gate``)."""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from fagen import KernelSpec, renderer
from fagen.runtime import cpu


def rendered_with(spec: KernelSpec, template: str, text: str) -> renderer.Rendered:
    """``spec`` rendered with ``text`` in place of ``template``."""
    return renderer.render_with(spec, {template: text})


def mutated_module(spec: KernelSpec, template: str, text: str, schedule: str = "forward") -> cpu.CpuModule:
    """``spec``'s emulator module (in ``schedule``'s thread order) with ``text`` in place of ``template``."""
    return cpu.CpuModule(spec, schedule, rendered=rendered_with(spec, template, text))


def module_with(spec: KernelSpec, texts: Mapping[str, str], schedule: str = "forward") -> cpu.CpuModule:
    """``spec``'s emulator module with each template named in ``texts`` replaced by its text (one
    build for the mutations of several templates)."""
    return cpu.CpuModule(spec, schedule, rendered=renderer.render_with(spec, texts))


def gated(text: str, sites: Iterable[tuple[int, str, int]]) -> str:
    """``text`` with each site (offset, the call's text, gate number i) behind gate i, tagged
    /*FAGEN_SITE_i*/: ``(fagen_emu_race_gate(i) /*FAGEN_SITE_i*/ ? (void)(call) : (void)0)``, the
    call's own semicolon kept after it (``fa_sync_or(p)``, a value: ``... ? fa_sync_or(p) : (bool)(p)``)."""
    for off, call, i in sorted(sites, reverse=True):
        assert text.startswith(call, off), (off, call)
        semi = ";" if call.endswith(";") else ""
        expr = call[:-1] if semi else call
        if expr.startswith("fa_sync_or("):  # a barrier with a value: removed, each thread keeps its own predicate
            arg = expr[len("fa_sync_or("):-1]
            gate = f"(fagen_emu_race_gate({i}) /*FAGEN_SITE_{i}*/ ? {expr} : (bool)({arg}))"
        else:
            gate = f"(fagen_emu_race_gate({i}) /*FAGEN_SITE_{i}*/ ? (void)({expr}) : (void)0)"
        text = text[:off] + gate + semi + text[off + len(call):]
    return text


def site_lines(mod: cpu.CpuModule, i: int) -> set[int]:
    """The lines of a gated module's kernel source that hold site i."""
    return {n for n, ln in enumerate(mod.rendered.source.splitlines(), 1) if f"/*FAGEN_SITE_{i}*/" in ln}
