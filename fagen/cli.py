"""The ``fagen`` command line: inspect, generate, compile, autotune.

Errors are one line on stderr naming the option, exit code 2, no traceback;
bare ``fagen`` prints the help on stderr, also with exit code 2. Long work
(each NVRTC compile / emulator build, each autotune candidate) is logged on
stderr as ``fagen: ...`` lines (the library's ``"fagen"`` logger at INFO).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NoReturn

from pydantic import ValidationError

from ._version import __version__
from .errors import FagenError, InputError, InputTypeError

#: KernelSpec field -> CLI option (the spec options every command takes).
SPEC_OPTIONS = {
    "direction": "--direction", "head_dim": "--head-dim", "dtype": "--dtype", "causal": "--causal",
    "key_padding": "--key-padding", "dropout": "--dropout", "arch": "--arch", "sram_bytes": "--sram-bytes",
    "block_r": "--block-r", "block_c": "--block-c", "num_warps": "--num-warps", "impl": "--impl",
    "causal_align": "--causal-align", "window": "--window", "softcap": "--softcap", "alibi": "--alibi",
    "attn_mask": "--attn-mask", "bias": "--bias", "bias_grad": "--bias-grad", "varlen": "--varlen",
    "deterministic": "--deterministic", "sinks": "--sinks", "codegen": "--codegen",
}


class UsageError(Exception):
    """A bad option: printed as one line, exit code 2."""

    def __init__(self, option: str, reason: str) -> None:
        super().__init__(f"{option}: {reason}" if option else reason)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, no usage block
        raise UsageError("" if self.prog == "fagen" else self.prog.removeprefix("fagen "), message)


def one_of(values: Iterable[object]) -> str:
    return "{" + ",".join(map(str, values)) + "}"


def _add_spec_options(p: argparse.ArgumentParser, *, head_dim_required: bool = True) -> None:
    """One option per KernelSpec field; choices and defaults come from the spec and the family registry."""
    from .families import family_names
    from .spec import FLAG_FEATURES, HEAD_DIM_MAX, HEAD_DIM_MIN, HEAD_DIM_MULTIPLE, NUM_WARPS_CHOICES, KernelSpec

    field = KernelSpec.model_fields

    def literal(name: str) -> tuple[str, ...]:
        return typing.get_args(field[name].annotation)

    g = p.add_argument_group("spec options (the fields of fagen.KernelSpec)")
    g.add_argument("--direction", choices=literal("direction"), default=field["direction"].default,
                   help=f"{field['direction'].description} (default: %(default)s)")
    need = "required" if head_dim_required else "required unless --all"
    g.add_argument("--head-dim", type=int, required=head_dim_required, metavar="D",
                   help=f"d, the head dimension: a multiple of {HEAD_DIM_MULTIPLE} in {HEAD_DIM_MIN}..{HEAD_DIM_MAX} ({need})")
    g.add_argument("--dtype", choices=literal("dtype"), default=field["dtype"].default,
                   help="element type of q, k, v, o and the gradients (default: %(default)s)")
    g.add_argument("--causal", action="store_true", help="compile the causal mask in, aligned as --causal-align says (default: off)")
    g.add_argument("--key-padding", action="store_true", help="compile the key-padding mask in (default: off)")
    g.add_argument("--dropout", action="store_true", help="compile dropout in (default: off)")
    g.add_argument("--causal-align", choices=literal("causal_align"), default=field["causal_align"].default,
                   help=f"{field['causal_align'].description} (default: %(default)s)")
    for name in FLAG_FEATURES:
        g.add_argument(SPEC_OPTIONS[name], action="store_true",
                       help=f"compile in: {field[name].description} (default: off)")
    g.add_argument("--arch", choices=literal("arch"), default=field["arch"].default,
                   help="target GPU architecture (default: %(default)s)")
    g.add_argument("--sram-bytes", type=int, default=None, metavar="M",
                   help="M, shared memory per thread block in bytes (Algorithm 4 line 2; "
                        "default: the arch's opt-in maximum)")
    g.add_argument("--block-r", type=int, default=None, metavar="B_R",
                   help="rows of Q per tile (default: the paper's B_r, made to fit M)")
    g.add_argument("--block-c", type=int, default=None, metavar="B_C",
                   help="rows of K/V per tile (default: the paper's B_c, made to fit M)")
    g.add_argument("--num-warps", type=int, default=field["num_warps"].default, metavar="W",
                   help=f"warps per thread block, one of {one_of(NUM_WARPS_CHOICES)} (default: the family's choice)")
    g.add_argument("--impl", default=field["impl"].default, metavar="FAMILY",
                   help=f"kernel family, one of {one_of(family_names())} "
                        f"(default: the preferred family that implements the spec)")
    g.add_argument("--codegen", action="append", default=None, metavar="KNOB=VALUE",
                   help="set a codegen knob of the family (mma's, e.g. fwd_q_in_regs=0; wgmma's, e.g. ds_row_xor=1), before the "
                        "stored search's table and the starting points; repeat for more "
                        "(default: none, `fagen explain` shows each knob's value and source)")


def spec_from_args(args: argparse.Namespace):
    from .spec import KernelSpec

    fields = {f: getattr(args, f) for f in SPEC_OPTIONS}
    if fields["head_dim"] is None:
        raise UsageError("--head-dim", "required")
    if fields["sram_bytes"] is None:
        del fields["sram_bytes"]
    fields["codegen"] = parse_codegen(fields["codegen"] or [])
    try:
        return KernelSpec(**fields)
    except ValidationError as e:
        err = e.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else "head_dim"
        msg = err["msg"].removeprefix("Value error, ")
        raise UsageError(SPEC_OPTIONS.get(field, field), msg) from None


def parse_codegen(items: Iterable[str]) -> dict[str, int]:
    """``--codegen KNOB=VALUE`` (repeated, or comma-separated) as KernelSpec.codegen's name -> int."""
    out: dict[str, int] = {}
    for item in items:
        for part in filter(None, (p.strip() for p in item.split(","))):
            name, eq, value = part.partition("=")
            if not eq or not name.strip() or not value.strip().lstrip("-").isdigit():
                raise UsageError("--codegen", f"expects KNOB=VALUE with an integer value, got {part!r}")
            if name.strip() in out:
                raise UsageError("--codegen", f"knob {name.strip()!r} given twice")
            out[name.strip()] = int(value)
    return out


