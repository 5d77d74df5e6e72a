"""The cost model's predicted ceiling per kernel family beside published FlashAttention numbers.

    python benchmarks/ceilings.py [--device "NVIDIA H100 80GB HBM3"] [--json]

No GPU needed: for every registered family that supports the spec, compile its default
spec (NVRTC), read the main kernel's registers and, when ``nvdisasm`` is installed, its
main-loop SASS mix, and print the model's throughput (nominal FLOPs / predicted time) for
the backward and the forward at d = 64 and 128, N = 8192, non-causal, fp16 (batch x seqlen
= 16k tokens, hidden 2048, as in the FlashAttention-2 benchmarks). A family that targets one
arch (the Hopper family: sm_90a) is modelled there, the others on sm_90. The published numbers
are H100 SXM5 throughputs quoted for the same shapes; the model's figures are predictions.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

#: Published H100 backward TFLOP/s, d64 / d128 at 8k, non-causal (FlashAttention-2, cuDNN, FlashAttention-3).
ANCHORS_BWD = {"FA2": {64: 287, 128: 318}, "cuDNN": {64: 432, 128: 518}, "FA3": {64: 472, 128: 559}}
#: Published H100 forward TFLOP/s at d128, 8k, non-causal, fp16 (the FlashAttention-3 paper's figure).
ANCHORS_FWD = {"FA2": {128: 370}, "cuDNN": {128: 600}, "FA3": {128: 646}}


def rows(device_name: str, seqlen: int = 8192) -> list[dict[str, Any]]:
    from fagen.autotune.model import Workload, ceiling_tflops, device_model, predict
    from fagen.autotune.candidates import main_loop_mix
    from fagen.compiler import compile as compile_spec
    from fagen.families import FamilySpec, family_names, get_family
    from fagen.spec import KernelSpec

    out = []
    for direction in ("bwd", "fwd"):
        for d in (64, 128):
            for impl in family_names():
                arch = getattr(sys.modules[type(get_family(impl)).__module__], "ARCH", "sm_90")
                if get_family(impl).unsupported_reason(FamilySpec(direction, d, "float16", arch)):
                    continue
                spec = KernelSpec(direction=direction, head_dim=d, dtype="float16", arch=arch, impl=impl)
                mod = compile_spec(spec)
                main = mod.resource("main")
                loop = main_loop_mix(mod)  # the walked tile loop where the family states its work
                dev = device_model(arch, device_name)
                w = Workload(16384 // seqlen, 2048 // d, seqlen, seqlen)
                pred = predict(spec, w, main.registers, dev, loop)
                out.append({
                    "direction": direction, "head_dim": d, "impl": impl, "arch": arch, "spec": spec.name,
                    "registers": main.registers, "sass": loop is not None, "bound": pred.bound,
                    "predicted_tflops": round(ceiling_tflops(spec, w, main.registers, dev, loop), 1),
                    "anchors_tflops": {k: v[d] for k, v in (ANCHORS_BWD if direction == "bwd" else ANCHORS_FWD).items()
                                       if d in v},
                })
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="NVIDIA H100 80GB HBM3", help="CUDA device name the model assumes")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    data = rows(args.device)
    if args.json:
        json.dump(data, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    print(f"{'dir':4} {'d':>4} {'family':7} {'arch':6} {'predicted TFLOP/s':>17} {'bound':7} {'SASS':5} "
          "published (H100 SXM5)")
    for r in data:
        anchors = ", ".join(f"{k} {v}" for k, v in r["anchors_tflops"].items())
        print(f"{r['direction']:4} {r['head_dim']:>4} {r['impl']:7} {r['arch']:6} {r['predicted_tflops']:>17} {r['bound']:7} "
              f"{'yes' if r['sass'] else 'no':5} {anchors}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
