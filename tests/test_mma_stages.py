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


# ------------------------------------------------------------------ the kernel bodies as orchestration
#: At most this many lines in the body of each mma kernel (the rest: named device functions).
MAX_BODY_LINES = 250


def _bodies(src: str) -> dict[str, list[str]]:
    """The body lines of every __global__ function of a rendered source, by its role (name suffix)."""
    lines = src.splitlines()
    out = {}
    for i, line in enumerate(lines):
        m = re.match(r'extern "C" __global__ .* (\w+)\($', line)
        if not m:
            continue
        j = next(k for k in range(i, len(lines)) if lines[k] == "{")
        depth, k = 0, j
        while True:
            depth += lines[k].count("{") - lines[k].count("}")
            if depth == 0 and k > j:
                break
            k += 1
        out[m.group(1).rsplit("_", 1)[1]] = lines[j + 1:k]
    return out


#: The stage functions each kernel calls (Algorithm 4 / the forward's step as named device functions).
STAGES = {
    "bwd_1d": ("mma_bwd_hold_kv(", "mma_bwd_prefetch(", "mma_bwd_chunk_sdp<", "mma_bwd_chunk_keep_bits<",
               "mma_bwd_chunk_rows<", "mma_bwd_pds<", "mma_bwd_chunk_pack<", "mma_bwd_chunk_dkdv<", "mma_bwd_store_dkdv<"),
    "bwd_2d": ("mma2d_sdp(", "mma2d_rows(", "mma_bwd_pds<", "mma2d_zero_masked(", "mma2d_store_pds(", "mma2d_kv(",
               "mma2d_dq_add(", "mma2d_store_dkdv("),
    "dq": ("mma_dq_rows(", "mma_dq_sdp(", "mma_bwd_pds<", "mma_dq_add(", "mma_dq_store("),
    "fwd": ("fwd_s<", "fwd_mask<", "fwd_keep_bits<", "fwd_row_max<", "fwd_softmax<", "fwd_pv<"),
}


@pytest.mark.parametrize("fields,kinds", [
    (dict(direction="bwd", head_dim=64, arch="sm_80"), {"main": "bwd_1d"}),
    (dict(direction="bwd", head_dim=64, dropout=True, bias=True, bias_grad=True), {"main": "bwd_1d"}),
    (dict(direction="bwd", head_dim=96, head_dim_v=64, arch="sm_80"), {"main": "bwd_1d"}),
    (dict(direction="bwd", head_dim=192), {"main": "bwd_1d"}),
    (dict(direction="bwd", head_dim=64, deterministic=True, dropout=True, softcap=True), {"main": "bwd_1d", "dq": "dq"}),
    (dict(direction="bwd", head_dim=128, arch="sm_80"), {"main": "bwd_2d"}),
    (dict(direction="fwd", head_dim=64, arch="sm_80"), {"main": "fwd"}),
    (dict(direction="fwd", head_dim=128, dropout=True, softcap=True, attn_mask=True), {"main": "fwd"}),
    (dict(direction="fwd", head_dim=64, head_dim_v=32, arch="sm_80"), {"main": "fwd"}),
])
def test_kernel_bodies_are_orchestration_over_named_stages(fields, kinds) -> None:
    spec = KernelSpec(impl="mma", **fields)
    bodies = _bodies(render(spec).source)
    assert set(kinds) <= set(bodies), bodies.keys()
    for role, kind in kinds.items():
        body = "\n".join(bodies[role])
        assert len(bodies[role]) <= MAX_BODY_LINES, (role, len(bodies[role]))
        missing = [f for f in STAGES[kind] if f not in body]
        assert not missing, (role, missing)
    if "dq" in kinds:  # the deterministic main kernel keeps no dQ block
        assert "mma_bwd_dq_" not in "\n".join(bodies["main"])
    elif kinds["main"] == "bwd_1d":
        assert re.search(r"mma_bwd_dq_(blocks|tiles)\(", "\n".join(bodies["main"]))


def test_no_mma_template_computes_a_decision() -> None:
    """The forward's FWD_HOLD / FWD_S_SPLIT come from Python (rules.fwd_hold, fwd_s_split) as the backward's
    DQ_* do; the templates' Jinja assignments only name the v head dim's symbols."""
    from fagen.families.mma.rules import SCORE_MOD_FLAGS, fwd_hold, fwd_m_tiles, fwd_s_split

    for path in TEMPLATES.iterdir():
        text = path.read_text()
        assert not re.search(r"constexpr bool (FWD_HOLD|FWD_S_SPLIT) =", text), path.name
        names = set(re.findall(r"\{%-? *set ([\w, ]+?) *=", text))
        assert names <= {"VD", "TILE_DIMS", "LDV, DPV, HDV, NTV", "VARGS"}, (path.name, names)
    for block_r, warps in ((128, 8), (128, 4), (64, 4), (64, 8)):
        assert fwd_s_split(block_r, warps) == (fwd_m_tiles(block_r, warps) == 2)
        for flags in (frozenset(), frozenset({"causal"}), *(frozenset({f}) for f in SCORE_MOD_FLAGS)):
            assert fwd_hold(block_r, warps, flags) == (fwd_m_tiles(block_r, warps) == 1 and not flags & SCORE_MOD_FLAGS)
    for fields in (dict(head_dim=64, arch="sm_80"), dict(head_dim=64, block_r=128, num_warps=4), dict(head_dim=64, softcap=True)):
        spec = KernelSpec(direction="fwd", impl="mma", **fields)
        src = render(spec).source
        t = spec.tile
        hold = fwd_hold(t.block_r, spec.num_warps, spec.family_spec.flags)
        split = fwd_s_split(t.block_r, spec.num_warps)
        assert f"constexpr bool FWD_HOLD = {'true' if hold else 'false'};" in src
        assert f"constexpr bool FWD_S_SPLIT = {'true' if split else 'false'};" in src