def _print_table(rows: list[tuple[str, Any]]) -> None:
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


# --------------------------------------------------------------------------- commands
def inspect_dict(spec) -> dict[str, Any]:
    from .plan import plan_of
    from .spec import FLAG_FEATURES

    t, plan = spec.tile, plan_of(spec)
    return {
        "name": spec.name, "direction": spec.direction, "head_dim": spec.head_dim, "dtype": spec.dtype,
        "causal": spec.causal, "key_padding": spec.key_padding, "dropout": spec.dropout, "arch": spec.arch,
        "causal_align": spec.causal_align, **{f: getattr(spec, f) for f in FLAG_FEATURES},
        "impl": spec.impl, "sram_bytes": spec.sram_bytes, "paper_block_r": spec.paper_block_r,
        "paper_block_c": spec.paper_block_c, "block_r": t.block_r, "block_c": t.block_c,
        "num_warps": spec.num_warps, "num_threads": spec.num_threads, "smem_bytes": spec.smem_bytes,
        "smem_breakdown": plan.smem_layout.breakdown(),
        "kernels": [{"kernel": k.name, "block": list(k.block), "smem_bytes": k.smem_bytes,
                     "grid": f"(ceil(seqlen_{k.role.grid_seq} / {k.rows_per_block}), batch, "
                             f"{'heads_kv' if k.role.grid_heads == 'kv' else 'heads'})"}
                    for k in plan.kernels],
        "cache_key": spec.cache_key,
    }


def cmd_inspect(args: argparse.Namespace) -> int:
    info = inspect_dict(spec_from_args(args))
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    rows = [(k, v) for k, v in info.items() if k not in ("smem_breakdown", "kernels")]
    rows += [(f"smem[{n}]", f"{b} B") for n, b in info["smem_breakdown"].items()]
    rows += [(f"kernel[{i}]", f"{k['kernel']} grid={k['grid']} block={k['block']}") for i, k in enumerate(info["kernels"])]
    _print_table(rows)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from .generate import all_specs, generate

    if args.out is None:
        raise UsageError("--out", "required")
    if args.all:
        specs = all_specs()
        changed = generate(specs, Path(args.out), prune=True)
    else:
        specs = [spec_from_args(args)]
        changed = generate(specs, Path(args.out))
    print(f"{len(specs)} spec(s), {len(changed)} file(s) written to {args.out}")
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    from . import sass
    from .compiler import compile as compile_spec

    mod = compile_spec(spec_from_args(args))
    mix = sass.instruction_mix(mod.cubin) if args.json else None  # None without nvdisasm
    rows = [{
        "kernel": r.kernel, "arch": mod.spec.arch, "registers": r.registers, "spill_bytes": r.spill_bytes,
        "spill_store_bytes": r.spill_store_bytes, "spill_load_bytes": r.spill_load_bytes,
        "smem_bytes": r.smem_bytes, "static_smem_bytes": r.static_smem_bytes,
        "dynamic_smem_bytes": r.dynamic_smem_bytes, "compile_seconds": round(mod.compile_seconds, 4),
        "ptxas_seconds": round(r.ptxas_ms / 1000.0, 4), "cached": mod.cached,
        **({"sass": mix.get(r.kernel, {})} if mix is not None else {}),
    } for r in mod.resources]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{mod.spec.name}  ({'cached' if mod.cached else f'compiled in {mod.compile_seconds:.2f}s'}, options: {' '.join(mod.options)})")
    for r in rows:
        print(f"  {r['kernel']}: {r['registers']} regs, {r['spill_bytes']} B spills, {r['smem_bytes']} B smem")
    return 0


