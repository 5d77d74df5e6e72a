"""flash_attn_func's flash-attn features through the autograd op, on CPU (emulator):
GQA/MQA, sliding window, softcap, ALiBi, head dims that are not multiples of 8, deterministic
backward, return_attn_probs, float64 gradcheck, torch.compile, and the argument errors.

Expected values come from tests/featref.py (float64, written from flash-attn's docstrings);
the criterion is flash-attn's. Each Case is one fwd and one bwd spec, shared by the tests.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import pytest
import torch

import fagen.functional as F
from fagen import flash_attn_func
from fagen.errors import InputError, InputTypeError
from fagen.ops import attn_probs, draw_rng_state

import featref as R


@dataclass(frozen=True)
class Case:
    name: str
    dtype: torch.dtype
    head_dim: int
    heads: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: str | None = None  # None, "h" ([H]) or "bh" ([B, H])
    dropout_p: float = 0.0
    batch: int = 2

    def __str__(self) -> str:
        return self.name


CASES = [
    # GQA (2 q heads per kv head), causal + window (flash-attn: right = 0), head dim 59 -> padded to 64
    Case("gqa-causal-window-d59", torch.float16, 59, 4, 2, 40, 56, causal=True, window=(8, -1)),
    # MQA, ALiBi [H] with causal and Nq < Nk
    Case("mqa-alibi-causal", torch.bfloat16, 16, 3, 1, 24, 48, causal=True, alibi="h"),
    # softcap + ALiBi [B, H] + a two-sided window + dropout, head dim 20 -> 24, Nq > Nk
    Case("softcap-alibi-window-dropout-d20", torch.float32, 20, 2, 2, 45, 30, window=(6, 3), softcap=4.0,
         alibi="bh", dropout_p=0.15),
    # MQA alone needs no spec flag: the default family's plain fp16 kernels (the specs of test_ops)
    Case("mqa-plain", torch.float16, 32, 4, 1, 37, 70),
    # flash-attn's odd head dim 111 (padded to 112), causal with Nq < Nk
    Case("d111-causal", torch.float16, 111, 2, 2, 17, 29, causal=True),
]


def make_inputs(case: Case, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    B, H, Hkv, d = case.batch, case.heads, case.heads_kv, case.head_dim
    out = {
        "q": torch.randn(B, case.seqlen_q, H, d, generator=g).to(case.dtype),
        "k": torch.randn(B, case.seqlen_k, Hkv, d, generator=g).to(case.dtype),
        "v": torch.randn(B, case.seqlen_k, Hkv, d, generator=g).to(case.dtype),
        "do": torch.randn(B, case.seqlen_q, H, d, generator=g).to(case.dtype),
    }
    if case.alibi:
        shape = (H,) if case.alibi == "h" else (B, H)
        out["alibi"] = torch.rand(shape, generator=g) * 0.5 + 0.05
    return out


def run_fagen(case: Case, t: dict[str, torch.Tensor], rng_seed: int = 0, deterministic: bool = False):
    """flash_attn_func + backward: (out, lse, S_dmask, dq, dk, dv, rng_state)."""
    q, k, v = (t[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v"))
    torch.manual_seed(rng_seed)
    rng = draw_rng_state() if case.dropout_p else torch.zeros(2, dtype=torch.int64)
    torch.manual_seed(rng_seed)
    out, lse, s_dmask = flash_attn_func(q, k, v, case.dropout_p, None, case.causal, case.window, case.softcap,
                                        t.get("alibi"), deterministic, True)
    out.backward(t["do"])
    return out.detach(), lse, s_dmask, q.grad, k.grad, v.grad, rng


def oracle_kwargs(case: Case, t: dict[str, torch.Tensor], rng: torch.Tensor) -> dict:
    keep = None
    if case.dropout_p:
        keep = F.dropout_keep_mask(case.batch, case.heads, case.seqlen_q, case.seqlen_k, case.dropout_p,
                                   seed=int(rng[0]), offset=int(rng[1]))
    return dict(causal=case.causal, window=case.window, softcap=case.softcap, alibi=t.get("alibi"), keep=keep,
                dropout_p=case.dropout_p)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_outputs_and_gradients_match_the_float64_oracle(case: Case) -> None:
    t = make_inputs(case)
    out, lse, s_dmask, dq, dk, dv, rng = run_fagen(case, t, rng_seed=3)
    kw = oracle_kwargs(case, t, rng)
    o64, lse64, g64 = R.run_oracle(t, ("q", "k", "v"), t["do"], torch.float64, **kw)
    o_pt, _, g_pt = R.run_oracle(t, ("q", "k", "v"), t["do"], case.dtype, **kw)
    R.assert_close("out", out, o64, o_pt, case.dtype)
    for name, ours in (("q", dq), ("k", dk), ("v", dv)):
        assert ours.dtype == case.dtype
        R.assert_close(f"d{name}", ours, g64[name], g_pt[name], case.dtype)
    # lse: flash-attn's [B, H, Nq], -inf exactly on rows that see no key
    assert lse.shape == (case.batch, case.heads, case.seqlen_q) and lse.dtype == torch.float32
    lse32 = R.attention(*(t[n].float() for n in "qkv"), **kw)[1]
    e_lse = R.assert_lse_close("lse", lse, lse64, lse32)
    finite = torch.isfinite(lse64)
    # S_dmask: the probabilities, negative where dropout dropped the pair; a row sums to
    # exp(lse64 - lse) up to one rounding to q's dtype per element
    assert s_dmask.shape == (case.batch, case.heads, case.seqlen_q, case.seqlen_k)
    rows = s_dmask.double().abs().sum(-1)
    atol = torch.finfo(case.dtype).eps / 2 + 2 * e_lse + 4 * R.EPS32
    assert R.max_err(rows[finite], torch.ones_like(rows[finite])) <= atol
    if case.dropout_p:
        assert torch.equal(s_dmask < 0, ~kw["keep"] & (s_dmask != 0))


def test_keys_outside_the_window_take_no_part() -> None:
    """Keys outside every row's window may hold NaN in k: their scores never reach a softmax."""
    case = CASES[0]
    t = make_inputs(case)
    k = t["k"].clone()
    k[:, :4] = float("nan")  # row i sees keys >= i + (56 - 40) - 8 >= 8 only
    out = flash_attn_func(t["q"], k, t["v"], causal=True, window_size=(8, -1))
    assert not torch.isnan(out).any()
    ref = flash_attn_func(t["q"], t["k"], t["v"], causal=True, window_size=(8, -1))
    assert torch.equal(out, ref)


