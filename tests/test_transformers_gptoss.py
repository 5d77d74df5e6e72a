"""gpt-oss through fagen's transformers integration: attention sinks (``s_aux``), forward and training.

A tiny random gpt-oss (GptOssConfig with small sizes, no downloads: alternating sliding-window and
full layers, GQA, head_dim 16, learnable sinks) under ``attn_implementation=register()`` against the
same weights under ``"eager"`` (gpt-oss's own attention: the sink column appended, softmax, dropped):
logits, loss and every parameter's gradient, the sinks' included. CPU tensors: the emulator.
"""
from __future__ import annotations

import copy

import pytest
import torch

import fagen.integrations.transformers as ft
from fagen.errors import InputError

tr = pytest.importorskip("transformers")

VOCAB = 96


def _config():
    return tr.GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                           num_experts_per_tok=2, sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                           max_position_embeddings=64, attention_dropout=0.0,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


@pytest.fixture(scope="module")
def name() -> str:
    return ft.register()


def _pair(name: str):
    torch.manual_seed(0)
    cfg = _config()
    ref = tr.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager")
    with torch.no_grad():  # sinks that bite: some rows give the sink most of their weight
        for layer in ref.model.layers:
            layer.self_attn.sinks.copy_(torch.tensor([2.0, -1.0, 0.5, 3.0]))
    ours = tr.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=name)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def _batch(B: int = 2, N: int = 14, pad: int = 5):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (B, N), generator=g)
    am = torch.ones(B, N, dtype=torch.long)
    am[1, :pad] = 0  # left padding
    return ids, am


def test_gpt_oss_logits_match_eager(name: str) -> None:
    ref, ours = _pair(name)
    ref.eval(), ours.eval()
    ids, am = _batch()
    with torch.no_grad():
        want, got = ref(ids, attention_mask=am).logits, ours(ids, attention_mask=am).logits
        for layer in ref.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # no sinks: a visibly different model
        no_sinks = ref(ids, attention_mask=am).logits
    valid = am.bool()
    assert (no_sinks - want)[valid].abs().max() > 1e-2  # the sinks matter ...
    assert (got - want)[valid].abs().max() <= 1e-4      # ... and fagen applies them


def test_gpt_oss_training_matches_eager(name: str) -> None:
    """Two SGD steps: loss and every gradient (sinks included) as eager's."""
    ref, ours = _pair(name)
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
        grads = dict(ours.named_parameters())
        for n, pr in ref.named_parameters():
            po = grads[n]
            if pr.grad is None:
                assert po.grad is None or not po.grad.any(), n
                continue
            err = (pr.grad - po.grad).abs().max().item()
            assert err <= 1e-4 * max(1.0, pr.grad.abs().max().item()), (n, err)
            if n.endswith("sinks"):
                assert pr.grad.abs().max() > 1e-4, n  # the sinks do get a gradient
        opt_r.step(), opt_o.step()
        opt_r.zero_grad(), opt_o.zero_grad()


def test_s_aux_of_the_wrong_shape_is_refused() -> None:
    q = torch.zeros(1, 2, 3, 8)
    with pytest.raises(InputError, match="s_aux"):
        ft.attention_forward(torch.nn.Module(), q, q, q, None, s_aux=torch.zeros(3))
