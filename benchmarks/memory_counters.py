"""Memory counters of the default kernels at the emulator's PTX level (docs/emulator.md,
"Memory counters"): shared-memory wavefronts per request and global sectors per request, in the
tile loop and outside it (prologue, epilogue), and the TMA / bulk copies with their bytes, for the default spec of every family and arch
(simt sm_80, mma sm_80 / sm_90, wgmma sm_90a), forward and backward, d = 64 and 128, fp16.

    python benchmarks/memory_counters.py [--json] [--seqlen 256] [--dims 64,128] [--sites]
    python benchmarks/memory_counters.py --only-spec --spec 'impl=wgmma,arch=sm_90a,head_dim=192,head_dim_v=128'
    python benchmarks/memory_counters.py --only-spec --spec 'impl=wgmma,arch=sm_90a,head_dim=64,attn_mask=true,bias=true,bias_grad=true'

Counted on B = 1, H = 1, N = --seqlen (non-causal, the spec defaults), every launch of the
forward and the backward (pre, main, post kernels). The counts per request do not depend on N
once the tile loop runs more than once; the totals do.

``--spec key=value,...`` (KernelSpec fields, as benchmarks/sass_cost.py's; impl, arch and head_dim
default to wgmma, sm_90a and 64) adds the forward and the backward of those fields (``bias_grad``
and ``deterministic`` the backward's only), with inputs that turn every flag on: dropout p = 0.1,
softcap 3.5, ALiBi slopes, a key padding mask, a sliding window (64, 64), a bool mask and an
additive bias of [1, 1, N, N], two packed sequences of N / 2 (varlen). ``--only-spec`` counts
only those rows.
"""
from __future__ import annotations

import argparse
import json
import re
import sys

FAMILIES = (("simt", "sm_80"), ("mma", "sm_80"), ("mma", "sm_90"), ("wgmma", "sm_90a"))


def parse_spec(text: str) -> dict:
    """``key=value,...`` as KernelSpec fields (ints, booleans, ``knobs=stages:1;other:2``)."""
    out: dict = {}
    for part in filter(None, text.split(",")):
        key, _, val = (x.strip() for x in part.partition("="))
        if val.lower() in ("true", "false"):
            out[key] = val.lower() == "true"
        elif re.fullmatch(r"-?\d+", val):
            out[key] = int(val)
        elif key in ("knobs", "codegen"):
            out[key] = {k: int(v) for k, v in (kv.split(":") for kv in val.split(";") if kv)}
        else:
            out[key] = val
    return out


def specs_of(impl: str, arch: str, head_dim: int, extra: dict | None = None):
    """The forward and backward KernelSpec of the row (``extra``: more KernelSpec fields; ``bias_grad``
    and ``deterministic`` go to the backward only)."""
    from fagen import KernelSpec

    fields = {"head_dim": head_dim, "dtype": "float16", "impl": impl, "arch": arch, **(extra or {})}
    fields.pop("direction", None)
    bwd_only = {k: fields.pop(k) for k in ("bias_grad", "deterministic") if k in fields}
    return KernelSpec(direction="fwd", **fields), KernelSpec(direction="bwd", **bwd_only, **fields)


