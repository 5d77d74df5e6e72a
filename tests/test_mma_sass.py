"""SASS evidence with no GPU: every mma kernel of the standard matrix, for sm_80, sm_90, sm_100 and
sm_120 (Ampere, Hopper, Blackwell datacenter and GeForce), keeps
everything in registers and smem (no spills, no local memory: ptxas's report) and fits the arch's
opt-in shared memory; its SASS (every cubin on sm_80 / sm_90, a sample on the others) runs on the
tensor cores (HMMA, ldmatrix, cp.async) with no local loads or stores."""
from __future__ import annotations

import json

import pytest

from fagen import KernelSpec, compile, sass
from fagen.cli import main
from fagen.generate import standard_matrix
from fagen.spec import ARCH_SMEM_OPTIN
from tiers import EXHAUSTIVE

pytestmark = pytest.mark.skipif(sass.nvdisasm_path() is None, reason="nvdisasm (nvidia-cuda-nvdisasm) not installed")

ARCHS = ("sm_80", "sm_90", "sm_100", "sm_120")
SPECS = [s.replace(arch=arch, sram_bytes=ARCH_SMEM_OPTIN[arch]) for arch in ARCHS for s in standard_matrix() if s.impl == "mma"]


def test_the_standard_matrix_is_mma() -> None:
    assert len(SPECS) == len(ARCHS) * len(standard_matrix())


#: Archs whose every standard-matrix cubin is disassembled (nvdisasm costs about a compile's half); on the
#: others ptxas's report covers spills and local memory, and SASS_SAMPLE's cubins are disassembled.
SASS_ARCHS = ("sm_80", "sm_90")
SASS_SAMPLE = {s.name for s in SPECS if s.arch not in SASS_ARCHS and s.head_dim in (64, 128) and s.causal
               and not s.key_padding and not s.dropout}


def test_the_sass_sample_covers_both_directions_of_every_other_arch() -> None:
    got = {(s.arch, s.direction) for s in SPECS if s.name in SASS_SAMPLE}
    assert got == {(a, d) for a in ARCHS if a not in SASS_ARCHS for d in ("fwd", "bwd")}, sorted(got)


#: sm_80 / sm_90's whole standard matrix; the newer archs' SASS_SAMPLE (their other rows: exhaustive).
SPEC_ROWS = [pytest.param(s, id=s.name, marks=() if s.arch in SASS_ARCHS or s.name in SASS_SAMPLE else EXHAUSTIVE)
             for s in SPECS]


@pytest.mark.parametrize("spec", SPEC_ROWS)
def test_tensor_cores_no_spills_no_local_memory(spec) -> None:
    mod = compile(spec)
    for res in mod.resources:
        assert res.spill_bytes == 0 and res.stack_frame_bytes == 0, (res.kernel, res)
        assert res.smem_bytes <= ARCH_SMEM_OPTIN[spec.arch]
    if spec.arch not in SASS_ARCHS and spec.name not in SASS_SAMPLE:
        return
    mix = sass.instruction_mix(mod.cubin)
    assert mix is not None
    for res in mod.resources:
        ops = mix[res.kernel]
        assert ops.get("LDL", 0) == 0 and ops.get("STL", 0) == 0, (res.kernel, ops)
    main_ops = mix[mod.rendered.kernel("main").name]
    assert main_ops.get("HMMA", 0) > 0 and main_ops.get("LDSM", 0) > 0 and main_ops.get("LDGSTS", 0) > 0, main_ops


def test_done_when_command(capsys: pytest.CaptureFixture) -> None:
    """fagen compile --impl mma --head-dim 128 --dtype bfloat16 --causal --dropout --arch sm_90 --json"""
    rc = main(["compile", "--impl", "mma", "--head-dim", "128", "--dtype", "bfloat16", "--causal", "--dropout",
               "--arch", "sm_90", "--json"])
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["kernel"].rsplit("_", 1)[1] for r in rows] == ["pre", "main", "post"]
    for r in rows:
        assert r["spill_bytes"] == 0
        assert r["sass"].get("LDL", 0) == 0 and r["sass"].get("STL", 0) == 0
    assert rows[1]["sass"]["HMMA"] > 0


