"""Bad input to the functional API: a typed error naming the argument, and nothing runs."""
from __future__ import annotations

import pytest
import torch

import fagen.functional as F
from fagen.errors import InputError, InputTypeError


def _qkv(dtype=torch.float16, B=2, Nq=8, Nk=9, H=2, d=32):
    return (torch.randn(B, Nq, H, d).to(dtype), torch.randn(B, Nk, H, d).to(dtype), torch.randn(B, Nk, H, d).to(dtype))


def _bwd_args(**over):
    q, k, v = _qkv()
    args = dict(do=torch.randn_like(q), q=q, k=k, v=v, o=torch.randn_like(q),
                lse=torch.zeros(2, 2, 8, dtype=torch.float32))
    args.update(over)
    return args


def _bwd(**over):
    a = _bwd_args(**{k: v for k, v in over.items() if k in ("do", "q", "k", "v", "o", "lse")})
    kw = {k: v for k, v in over.items() if k not in ("do", "q", "k", "v", "o", "lse")}
    return F.attention_backward(a["do"], a["q"], a["k"], a["v"], a["o"], a["lse"], **kw)


@pytest.fixture(autouse=True)
def _nothing_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*a, **k):
        raise AssertionError("a kernel module was requested for invalid input")

    monkeypatch.setattr(F, "get_module", boom)


q0, k0, v0 = _qkv()
CASES = [
    # (kwargs for attention_backward, error type, argument named)
    ({"q": q0.float()}, InputTypeError, "k"),  # mixed dtypes
    ({"q": q0.to(torch.complex64), "k": k0.to(torch.complex64), "v": v0.to(torch.complex64),
      "o": q0.to(torch.complex64), "do": q0.to(torch.complex64)}, InputTypeError, "q"),
    ({"q": q0.to(torch.int32)}, InputTypeError, "q"),
    ({"k": torch.randn(2, 9, 3, 32).half(), "v": torch.randn(2, 9, 3, 32).half()}, InputError, "k"),  # 3 kv heads, 2 q heads
    ({"v": v0[:, :5]}, InputError, "v"),  # Nk differs from k
    ({"q": q0[..., :16]}, InputError, "k"),  # head dim differs
    ({"q": q0[0]}, InputError, "q"),  # 3-D
    ({"q": torch.randn(2, 8, 2, 0).half(), "k": torch.randn(2, 9, 2, 0).half(), "v": torch.randn(2, 9, 2, 0).half(),
      "o": torch.randn(2, 8, 2, 0).half(), "do": torch.randn(2, 8, 2, 0).half()}, InputError, "head_dim"),
    ({"q": torch.randn(2, 8, 2, 512).half(), "k": torch.randn(2, 9, 2, 512).half(), "v": torch.randn(2, 9, 2, 512).half(),
      "o": torch.randn(2, 8, 2, 512).half(), "do": torch.randn(2, 8, 2, 512).half()}, InputError, "head_dim"),
    ({"q": torch.randn(2, 8, 64, 2).half().transpose(2, 3)}, InputError, "q"),  # non-contiguous last dim
    ({"k": torch.randn(2, 9, 32, 2).half().transpose(2, 3)}, InputError, "k"),
    ({"o": torch.randn(2, 8, 2, 32)}, InputTypeError, "o"),
    ({"do": torch.randn(2, 8, 2, 16).half()}, InputError, "do"),
    ({"lse": torch.zeros(2, 8, 2)}, InputError, "lse"),  # wrong layout
    ({"lse": torch.zeros(2, 2, 8, dtype=torch.float16)}, InputTypeError, "lse"),
    ({"lse": "zeros"}, InputTypeError, "lse"),
    ({"dropout_p": 1.0}, InputError, "dropout_p"),
    ({"dropout_p": -0.1}, InputError, "dropout_p"),
    ({"dropout_p": "0.1"}, InputError, "dropout_p"),
    ({"key_padding_mask": torch.ones(2, 8, dtype=torch.bool)}, InputError, "key_padding_mask"),
    ({"key_padding_mask": torch.ones(2, 9)}, InputTypeError, "key_padding_mask"),
    ({"key_padding_mask": torch.ones(2, 9, dtype=torch.bool, device="meta")}, InputError, "key_padding_mask"),
    ({"k": torch.randn(2, 9, 2, 32, device="meta").half()}, InputError, "k"),  # different devices
    ({"seed": -1}, InputError, "seed"),
    ({"offset": 2**64}, InputError, "offset"),
    ({"softmax_scale": float("nan")}, InputError, "softmax_scale"),
    ({"softmax_scale": 1e39}, InputError, "softmax_scale"),  # finite double, inf as the kernel's float32
    ({"softmax_scale": -3.5e38}, InputError, "softmax_scale"),
    ({"softmax_scale": "0.1"}, InputTypeError, "softmax_scale"),
    ({"causal": "False"}, InputTypeError, "causal"),  # truthy, but not a bool
    ({"causal": 1}, InputTypeError, "causal"),
    ({"causal": None}, InputTypeError, "causal"),
    ({"causal": torch.tensor(True)}, InputTypeError, "causal"),
]


