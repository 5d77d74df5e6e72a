"""Inputs of the Hopper family (``wgmma``) that another family takes, and CPU tensors that take it.

* Tensor maps describe only some layouts (outer strides positive multiples of 16 bytes, a 16-byte
  aligned address): a dO broadcast over the batch (``(out * w).sum().backward()``), rows 68 halves
  apart, a view at an odd element offset. The launchers copy such an input (``Family.tma_tensors``,
  :func:`fagen.tma.layout_fits`) instead of raising where ``mma`` would not.
* ``FAGEN_EMULATE_ARCH`` (``fagen.settings``): CPU tensors take the specs, families and tiles a GPU
  of that arch takes, through every entry point (they reach the same ``spec_for``)."""
from __future__ import annotations

import pytest
import torch

import fagen
import fagen.functional as F
from fagen import KernelSpec, settings, tma
from fagen.errors import InputError
from fagen.runtime import cpu

from featref import assert_close, attention


@pytest.fixture
def emulate(monkeypatch: pytest.MonkeyPatch):
    """``emulate(arch)``: the setting for the rest of the test (configure(), as from the environment)."""
    monkeypatch.delenv("FAGEN_EMULATE_ARCH", raising=False)
    settings.reset()

    def set_arch(arch: str | None) -> None:
        settings.configure(emulate_arch=arch)
    yield set_arch
    settings.reset()


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list[KernelSpec]:
    """The specs of the CPU modules the launches use, in order."""
    seen: list[KernelSpec] = []
    real = cpu.cpu_module

    def record(spec: KernelSpec) -> cpu.CpuModule:
        seen.append(spec)
        return real(spec)
    monkeypatch.setattr(cpu, "cpu_module", record)
    return seen


def _qkv(B=2, N=70, H=2, d=64, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, N, H, d, generator=g).to(dtype) for _ in range(3)]


# --------------------------------------------------------------------------- layouts a tensor map cannot take
def test_layout_fits() -> None:
    assert tma.layout_fits((2, 64, 1, 64), (4096, 64, 64, 1), 2)
    assert not tma.layout_fits((2, 64, 1, 64), (0, 64, 64, 1), 2)      # broadcast over the batch
    assert tma.layout_fits((1, 64, 1, 64), (0, 64, 64, 1), 2)          # one batch: its stride is never used
    assert not tma.layout_fits((1, 64, 1, 64), (4352, 68, 68, 1), 2)   # rows 136 bytes apart
    assert tma.layout_fits((1, 64, 1, 64), (4352, 72, 72, 1), 2)       # 144 bytes: fine
    assert not tma.layout_fits((1, 64, 1, 64), (4096, 64, 64, 1), 2, address=8)
    assert not tma.layout_fits((1, 64, 1, 64), (4096, 64, 64, 2), 2)   # the head dim not contiguous
    # a dimension of one element gets the dense stride in the map, whatever torch says
    f = tma.tensor_map_fields(1 << 20, "float16", (1, 64, 1, 64), (0, 64, 7, 1), (1, 64, 1, 64))
    assert f.strides == (128, 128, 64 * 128)
    with pytest.raises(InputError, match="strides"):
        tma.tensor_map_fields(1 << 20, "float16", (2, 64, 1, 64), (0, 64, 64, 1), (1, 64, 1, 64))


def _spec(direction: str, **kw) -> KernelSpec:
    spec = KernelSpec(direction=direction, arch="sm_90a", head_dim=64, dtype="float16", causal=True, **kw)
    assert spec.impl == "wgmma"
    return spec