@pytest.mark.parametrize("direction", ["bwd", "fwd"])
@pytest.mark.parametrize("d", [136, 200, 240, 256])
def test_wide_head_dims_compile_without_spills(direction: str, d: int) -> None:
    """Beyond d = 128 the default tiles still fit the registers (backward: dK~/dV~ in smem;
    forward: 32-key steps), on sm_80's smaller shared memory too."""
    spec = KernelSpec(direction=direction, head_dim=d, dtype="bfloat16", causal=True, key_padding=True, dropout=True,
                      arch="sm_80")
    mod = compile(spec)
    assert all(r.spill_bytes == 0 for r in mod.resources), [(r.kernel, r.spill_bytes) for r in mod.resources]
    assert sass.instruction_mix(mod.cubin)[mod.rendered.kernel("main").name].get("HMMA", 0) > 0


DQ_ROWS = [(64, dict(causal=True)), (128, dict(causal=True)),
           (128, dict(causal=True, dropout=True, window=True, softcap=True, varlen=True)),
           (256, dict(causal=True, key_padding=True, dropout=True, alibi=True)),
           # the widest S/dP fragments: 128 keys per step at d = 128 (255 registers)
           (128, dict(causal=True, dropout=True, softcap=True, block_r=64, block_c=128, num_warps=8))]


@pytest.mark.parametrize("arch, d, flags", [  # the newer archs: d = 64 and the widest fragments; the rest exhaustive
    pytest.param(arch, d, flags, marks=() if arch in SASS_ARCHS or i in (0, len(DQ_ROWS) - 1) else EXHAUSTIVE)
    for arch in ARCHS for i, (d, flags) in enumerate(DQ_ROWS)])
def test_deterministic_dq_kernel_is_tensor_core_without_spills_or_atomics(arch: str, d: int, flags: dict) -> None:
    """The deterministic backward's dq kernel: HMMA, ldmatrix and cp.async, no spills or local memory,
    and no global reduction or atomic (RED/ATOM) in any of the four kernels."""
    if arch == "sm_120" and flags.get("num_warps") == 8:
        # known: the widest explicit dq tile (128 keys per step at d = 128, 8 warps) spills on sm_120,
        # whose ptxas budgets fewer registers for it; the default tiles do not
        pytest.xfail("dq kernel at 64x128, 8 warps, d = 128 spills on sm_120")
    spec = KernelSpec(head_dim=d, dtype="float16", deterministic=True, arch=arch, sram_bytes=ARCH_SMEM_OPTIN[arch],
                      **flags)
    assert spec.impl == "mma"
    mod = compile(spec)
    mix = sass.instruction_mix(mod.cubin)
    assert [r.kernel.rsplit("_", 1)[1] for r in mod.resources] == ["pre", "main", "dq", "post"]
    for res in mod.resources:
        ops = mix[res.kernel]
        assert res.spill_bytes == 0 and res.stack_frame_bytes == 0, (res.kernel, res)
        assert ops.get("LDL", 0) == 0 and ops.get("STL", 0) == 0, (res.kernel, ops)
        assert not [op for op in ops if op.startswith(("RED", "ATOM"))], (res.kernel, ops)
    dq_ops = mix[mod.rendered.kernel("dq").name]
    assert dq_ops.get("HMMA", 0) > 0 and dq_ops.get("LDSM", 0) > 0 and dq_ops.get("LDGSTS", 0) > 0, dq_ops


# One flag at a time at its default tile: each feature's per-element state beside the S/dP fragments
# (an additive bias once spilled 250-350 bytes beside 128 keys per forward step at d <= 96).
FEATURE_FLAGS = [dict(bias=True), dict(attn_mask=True), dict(key_padding=True), dict(dropout=True), dict(softcap=True),
                 dict(alibi=True), dict(window=True, varlen=True)]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("d", [32, 128, 256])  # the smallest, the widest in registers, the widest
@pytest.mark.parametrize("flags", FEATURE_FLAGS, ids=lambda f: "-".join(f))
def test_single_features_at_their_default_tiles_do_not_spill(arch: str, direction: str, d: int, flags: dict) -> None:
    spec = KernelSpec(direction=direction, head_dim=d, dtype="float16", arch=arch, **flags)
    if spec.impl != "mma":
        pytest.skip(f"{spec.name}: not an mma spec")
    mod = compile(spec)
    assert all(r.spill_bytes == 0 and r.stack_frame_bytes == 0 for r in mod.resources), \
        [(r.kernel, r.spill_bytes, r.stack_frame_bytes) for r in mod.resources]
