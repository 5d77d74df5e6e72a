"""The mma backward's stages (templates/mma/bwd_stages.cuh): S -> P -> dS written once for the family's
backward kernels, the dK~/dV~ accumulator's home a type, and the dQ tiling decided in Python."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from fagen.families.mma.rules import dq_2d, dq_cols_at_once, dq_warps_per_row_tile
from fagen.renderer import render
from fagen.spec import KernelSpec

TEMPLATES = Path(__file__).resolve().parents[1] / "templates" / "mma"


def _kernels_text(spec: KernelSpec) -> str:
    src = render(spec).source
    return src[src.index('extern "C"'):]  # the entry points (after the shared device functions)


@pytest.mark.parametrize("fields", [
    dict(head_dim=64),                                   # 1-D main kernel
    dict(head_dim=128, arch="sm_80"),                    # the two-dimensional main kernel
    dict(head_dim=64, deterministic=True, softcap=True),  # + the deterministic dq kernel
    dict(head_dim=192),                                  # dK~/dV~ in shared memory
])
def test_every_backward_kernel_takes_p_and_ds_from_the_one_stage(fields) -> None:
    spec = KernelSpec(direction="bwd", impl="mma", **fields)
    kernels = _kernels_text(spec)
    assert "mma_pds" not in kernels.replace("mma_pds_", "")  # no kernel spells the per-element step itself
    calls = kernels.count("mma_bwd_pds<")
    assert calls >= (2 if fields.get("deterministic") else 1)
    src = render(spec).source
    assert src.count("FA_DEVICE void mma_bwd_pds(") == 1


def test_the_accumulator_home_is_a_type_not_a_template_branch() -> None:
    text = (TEMPLATES / "bwd.cu.j2").read_text()
    main = text[text.index('{{ entry(kernels["main"]) }}'):text.index('{% if "dq" in kernels %}')]
    assert "{% if ACC_IN_SMEM %}" not in main and "dk_sm" not in main
    for d in (64, 192):
        src = render(KernelSpec(direction="bwd", impl="mma", head_dim=d)).source
        home = "MmaKvAccSmem" if d == 192 else "MmaKvAccRegs"
        assert re.search(r"using MmaKvAcc = typename MmaPick<ACC_IN_SMEM, MmaKvAccSmem<", src)
        assert f"constexpr bool ACC_IN_SMEM = {'true' if d == 192 else 'false'};" in src, home


@pytest.mark.parametrize("d,block_r,warps", [(64, 128, 8), (128, 64, 8), (96, 128, 8), (32, 64, 4), (40, 64, 4)])
def test_dq_tiling_is_decided_in_python(d, block_r, warps) -> None:
    for name in ("DQ_2D", "DQ_WPM", "DQ_NCC"):
        assert not re.search(rf"constexpr \w+ {name} =", (TEMPLATES / "bwd.cu.j2").read_text()), name
    assert "constexpr bool DO_LATE =" not in (TEMPLATES / "bwd_2d.cu.j2").read_text()
    dp = -(-d // 16) * 16
    two_d = dq_2d(d, block_r, warps)
    assert two_d == (d == dp and block_r % 32 == 0 and dp % 32 == 0 and (block_r // 32) * (dp // 32) == warps)
    wpm = dq_warps_per_row_tile(d, block_r, warps)
    assert wpm == 1 or wpm * (block_r // 16) == warps
    ncc = dq_cols_at_once(d, block_r, warps)
    assert (dp // 16 // wpm) % ncc == 0 and ncc in (1, 2, 4)
    spec = KernelSpec(direction="bwd", impl="mma", head_dim=64)
    src = render(spec).source
    assert "constexpr bool DQ_2D = true;" in src and "constexpr int DQ_WPM = 1;" in src