def cmd_autotune(args: argparse.Namespace) -> int:
    from .autotune.cli import run

    return run(args, spec_from_args(args))


def cmd_explain(args: argparse.Namespace) -> int:
    from .explain.cli import run

    return run(args, spec_from_args(args))


def cmd_tune_codegen(args: argparse.Namespace) -> int:
    from .autotune.codegen import run

    if args.all and args.head_dim is not None:
        raise UsageError("--all", "takes no --head-dim (every class of the default rows)")
    if not args.all and args.head_dim is None:
        raise UsageError("--head-dim", "required unless --all")
    return run(args, None if args.all else spec_from_args(args))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fagen", description="Generate, inspect and compile specialised FlashAttention kernels.",
                     epilog="`fagen COMMAND --help` lists the options of a command, with their choices and defaults.")
    parser.add_argument("--version", action="version", version=f"fagen {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("inspect", help="derived tile, smem layout and names of a spec")
    _add_spec_options(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON (default: a table)")
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser("generate", help="emit CUDA sources (one spec, or --all for the standard matrix)")
    _add_spec_options(p, head_dim_required=False)
    p.add_argument("--all", action="store_true",
                   help="emit the standard matrix (plus manifest.json; stale files in DIR are removed) "
                        "instead of one spec (default: off)")
    p.add_argument("--out", type=str, default=None, metavar="DIR", help="output directory (required)")
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser("compile", help="NVRTC-compile a spec and report registers/spills/smem")
    _add_spec_options(p)
    p.add_argument("--json", action="store_true", help="print one JSON object per kernel (default: a table)")
    p.set_defaults(func=cmd_compile)
    p = sub.add_parser("autotune", help="rank (and on a GPU, time) tiles for a problem")
    _add_spec_options(p)
    try:
        from .autotune.cli import add_arguments
    except ImportError:  # pragma: no cover
        add_arguments = None
    if add_arguments is not None:
        add_arguments(p)
    p.set_defaults(func=cmd_autotune)
    p = sub.add_parser("explain", help="a kernel's tiles, smem, resources and source as one HTML page (--html) or JSON")
    _add_spec_options(p)
    from .explain.cli import add_arguments as explain_arguments

    explain_arguments(p)
    p.set_defaults(func=cmd_explain)
    p = sub.add_parser("tune-codegen", help="search a family's codegen knobs (mma, wgmma) of a class (or --all) with NVRTC "
                                            "and store the winners in its table")
    _add_spec_options(p, head_dim_required=False)
    from .autotune.codegen import add_arguments as tune_codegen_arguments

    tune_codegen_arguments(p)
    p.set_defaults(func=cmd_tune_codegen)
    return parser


class _StderrHandler(logging.StreamHandler):
    """``fagen: <message>`` on whatever ``sys.stderr`` is when the record is written."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("fagen: %(message)s"))

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201
        return sys.stderr

    @stream.setter
    def stream(self, _value: object) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    if not argv:  # bare `fagen`: what it can do
        sys.stderr.write(parser.format_help())
        return 2
    log = logging.getLogger("fagen")
    handler, level = _StderrHandler(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        code = _run(parser, argv)
        sys.stdout.flush()  # inside the try: a small output reaches a closed pipe only here
        return code
    except BrokenPipeError:  # `fagen ... --json | head`: the reader left; no traceback (Python's own advice)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush would raise again
        return 1
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def _run(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    try:
        args = parser.parse_args(argv)
        return int(args.func(args) or 0)
    except UsageError as e:
        print(f"fagen: error: {e}", file=sys.stderr)
        return 2
    except (InputError, InputTypeError) as e:
        print(f"fagen: error: {e}", file=sys.stderr)
        return 2
    except FagenError as e:
        print(f"fagen: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
