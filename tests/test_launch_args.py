"""A launch plan's constant kernel arguments are converted for CUDA once, not per call: the
functional layer hands the launchers a :class:`~fagen.runtime.args.LaunchArgs` (the plan's
constants plus the per-call pointers, seed and offset), and the GPU packer converts only the
per-call ones on later calls -- with the same bytes, types and errors as a plain dict gets.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import fagen.functional as F
from fagen import AttentionOptions
from fagen.errors import InputError, InputTypeError
from fagen.runtime import gpu
from fagen.runtime.args import LaunchArgs


class Packer:
    """A launcher that does the GPU launcher's argument packing (no CuPy, nothing runs) and
    keeps each launch's kernel and arguments."""

    def __init__(self) -> None:
        self.launches: list[tuple[Any, Any, tuple[Any, ...]]] = []

    def launch(self, kernel: Any, grid: tuple[int, int, int], args: dict[str, Any]) -> None:
        self.launches.append((kernel, args, gpu.cuda_args(kernel, args)))


@pytest.fixture
def converted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The parameter names whose converter runs, call after call (fresh packers for the test)."""
    calls: list[str] = []
    real = gpu._converter

    def counting(ctype: str, name: str) -> Any:
        conv = real(ctype, name)

        def convert(value: Any) -> Any:
            calls.append(name)
            return conv(value)

        convert.memo = getattr(conv, "memo", {})  # type: ignore[attr-defined]
        return convert

    monkeypatch.setattr(gpu, "_converter", counting)
    monkeypatch.setattr(gpu, "_converters", {})
    monkeypatch.setattr(gpu, "_plan_packers", {}, raising=False)
    return calls


def _qkv(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, 16, 2, 16, generator=g).half() for _ in range(4))


def _per_call(kernel: Any) -> set[str]:
    return {n for t, n in kernel.params if t.endswith("*")} | {"seed", "offset"}


def test_a_plans_constants_are_converted_on_its_first_call_only(monkeypatch: pytest.MonkeyPatch,
                                                               converted: list[str]) -> None:
    packer = Packer()
    monkeypatch.setattr(F, "get_module", lambda spec, device_type: packer)
    opts = AttentionOptions.of(causal=True)
    q, k, v, do = _qkv(0)
    o, lse = F.forward(q, k, v, opts)
    F.backward(do, q, k, v, o, lse, opts)
    kernels = [kern for kern, _, _ in packer.launches]
    assert {"heads", "seqlen_q", "stride_q_s"} <= set(converted)  # the first call converts the constants
    first = packer.launches[:]
    converted.clear()
    packer.launches.clear()
    q, k, v, do = _qkv(1)  # new tensors, the same metadata: the same plans
    o, lse = F.forward(q, k, v, opts, seed=5, offset=7)
    F.backward(do, q, k, v, o, lse, opts, seed=5, offset=7)
    assert [kern for kern, _, _ in packer.launches] == kernels
    per_call = set().union(*(_per_call(kern) for kern in kernels))
    assert {"seed", "offset"} <= set(converted) <= per_call  # only pointers, seed and offset
    for (kern, args, packed), (_, old_args, _) in zip(packer.launches, first):
        assert type(args) is LaunchArgs and args.constants is old_args.constants  # the plan's own constants
        assert set(args) - set(args.constants) <= per_call
        plain = gpu.cuda_args(kern, dict(args))  # a plain dict: every argument converted
        assert [type(x) for x in packed] == [type(x) for x in plain]
        assert [np.asarray(x).tobytes() for x in packed] == [np.asarray(x).tobytes() for x in plain]


def test_launch_args_keep_the_errors_of_a_plain_dict() -> None:
    q, k, v, _ = _qkv(0)
    opts = AttentionOptions.of()
    packer = Packer()
    F.get_module, real = (lambda spec, device_type: packer), F.get_module
    try:
        F.forward(q, k, v, opts)
    finally:
        F.get_module = real
    kern, args, _ = packer.launches[0]
    constants = args.constants
    per_call = {n: args[n] for n in args if n not in constants}
    with pytest.raises(ValueError, match="heads"):
        LaunchArgs(constants, {**per_call, "heads": 3})
    for bad in ({"seed": 2**64}, {"q": -1}, {"seed": True}):
        with pytest.raises(gpu.LaunchError) as plain:
            gpu.cuda_args(kern, {**args, **bad})
        with pytest.raises(gpu.LaunchError) as planned:
            gpu.cuda_args(kern, LaunchArgs(constants, {**per_call, **bad}))
        assert str(planned.value) == str(plain.value)
    wrong = {**constants, "heads": 2**40}  # a constant no int parameter holds: named, as before
    with pytest.raises(gpu.LaunchError, match="heads"):
        gpu.cuda_args(kern, LaunchArgs(wrong, per_call))
    missing = {n: v for n, v in per_call.items() if n != "q"}
    with pytest.raises(KeyError, match=r"missing kernel arguments \['q'\]"):
        gpu.cuda_args(kern, LaunchArgs(constants, missing))


def test_a_bad_lse_lo_is_refused_on_every_call_after_the_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(F, "get_module", lambda spec, device_type: Packer())
    q, k, v, do = _qkv(0)
    opts = AttentionOptions.of()
    o, lse = F.forward(q, k, v, opts)
    bad = torch.zeros(lse.shape, dtype=torch.float64)
    for _ in range(2):  # the plan remembers the metadata, not that the check passed
        with pytest.raises(InputTypeError, match="lse_lo"):
            F.backward(do, q, k, v, o, lse, opts, lse_lo=bad)
    with pytest.raises(InputError, match="seed"):
        F.backward(do, q, k, v, o, lse, opts, lse_lo=bad, seed=-1)
    F.backward(do, q, k, v, o, lse, opts, lse_lo=torch.zeros_like(lse))
