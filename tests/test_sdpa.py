"""fagen.scaled_dot_product_attention against torch's own (math path, float64 as the reference):
bool and float attn_mask of several broadcast shapes (the float mask's gradient included),
is_causal top-left with Nq != Nk, enable_gqa, 3-D and 5-D inputs, float64 gradcheck and
torch.compile. float32, d = 16: the specs are shared by the tests of this file.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as TF

from fagen import scaled_dot_product_attention as sdpa
from fagen.errors import InputError

import featref as R

B, H, NQ, NK, D = 2, 2, 24, 40, 16


def qkv(*lead: int, heads_kv: int = H, nq: int = NQ, nk: int = NK, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*lead, H, nq, D, generator=g).to(dtype)
    k = torch.randn(*lead, heads_kv, nk, D, generator=g).to(dtype)
    v = torch.randn(*lead, heads_kv, nk, D, generator=g).to(dtype)
    do = torch.randn(*lead, H, nq, D, generator=g).to(dtype)
    return q, k, v, do


def compare(inputs: dict[str, torch.Tensor], do: torch.Tensor, grads_of: tuple[str, ...], **kw) -> None:
    """fagen vs torch SDPA: outputs and gradients (flash-attn's criterion, float64 torch as the reference)."""
    results = {}
    for who, dtype in (("ours", None), ("ref", torch.float64), ("pt", None)):
        leaves = {n: t.detach().to(dtype or t.dtype).requires_grad_(n in grads_of) for n, t in inputs.items()}
        fn = sdpa if who == "ours" else TF.scaled_dot_product_attention
        out = fn(leaves["q"], leaves["k"], leaves["v"], attn_mask=leaves.get("mask"), **kw)
        out.backward(do.to(out.dtype))
        results[who] = [out.detach()] + [leaves[n].grad for n in grads_of]
    for name, ours, ref, pt in zip(("out",) + grads_of, results["ours"], results["ref"], results["pt"]):
        assert ours.dtype == (inputs[name] if name in inputs else inputs["q"]).dtype, name
        R.assert_close(name, ours, ref, pt, torch.float32)


# --------------------------------------------------------------------------- masks
@pytest.mark.parametrize("shape", [(NQ, NK), (B, 1, NQ, NK), (1, H, 1, NK), (B, H, NQ, NK), (B, 1, 1, NK), (1, NK)],
                         ids=str)
def test_bool_attn_mask_broadcast_shapes(shape: tuple[int, ...]) -> None:
    q, k, v, do = qkv(B)
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(1)) > 0.4
    mask[..., 0] = True  # every row keeps a key (torch gives NaN rows otherwise)
    compare({"q": q, "k": k, "v": v, "mask": mask}, do, ("q", "k", "v"))


@pytest.mark.parametrize("shape", [(B, H, NQ, NK), (NQ, NK), (H, 1, NK), (B, 1, 1, 1)], ids=str)
def test_float_attn_mask_and_its_gradient(shape: tuple[int, ...]) -> None:
    q, k, v, do = qkv(B)
    bias = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    compare({"q": q, "k": k, "v": v, "mask": bias}, do, ("q", "k", "v", "mask"))


def test_float_attn_mask_is_read_with_broadcast_strides() -> None:
    """A [1, 1, 1, Nk] bias expanded to [B, H, Nq, Nk] runs without materialising (same result as the
    expanded copy), and a non-contiguous bias view is read through its strides."""
    q, k, v, _ = qkv(B)
    row = torch.randn(1, 1, 1, NK)
    a = sdpa(q, k, v, attn_mask=row)
    b = sdpa(q, k, v, attn_mask=row.expand(B, H, NQ, NK).contiguous())
    assert torch.equal(a, b)
    full = torch.randn(B, H, NK, NQ).transpose(-1, -2)  # [B, H, Nq, Nk] with a transposed layout
    assert torch.equal(sdpa(q, k, v, attn_mask=full), sdpa(q, k, v, attn_mask=full.contiguous()))


def test_fully_masked_rows_are_zero() -> None:
    """torch gives NaN for a row with no key left; fagen gives 0 (and zero gradients)."""
    q, k, v, _ = qkv(B)
    mask = torch.ones(NQ, NK, dtype=torch.bool)
    mask[3] = False
    q.requires_grad_(True)
    out = sdpa(q, k, v, attn_mask=mask)
    assert torch.equal(out[:, :, 3], torch.zeros_like(out[:, :, 3]))
    out.sum().backward()
    assert torch.equal(q.grad[:, :, 3], torch.zeros_like(q.grad[:, :, 3]))


# --------------------------------------------------------------------------- causal, GQA, layouts
@pytest.mark.parametrize("nq, nk, heads_kv", [(NQ, NK, H), (NK, NQ, H), (NQ, NK, 1)], ids=["q<k", "q>k", "gqa"])
def test_is_causal_top_left_and_gqa(nq: int, nk: int, heads_kv: int) -> None:
    q, k, v, do = qkv(B, heads_kv=heads_kv, nq=nq, nk=nk)
    compare({"q": q, "k": k, "v": v}, do, ("q", "k", "v"), is_causal=True, enable_gqa=heads_kv != H)


