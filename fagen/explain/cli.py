"""Options and body of ``fagen explain`` (registered by :mod:`fagen.cli`)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..cli import UsageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("explain options")
    g.add_argument("--seqlen-q", type=int, default=1024, help="N_q of the drawn problem (default 1024)")
    g.add_argument("--seqlen-k", type=int, default=None, help="N_k (default: N_q)")
    g.add_argument("--html", type=str, default=None, metavar="OUT.html", help="write the self-contained page here")
    g.add_argument("--json", action="store_true", help="print the facts the page renders from")


def run(args: argparse.Namespace, spec) -> int:
    for option, value in (("--seqlen-q", args.seqlen_q), ("--seqlen-k", args.seqlen_k)):
        if value is not None and value < 1:
            raise UsageError(option, f"must be at least 1, got {value}")
    if args.html is None and not args.json:
        raise UsageError("--html", "give --html OUT.html and/or --json")
    if args.html is not None:
        parent = Path(args.html).expanduser().resolve().parent
        if not parent.is_dir():
            raise UsageError("--html", f"directory {parent} does not exist")
    from .facts import ExplainError, explain
    from .page import write_html

    try:
        facts = explain(spec, args.seqlen_q, args.seqlen_k)
    except ExplainError as e:
        raise UsageError(f"--{e.argument.replace('_', '-')}", str(e).split(": ", 1)[-1]) from None
    if args.html is not None:
        try:
            out = write_html(facts, args.html)
        except OSError as e:
            raise UsageError("--html", f"cannot write {args.html}: {e.strerror or e}") from None
        t = facts["tiles"]
        if not args.json:
            print(f"wrote {out} ({facts['kernel']}: {t['visited']} of {t['total']} tiles visited, "
                  f"{t['fully_visible']} fully visible, {t['skipped']} skipped)")
    if args.json:
        print(json.dumps(facts, indent=2))
    return 0
