"""fagen as a transformers attention implementation: tiny random-init models vs attn_implementation="sdpa".

CPU (emulator), no downloads: every model has head_dim 16, so all of them share a handful of kernels.
"""
from __future__ import annotations

import copy
import importlib
import sys
from typing import Any

import pytest
import torch

import fagen.integrations.transformers as ft
from fagen.reference import mask_matrix

try:
    import transformers as tr
    import transformers.masking_utils as mu
except ImportError:  # the extra is not installed: only the tests of that case run
    tr = mu = None
needs_transformers = pytest.mark.skipif(tr is None, reason="the transformers extra is not installed")

VOCAB = 96
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64, attention_dropout=0.0)
CONFIGS: dict[str, Any] = {
    "llama-mha": lambda: tr.LlamaConfig(**SMALL, num_key_value_heads=4),
    "llama-gqa": lambda: tr.LlamaConfig(**SMALL, num_key_value_heads=2),
    "gpt2": lambda: tr.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                  attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0),
    "qwen2-window": lambda: tr.Qwen2Config(**SMALL, num_key_value_heads=2, use_sliding_window=True, sliding_window=6,
                                           max_window_layers=1),
    "mistral-window": lambda: tr.MistralConfig(**SMALL, num_key_value_heads=2, sliding_window=6),
}


@pytest.fixture(scope="module")
def name() -> str:
    if tr is None:
        pytest.skip("the transformers extra is not installed")
    return ft.register()


class _Recorder:
    """Wraps the registered mask function to see what it hands the attention."""

    def __init__(self) -> None:
        self.masks: list[ft.FagenMask] = []

    def __call__(self, *args: Any, **kwargs: Any) -> ft.FagenMask:
        m = ft.mask_function(*args, **kwargs)
        self.masks.append(m)
        return m


@pytest.fixture
def recorder(name: str) -> Any:
    rec = _Recorder()
    tr.AttentionMaskInterface.register(name, rec)
    yield rec
    tr.AttentionMaskInterface.register(name, ft.mask_function)


def _pair(key: str, name: str, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    torch.manual_seed(0)
    cfg = CONFIGS[key]()
    ref = tr.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa", dtype=dtype)
    ours = tr.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=name, dtype=dtype)
    ours.load_state_dict(ref.state_dict())
    assert ours.config._attn_implementation == name and ref.config._attn_implementation == "sdpa"
    return ref.eval(), ours.eval()


def _batch(B: int = 2, N: int = 14, pad: int = 5, left: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (B, N), generator=g)
    am = torch.ones(B, N, dtype=torch.long)
    if left:
        am[1, :pad] = 0
    else:
        am[1, N - pad:] = 0
    return ids, am


# --------------------------------------------------------------------------- no kernels: the mask function
def _dense(m: ft.FagenMask, B: int, Nq: int, Nk: int) -> torch.Tensor:
    if m.dense is not None:
        return m.dense.expand(B, 1, Nq, Nk)
    return mask_matrix(B, Nq, Nk, causal=m.causal, key_padding_mask=m.key_padding_mask,
                       window_size=(m.window_left, 0 if m.causal else -1), causal_align=m.causal_align)


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("q_len,kv_len,q_off,kv_off", [
    (7, 7, 0, 0),      # no cache
    (3, 10, 7, 0),     # dynamic cache, chunk after a prefix (bottom-right)
    (1, 10, 9, 0),     # dynamic cache, decoding
    (5, 12, 0, 0),     # static cache prefill (top-left)
    (1, 12, 4, 0),     # static cache decoding: neither alignment, folded into the key mask
    (2, 4, 9, 7),      # sliding-window cache: offset keys (bottom-right)
])
@needs_transformers
@pytest.mark.parametrize("tensor_offset", [False, True])
def test_mask_function_matches_transformers_mask(window: int, q_len: int, kv_len: int, q_off: int, kv_off: int,
                                                 tensor_offset: bool) -> None:
    B = 2
    am = torch.ones(B, q_off + q_len, dtype=torch.bool)  # the 2-D mask covers the tokens seen so far
    am[1, :2] = False
    fn = mu.sliding_window_causal_mask_function(window) if window else mu.causal_mask_function
    q_offset: Any = torch.tensor(q_off) if tensor_offset else q_off
    kw = dict(batch_size=B, q_length=q_len, kv_length=kv_len, q_offset=q_offset, kv_offset=kv_off, mask_function=fn,
              attention_mask=am)
    m = ft.mask_function(**kw)
    want = mu.sdpa_mask(**kw, allow_is_causal_skip=False)
    assert torch.equal(_dense(m, B, q_len, kv_len), want.expand(B, 1, q_len, kv_len))
    # a cache position held in a tensor (static cache) is read without a host sync: parameters for a
    # single query, transformers' 4-D mask otherwise
    assert (m.dense is None) == (not tensor_offset or q_len == 1), m