@pytest.mark.parametrize("lead", [(), (2, 3)], ids=["3d", "5d"])
def test_any_leading_batch_dims(lead: tuple[int, ...]) -> None:
    q, k, v, do = qkv(*lead)
    compare({"q": q, "k": k, "v": v}, do, ("q", "k", "v"), is_causal=True, scale=0.4)
    if lead:  # a mask over the leading dims as well
        mask = torch.rand(lead[0], 1, 1, NQ, NK, generator=torch.Generator().manual_seed(3)) > 0.3
        mask[..., 0] = True
        compare({"q": q, "k": k, "v": v, "mask": mask}, do, ("q", "k", "v"))


def test_gradcheck_float64_with_a_float_mask() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 5, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(1, 1, 6, 8, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(1, 1, 6, 8, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(2, 1, 6, dtype=torch.float64, generator=g, requires_grad=True)

    def fn(q, k, v, bias):
        return sdpa(q, k, v, attn_mask=bias, enable_gqa=True)

    assert torch.autograd.gradcheck(fn, (q, k, v, bias), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_torch_compile_fullgraph_with_a_float_mask() -> None:
    q, k, v, do = qkv(B)
    bias = torch.randn(NQ, NK)

    def step(fn):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, bias)]
        out = fn(*leaves)
        out.backward(do)
        return [out.detach()] + [t.grad for t in leaves]

    def attn(q, k, v, m):
        return sdpa(q, k, v, attn_mask=m)

    torch._dynamo.reset()
    for a, b in zip(step(torch.compile(attn, fullgraph=True, backend="aot_eager")), step(attn)):
        assert torch.equal(a, b)


def test_value_may_have_its_own_head_dim() -> None:
    """As torch's: value [..., Nk, Ev] -> out [..., Nq, Ev] (fagen: the SIMT family); other dims must match."""
    q, k, v, _ = qkv(B)
    out = sdpa(q, k, v[..., :8], is_causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v[..., :8], is_causal=True)
    assert out.shape == ref.shape and (out - ref).abs().max() <= 1e-5
    with pytest.raises(InputError) as err:
        sdpa(q, k, v[..., :-1, :])
    assert err.value.argument == "value"


# --------------------------------------------------------------------------- torch's own mask types
@pytest.mark.filterwarnings("ignore:Lower right causal bias:UserWarning")
@pytest.mark.parametrize("variant", ["causal_upper_left", "causal_lower_right"])
@pytest.mark.parametrize("nq,nk", [(64, 64), (23, 56), (40, 24)], ids=str)
def test_causal_bias_as_torch_reads_it(variant: str, nq: int, nk: int) -> None:
    """torch.nn.attention.bias.CausalBias: upper-left = top-left causal, lower-right =
    bottom-right; values and gradients as torch's SDPA, a plain tensor out, no N x N mask."""
    from torch.nn.attention import bias as tb

    q, k, v, do = qkv(B, nq=nq, nk=nk)
    mask = getattr(tb, variant)(nq, nk)
    results = []
    for fn, dtype in ((sdpa, torch.float32), (TF.scaled_dot_product_attention, torch.float64)):
        leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
        out = fn(*leaves, attn_mask=mask)
        out.backward(do.to(dtype))
        results.append([out.detach()] + [t.grad for t in leaves])
    assert type(results[0][0]) is torch.Tensor
    rows_without_keys = variant == "causal_lower_right" and nq > nk  # torch's math path gives NaN there
    for name, ours, ref in zip(("out", "dq", "dk", "dv"), *results):
        if rows_without_keys and name in ("out", "dq"):
            ours, ref = ours[..., nq - nk:, :], ref[..., nq - nk:, :]
        torch.testing.assert_close(ours.double(), ref, rtol=2e-4, atol=2e-5, msg=name)


def test_causal_bias_errors() -> None:
    from torch.nn.attention.bias import causal_lower_right, causal_upper_left

    q, k, v, _ = qkv(B)
    with pytest.raises(InputError, match="^is_causal"):
        sdpa(q, k, v, attn_mask=causal_upper_left(NQ, NK), is_causal=True)
    with pytest.raises(InputError, match="^attn_mask: .*CausalBias of \\[Nq, Nk\\] = \\[24, 40\\]"):
        sdpa(q, k, v, attn_mask=causal_lower_right(NQ, NK + 1))


def test_fully_masked_rows_are_zero_as_torch_fused_kernels_give() -> None:
    """A query row that may attend to no key: 0 out and zero gradients through it, what torch's
    fused CUDA kernels and (since _safe_softmax) its math backend return."""
    q, k, v, do = qkv(B)
    mask = torch.rand(NQ, NK, generator=torch.Generator().manual_seed(5)) > 0.5
    mask[3] = False
    mask[:, 0] = mask[:, 0] | (torch.arange(NQ) != 3)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = sdpa(*leaves, attn_mask=mask)
    out.backward(do)
    assert not out[..., 3, :].any() and not leaves[0].grad[..., 3, :].any()
    ref = TF.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out.detach()[..., 3, :], ref[..., 3, :])
