"""Options and body of ``fagen explain`` (registered by :mod:`fagen.cli`)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import InputError


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("explain options")
    g.add_argument("--seqlen-q", type=int, default=1024, metavar="N", help="N_q of the drawn problem (default 1024)")
    g.add_argument("--seqlen-k", type=int, default=None, metavar="N", help="N_k (default: N_q)")
    g.add_argument("--window-size", type=int, nargs=2, default=(-1, -1), metavar=("LEFT", "RIGHT"),
                   help="runtime sliding window of a --window spec (-1 = unbounded; default: -1 -1)")
    g.add_argument("--html", type=str, default=None, metavar="OUT.html", help="write the self-contained page here")
    g.add_argument("--json", action="store_true", help="print the facts the page renders from")


def run(args: argparse.Namespace, spec) -> int:
    for option, value in (("--seqlen-q", args.seqlen_q), ("--seqlen-k", args.seqlen_k)):
        if value is not None and value < 1:
            raise InputError(option, "at least 1", value)
    if args.html is None and not args.json:
        raise InputError("--html", "OUT.html (or --json, or both)", "neither")
    if args.html is not None:
        parent = Path(args.html).expanduser().resolve().parent
        if not parent.is_dir():
            raise InputError("--html", "a file in an existing directory", f"{parent} does not exist")
    from .facts import explain
    from .page import write_html

    try:
        facts = explain(spec, args.seqlen_q, args.seqlen_k, window=tuple(args.window_size))
    except InputError as e:
        option = "window-size" if e.argument == "window" else e.argument.replace("_", "-")
        raise InputError(f"--{option}", e.expected) from None
    if args.html is not None:
        try:
            out = write_html(facts, args.html)
        except OSError as e:
            raise InputError("--html", "a writable file", f"{args.html} ({e.strerror or e})") from None
        t = facts["tiles"]
        if not args.json:
            print(f"wrote {out} ({facts['kernel']}: {t['visited']} of {t['total']} tiles visited, "
                  f"{t['fully_visible']} fully visible, {t['skipped']} skipped)")
    if args.json:
        print(json.dumps(facts, indent=2))
    return 0