@needs_transformers
def test_mask_function_bidirectional_and_unknown_patterns() -> None:
    am = torch.tensor([[True] * 6, [False, False] + [True] * 4])
    m = ft.mask_function(2, 6, 6, mask_function=mu.bidirectional_mask_function, attention_mask=am)
    assert m.dense is None and not m.causal and torch.equal(m.key_padding_mask, am)
    # packed sequences (found from position_ids): a pattern the parameters cannot express -> the 4-D mask
    packed = mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(torch.tensor([[0, 0, 0, 1, 1, 1]])))
    m = ft.mask_function(1, 6, 6, mask_function=packed)
    assert m.dense is not None and m.dense.shape == (1, 1, 6, 6) and m.shape == (1, 1, 6, 6)
    assert not m.dense[0, 0, 3, :3].any() and m.dense[0, 0, 4, 3:5].all()
    assert ft.mask_function(1, 4, 4, attention_mask=m) is m  # a prepared mask passes through


@needs_transformers
def test_packed_sequences_become_varlen() -> None:
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    ids = mu.find_packed_sequence_indices(pos)
    for base, left in ((mu.causal_mask_function, -1), (mu.sliding_window_causal_mask_function(2), 1)):
        fn = mu.and_masks(mu.remap_positions_for_packed_sequence(base, pos), mu.packed_sequence_mask_function(ids))
        m = ft.mask_function(2, 6, 6, mask_function=fn)
        assert m.dense is None and m.causal and m.window_left == left
        assert m.cu_seqlens.dtype == torch.int32 and m.cu_seqlens.tolist() == [0, 3, 5, 6, 12] + [12] * 8


def test_missing_transformers_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'fagen\[transformers\]'"):
        ft.register()


@needs_transformers
def test_old_transformers_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # the module register() imports now (another test may have re-imported transformers since this file did)
    monkeypatch.setattr(importlib.import_module("transformers"), "__version__", "4.57.1")
    with pytest.raises(ImportError, match=r"transformers>=5.24,<6, found 4.57.1"):
        ft.register()


@pytest.mark.parametrize("bad", ["", "sdpa", "flash_attention_2", 3])
def test_register_rejects_builtin_names(bad: Any) -> None:
    with pytest.raises(ValueError, match="name"):
        ft.register(bad)


def test_position_bias_is_refused() -> None:
    q = torch.zeros(1, 2, 3, 8)
    with pytest.raises(ValueError, match="position_bias"):
        ft.attention_forward(torch.nn.Module(), q, q, q, None, position_bias=torch.zeros(1, 2, 3, 3))


# --------------------------------------------------------------------------- models (emulator kernels)
@needs_transformers
@pytest.mark.parametrize("key", list(CONFIGS))
def test_logits_match_sdpa_padded(key: str, name: str, recorder: _Recorder) -> None:
    ref, ours = _pair(key, name)
    ids, am = _batch()
    with torch.no_grad():
        want = ref(ids, attention_mask=am).logits
        got = ours(ids, attention_mask=am).logits
    valid = am.bool()
    err = (got - want)[valid].abs().max().item()
    assert err <= 1e-4, err
    assert recorder.masks and all(m.dense is None for m in recorder.masks), recorder.masks
    if "window" in key:
        assert any(m.window_left == 5 for m in recorder.masks)


@needs_transformers
def test_gemma2_softcap_and_window_match_eager(name: str, recorder: _Recorder) -> None:
    """Gemma-2: attn_logit_softcapping (sdpa refuses it, so eager is the reference), alternating
    sliding-window and full layers, its own query scaling."""
    cfg = tr.Gemma2Config(**SMALL, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=12, sliding_window=6,
                          attn_logit_softcapping=0.05)  # small: random-init scores are small, the cap must bite
    torch.manual_seed(0)
    ref = tr.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    ours = tr.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=name).eval()
    ours.load_state_dict(ref.state_dict())
    ids, am = _batch()
    with torch.no_grad():
        want, got = ref(ids, attention_mask=am).logits, ours(ids, attention_mask=am).logits
        for layer in ref.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        uncapped = ref(ids, attention_mask=am).logits
    valid = am.bool()
    assert (uncapped - want)[valid].abs().max() > 1e-3  # the cap changes the result ...
    assert (got - want)[valid].abs().max() <= 1e-4      # ... and fagen applies it
    assert {m.window_left for m in recorder.masks} == {-1, 5} and all(m.dense is None for m in recorder.masks)