def test_causal_folds_into_the_window_right_side_as_flash_attn() -> None:
    """flash-attn: causal=True sets window_size[1] = 0, whatever was passed."""
    case = CASES[0]
    t = make_inputs(case)
    a = flash_attn_func(t["q"], t["k"], t["v"], causal=True, window_size=(8, -1))
    b = flash_attn_func(t["q"], t["k"], t["v"], causal=True, window_size=(8, 5))
    assert torch.equal(a, b)


def test_deterministic_backward_is_reproducible_and_matches() -> None:
    case = CASES[0]
    t = make_inputs(case)
    first = run_fagen(case, t, deterministic=True)
    again = run_fagen(case, t, deterministic=True)
    for a, b in zip(first[3:6], again[3:6]):
        assert torch.equal(a, b)
    o64, _, g64 = R.run_oracle(t, ("q", "k", "v"), t["do"], torch.float64, **oracle_kwargs(case, t, first[6]))
    _, _, g_pt = R.run_oracle(t, ("q", "k", "v"), t["do"], case.dtype, **oracle_kwargs(case, t, first[6]))
    for name, ours in zip("qkv", first[3:6]):
        R.assert_close(f"d{name}", ours, g64[name], g_pt[name], case.dtype)


def test_attn_probs_is_the_documented_recomputation() -> None:
    """S_dmask from attn_probs equals the oracle's probabilities (dropped pairs negated)."""
    case = CASES[2]
    t = make_inputs(case)
    out, lse, s_dmask, *_, rng = run_fagen(case, t, rng_seed=4)
    kw = oracle_kwargs(case, t, rng)
    keep, p = kw.pop("keep"), kw.pop("dropout_p")
    again = attn_probs(t["q"], t["k"], lse, rng, dropout_p=case.dropout_p, window_size=case.window,
                       softcap=case.softcap, alibi_slopes=t["alibi"])
    assert torch.equal(again, s_dmask)

    # the oracle's probabilities: its output for v = the identity (o[b, i, h, j] = P[b, h, i, j])
    def probs(dtype: torch.dtype) -> torch.Tensor:
        eye = torch.eye(case.seqlen_k, dtype=dtype)[None, :, None, :].expand(case.batch, -1, case.heads_kv, -1)
        o, _ = R.attention(t["q"].to(dtype), t["k"].to(dtype), eye, **kw)
        return o.permute(0, 2, 1, 3) * torch.where(keep, 1.0, -1.0).to(dtype)  # dropped pairs negated

    p64 = probs(torch.float64)
    R.assert_close("S_dmask", s_dmask, p64, probs(case.dtype), case.dtype)
    # the kept probabilities reproduce the output: out = relu(S_dmask) / (1 - p) @ v, as out itself does
    o64, _ = R.attention(*(t[n].double() for n in "qkv"), keep=keep, dropout_p=p, **kw)
    o_from_s = torch.einsum("bhij,bjhd->bihd", s_dmask.double().clamp(min=0) / (1 - p), t["v"].double())
    R.assert_close("out from S_dmask", o_from_s, o64, out, case.dtype)


