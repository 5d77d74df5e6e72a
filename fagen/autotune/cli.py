"""``fagen autotune``: the options this package adds and the command body.

The main CLI (fagen/cli.py) adds the spec options, builds the KernelSpec and
calls :func:`run`; an :class:`~fagen.errors.InputError` becomes a one-line
message and exit code 2 there.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from ..errors import InputError, NoGPUError
from ..spec import KernelSpec
from .timing import cuda_available, current_device
from .tuner import TuneResult, tune


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("autotune (the problem to tune for)")
    g.add_argument("--batch", type=int, required=True, metavar="B", help="batch size (required)")
    g.add_argument("--heads", type=int, required=True, metavar="H", help="number of heads (required)")
    g.add_argument("--heads-kv", type=int, default=None, metavar="H_KV",
                   help="K/V heads for grouped-query attention, a divisor of --heads "
                        "(default: as many as --heads)")
    g.add_argument("--seqlen", type=int, required=True, metavar="N",
                   help="sequence length, tuned for its power-of-two bucket (required)")
    g.add_argument("--dry-run", action="store_true",
                   help="no GPU needed: compile the candidates and rank them by the cost model only "
                        "(default: off, which times the top candidates on the GPU and records the winner)")
    g.add_argument("--json", action="store_true", help="print the result as JSON (default: a table)")
    g.add_argument("--top", type=int, default=4, metavar="K",
                   help="candidates to time on the GPU, besides the default tile (default: %(default)s)")


def _positive(args: argparse.Namespace, name: str, option: str) -> int:
    v = getattr(args, name, None)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise InputError(argument=option, expected="a positive integer", got=v)
    return v


def run(args: argparse.Namespace, spec: KernelSpec) -> int:
    """Tune ``spec`` for the problem in ``args``; print a table (or JSON). Returns the exit code."""
    batch = _positive(args, "batch", "--batch")
    heads = _positive(args, "heads", "--heads")
    seqlen = _positive(args, "seqlen", "--seqlen")
    top = _positive(args, "top", "--top")
    heads_kv = None if getattr(args, "heads_kv", None) is None else _positive(args, "heads_kv", "--heads-kv")
    if heads_kv is not None and heads % heads_kv:
        raise InputError(argument="--heads-kv", expected=f"a divisor of --heads ({heads})", got=heads_kv)
    dry_run = bool(getattr(args, "dry_run", False))
    as_json = bool(getattr(args, "json", False))
    device = None
    if not dry_run:
        if not cuda_available():
            raise NoGPUError("no CUDA GPU to time the candidates on (torch sees none); "
                             "add --dry-run to rank them by the cost model alone")
        device = current_device()
        if device.arch != spec.arch:
            raise InputError(argument="--arch", expected=f"{device.arch or 'a supported arch'} (the arch of "
                             f"{device.name}, compute capability {device.capability[0]}.{device.capability[1]})",
                             got=spec.arch)
    result = tune(spec, batch=batch, heads=heads, seqlen=seqlen, heads_kv=heads_kv, dry_run=dry_run, top=top,
                  device=device)
    if as_json:
        json.dump(_jsonable(result.as_dict()), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        _print_table(result)
    return 0 if result.best is not None else 1


def _jsonable(x: Any) -> Any:
    """inf / nan (a failed timing) become null so the output is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def _fmt(v: float | int | None, spec: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and not math.isfinite(v):
        return "failed"
    return format(v, spec)


def _print_table(result: TuneResult) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 160)
    p = result.problem
    heads = f"{p.heads} (K/V {p.heads_kv})" if p.heads_kv else f"{p.heads}"
    title = (f"{result.spec.name}: batch {p.batch}, heads {heads}, seqlen {p.seqlen_q}x{p.seqlen_k} "
             f"(model: {result.device.name})")
    table = Table(title=title)
    for col in ("#", "tile", "warps", "family", "smem B", "regs", "spills", "occupancy", "predicted ms"):
        table.add_column(col, justify="right" if col not in ("tile", "family") else "left")
    if result.timed:
        table.add_column("measured ms", justify="right")
        table.add_column("TFLOP/s", justify="right")
    table.add_column("status")
    for i, c in enumerate(result.ok, 1):
        note = " ".join(x for x in ("paper" if c.is_paper else "", "default" if c.is_default else "",
                                    "best" if c == result.best else "") if x)
        row = [str(i), c.label, str(c.num_warps), c.impl, _fmt(c.smem_bytes), _fmt(c.registers),
               _fmt(c.spill_bytes), _fmt(c.occupancy, ".3f"), _fmt(c.predicted_ms, ".3f")]
        if result.timed:
            row += [_fmt(c.measured_ms, ".3f"), _fmt(result.tflops(c), ".2f")]
        table.add_row(*row, f"ok {note}".strip())
    console.print(table)
    if result.rejected:
        console.print(f"[bold]rejected ({len(result.rejected)})[/bold]")
        for c in result.rejected:
            console.print(f"  {c.label} w{c.num_warps} {c.impl}: {c.reason}", markup=False, highlight=False)
    best = result.best
    if best is None:
        console.print("no candidate survived", style="red")
    else:
        how = f"measured {best.measured_ms:.3f} ms" if result.timed and best.measured_ms is not None \
            else f"predicted {best.predicted_ms:.3f} ms"
        console.print(f"best: {best.label} w{best.num_warps} {best.impl} ({how})"
                      + (" -- recorded" if result.timed else ""), markup=False, highlight=False)


__all__ = ["add_arguments", "run"]