@pytest.mark.parametrize("over, exc, argument", CASES)
def test_backward_rejects(over: dict, exc: type, argument: str) -> None:
    with pytest.raises(exc) as ei:
        _bwd(**over)
    assert argument in str(ei.value)
    assert isinstance(ei.value, (ValueError, TypeError))


@pytest.mark.parametrize("over, exc, argument", [c for c in CASES if not set(c[0]) & {"o", "do", "lse"}])
def test_forward_rejects(over: dict, exc: type, argument: str) -> None:
    q, k, v = _qkv()
    args = {"q": q, "k": k, "v": v, **over}
    kw = {n: val for n, val in args.items() if n not in ("q", "k", "v")}
    with pytest.raises(exc) as ei:
        F.attention_forward(args["q"], args["k"], args["v"], **kw)
    assert argument in str(ei.value)


def test_keep_mask_rejects() -> None:
    with pytest.raises(ValueError, match="dropout_p"):
        F.dropout_keep_mask(1, 1, 4, 4, 1.5)
    with pytest.raises(ValueError, match="seed"):
        F.dropout_keep_mask(1, 1, 4, 4, 0.5, seed=-3)


def test_explicit_spec_must_match_the_tensors() -> None:
    from fagen import KernelSpec

    q, k, v = _qkv()
    with pytest.raises(InputError, match="spec"):
        F.run_forward(KernelSpec(direction="bwd", head_dim=32), q, k, v)
    with pytest.raises(InputError, match="spec"):
        F.run_forward(KernelSpec(direction="fwd", head_dim=64), q, k, v)
    with pytest.raises(InputError, match="spec"):
        F.run_forward(KernelSpec(direction="fwd", head_dim=32, dtype="bfloat16"), q, k, v)
    with pytest.raises(InputError, match="key_padding_mask"):
        F.run_forward(KernelSpec(direction="fwd", head_dim=32, key_padding=True), q, k, v)
    with pytest.raises(InputError, match="dropout_p"):
        F.run_forward(KernelSpec(direction="fwd", head_dim=32), q, k, v, dropout_p=0.1)


# --------------------------------------------------------------------------- ops layer
def test_ops_reject_non_bool_flags_and_float32_overflowing_scales() -> None:
    from fagen import flash_attn_func, scaled_dot_product_attention

    q, k, v = _qkv()
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k[:, :8], v[:, :8]))
    bad = [
        (lambda: flash_attn_func(q, k, v, causal="False"), InputTypeError, "causal"),
        (lambda: flash_attn_func(q, k, v, causal=0), InputTypeError, "causal"),
        (lambda: flash_attn_func(q, k, v, softmax_scale=1e39), InputError, "softmax_scale"),
        (lambda: scaled_dot_product_attention(qt, kt, vt, is_causal="True"), InputTypeError, "is_causal"),
        (lambda: scaled_dot_product_attention(qt, kt, vt, enable_gqa="False"), InputTypeError, "enable_gqa"),
        (lambda: scaled_dot_product_attention(qt, kt, vt, scale=-1e39), InputError, "scale"),
    ]
    for call, exc, argument in bad:
        with pytest.raises(exc) as ei:
            call()
        assert ei.value.argument == argument


def test_numpy_bools_and_float32_max_scale_are_accepted() -> None:
    """numpy bool_ flags and a scale at float32's largest finite value pass (checked on meta: no launch)."""
    import numpy as np

    from fagen import flash_attn_func, scaled_dot_product_attention

    q, k, v = (t.to("meta") for t in _qkv())
    o, lse = F.attention_forward(q, k, v, causal=np.bool_(True), softmax_scale=3.4028235e38)
    assert o.shape == q.shape and lse.shape == (2, 2, 8)
    assert flash_attn_func(q, k, v, causal=np.bool_(False)).shape == q.shape
    qt = q.transpose(1, 2)
    assert scaled_dot_product_attention(qt, qt, qt, is_causal=np.bool_(True), enable_gqa=np.bool_(False)).shape == qt.shape


# --------------------------------------------------------------------------- meta tensors (shape propagation)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_functional_api_propagates_shapes_on_meta(dtype: torch.dtype) -> None:
    q, k, v = (t.to(dtype).to("meta") for t in _qkv())
    mask = torch.ones(2, 9, dtype=torch.bool, device="meta")
    o, lse = F.attention_forward(q, k, v, causal=True, key_padding_mask=mask, dropout_p=0.1)
    assert (o.device.type, o.shape, o.dtype) == ("meta", q.shape, dtype)
    assert (lse.device.type, lse.shape, lse.dtype) == ("meta", (2, 2, 8), torch.float32)
    dq, dk, dv = F.attention_backward(o, q, k, v, o, lse, causal=True, key_padding_mask=mask, dropout_p=0.1)
    assert [(t.device.type, t.shape, t.dtype) for t in (dq, dk, dv)] == [
        ("meta", q.shape, dtype), ("meta", k.shape, dtype), ("meta", v.shape, dtype)]


