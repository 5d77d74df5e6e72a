"""Plots of the benchmark outputs (matplotlib, an optional extra: pip install -e '.[plots]').

    python benchmarks/plots.py RESULT.json [--out DIR] [--format png svg]

RESULT.json is one of
* ``gpu_check.json`` (benchmarks/gpu_check.py): TFLOP/s vs sequence length, one line per
  provider (fagen, each torch SDPA backend) and dtype, one panel per (d, causal), one figure
  for the forward and one for the backward -> ``tflops_fwd.*``, ``tflops_bwd.*``; its autotune
  rows, when present, as ``autotune_<spec>.*``;
* the output of ``fagen autotune --json`` (timed, i.e. without --dry-run) or of
  benchmarks/autotune_check.py: predicted vs measured time per candidate, the y = x line for
  reference, the default and the fastest measured marked -> ``autotune_<spec>.*``.

Prints the files it wrote; exits 2 with one line when matplotlib is missing or the JSON is none of
these. benchmarks/gpu_check.py calls :func:`plot_gpu_check` itself when matplotlib is installed.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

FORMATS = ("png", "svg")
LINESTYLE = {"float16": "-", "bfloat16": "--", "float32": ":"}


class PlotError(ValueError):
    """Input that cannot be plotted (the message says why)."""


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise PlotError("matplotlib is not installed: pip install -e '.[plots]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, outdir: Path, stem: str, formats: Sequence[str]) -> list[Path]:
    outdir.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in formats:
        path = outdir / f"{stem}.{fmt}"
        fig.savefig(path, dpi=120, bbox_inches="tight", metadata={"Date": None} if fmt == "svg" else None)
        paths.append(path)
    return paths


# --------------------------------------------------------------------------- gpu_check.json
def tflops_series(rows: list[dict[str, Any]], direction: str) -> dict[tuple[int, bool], dict[tuple[str, str], list[tuple[int, float]]]]:
    """(d, causal) -> (provider, dtype) -> sorted [(seqlen, TFLOP/s)] of the measured rows."""
    key = f"{direction}_tflops"
    out: dict[tuple[int, bool], dict[tuple[str, str], list[tuple[int, float]]]] = {}
    for row in rows:
        s = row["shape"]
        panel = out.setdefault((int(s["head_dim"]), bool(s["causal"])), {})
        for provider, m in row.get("results", {}).items():
            v = m.get(key)
            if v is None or not math.isfinite(v):
                continue
            panel.setdefault((provider, s["dtype"]), []).append((int(s["seqlen"]), float(v)))
    return {k: {p: sorted(pts) for p, pts in v.items()} for k, v in sorted(out.items())}


def plot_gpu_check(result: dict[str, Any], outdir: Path, formats: Sequence[str] = FORMATS) -> list[Path]:
    """TFLOP/s vs sequence length per backend (fwd and bwd figures), plus the autotune rows."""
    rows = (result.get("benchmark") or {}).get("rows") or []
    paths: list[Path] = []
    if rows:
        plt = _pyplot()
        providers = sorted({p for r in rows for p in r.get("results", {})}, key=lambda p: (p != "fagen", p))
        colors = {p: plt.get_cmap("tab10")(k % 10) for k, p in enumerate(providers)}
        for direction in ("fwd", "bwd"):
            series = tflops_series(rows, direction)
            if not any(series.values()):
                continue
            panels = list(series)
            cols = min(2, len(panels))
            nrows = math.ceil(len(panels) / cols)
            fig, axes = plt.subplots(nrows, cols, figsize=(6 * cols, 4 * nrows), squeeze=False)
            for ax, (d, causal) in zip(axes.flat, panels):
                for (provider, dtype), pts in series[(d, causal)].items():
                    ax.plot([n for n, _ in pts], [t for _, t in pts], marker="o", color=colors[provider],
                            linestyle=LINESTYLE.get(dtype, "-"), label=f"{provider} {dtype}")
                ax.set_xscale("log", base=2)
                ax.set_title(f"{direction}, d = {d}{', causal' if causal else ''}")
                ax.set_xlabel("sequence length N")
                ax.set_ylabel("TFLOP/s")
                ax.grid(True, alpha=0.3)
                ax.legend(fontsize=7)
            for ax in list(axes.flat)[len(panels):]:
                ax.set_visible(False)
            dev = (result.get("environment") or {}).get("device") or {}
            fig.suptitle(f"{'forward' if direction == 'fwd' else 'backward'} TFLOP/s"
                         f"{' on ' + dev['name'] if dev.get('name') else ''}")
            fig.tight_layout()
            paths += _save(fig, outdir, f"tflops_{direction}", formats)
            plt.close(fig)
    auto = result.get("autotune") or {}
    if auto.get("rows"):
        paths += plot_autotune(auto["rows"], outdir, formats)
    return paths


# --------------------------------------------------------------------------- autotune
def _autotune_panels(data: Any) -> list[tuple[str, list[dict[str, Any]]]]:
    """(title, candidates) for each tuned problem in any of the autotune outputs."""
    if isinstance(data, dict) and "candidates" in data:  # fagen autotune --json
        spec = data.get("spec") or {}
        prob = data.get("problem") or {}
        title = (f"d{spec.get('head_dim')} {spec.get('dtype')}{' causal' if spec.get('causal') else ''} "
                 f"{spec.get('direction', '')} B{prob.get('batch')} H{prob.get('heads')} N{prob.get('seqlen_q')}")
        return [(title, data["candidates"])]
    if isinstance(data, dict) and "rows" in data:
        data = data["rows"]
    if isinstance(data, list) and all(isinstance(r, dict) and "candidates" in r for r in data):
        return [(str(r.get("spec") or f"row {k}"), r["candidates"]) for k, r in enumerate(data)]
    raise PlotError("not an autotune result: expected 'candidates' or 'rows' of candidates")


def plot_autotune(data: Any, outdir: Path, formats: Sequence[str] = FORMATS) -> list[Path]:
    """Predicted vs measured milliseconds per candidate, one figure per tuned problem."""
    paths: list[Path] = []
    for title, cands in _autotune_panels(data):
        pts = [c for c in cands if c.get("predicted_ms") is not None and c.get("measured_ms") is not None
               and math.isfinite(c["measured_ms"]) and math.isfinite(c["predicted_ms"])]
        if not pts:
            continue
        plt = _pyplot()
        fig, ax = plt.subplots(figsize=(6, 5))
        xs, ys = [c["predicted_ms"] for c in pts], [c["measured_ms"] for c in pts]
        ax.scatter(xs, ys, color="tab:blue", zorder=3)
        for c in pts:
            label = c.get("label") or f"{c.get('block_r')}x{c.get('block_c')} w{c.get('num_warps')}"
            ax.annotate(label, (c["predicted_ms"], c["measured_ms"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        best = min(pts, key=lambda c: c["measured_ms"])
        ax.scatter([best["predicted_ms"]], [best["measured_ms"]], s=160, facecolors="none", edgecolors="tab:green",
                   label="fastest measured", zorder=4)
        default = [c for c in pts if c.get("default")]
        if default:
            ax.scatter([default[0]["predicted_ms"]], [default[0]["measured_ms"]], marker="x", s=90, color="tab:red",
                       label="default tile", zorder=4)
        lo, hi = min(xs + ys), max(xs + ys)
        ax.plot([lo, hi], [lo, hi], color="gray", linestyle=":", label="measured = predicted")
        ax.set_xlabel("predicted (ms)")
        ax.set_ylabel("measured (ms)")
        ax.set_title(f"autotune: {title}", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        stem = "autotune_" + re.sub(r"[^A-Za-z0-9_.-]+", "_", title).strip("_")
        paths += _save(fig, outdir, stem, formats)
        plt.close(fig)
    return paths


# --------------------------------------------------------------------------- CLI
def plot_file(path: Path, outdir: Path, formats: Sequence[str] = FORMATS) -> list[Path]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PlotError(f"{path}: {e}") from None
    if isinstance(data, dict) and ("benchmark" in data or "environment" in data):
        return plot_gpu_check(data, outdir, formats)
    return plot_autotune(data, outdir, formats)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", type=Path, help="gpu_check.json, or fagen autotune --json / autotune_check.py output")
    ap.add_argument("--out", type=Path, default=None, help="directory for the plots (default: beside RESULT)")
    ap.add_argument("--format", nargs="+", choices=FORMATS, default=list(FORMATS))
    args = ap.parse_args(argv)
    try:
        paths = plot_file(args.result, args.out or args.result.parent, args.format)
    except PlotError as e:
        print(f"plots: error: {e}", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    if not paths:
        print("plots: nothing measured to plot", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
