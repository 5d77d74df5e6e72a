"""The real Algorithm 4 kernel under AddressSanitizer: clean on exact-size buffers, caught when overrun."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import fagen.functional as F
from fagen.abi import neutral_args
from fagen import KernelSpec
from fagen.emulator import EmulatorMemoryError, run_sanitized
from fagen.philox import drop_threshold
from fagen.renderer import render

B, H, NQ, NK, D = 1, 2, 19, 23, 16
P = 0.2


def _inputs():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, NQ, H, D, generator=g)
    k = torch.randn(B, NK, H, D, generator=g)
    v = torch.randn(B, NK, H, D, generator=g)
    do = torch.randn(B, NQ, H, D, generator=g)
    mask = torch.rand(B, NK, generator=g) > 0.2
    return q, k, v, do, mask


def _main_args(q, k, v, do, mask, o, lse, seqlen_k: int) -> dict:
    def strides(name: str, t: torch.Tensor) -> dict:
        return {f"stride_{name}_b": t.stride(0), f"stride_{name}_s": t.stride(1), f"stride_{name}_h": t.stride(2)}

    delta = (do * o).sum(-1).permute(0, 2, 1).contiguous()  # D = rowsum(dO o O), [B, H, Nq]
    return {
        **neutral_args(heads=H, seqlen_q=NQ, null=None),
        "q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "do_": do.numpy(), "lse": lse.numpy(),
        "delta": delta.numpy(), "kpm": mask.numpy().astype(np.uint8),
        "dq_accum": np.zeros((B, NQ, H, D), np.float32), "dk": np.zeros((B, NK, H, D), np.float32),
        "dv": np.zeros((B, NK, H, D), np.float32), "heads": H, "seqlen_q": NQ, "seqlen_k": seqlen_k,
        **strides("q", q), **strides("k", k), **strides("v", v), **strides("do", do), **strides("dk", k),
        **strides("dv", v), "scale": D ** -0.5, "seed": 11, "offset": 0, "drop_threshold": drop_threshold(P),
        "rp_keep": 1.0 / (1.0 - P),
    }


@pytest.fixture(scope="module")
def setup():
    spec = KernelSpec(head_dim=D, dtype="float32", causal=True, key_padding=True, dropout=True)
    q, k, v, do, mask = _inputs()
    o, lse = F.attention_forward(q, k, v, causal=True, key_padding_mask=mask, dropout_p=P, seed=11)
    ref = F.attention_backward(do, q, k, v, o, lse, causal=True, key_padding_mask=mask, dropout_p=P, seed=11)
    return spec, (q, k, v, do, mask, o, lse), ref


def test_backward_main_kernel_is_clean_under_asan(setup) -> None:
    spec, tensors, (dq, dk, dv) = setup
    r = render(spec)
    kern = r.kernel("main")
    grid = kern.grid(B, H, NQ, NK)
    out = run_sanitized(r.source, r.kernels, kern.name, grid, kern.block, kern.smem_bytes, _main_args(*tensors, NK))
    np.testing.assert_allclose(out["dk"], dk.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["dv"], dv.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["dq_accum"], dq.numpy(), rtol=1e-5, atol=1e-6)


def test_overrun_is_reported_with_the_buffer(setup) -> None:
    # Lie about seqlen_k: the kernel reads keys past the end of k (a deliberately broken launch).
    spec, tensors, _ = setup
    r = render(spec)
    kern = r.kernel("main")
    with pytest.raises(EmulatorMemoryError) as ei:
        run_sanitized(r.source, r.kernels, kern.name, kern.grid(B, H, NQ, NK + 40), kern.block, kern.smem_bytes,
                      _main_args(*tensors, NK + 40))
    assert "overflow" in str(ei.value).lower() or "AddressSanitizer" in ei.value.report