def test_ops_forward_and_backward_on_meta() -> None:
    """flash_attn_func and scaled_dot_product_attention run on meta, autograd included."""
    from fagen import flash_attn_func, scaled_dot_product_attention

    q, k, v = (t.to("meta").requires_grad_(True) for t in _qkv(torch.bfloat16))
    out = flash_attn_func(q, k, v, dropout_p=0.2, causal=True, key_padding_mask=torch.ones(2, 9, dtype=torch.bool, device="meta"))
    assert (out.device.type, out.shape, out.dtype) == ("meta", q.shape, torch.bfloat16)
    out.backward(torch.ones_like(out))
    assert [(t.grad.device.type, t.grad.shape) for t in (q, k, v)] == [("meta", q.shape), ("meta", k.shape), ("meta", v.shape)]

    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_(True) for t in (q, k, v))  # [B, H, N, d]
    out = scaled_dot_product_attention(qt, kt, vt, attn_mask=torch.ones(9, dtype=torch.bool, device="meta"))
    assert (out.device.type, out.shape) == ("meta", (2, 2, 8, 32))
    out.sum().backward()
    assert kt.grad.shape == kt.shape and kt.grad.device.type == "meta"


# --------------------------------------------------------------------------- 32-bit index limits
def _meta(*shape: int) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.float16, device="meta")  # no storage: any size


@pytest.mark.parametrize("which", ["q", "k"])
def test_sequence_lengths_beyond_int32_indexing_are_rejected(which: str) -> None:
    """The kernels index rows and keys with 32-bit ints (plus one tile of headroom); longer is an error."""
    n_ok, n_bad = F.SEQLEN_MAX, F.SEQLEN_MAX + 1
    for n, ok in ((n_ok, True), (n_bad, False), (2**31, False), (2**32 + 5, False)):
        q = _meta(1, n if which == "q" else 4, 1, 8)
        kv = _meta(1, n if which == "k" else 4, 1, 8)
        if ok:
            o, lse = F.attention_forward(q, kv, kv, causal=True)
            assert o.shape == q.shape
        else:
            with pytest.raises(InputError) as ei:
                F.attention_forward(q, kv, kv, causal=True)
            assert ei.value.argument == which and str(F.SEQLEN_MAX) in str(ei.value)


def test_huge_batch_times_heads_and_long_sequences_validate() -> None:
    """B*H > 2**31 and Nq + Nk > 2**31 are valid sizes: the kernels compute them in 64 bits (below)."""
    big = _meta(65535, 2, 65535, 8)
    assert big.shape[0] * big.shape[2] > 2**31
    o, lse = F.attention_forward(big, big, big)
    assert lse.shape == (65535, 65535, 2)
    q = _meta(1, F.SEQLEN_MAX, 1, 8)
    o, lse = F.attention_forward(q, q, q, causal=True)
    dq, dk, dv = F.attention_backward(o, q, q, q, o, lse, causal=True)
    assert dq.shape == q.shape


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_kernels_compute_bh_and_causal_bounds_in_64_bits(direction: str) -> None:
    """The emitted arithmetic that can exceed int32: b*heads+h (B*H up to 65535**2) and the
    causal bounds that add Nq and Nk (up to 2 * SEQLEN_MAX)."""
    import re

    from fagen import KernelSpec, render
    from fagen.families import family_names

    for impl in family_names():
        try:
            spec = KernelSpec(direction=direction, head_dim=64, causal=True, dropout=True, impl=impl)
        except ValueError:
            continue
        src = render(spec).source
        bh = re.findall(r"(\S+)\s+bh\s*=\s*([^;]*);", src)
        assert bh, f"{impl}/{direction}: no bh = ... in the source"
        for ctype, expr in bh:
            assert ctype == "long long" or "(long long)" in expr, f"{impl}/{direction}: 32-bit bh: {ctype} bh = {expr}"
        # (the Philox counter word is an unsigned int: B*H < 2**32 always fits it)
        assert not re.search(r"(?<!unsigned )\bint\s+bh\b", src), f"{impl}/{direction}: bh passed as a 32-bit int"
        # every expression that adds or subtracts the two sequence lengths (causal bounds) is 64-bit
        mixed = [line for line in (ln.split("//")[0] for ln in src.splitlines())
                 if re.search(r"seqlen_[qk]\s*[-+]\s*(?:\w+\.)?seqlen_[qk]", line)]
        assert mixed, f"{impl}/{direction}: no causal bound found"
        for line in mixed:
            # a cast on the line, or the sum's first operand is a variable declared long long
            first = re.search(r"=\s*\(?\s*([A-Za-z_]\w*)", line)
            declared = first and re.search(rf"long long\s+{first.group(1)}\b", src)
            assert "long long" in line or declared, f"{impl}/{direction}: 32-bit causal bound: {line.strip()}"
