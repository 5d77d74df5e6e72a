"""fagen on a CUDA GPU: the op layer against the float64 reference, streams, memory.

Every test is marked ``gpu`` and skipped without CUDA, and skipped with the reason on a
device fagen has no kernel for (below sm_80). ``benchmarks/gpu_check.py`` runs this file
as ``pytest tests/test_gpu.py -m gpu``. References are computed on the CPU from the same
inputs (float64, and plain PyTorch in the input dtype).

Repeated runs of the atomic backward agree in o, dK and dV bit for bit (each written by
one CTA) but not in dQ: its fp32 atomic adds from the K/V-block CTAs land in a different
order from run to run, so dQ is compared with a tolerance of a few ulps of the dtype
(:func:`assert_same_up_to_atomic_order`); bit-equality of dQ is the deterministic
backward's test.
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch

import fagen.functional as F
from fagen import reference as R
from fagen.ops import draw_rng_state, flash_attn_func, scaled_dot_product_attention
from ops_cases import ATOL, Case, leaves, make_inputs, max_err, run_flash

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]


@pytest.fixture(autouse=True)
def _device_has_kernels() -> None:
    """Skip, with the reason, on a device whose arch fagen has no kernel for."""
    from fagen.errors import SpecError
    from fagen.runtime.gpu import device_arch

    try:
        device_arch(torch.cuda.current_device())
    except SpecError as e:
        pytest.skip(f"no fagen kernel for this device: {e}")


def assert_same_up_to_atomic_order(a: tuple, b: tuple, what: str = "") -> None:
    """(o, dq, dk, dv) of two runs of the same call: o, dk, dv equal bit for bit; dq (fp32 atomics
    summed in a run-dependent order, then rounded to the dtype) within a few ulps."""
    for name, x, y in zip(("out", "dq", "dk", "dv"), a, b):
        assert x.shape == y.shape and x.dtype == y.dtype, (what, name)
        if name != "dq":
            assert torch.equal(x, y), f"{what}: {name} differs"
            continue
        eps = torch.finfo(x.dtype).eps
        atol = ATOL[str(x.dtype).removeprefix("torch.")] * max(1.0, y.abs().max().item())
        err = (x.double() - y.double()).abs()
        bound = 4 * eps * y.double().abs() + atol
        assert bool((err <= bound).all()), f"{what}: dq differs by {err.max().item():.3g} (beyond atomic reordering)"

# Odd lengths (not multiples of any tile), every dtype, d in {32, 64, 128, 256}, Nq != Nk both ways.
GPU_CASES = [
    Case("float16", 64, seqlen_q=113, seqlen_k=203),
    Case("bfloat16", 128, causal=True, seqlen_q=203, seqlen_k=113),
    Case("float32", 32, padding=True, seqlen_q=1, seqlen_k=257),
    Case("float16", 128, causal=True, padding=True, dropout_p=0.17, seqlen_q=257, seqlen_k=257),
    Case("bfloat16", 64, dropout_p=0.3, seqlen_q=129, seqlen_k=65),
    Case("float32", 64, causal=True, padding=True, dropout_p=0.1, seqlen_q=77, seqlen_k=77),
    Case("float16", 32, causal=True, seqlen_q=500, seqlen_k=1031, batch=1),
    Case("bfloat16", 256, seqlen_q=70, seqlen_k=90, batch=1),
]


def cuda(*ts):
    return [None if t is None else t.cuda() for t in ts]


def _references(case: Case, q, k, v, do, mask, rng_state: torch.Tensor):
    """(float64 reference, same-dtype torch) outputs and gradients, computed on the CPU."""
    keep = None
    if case.dropout_p:
        seed, offset = (int(x) for x in rng_state)
        keep = F.dropout_keep_mask(case.batch, case.heads, case.seqlen_q, case.seqlen_k, case.dropout_p,
                                   seed=seed, offset=offset)
    kw = dict(causal=case.causal, key_padding_mask=mask, keep_mask=keep, dropout_p=case.dropout_p)
    o64, lse64 = R.attention_forward_ref(q, k, v, **kw)
    ref = (o64, *R.attention_backward_ref(do, q, k, v, o64, lse64, **kw))
    qt, kt, vt = leaves(q, k, v)
    out_pt = R.attention_ref_torch(qt, kt, vt, **kw)
    out_pt.backward(do)
    return ref, (out_pt.detach(), qt.grad, kt.grad, vt.grad)


@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_gpu_autograd_matches_float64_reference(case: Case) -> None:
    q, k, v, do, mask = make_inputs(case)
    torch.manual_seed(21)
    rng_state = draw_rng_state() if case.dropout_p else torch.zeros(2, dtype=torch.int64)
    ours = run_flash(case, *cuda(q, k, v, do, mask), rng_seed=21)
    ref, pt = _references(case, q, k, v, do, mask, rng_state)
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), ours, pt, ref):
        assert a.is_cuda and a.dtype == q.dtype, name
        a = a.cpu()
        assert not torch.isnan(a).any(), f"{case}: NaN in {name}"
        bound = 2 * max_err(b, r) + ATOL[case.dtype]
        assert max_err(a, r) <= bound, f"{case}: {name} error {max_err(a, r):.3g} > {bound:.3g}"


@pytest.mark.skipif(shutil.which(os.environ.get("FAGEN_CXX", "g++")) is None, reason="the CPU emulator needs g++")
def test_gpu_agrees_with_cpu_emulator() -> None:
    """Same kernel text on both backends: same shapes and dtypes, values equal up to rounding order."""
    from fagen.emulator.errors import EmulatorBuildError
    from fagen.emulator.toolchain import cuda_include_dir

    try:
        cuda_include_dir()
    except EmulatorBuildError as e:  # a GPU machine set up for the GPU alone: say what the emulator lacks
        pytest.skip(f"the CPU emulator cannot build here: {e}")
    case = GPU_CASES[4]
    q, k, v, do, mask = make_inputs(case)
    cpu = run_flash(case, q, k, v, do, mask, rng_seed=4)
    gpu = run_flash(case, *cuda(q, k, v, do, mask), rng_seed=4)
    for a, b in zip(cpu, gpu):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert max_err(a, b.cpu()) <= 4 * ATOL[case.dtype] * max(1.0, a.abs().max().item())


def test_gpu_dropout_reproducible() -> None:
    case = GPU_CASES[3]
    q, k, v, do, mask = cuda(*make_inputs(case))
    first = run_flash(case, q, k, v, do, mask, rng_seed=7)
    again = run_flash(case, q, k, v, do, mask, rng_seed=7)
    other = run_flash(case, q, k, v, do, mask, rng_seed=8)
    assert_same_up_to_atomic_order(first, again, "same seed")  # the same dropout mask
    assert not any(torch.equal(a, b) for a, b in zip(first, other))
    assert max_err(first[0], other[0]) > 100 * ATOL[case.dtype]  # another mask, not rounding


@pytest.mark.parametrize("dtype", ["float16", "float32"])  # the mma family, the SIMT family
def test_gpu_deterministic_backward_is_bitwise_reproducible(dtype: str) -> None:
    """deterministic=True: dq, dk, dv bit for bit the same over repeated runs on a GPU (GQA, causal,
    dropout, 16+ K/V blocks per dQ row, hundreds of blocks in flight), and close to the atomic backward."""
    g = torch.Generator().manual_seed(3)
    dt = getattr(torch, dtype)
    B, Nq, Nk, H, Hk, d = 2, 640, 1100, 8, 2, 64
    q, do = (torch.randn(B, Nq, H, d, generator=g).to(dt).cuda() for _ in range(2))
    k, v = (torch.randn(B, Nk, Hk, d, generator=g).to(dt).cuda() for _ in range(2))
    kw = dict(causal=True, dropout_p=0.1, seed=5)
    o, lse = F.attention_forward(q, k, v, **kw)
    runs = [F.attention_backward(do, q, k, v, o, lse, deterministic=True, **kw) for _ in range(4)]
    for again in runs[1:]:
        for name, a, b in zip(("dq", "dk", "dv"), runs[0], again):
            assert torch.equal(a, b), name
    atomic = F.attention_backward(do, q, k, v, o, lse, **kw)
    for a, b in zip(runs[0], atomic):
        assert max_err(a, b) <= 4 * ATOL[dtype] * max(1.0, b.abs().max().item())


def test_gpu_runs_on_the_current_stream() -> None:
    case = GPU_CASES[0]
    q, k, v, do, _ = cuda(*make_inputs(case))
    want = run_flash(case, q, k, v, do, None)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = run_flash(case, q, k, v, do, None)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    assert_same_up_to_atomic_order(want, got, "side stream")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_gpu_second_device() -> None:
    case = GPU_CASES[0]
    inputs = make_inputs(case)
    want = run_flash(case, *cuda(*inputs))
    got = run_flash(case, *[None if t is None else t.to("cuda:1") for t in inputs])
    assert all(b.device.index == 1 for b in got)
    assert_same_up_to_atomic_order(tuple(t.cpu() for t in want), tuple(t.cpu() for t in got), "second device")


def test_gpu_sdpa_layout_and_compile() -> None:
    case = GPU_CASES[3]
    q, k, v, do, mask = cuda(*make_inputs(case))
    flash = run_flash(case, q, k, v, do, mask, rng_seed=3)

    def sdpa(qs, ks, vs):
        return scaled_dot_product_attention(qs, ks, vs, attn_mask=mask[:, None, None, :], dropout_p=0.17,
                                            is_causal=True)

    torch._dynamo.reset()
    for fn in (sdpa, torch.compile(sdpa, fullgraph=True, backend="aot_eager")):
        qs, ks, vs = leaves(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        torch.manual_seed(3)
        out = fn(qs, ks, vs)
        out.backward(do.transpose(1, 2))
        assert_same_up_to_atomic_order(flash, tuple(t.transpose(1, 2) for t in (out.detach(), qs.grad, ks.grad,
                                                                                 vs.grad)), "sdpa layout")


def test_gpu_extra_memory_is_linear_in_seqlen() -> None:
    """N = 16k: forward + backward allocate O(N) beyond inputs -- far below one N x N fp16 matrix."""
    n, d = 16 * 1024, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(1, n, 1, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(4))
    mask = torch.ones(1, n, dtype=torch.bool, device="cuda")
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = flash_attn_func(q, k, v, dropout_p=0.1, causal=True, key_padding_mask=mask)
    out.backward(do)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    quadratic = n * n * 2
    # o, dq, dk, dv, the fp32 dq accumulator, lse and delta: about 12 x (N d) elements, ~16 MiB here.
    assert extra < quadratic / 16, f"peak extra memory {extra / 2**20:.1f} MiB vs N^2 fp16 {quadratic / 2**20:.0f} MiB"
    assert torch.isfinite(q.grad).all() and torch.isfinite(out).all()