def test_forward_takes_rows_a_tensor_map_cannot_and_views_at_odd_offsets() -> None:
    """Bit for bit the contiguous inputs' result: k's rows 68 halves apart (136 bytes), q a view one
    element into its storage (not 16-byte aligned), v broadcast over the batch."""
    q, k, v = _qkv()
    want, want_lse = F.attention_forward(q, k, v[:1].expand_as(v).contiguous(), causal=True, spec=_spec("fwd"))
    k68 = torch.zeros(2, 70, 2, 68, dtype=torch.float16)[..., :64].copy_(k)
    q_odd = torch.empty(q.numel() + 1, dtype=torch.float16)[1:].view(q.shape).copy_(q)
    assert q_odd.data_ptr() % 16 and not tma.layout_fits(k68.shape, k68.stride(), 2)
    o, lse = F.attention_forward(q_odd, k68, v[:1].expand_as(v), causal=True, spec=_spec("fwd"))
    assert torch.equal(o, want) and torch.equal(lse, want_lse)


def test_backward_takes_a_broadcast_do() -> None:
    q, k, v = _qkv()
    o, lse = F.attention_forward(q, k, v, causal=True, spec=_spec("fwd"))
    w = torch.randn(1, 70, 2, 64).half()
    do = w.expand(2, 70, 2, 64)  # what (o * w).sum().backward() hands the backward: batch stride 0
    assert do.stride(0) == 0
    got = F.attention_backward(do, q, k, v, o, lse, causal=True, spec=_spec("bwd"))
    want = F.attention_backward(do.contiguous(), q, k, v, o, lse, causal=True, spec=_spec("bwd"))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_autograd_with_a_broadcast_weight_on_wgmma(emulate, launched) -> None:
    """``(out * w).sum().backward()`` with ``w`` broadcast over the batch through flash_attn_func and
    scaled_dot_product_attention on the Hopper family (FAGEN_EMULATE_ARCH=sm_90a), against float64."""
    emulate("sm_90a")
    q, k, v = _qkv(N=90)
    w = torch.randn(1, 90, 2, 64).half()
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    o64, _ = attention(*leaves, causal=True)
    (o64 * w.double()).sum().backward()
    same = [x.clone().requires_grad_() for x in (q, k, v)]
    o_pt, _ = attention(*same, causal=True)
    (o_pt * w).sum().backward()
    for api in ("flash_attn_func", "sdpa"):
        ours = [x.clone().requires_grad_() for x in (q, k, v)]
        launched.clear()
        if api == "flash_attn_func":
            out = fagen.flash_attn_func(*ours, causal=True)
            (out * w).sum().backward()
        else:
            out = fagen.scaled_dot_product_attention(*(x.transpose(1, 2) for x in ours), is_causal=True)
            (out * w.transpose(1, 2)).sum().backward()  # torch's causal: top-left, the same for Nq == Nk
        assert [(s.direction, s.impl) for s in launched] == [("fwd", "wgmma"), ("bwd", "wgmma")], launched
        for name, x, r64, pt in zip(("dq", "dk", "dv"), ours, leaves, same):
            assert_close(f"{api} {name}", x.grad, r64.grad, pt.grad, torch.float16)


# --------------------------------------------------------------------------- FAGEN_EMULATE_ARCH
def test_setting_is_read_from_the_environment_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAGEN_EMULATE_ARCH", "sm_90a")
    assert settings.Settings.from_env().emulate_arch == "sm_90a"
    monkeypatch.setenv("FAGEN_EMULATE_ARCH", "")
    assert settings.Settings.from_env().emulate_arch is None
    monkeypatch.setenv("FAGEN_EMULATE_ARCH", "sm_75")
    with pytest.raises(ValueError, match=r"FAGEN_EMULATE_ARCH: expected one of .*'sm_90a'.*got 'sm_75'"):
        settings.Settings.from_env()


@pytest.mark.parametrize("arch, impl, spec_arch", [(None, "mma", "sm_90"), ("sm_90", "mma", "sm_90"),
                                                   ("sm_90a", "wgmma", "sm_90a"), ("sm_80", "mma", "sm_80"),
                                                   ("sm_120", "mma", "sm_120")])
