"""Memory counters of the default kernels at the emulator's PTX level (docs/emulator.md,
"Memory counters"): shared-memory wavefronts per request and global sectors per request, in the
tile loop and outside it (prologue, epilogue), and the TMA / bulk copies with their bytes, for the default spec of every family and arch
(simt sm_80, mma sm_80 / sm_90, wgmma sm_90a), forward and backward, d = 64 and 128, fp16.

    python benchmarks/memory_counters.py [--json] [--seqlen 256] [--dims 64,128] [--sites]

Counted on B = 1, H = 1, N = --seqlen (non-causal, the spec defaults), every launch of the
forward and the backward (pre, main, post kernels). The counts per request do not depend on N
once the tile loop runs more than once; the totals do.
"""
from __future__ import annotations

import argparse
import json
import sys

FAMILIES = (("simt", "sm_80"), ("mma", "sm_80"), ("mma", "sm_90"), ("wgmma", "sm_90a"))


def count(impl: str, arch: str, head_dim: int, seqlen: int) -> dict:
    import torch

    import fagen.functional as F
    from fagen import KernelSpec
    from fagen.runtime import cpu

    common = {"head_dim": head_dim, "dtype": "float16", "impl": impl, "arch": arch}
    fwd, bwd = KernelSpec(direction="fwd", **common), KernelSpec(direction="bwd", **common)
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, seqlen, 1, head_dim, generator=g).half() for _ in range(4))
    with cpu.ptx(counters=True) as rec:
        o, lse = F.run_forward(fwd, q, k, v)
        F.run_backward(bwd, do, q, k, v, o, lse)
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
        lines.append(f"| d{r['head_dim']} {r['spec'].split('_')[1]} {r['role']} | {r['impl']} {r['arch']} | {_fmt(loop, 'shared')} | "
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
    args = ap.parse_args()
    results = []
    for fam in args.families.split(","):
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
