"""One module plan per spec (fagen.plan): the family is asked for a spec's kernels once, and every
stage reads the same plan."""
from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import fagen
import fagen.functional as F
from fagen.families import families, registered_only
from fagen.plan import plan_of
from fagen.renderer import kernel_infos
from fagen.spec import KernelSpec


def test_plan_is_one_object_per_spec() -> None:
    spec = KernelSpec(direction="bwd", head_dim=64, causal=True)
    plan = plan_of(spec)
    assert plan_of(KernelSpec(direction="bwd", head_dim=64, causal=True)) is plan
    assert kernel_infos(spec) is plan.kernels
    assert [k.role.name for k in plan.kernels] == ["pre", "main", "post"]
    assert plan.kernel("main") is plan.kernels[1] and plan.family is spec.family
    assert plan.smem_layout == spec.smem_layout


class _Nothing:
    def launch(self, kernel: Any, grid: tuple[int, int, int], args: dict[str, Any]) -> None:
        pass


def test_family_asked_once_per_spec_across_forward_and_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward + backward asks the family for each spec's roles and launch geometry once (a
    second call asks nothing): a counting copy of the spec's family, registered in its place."""
    fam = KernelSpec(direction="fwd", head_dim=64, causal=True).family
    calls: list[str] = []

    class Counting(type(fam)):  # type: ignore[misc, valid-type]
        def roles(self, fs: Any) -> Any:
            calls.append(f"roles {fs.direction}")
            return super().roles(fs)

        def launch(self, fs: Any, role: Any) -> Any:
            calls.append(f"launch {fs.direction} {role.name}")
            return super().launch(fs, role)

    counting = Counting(**{f.name: getattr(fam, f.name) for f in dataclasses.fields(fam)})
    monkeypatch.setattr(F, "get_module", lambda spec, device_type: _Nothing())
    F.clear_launch_plans()  # no launch plan of an earlier test
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 40, 2, 64, generator=g).half().requires_grad_(True) for _ in range(3))
    do = torch.randn(1, 40, 2, 64, generator=g).half()
    with registered_only(*(counting if f.name == fam.name else f for f in families())):
        for _ in range(2):
            fagen.flash_attn_func(q, k, v, causal=True).backward(do)
    assert sorted(calls) == ["launch bwd main", "launch bwd post", "launch bwd pre", "launch fwd main",
                             "roles bwd", "roles fwd"]
