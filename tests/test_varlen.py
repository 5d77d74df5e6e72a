"""fagen.flash_attn_varlen_func: packed sequences in flash-attn's layout, on CPU (emulator).

Sequences of length 0 and 1 included (a query sequence whose key sequence is empty gives zero
rows with lse = -inf); causal, window and ALiBi aligned bottom-right per sequence; lse per
token [H, total_q] as flash-attn returns it. Expected values: tests/featref.py per sequence.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import fagen.functional as F
from fagen import flash_attn_varlen_func
from fagen.errors import InputError, InputTypeError
from fagen.ops import draw_rng_state

import featref as R


@dataclass(frozen=True)
class Case:
    name: str
    dtype: torch.dtype
    head_dim: int
    heads: int
    heads_kv: int
    lens_q: tuple[int, ...]
    lens_k: tuple[int, ...]
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    dropout_p: float = 0.0

    def __str__(self) -> str:
        return self.name


CASES = [
    Case("plain", torch.float32, 16, 2, 2, (5, 1, 0, 17), (0, 1, 4, 22)),
    # the combination: GQA + varlen + window + causal + dropout + softcap
    Case("gqa-causal-window-softcap-dropout", torch.float16, 32, 4, 2, (9, 1, 0, 30, 2), (12, 1, 3, 26, 0),
         causal=True, window=(7, -1), softcap=3.0, dropout_p=0.1),
]


def cu(lens: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)


def make_inputs(case: Case, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(case.lens_q), sum(case.lens_k)
    return {
        "q": torch.randn(tq, case.heads, case.head_dim, generator=g).to(case.dtype),
        "k": torch.randn(tk, case.heads_kv, case.head_dim, generator=g).to(case.dtype),
        "v": torch.randn(tk, case.heads_kv, case.head_dim, generator=g).to(case.dtype),
        "do": torch.randn(tq, case.heads, case.head_dim, generator=g).to(case.dtype),
    }


def run_fagen(case: Case, t: dict[str, torch.Tensor], rng_seed: int = 0, fn=flash_attn_varlen_func):
    q, k, v = (t[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v"))
    torch.manual_seed(rng_seed)
    out, lse, s_dmask = fn(q, k, v, cu(case.lens_q), cu(case.lens_k), max(case.lens_q), max(case.lens_k),
                           case.dropout_p, None, case.causal, case.window, case.softcap, None, False, True)
    out.backward(t["do"])
    return out.detach(), lse, s_dmask, q.grad, k.grad, v.grad


def oracle(case: Case, t: dict[str, torch.Tensor], dtype: torch.dtype, rng: torch.Tensor):
    """Per sequence: (out, lse [H, total_q], dq, dk, dv) of tests/featref.py in ``dtype``."""
    keep_all = None
    if case.dropout_p:
        keep_all = F.dropout_keep_mask(len(case.lens_q), case.heads, max(case.lens_q), max(case.lens_k),
                                       case.dropout_p, seed=int(rng[0]), offset=int(rng[1]))
    cq, ck = cu(case.lens_q).tolist(), cu(case.lens_k).tolist()
    outs, lses, dqs, dks, dvs = [], [], [], [], []
    for b, (nq, nk) in enumerate(zip(case.lens_q, case.lens_k)):
        seq = {n: t[n][(cq if n in ("q", "do") else ck)[b]:(cq if n in ("q", "do") else ck)[b + 1]].unsqueeze(0)
               for n in ("q", "k", "v", "do")}
        keep = None if keep_all is None else keep_all[b:b + 1, :, :nq, :nk]
        o, lse, g = R.run_oracle({n: seq[n] for n in "qkv"}, ("q", "k", "v"), seq["do"], dtype, causal=case.causal,
                                 window=case.window, softcap=case.softcap, keep=keep, dropout_p=case.dropout_p)
        outs.append(o[0]), lses.append(lse[0]), dqs.append(g["q"][0]), dks.append(g["k"][0]), dvs.append(g["v"][0])
    return torch.cat(outs), torch.cat(lses, dim=1), torch.cat(dqs), torch.cat(dks), torch.cat(dvs)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_varlen_matches_the_per_sequence_oracle(case: Case) -> None:
    t = make_inputs(case)
    out, lse, s_dmask, dq, dk, dv = run_fagen(case, t, rng_seed=7)
    torch.manual_seed(7)
    rng = draw_rng_state() if case.dropout_p else torch.zeros(2, dtype=torch.int64)
    o64, lse64, *g64 = oracle(case, t, torch.float64, rng)
    o_pt, _, *g_pt = oracle(case, t, case.dtype, rng)
    R.assert_close("out", out, o64, o_pt, case.dtype)
    for name, ours, ref, pt in zip(("dq", "dk", "dv"), (dq, dk, dv), g64, g_pt):
        assert ours.dtype == case.dtype
        R.assert_close(name, ours, ref, pt, case.dtype)
    assert lse.shape == (case.heads, sum(case.lens_q)) and lse.dtype == torch.float32
    lse32 = oracle(case, t, torch.float32, rng)[1]  # lse is float32 whatever the input dtype
    R.assert_lse_close("lse", lse, lse64, lse32)
    finite = torch.isfinite(lse64)
    dead = ~finite.T  # [total_q, H]: query rows whose sequence has no key
    assert (out[dead] == 0).all() and (dq[dead] == 0).all()
    B = len(case.lens_q)
    assert s_dmask.shape == (B, case.heads, max(case.lens_q), max(case.lens_k))


def test_torch_compile_fullgraph_varlen() -> None:
    case = CASES[0]
    t = make_inputs(case)
    torch._dynamo.reset()
    compiled = torch.compile(flash_attn_varlen_func, fullgraph=True, backend="aot_eager")

    def step(fn):
        q, k, v = (t[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v"))
        out = fn(q, k, v, cu(case.lens_q), cu(case.lens_k), max(case.lens_q), max(case.lens_k))
        out.backward(t["do"])
        return out.detach(), q.grad, k.grad, v.grad

    for a, b in zip(step(compiled), step(flash_attn_varlen_func)):
        assert torch.equal(a, b)


def test_opcheck_varlen() -> None:
    case = CASES[0]
    t = make_inputs(case)
    q, k, v = (t[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v"))
    args = (q, k, v, None, 0.0, None, False, -1, -1, 0.0, None, None, None, "bottom_right", cu(case.lens_q),
            cu(case.lens_k), max(case.lens_q), max(case.lens_k), False)
    torch.library.opcheck(torch.ops.fagen.fwd.default, args)


def _packed(lens_q=(3, 4), lens_k=(2, 5), H=2, d=8):
    return (torch.randn(sum(lens_q), H, d), torch.randn(sum(lens_k), H, d), torch.randn(sum(lens_k), H, d),
            cu(lens_q), cu(lens_k), max(lens_q), max(lens_k))


@pytest.mark.parametrize("change, error, argument", [
    ({3: cu((3, 4)).long()}, InputTypeError, "cu_seqlens_q"),
    ({3: torch.tensor([0, 8, 7], dtype=torch.int32)}, InputError, "cu_seqlens_q"),  # decreasing
    ({3: torch.tensor([0, 3, 6], dtype=torch.int32)}, InputError, "cu_seqlens_q"),  # last != total_q
    ({3: torch.tensor([1, 3, 7], dtype=torch.int32)}, InputError, "cu_seqlens_q"),  # does not start at 0
    ({4: torch.tensor([0, 7], dtype=torch.int32)}, InputError, "cu_seqlens_k"),  # other number of sequences
    ({4: cu((2, 5)).to("meta")}, InputError, "cu_seqlens_k"),  # other device
    ({5: 3}, InputError, "max_seqlen_q"),  # shorter than the longest sequence (4)
    ({6: -1}, InputError, "max_seqlen_k"),
    ({6: 5.0}, InputError, "max_seqlen_k"),
    ({0: torch.randn(2, 7, 2, 8)}, InputError, "q"),  # not packed
])
def test_varlen_argument_errors(change: dict, error: type, argument: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(F, "get_module", lambda *a: pytest.fail("a kernel module was requested"))
    args = list(_packed())
    for i, value in change.items():
        args[i] = value
    with pytest.raises(error) as err:
        flash_attn_varlen_func(*args)
    assert err.value.argument == argument