def inputs_of(fwd, seqlen: int) -> tuple[tuple, dict]:
    """(q, k, v, dO) of B = 1, H = 1, N = seqlen and the options of run_forward / run_backward that the
    spec's flags need (the module docstring's values)."""
    import torch

    d, dv = fwd.head_dim, fwd.head_dim_v or fwd.head_dim
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, seqlen, 1, d, generator=g).half() for _ in range(2))
    v, do = (torch.randn(1, seqlen, 1, dv, generator=g).half() for _ in range(2))
    opts: dict = {}
    if fwd.dropout:
        opts["dropout_p"] = 0.1
    if fwd.softcap:
        opts["softcap"] = 3.5
    if fwd.window:
        opts["window_size"] = (64, 64)
    if fwd.alibi:
        opts["alibi_slopes"] = torch.full((1,), 0.25)
    if fwd.key_padding:
        opts["key_padding_mask"] = torch.rand(1, seqlen, generator=g) > 0.2
    if fwd.attn_mask:
        opts["attn_mask"] = torch.rand(1, 1, seqlen, seqlen, generator=g) > 0.2
    if fwd.bias:
        opts["attn_bias"] = torch.randn(1, 1, seqlen, seqlen, generator=g).half()
    if fwd.varlen:  # two packed sequences of N / 2
        q, k, v, do = (x[0] for x in (q, k, v, do))
        cu = torch.tensor([0, seqlen // 2, seqlen], dtype=torch.int32)
        opts.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=seqlen // 2, max_seqlen_k=seqlen // 2)
    return (q, k, v, do), opts


def count(impl: str, arch: str, head_dim: int, seqlen: int, extra: dict | None = None) -> dict:
    """Counters of every launch of the forward and the backward of the row (:func:`specs_of`,
    :func:`inputs_of`)."""
    import fagen.functional as F
    from fagen.runtime import cpu

    fwd, bwd = specs_of(impl, arch, head_dim, extra)
    (q, k, v, do), opts = inputs_of(fwd, seqlen)
    with cpu.ptx(counters=True) as rec:
        o, lse = F.run_forward(fwd, q, k, v, **opts)
        F.run_backward(bwd, do, q, k, v, o, lse, **opts)
    roles = {name: role for _, role, name in rec.launches}
    specs = {name: spec for spec, _, name in rec.launches}
    return {name: {"spec": specs[name], "role": roles[name], **kc.as_dict()} for name, kc in rec.counters.items()}


def _fmt(t: dict, what: str) -> str:
    if what == "bulk":
        return f"{t['bulk_copies']} ({t['bulk_bytes'] / 1024:g} KiB)" if t["bulk_copies"] else "-"
    if what == "shared":
        if not t["shared_requests"]:
            return "-"
        return f"{t['wavefronts_per_request']:.2f} ({t['shared_requests']})"
    if not t["global_requests"]:
        return "-"
    return f"{t['sectors_per_request']:.2f} / {t['ideal_sectors_per_request']:.2f} ({t['global_requests']})"


def table(results: list[dict]) -> str:
    lines = [("| kernel (d, role) | family / arch | smem wavefronts / request (requests): tile loop | other | "
              "excess wavefronts: loop / other | global sectors / ideal sectors per request (requests): tile loop | "
              "other | TMA / bulk copies (bytes): tile loop | other |"),
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        loop, other = r["tile_loop"], r["other"]
        what = f"d{r['head_dim']} {r['spec'].split('_')[1]} {r['role']}" + (f" ({r['label']})" if r.get("label") else "")
        lines.append(f"| {what} | {r['impl']} {r['arch']} | {_fmt(loop, 'shared')} | "
                     f"{_fmt(other, 'shared')} | {loop['excess_wavefronts']} / {other['excess_wavefronts']} | "
                     f"{_fmt(loop, 'global')} | {_fmt(other, 'global')} | {_fmt(loop, 'bulk')} | "
                     f"{_fmt(other, 'bulk')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true", help="print JSON (every kernel, its sites) instead of the table")
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--families", default=",".join(f"{i}:{a}" for i, a in FAMILIES))
    ap.add_argument("--sites", action="store_true", help="with the table: the sites of each kernel")
    ap.add_argument("--spec", action="append", default=[],
                    help="an extra row pair as key=value,... (KernelSpec fields; impl, arch and head_dim "
                         "default to wgmma, sm_90a, 64), e.g. impl=wgmma,arch=sm_90a,head_dim=64,dropout=true")
    ap.add_argument("--only-spec", action="store_true", help="only the --spec rows, not the default kernels")
    args = ap.parse_args()
    results = []
    for text in args.spec:
        extra = parse_spec(text)
        impl, arch, d = extra.pop("impl", "wgmma"), extra.pop("arch", "sm_90a"), extra.pop("head_dim", 64)
        for name, r in count(impl, arch, d, args.seqlen, extra).items():
            results.append({"impl": impl, "arch": arch, "head_dim": d, "kernel": name, "label": ",".join(
                f"{k}={v}" for k, v in extra.items()), **r})
        print(f"# counted {text}", file=sys.stderr, flush=True)
    for fam in ([] if args.only_spec else args.families.split(",")):
        impl, arch = fam.split(":")
        for d in (int(x) for x in args.dims.split(",")):
            for name, r in count(impl, arch, d, args.seqlen).items():
                results.append({"impl": impl, "arch": arch, "head_dim": d, "kernel": name, **r})
            print(f"# counted {impl} {arch} d{d}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print(table(results))
    if args.sites:
        for r in results:
            print(f"\n{r['kernel']}")
            for s in r["sites"]:
                print(f"  {s['line']:6d} {'loop ' if s['tile_loop'] else 'other'} {s['opcode']:48s} "
                      f"smem {s['shared_requests']:6d} req {s['wavefronts']:7d} wf (ideal {s['ideal_wavefronts']:6d})  "
                      f"global {s['global_requests']:6d} req {s['sectors']:7d} sectors  "
                      f"bulk {s['bulk_copies']:5d} ({s['bulk_bytes']} B)")


if __name__ == "__main__":
    main()