@pytest.mark.parametrize("align", ["bottom_right", "top_left"])
def test_the_oracle_agrees_with_fagen_reference(align: str) -> None:
    """tests/featref.py (autograd) and fagen.reference (explicit backward) state the same semantics:
    GQA, causal + window, softcap, ALiBi [B, H], bool mask, bias (and its gradient), dropout."""
    from fagen import reference as FR

    g = torch.Generator().manual_seed(9)
    B, H, Hkv, Nq, Nk, d = 2, 4, 2, 9, 13, 8
    q, do = (torch.randn(B, Nq, H, d, dtype=torch.float64, generator=g) for _ in range(2))
    k, v = (torch.randn(B, Nk, Hkv, d, dtype=torch.float64, generator=g) for _ in range(2))
    slopes, bias = torch.rand(B, H, generator=g), torch.randn(H, 1, Nk, dtype=torch.float64, generator=g)
    mask = torch.rand(B, 1, Nq, Nk, generator=g) > 0.2
    keep = torch.rand(B, H, Nq, Nk, generator=g) > 0.1
    kw = dict(causal=True, window=(4, -1), softcap=3.0, alibi=slopes, mask=mask, keep=keep, dropout_p=0.1,
              align=align)
    o, lse, grads = R.run_oracle({"q": q, "k": k, "v": v, "bias": bias}, ("q", "k", "v", "bias"), do,
                                 torch.float64, **kw)
    rkw = dict(causal=True, window_size=(4, -1), softcap=3.0, alibi_slopes=slopes, attn_mask=mask, attn_bias=bias,
               keep_mask=keep, dropout_p=0.1, causal_align=align)
    o_r, lse_r = FR.attention_forward_ref(q, k, v, **rkw)
    assert R.max_err(o, o_r) <= 1e-12 and torch.equal(torch.isinf(lse), torch.isinf(lse_r))
    assert R.max_err(lse[torch.isfinite(lse)], lse_r[torch.isfinite(lse_r)]) <= 1e-12
    dq, dk, dv, dbias = FR.attention_backward_ref(do, q, k, v, o_r, lse_r, bias_requires_grad=True, **rkw)
    for name, ref in (("q", dq), ("k", dk), ("v", dv), ("bias", dbias)):
        assert R.max_err(grads[name], ref) <= 1e-10, name