def test_cpu_tensors_take_the_spec_of_the_emulated_arch(emulate, launched, arch, impl, spec_arch) -> None:
    """flash_attn_func forward and backward on CPU tensors: the family and arch a GPU of the
    setting's arch takes (sm_90a: what a compute capability 9.0 device takes; unset: sm_90's
    generic spec, as before); the plan follows a change of the setting between calls."""
    q, k, v = (x.requires_grad_() for x in _qkv(B=1, N=40))
    fagen.flash_attn_func(q, k, v, causal=True).sum().backward()  # a plan under another setting first
    emulate(arch)
    launched.clear()
    out = fagen.flash_attn_func(q, k, v, causal=True)
    out.sum().backward()
    assert [(s.direction, s.impl, s.arch) for s in launched] == [("fwd", impl, spec_arch), ("bwd", impl, spec_arch)]
    want = F.default_arch(torch.device("cpu"))
    assert want == {None: "sm_90", "sm_90a": "sm_90"}.get(arch, arch)


def test_emulated_hopper_declines_as_the_gpu_does(emulate, launched) -> None:
    """Softcap takes the Hopper family; a spec it declines (softcap at d = 256: 64 keys would spill, fewer keys
    issue more than mma) resolves to mma on sm_90, as on an H100."""
    emulate("sm_90a")
    q, k, v = _qkv(B=1, N=40)
    fagen.flash_attn_func(q, k, v, causal=True, softcap=5.0)
    q, k, v = _qkv(B=1, N=40, d=256)
    fagen.flash_attn_func(q, k, v, causal=True, softcap=5.0)
    assert [(s.impl, s.arch) for s in launched] == [("wgmma", "sm_90a"), ("mma", "sm_90")]


def test_emulated_hopper_trains(emulate, launched) -> None:
    """A few optimiser steps of a small attention model on the emulated Hopper family: the loss falls."""
    emulate("sm_90a")
    torch.manual_seed(0)
    proj = torch.nn.Linear(64, 3 * 64).half()
    x, y = torch.randn(2, 48, 64).half(), torch.randn(2, 48, 64).half()
    opt = torch.optim.SGD(proj.parameters(), lr=0.5)
    losses = []
    for _ in range(4):
        q, k, v = proj(x).view(2, 48, 3, 1, 64).unbind(2)
        loss = torch.nn.functional.mse_loss(fagen.flash_attn_func(q, k, v, causal=True).float().view(2, 48, 64),
                                            y.float())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert {s.impl for s in launched} == {"wgmma"} and {s.direction for s in launched} == {"fwd", "bwd"}


def test_emulated_hopper_through_the_ring(emulate, launched, tmp_path) -> None:
    """ring_flash_attn_func (a one-rank gloo group) takes the same specs as the other entry points."""
    import torch.distributed as dist

    from fagen.distributed import ring_flash_attn_func

    emulate("sm_90a")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        q, k, v = (x.requires_grad_() for x in _qkv(B=1, N=64))
        ring_flash_attn_func(q, k, v, causal=True, group=dist.group.WORLD).sum().backward()
    finally:
        dist.destroy_process_group()
    assert {(s.direction, s.impl) for s in launched} == {("fwd", "wgmma"), ("bwd", "wgmma")}, launched


def test_emulated_hopper_through_transformers(emulate, launched) -> None:
    """attn_implementation="fagen" (a llama with head dim 64, a padded batch) on the Hopper family."""
    tr = pytest.importorskip("transformers")
    import fagen.integrations.transformers as ft

    emulate("sm_90a")
    name = ft.register()
    torch.manual_seed(0)
    cfg = tr.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         attention_dropout=0.0)
    model = tr.AutoModelForCausalLM.from_config(cfg, attn_implementation=name, dtype=torch.float16)
    ids = torch.randint(0, 64, (2, 24))
    am = torch.ones(2, 24, dtype=torch.long)
    am[1, 20:] = 0
    out = model(input_ids=ids, attention_mask=am, labels=ids)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert ("fwd", "wgmma") in {(s.direction, s.impl) for s in launched}, launched
    assert ("bwd", "wgmma") in {(s.direction, s.impl) for s in launched}, launched