@needs_transformers
@pytest.mark.parametrize("key", ["llama-gqa", "mistral-window"])
def test_packed_sequences_match_sdpa(key: str, name: str, recorder: _Recorder) -> None:
    """Several sequences in one row, told apart by position_ids: fagen's varlen kernels."""
    ref, ours = _pair(key, name)
    ids, _ = _batch()
    pos = torch.tensor([list(range(5)) + list(range(9)), list(range(10)) + list(range(4))])
    with torch.no_grad():
        want = ref(ids, position_ids=pos, use_cache=False).logits  # packing is only looked for without a cache
        err = (ours(ids, position_ids=pos, use_cache=False).logits - want).abs().max().item()
    assert err <= 1e-4, err
    assert recorder.masks and all(m.cu_seqlens is not None for m in recorder.masks), recorder.masks
    assert ("window" in key) == any(m.window_left == 5 for m in recorder.masks)


@needs_transformers
def test_from_pretrained(name: str, tmp_path: Any) -> None:
    """A saved checkpoint loads with attn_implementation=name (no download: a local directory)."""
    ref, _ = _pair("llama-gqa", name)
    ref.save_pretrained(tmp_path)
    ours = tr.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=name).eval()
    assert ours.config._attn_implementation == name
    ids, am = _batch()
    with torch.no_grad():
        err = (ours(ids, attention_mask=am).logits - ref(ids, attention_mask=am).logits)[am.bool()].abs().max()
    assert err <= 1e-4, err


@needs_transformers
def test_logits_right_padding_and_no_mask(name: str) -> None:
    ref, ours = _pair("llama-gqa", name)
    ids, am = _batch(left=False)
    with torch.no_grad():
        err = (ours(ids, attention_mask=am).logits - ref(ids, attention_mask=am).logits)[am.bool()].abs().max()
        err_full = (ours(ids).logits - ref(ids).logits).abs().max()
    assert err <= 1e-4 and err_full <= 1e-4, (err, err_full)


@needs_transformers
def test_logits_bfloat16(name: str) -> None:
    """bf16 logits: within twice sdpa-bf16's own distance from the float32 model (flash-attn's criterion)."""
    ref32, _ = _pair("llama-gqa", name)
    ref, ours = _pair("llama-gqa", name, torch.bfloat16)
    ids, am = _batch()
    valid = am.bool()
    with torch.no_grad():
        exact = ref32(ids, attention_mask=am).logits[valid]
        e_ref = (ref(ids, attention_mask=am).logits.float()[valid] - exact).abs().max().item()
        e_ours = (ours(ids, attention_mask=am).logits.float()[valid] - exact).abs().max().item()
    assert e_ours <= 2 * e_ref + 1e-2, (e_ours, e_ref)


@needs_transformers
@pytest.mark.parametrize("key", ["llama-gqa", "mistral-window"])
def test_training_steps_match_sdpa(key: str, name: str) -> None:
    ref, ours = _pair(key, name)
    ref.train(), ours.train()
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_o = torch.optim.SGD(ours.parameters(), lr=0.1)
    ids, am = _batch()
    labels = ids.masked_fill(am == 0, -100)
    for _ in range(2):
        lr = ref(ids, attention_mask=am, labels=labels).loss
        lo = ours(ids, attention_mask=am, labels=labels).loss
        lr.backward(), lo.backward()
        assert abs(lr.item() - lo.item()) <= 1e-5, (lr.item(), lo.item())
        for (n, pr), po in zip(ref.named_parameters(), ours.parameters()):
            err = (pr.grad - po.grad).abs().max().item()
            assert err <= 1e-4 * max(1.0, pr.grad.abs().max().item()), (n, err)
        opt_r.step(), opt_o.step()
        opt_r.zero_grad(), opt_o.zero_grad()


