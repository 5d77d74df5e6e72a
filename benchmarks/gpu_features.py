"""What each training feature costs on a GPU: forward and backward time per feature against the plain row.

    python benchmarks/gpu_features.py OUTDIR [--arch sm_90a] [--head-dims 64,128] [--seqlen 4096] [--budget-s 240]

For each head dim, a plain row and one row per feature (causal, varlen, window, softcap, dropout,
deterministic backward, ALiBi, bool attn_mask, float bias with its gradient), plus the backward at
d = 192 and 256: B * N = 16k tokens, H = 16, fp16, through ``fagen.functional`` with specs at
``--arch`` (default: the device's own; ``sm_90a`` on a capability-9.0 GPU, so the Hopper family is
taken where it implements the spec; the family each kernel resolved to is printed). Timing:
``fagen.autotune.timing.measure`` (CUDA events around back-to-back calls, median). TFLOP/s count
4 B H N^2 d forward and 2.5x that backward over the whole square (the causal and window rows too:
their ``x plain`` is the comparison). Writes ``gpu_features.json`` and ``gpu_features.txt`` in
OUTDIR. Needs a CUDA GPU; without one it says so and exits 0.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TOKENS, HEADS = 16 * 1024, 16
DEVICE = "cuda"
#: name -> (spec flags, options); "plain" first: every row's ratio is to it.
FEATURES: dict[str, dict[str, Any]] = {
    "plain": {},
    "causal": {"causal": True},
    "varlen": {"varlen": True},
    "window": {"window": True},
    "softcap": {"softcap": True},
    "dropout": {"dropout": True},
    "deterministic": {"deterministic": True},
    "alibi": {"alibi": True},
    "attn_mask": {"attn_mask": True},
    "bias": {"bias": True},
    # the deterministic backward with a causal mask (its ratio is to the plain row: compare with "causal")
    "det_causal": {"deterministic": True, "causal": True},
    # the forward's speed-only knobs (templates/wgmma: softcap's tanh on the SFU; the consumer warpgroups'
    # ping-pong), set on the Hopper family's forward spec; the backward is the feature's own
    "softcap_sfu": {"softcap": True, "fwd_knobs": {"softcap_sfu": 1}},
    "pingpong": {"fwd_knobs": {"pingpong": 1}},
}
WIDE = (192, 256)  # the backward at these head dims: plain rows only


def _ints(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or min(out) < 8:
        raise argparse.ArgumentTypeError(f"expected head dims of at least 8, got {text!r}")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--arch", default=None, help="spec arch (default: the device's; sm_90a on capability 9.0)")
    ap.add_argument("--head-dims", type=_ints, default=(64, 128), metavar="D,D")
    ap.add_argument("--seqlen", type=int, default=4096, help=f"N (a divisor of {TOKENS}; B = {TOKENS} / N)")
    ap.add_argument("--budget-s", type=float, default=240.0, help="rows that would start past it are skipped")
    ap.add_argument("--features", type=lambda x: tuple(f for f in x.split(",") if f), default=tuple(FEATURES),
                    metavar="F,F", help="the rows to run (the plain row always runs first); default: all")
    args = ap.parse_args(argv)
    if args.seqlen < 1 or TOKENS % args.seqlen:
        ap.error(f"--seqlen: must divide {TOKENS}")
    if args.budget_s <= 0:
        ap.error("--budget-s must be positive")
    unknown = [f for f in args.features if f not in FEATURES]
    if unknown or not args.features:
        ap.error(f"--features: expected names of {', '.join(FEATURES)}, got {','.join(args.features) or 'none'}")
    args.features = ("plain",) + tuple(f for f in args.features if f != "plain")
    return args


def _case(name: str, d: int, n: int, arch: str) -> tuple[Any, Any, dict, dict, dict]:
    """(fwd spec, bwd spec, tensors, forward options, backward-only options) of one row."""
    import torch

    from fagen.spec import KernelSpec

    flags = dict(FEATURES[name])
    det = flags.pop("deterministic", False)
    knobs = flags.pop("fwd_knobs", None)
    b = TOKENS // n
    g = torch.Generator(device=DEVICE).manual_seed(0)
    shape = (b * n, HEADS, d) if flags.get("varlen") else (b, n, HEADS, d)
    t = {x: torch.randn(shape, device=DEVICE, dtype=torch.float16, generator=g) for x in ("q", "k", "v", "do")}
    opt: dict[str, Any] = {"causal": flags.get("causal", False)}
    if flags.get("varlen"):  # b sequences of uneven lengths summing to the same tokens, causal (packed training)
        lens = [n + (n // 4 if i % 2 == 0 else -n // 4) for i in range(b)] if b > 1 else [n]
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
        opt.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens), causal=True)
        flags["causal"] = True
    if flags.get("window"):
        opt["window_size"] = (512, 0)
        opt["causal"] = flags["causal"] = True
    if flags.get("softcap"):
        opt["softcap"] = 30.0
    if flags.get("dropout"):
        opt.update(dropout_p=0.1, seed=1, offset=0)
    if flags.get("alibi"):
        opt["alibi_slopes"] = torch.rand(HEADS, device=DEVICE, generator=g) + 0.1
    if flags.get("attn_mask"):
        opt["attn_mask"] = torch.rand((b, 1, n, n), device=DEVICE, generator=g) > 0.1
    if flags.get("bias"):
        opt["attn_bias"] = torch.randn((1, HEADS, n, n), device=DEVICE, dtype=torch.float16, generator=g)
    common = dict(head_dim=d, dtype="float16", arch=arch, **flags)
    fwd = KernelSpec(direction="fwd", **common, **({"impl": "wgmma", "knobs": knobs} if knobs else {}))
    bwd = KernelSpec(direction="bwd", deterministic=det, bias_grad=bool(flags.get("bias")), **common)
    back = {"deterministic": det, "bias_requires_grad": bool(flags.get("bias"))}
    return fwd, bwd, t, opt, back


def run_row(name: str, d: int, n: int, arch: str, fwd_only: bool = False) -> dict[str, Any]:
    import fagen.functional as F
    from fagen.autotune.timing import measure

    fwd, bwd, t, opt, back = _case(name, d, n, arch)
    q, k, v, do = t["q"], t["k"], t["v"], t["do"]
    o, lse = F.attention_forward(q, k, v, spec=fwd, **opt)
    row: dict[str, Any] = {"feature": name, "head_dim": d, "fwd_spec": fwd.name, "bwd_spec": bwd.name,
                           "fwd_family": fwd.impl, "bwd_family": bwd.impl}
    row["fwd_ms"] = measure(lambda: F.attention_forward(q, k, v, spec=fwd, **opt), warmup=2, reps=5)
    if not fwd_only:
        row["bwd_ms"] = measure(lambda: F.attention_backward(do, q, k, v, o, lse, spec=bwd, **opt, **back),
                                warmup=2, reps=5)
    if not fwd_only and back["deterministic"]:  # the same bits on a second call; how far from the other order
        a = F.attention_backward(do, q, k, v, o, lse, spec=bwd, **opt, **back)
        again = F.attention_backward(do, q, k, v, o, lse, spec=bwd, **opt, **back)
        free = F.attention_backward(do, q, k, v, o, lse, **opt)
        row["bitwise_repeat"] = all(bool((x == y).all()) for x, y in zip(a, again))
        row["max_abs_vs_nondeterministic"] = max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, free))
    flops = 4.0 * (TOKENS // n) * HEADS * n * n * d
    row["fwd_tflops"] = flops / row["fwd_ms"] / 1e9
    if "bwd_ms" in row:
        row["bwd_tflops"] = 2.5 * flops / row["bwd_ms"] / 1e9
    return row


def table(rows: list[dict[str, Any]]) -> str:
    plain = {r["head_dim"]: r for r in rows if r["feature"] == "plain" and "fwd_ms" in r}
    out = [f"{'d':>4} {'feature':<14} {'fwd ms':>8} {'TF/s':>6} {'x plain':>7} {'bwd ms':>8} {'TF/s':>6} "
           f"{'x plain':>7}  families (fwd / bwd)"]
    for r in rows:
        if "error" in r:
            out.append(f"{r['head_dim']:>4} {r['feature']:<14} {r['error']}")
            continue
        p = plain.get(r["head_dim"], {})

        def cell(key: str) -> str:
            if key not in r:
                return f"{'-':>8} {'-':>6} {'-':>7}"
            ratio = r[key] / p[key] if key in p else float("nan")
            tf = r[key.replace("_ms", "_tflops")]
            return f"{r[key]:8.3f} {tf:6.0f} {ratio:7.2f}"

        det = (f"  same bits twice: {r['bitwise_repeat']}, max |diff| to the non-deterministic: "
               f"{r['max_abs_vs_nondeterministic']:.2e}") if "bitwise_repeat" in r else ""
        out.append(f"{r['head_dim']:>4} {r['feature']:<14} {cell('fwd_ms')} {cell('bwd_ms')}  "
                   f"{r['fwd_family']} / {r['bwd_family']}{det}")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.outdir.mkdir(parents=True, exist_ok=True)
    import torch

    if not torch.cuda.is_available():
        print("gpu_features: no CUDA GPU (torch.cuda.is_available() is False); nothing was measured")
        return 0
    import fagen.functional as F

    arch = args.arch or F.default_arch(torch.device("cuda"))
    if args.arch is None and torch.cuda.get_device_capability() == (9, 0):
        arch = "sm_90a"
    end = time.monotonic() + args.budget_s
    wide = set(args.features) == set(FEATURES)  # the wide head dims' plain rows with the full set only
    plan = [(f, d) for d in args.head_dims for f in args.features] + [("plain", d) for d in WIDE if wide]
    rows: list[dict[str, Any]] = []
    for feature, d in plan:
        if time.monotonic() > end:
            rows.append({"feature": feature, "head_dim": d, "error": "skipped: time budget"})
            continue
        try:
            rows.append(run_row(feature, d, args.seqlen, arch))
        except Exception as e:  # noqa: BLE001 - a row that cannot run says why; the others still run
            rows.append({"feature": feature, "head_dim": d, "error": f"{type(e).__name__}: {str(e)[:200]}"})
        torch.cuda.empty_cache()
    text = (f"fagen feature rows on {torch.cuda.get_device_name()} (arch {arch}), fp16, H {HEADS}, "
            f"N {args.seqlen}, B {TOKENS // args.seqlen}\n" + table(rows))
    (args.outdir / "gpu_features.json").write_text(json.dumps({"arch": arch, "seqlen": args.seqlen, "rows": rows},
                                                              indent=1))
    (args.outdir / "gpu_features.txt").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