# --------------------------------------------------------------------------- float64 gradcheck (SIMT)
def test_gradcheck_float64_gqa_window_softcap_alibi() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 5, 2, 6, dtype=torch.float64, generator=g, requires_grad=True)  # d = 6 -> 8
    k = torch.randn(1, 7, 1, 6, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(1, 7, 1, 6, dtype=torch.float64, generator=g, requires_grad=True)
    slopes = torch.tensor([0.3, 0.1])

    def fn(q, k, v):
        return flash_attn_func(q, k, v, 0.0, None, True, (3, -1), 2.0, slopes)

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5)
    scale = float(torch.tensor(6 ** -0.5, dtype=torch.float32))  # the kernels take the scale as a float
    o64, _ = R.attention(q.detach(), k.detach(), v.detach(), causal=True, window=(3, -1), softcap=2.0, alibi=slopes,
                         scale=scale)
    assert R.max_err(fn(q, k, v), o64) <= 1e-10


# --------------------------------------------------------------------------- torch.compile
def test_torch_compile_fullgraph_with_features() -> None:
    case = CASES[1]
    t = make_inputs(case)

    def step(fn):
        q, k, v = (t[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v"))
        o = fn(q, k, v)
        o.backward(t["do"])
        return [o.detach(), q.grad, k.grad, v.grad]

    def attn(q, k, v):
        return flash_attn_func(q, k, v, causal=True, alibi_slopes=t["alibi"])

    torch._dynamo.reset()
    got = step(torch.compile(attn, fullgraph=True, backend="aot_eager"))
    want = step(attn)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_opcheck_with_features() -> None:
    """fagen::fwd / fagen::bwd with GQA, causal and ALiBi; and with an additive bias and its gradient."""
    case = CASES[1]
    t = make_inputs(case)
    q, k, v = (t[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v"))
    opts = (-1, -1, 0.0, t["alibi"], None, None, "bottom_right", None, None, None, None, False)
    torch.library.opcheck(torch.ops.fagen.fwd.default, (q, k, v, None, 0.0, None, True, *opts))
    o, lse, rng, _lo = torch.ops.fagen.fwd(q.detach(), k.detach(), v.detach(), None, 0.0, None, True, *opts)
    torch.library.opcheck(torch.ops.fagen.bwd.default,
                          (t["do"], q.detach(), k.detach(), v.detach(), o, lse, None, 0.0, None, True, rng, *opts))
    # float32, d = 16, an additive [Nq, Nk] bias that requires grad: the specs of tests/test_sdpa.py
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, n, 2, 16, generator=g).requires_grad_(True) for n in (24, 40, 40))
    bias = torch.randn(24, 40, generator=g, requires_grad=True)
    opts = (-1, -1, 0.0, None, None, bias, "bottom_right", None, None, None, None, False)
    torch.library.opcheck(torch.ops.fagen.fwd.default, (q, k, v, None, 0.0, None, False, *opts))
    with torch.no_grad():
        o, lse, rng, _lo = torch.ops.fagen.fwd(q, k, v, None, 0.0, None, False, *opts)
    do = torch.randn(o.shape, generator=g)
    args = (do, q.detach(), k.detach(), v.detach(), o, lse, None, 0.0, None, False, rng, *opts[:5], bias.detach(),
            *opts[6:], True)
    torch.library.opcheck(torch.ops.fagen.bwd.default, args)
    dbias = torch.ops.fagen.bwd(*args)[3]
    assert dbias.shape == bias.shape and dbias.dtype == bias.dtype


# --------------------------------------------------------------------------- signature and errors
def test_signature_is_flash_attn_positional_order() -> None:
    params = list(inspect.signature(flash_attn_func).parameters.values())
    assert [p.name for p in params] == ["q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size",
                                        "softcap", "alibi_slopes", "deterministic", "return_attn_probs",
                                        "key_padding_mask", "sinks", "return_lse"]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[-3:])
    q = torch.zeros(1, 2, 1, 8)
    with pytest.raises(TypeError):
        flash_attn_func(q, q, q, 0.0, None, False, (-1, -1), 0.0, None, False, False, None)


def _qkv(H: int = 2, Hkv: int = 2, d: int = 16) -> tuple[torch.Tensor, ...]:
    return torch.randn(2, 8, H, d), torch.randn(2, 9, Hkv, d), torch.randn(2, 9, Hkv, d)


@pytest.mark.parametrize("kwargs, error, argument", [
    ({"window_size": (-2, 0)}, InputError, "window_size"),
    ({"window_size": 4}, InputTypeError, "window_size"),
    ({"window_size": (1.5, 2)}, InputTypeError, "window_size"),
    ({"softcap": -1.0}, InputError, "softcap"),
    ({"softcap": float("inf")}, InputError, "softcap"),
    ({"softcap": "1"}, InputTypeError, "softcap"),
    ({"alibi_slopes": torch.ones(2, dtype=torch.float16)}, InputTypeError, "alibi_slopes"),
    ({"alibi_slopes": torch.ones(3)}, InputError, "alibi_slopes"),
    ({"alibi_slopes": torch.ones(2, 2, 1)}, InputError, "alibi_slopes"),
    ({"alibi_slopes": [0.5, 0.25]}, InputTypeError, "alibi_slopes"),
    ({"deterministic": "yes"}, InputTypeError, "deterministic"),
    ({"return_attn_probs": 1}, InputTypeError, "return_attn_probs"),
])
def test_feature_argument_errors(kwargs: dict, error: type, argument: str) -> None:
    q, k, v = _qkv()
    with pytest.raises(error) as err:
        flash_attn_func(q, k, v, **kwargs)
    assert err.value.argument == argument


def test_gqa_and_head_dim_errors() -> None:
    q, k, v = _qkv(H=4, Hkv=3)
    with pytest.raises(InputError) as err:
        flash_attn_func(q, k, v)
    assert err.value.argument == "k" and "multiple" in str(err.value)
    q, k, v = _qkv(d=264)
    with pytest.raises(InputError) as err:
        flash_attn_func(q, k, v)
    assert err.value.argument == "q" and "256" in str(err.value)


def _call_with(feature: str) -> None:
    q, k, v = _qkv()
    if feature == "softcap":
        flash_attn_func(q, k, v, softcap=3.0)
    elif feature == "window":
        flash_attn_func(q, k, v, window_size=(2, 2))
    elif feature == "alibi":
        flash_attn_func(q, k, v, alibi_slopes=torch.ones(2))
    elif feature == "float64":
        flash_attn_func(q.double(), k.double(), v.double())
    elif feature == "varlen":
        cu = torch.tensor([0, 3, 8], dtype=torch.int32)
        from fagen import flash_attn_varlen_func

        flash_attn_varlen_func(q[0], k[0, :8], v[0, :8], cu, cu, 5, 5)
    elif feature == "bias":  # SDPA's float mask: the error names attn_mask, SDPA's argument
        from fagen import scaled_dot_product_attention

        scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                     attn_mask=torch.zeros(8, 9))


@pytest.mark.parametrize("feature, error, argument", [
    ("softcap", InputError, "softcap"), ("window", InputError, "window_size"), ("alibi", InputError, "alibi_slopes"),
    ("float64", InputTypeError, "q"), ("varlen", InputError, "cu_seqlens_q"), ("bias", InputError, "attn_mask"),
])
def test_a_feature_no_family_implements_is_an_error_naming_it(feature: str, error: type, argument: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """With no family implementing the feature, the call fails before any launch, naming the argument."""
    import fagen.spec

    real = fagen.spec.feature_reason
    monkeypatch.setattr(fagen.spec, "feature_reason",
                        lambda fam, wanted: f"no {feature} here" if feature in wanted else real(fam, wanted))
    monkeypatch.setattr(F, "get_module", lambda *a: pytest.fail("a kernel module was requested"))
    F._default_spec.cache_clear()
    try:
        with pytest.raises(error) as err:
            _call_with(feature)
        assert err.value.argument == argument and f"no {feature} here" in str(err.value)
    finally:
        F._default_spec.cache_clear()