@needs_transformers
def test_training_bfloat16(name: str) -> None:
    """bf16 loss and gradients: within twice sdpa-bf16's distance from the float32 model (+ a small atol)."""
    ref32, _ = _pair("mistral-window", name)
    ref, ours = _pair("mistral-window", name, torch.bfloat16)
    ids, am = _batch()
    labels = ids.masked_fill(am == 0, -100)
    runs = []
    for model in (ref32, ref, ours):
        model.train()
        loss = model(ids, attention_mask=am, labels=labels).loss
        loss.backward()
        runs.append((loss.item(), [(n, p.grad.float()) for n, p in model.named_parameters()]))
    (l32, g32), (lref, gref), (lours, gours) = runs
    assert abs(lours - l32) <= 2 * abs(lref - l32) + 1e-3, (lours, lref, l32)
    for (n, a), (_, b), (_, c) in zip(g32, gref, gours):
        e_ref, e_ours = (b - a).abs().max().item(), (c - a).abs().max().item()
        assert e_ours <= 2 * e_ref + 1e-3 * a.abs().max().item() + 1e-6, (n, e_ours, e_ref)


@needs_transformers
def test_dropout_in_training_only(name: str) -> None:
    cfg = CONFIGS["llama-gqa"]()
    cfg.attention_dropout = 0.3
    torch.manual_seed(0)
    model = tr.AutoModelForCausalLM.from_config(cfg, attn_implementation=name)
    ids, am = _batch()
    model.train()
    torch.manual_seed(5)
    a = model(ids, attention_mask=am).logits
    torch.manual_seed(5)
    b = model(ids, attention_mask=am).logits
    c = model(ids, attention_mask=am).logits
    assert torch.equal(a, b) and not torch.equal(a, c)   # seeded by torch, fresh per call
    a.sum().backward()
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(ids, attention_mask=am).logits, model(ids, attention_mask=am).logits)


@needs_transformers
@pytest.mark.parametrize("key", ["llama-gqa", "mistral-window"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_generate_matches_sdpa(key: str, cache: str, name: str, recorder: _Recorder) -> None:
    ref, ours = _pair(key, name)
    ids, am = _batch(N=8, pad=3)
    kw = dict(attention_mask=am, max_new_tokens=6, do_sample=False, pad_token_id=0)
    if cache == "static":
        kw["cache_implementation"] = "static"
    want = ref.generate(ids, **kw)
    got = ours.generate(ids, **kw)
    assert torch.equal(got, want), (got, want)
    assert all(m.dense is None for m in recorder.masks), recorder.masks
    if cache == "static" and key == "llama-gqa":  # prefill against the whole cache: top-left, Nq < Nk
        assert any(m.causal and m.causal_align == "top_left" and m.shape[2] < m.shape[3] for m in recorder.masks)
        assert any(m.shape[2] == 1 and not m.causal for m in recorder.masks)  # decoding: folded into the key mask


@needs_transformers
@pytest.mark.parametrize("key", ["llama-gqa", "mistral-window"])
def test_torch_compile_fullgraph(key: str, name: str, recorder: _Recorder) -> None:
    """No graph break: the mask function and the attention trace into fagen's custom ops."""
    _, ours = _pair(key, name)
    ids, am = _batch()
    with torch.no_grad():
        want = ours(ids, attention_mask=am).logits
        recorder.masks.clear()
        compiled = torch.compile(ours, fullgraph=True, backend="eager")
        got = compiled(ids, attention_mask=am).logits
    assert torch.equal(got, want)
    assert recorder.masks and all(m.dense is None for m in recorder.masks), recorder.masks
    assert ("window" in key) == any(m.window_left == 5 for m in recorder.masks)


@needs_transformers
def test_compiled_decoding_step_with_static_cache(name: str, recorder: _Recorder) -> None:
    """One decoding step compiled with fullgraph=True against a static cache (cache position in a tensor)."""
    ref, ours = _pair("llama-gqa", name)
    ids, am = _batch(N=8, pad=3)
    am2 = torch.cat([am, torch.ones(2, 1, dtype=am.dtype)], 1)
    pos = (am2.cumsum(-1) - 1)[:, -1:]

    def step(model: Any, compiled: bool) -> torch.Tensor:
        cache = tr.StaticCache(config=model.config, max_cache_len=12)
        with torch.no_grad():
            tok = model(ids, attention_mask=am, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
            fn = torch.compile(model, fullgraph=True, backend="eager") if compiled else model
            return fn(tok, attention_mask=am2, cache=cache, position_ids=pos, use_cache=True).logits

    want = step(ref, False)
    recorder.masks.clear()
    got = step(ours, True)
    assert (got - want).abs().max() <= 1e-4
    assert [m.shape[2] for m in recorder.masks] == [8, 1] and all(m.dense is None for m in recorder.masks)
