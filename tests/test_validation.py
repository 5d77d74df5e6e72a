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
    ({"q": q0.double(), "k": k0.double(), "v": v0.double(), "o": q0.double(), "do": q0.double()}, InputTypeError, "q"),
    ({"q": q0.to(torch.int32)}, InputTypeError, "q"),
    ({"k": k0[:, :, :1]}, InputError, "k"),  # heads differ
    ({"v": v0[:, :5]}, InputError, "v"),  # Nk differs from k
    ({"q": q0[..., :16]}, InputError, "k"),  # head dim differs
    ({"q": q0[0]}, InputError, "q"),  # 3-D
    ({"q": torch.randn(2, 8, 2, 12).half(), "k": torch.randn(2, 9, 2, 12).half(), "v": torch.randn(2, 9, 2, 12).half(),
      "o": torch.randn(2, 8, 2, 12).half(), "do": torch.randn(2, 8, 2, 12).half()}, InputError, "head_dim"),
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
