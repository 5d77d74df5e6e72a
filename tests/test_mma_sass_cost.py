"""benchmarks/sass_cost.py and the tile-loop walk it rests on (fagen.autotune.sassloops.tile_loop): a
hand-written SASS listing with a known answer, and fagen's own kernels, whose solved loop trips must
issue exactly the tensor-core instructions, copies and dQ reductions one tile pair needs."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from fagen import KernelSpec, compile, sass
from fagen.autotune.sassloops import opcode_class, tile_loop

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("sass_cost", REPO / "benchmarks" / "sass_cost.py")
sass_cost = importlib.util.module_from_spec(_spec)
sys.modules["sass_cost"] = sass_cost
_spec.loader.exec_module(sass_cost)

needs_nvdisasm = pytest.mark.skipif(sass.nvdisasm_path() is None, reason="nvdisasm (nvidia-cuda-nvdisasm) not installed")

LISTING = """\
\t.section\t.text.k,"ax",@progbits
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   HMMA.16816.F32 R8, R2, R4, R8 ;
.L_x_1:
        /*0020*/                   LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64] ;
        /*0030*/                   IADD3 R5, R5, 0x1, RZ ;
        /*0040*/              @!P0 BRA `(.L_x_1) ;
        /*0050*/               @P1 BRA `(.L_x_2) ;
        /*0060*/                   FSEL R3, R3, RZ, P2 ;
.L_x_2:
        /*0070*/               @P3 BRA `(.L_x_3) ;
        /*0080*/                   LDG.E.U16 R6, desc[UR4][R2.64] ;
        /*0090*/                   STS.U16 [R1], R6 ;
        /*00a0*/                   BRA `(.L_x_4) ;
.L_x_3:
        /*00b0*/                   LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64] ;
.L_x_4:
        /*00c0*/               @P4 BRA `(.L_x_5) ;
        /*00d0*/                   IMAD R7, R7, 0x2, RZ ;
.L_x_5:
        /*00e0*/              @!P5 BRA `(.L_x_0) ;
        /*00f0*/                   EXIT ;
"""


def test_walk_of_a_known_listing() -> None:
    """One HMMA per trip; 3 copies per tile pair: 1 in the if/else (its cp.async side, not the element
    copy) and 2 trips of the nested loop; the FSEL region is the mask (skipped on an interior tile,
    walked on a diagonal one); the integer-only region is walked."""
    loop = tile_loop(LISTING, "k", {"HMMA": 1, "LDGSTS": 3})
    assert loop is not None and (loop.head, loop.end) == (0x10, 0xE0)
    assert [(x.head, x.end, x.trips) for x in loop.loops] == [(0x20, 0x40, 2.0)] and not loop.unsolved
    mix = dict(loop.mix)
    assert mix == {"HMMA": 1, "LDGSTS": 3, "IADD3": 2, "BRA": 2 + 4, "IMAD": 1}
    assert loop.total() == 13 and "LDG" not in mix and "STS" not in mix
    diag = tile_loop(LISTING, "k", {"HMMA": 1, "LDGSTS": 3}, diagonal=True)
    assert diag.total() == 14 and dict(diag.mix)["FSEL"] == 1
    # a loop count the work cannot pin (no LDGSTS asked for) is counted once and reported
    once = tile_loop(LISTING, "k", {"HMMA": 1})
    assert [(x.head, x.end) for x in once.unsolved] == [(0x20, 0x40)] and once.total() == 13 - 3
    assert tile_loop(LISTING.replace("HMMA.16816.F32", "FFMA"), "k", {"HMMA": 1}) is None


ROLLED_LISTING = """\
\t.section\t.text.n,"ax",@progbits
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64] ;
        /*0020*/                   IMAD R7, R7, 0x2, RZ ;
.L_x_1:
        /*0030*/                   HMMA.16816.F32 R8, R2, R4, R8 ;
        /*0040*/                   HMMA.16816.F32 R12, R2, R4, R12 ;
        /*0050*/                   IADD3 R5, R5, 0x1, RZ ;
        /*0060*/              @!P0 BRA `(.L_x_1) ;
        /*0070*/                   FADD R3, R3, R6 ;
        /*0080*/              @!P5 BRA `(.L_x_0) ;
        /*0090*/                   EXIT ;
"""


def test_tensor_core_instructions_rolled_into_a_loop_of_their_own() -> None:
    """ptxas may roll a tile pair's HMMAs into a loop inside the tile loop (fagen's mma deterministic backward
    with softcap, ALiBi or a bias does): that inner loop holds as many HMMAs as the tile loop, but one trip of it
    issues a fifth of the pair's. The tile loop is then the enclosing one, the inner loop at its solved trips
    (before: one trip of the inner loop was taken for the pair, about 5x too few instructions per FLOP)."""
    loop = tile_loop(ROLLED_LISTING, "n", {"HMMA": 10, "LDGSTS": 1})
    assert (loop.head, loop.end) == (0x10, 0x80) and [(x.head, x.end, x.trips) for x in loop.loops] == [(0x30, 0x60, 5.0)]
    assert dict(loop.mix) == {"LDGSTS": 1, "IMAD": 1, "HMMA": 10, "IADD3": 5, "BRA": 5 + 1, "FADD": 1}
    # where one trip of the inner loop is the pair's work, it stays the tile loop
    inner = tile_loop(ROLLED_LISTING, "n", {"HMMA": 2})
    assert (inner.head, inner.end) == (0x30, 0x60) and inner.total() == 4


RARE_LISTING = """\
\t.section\t.text.r,"ax",@progbits
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   BAR.RED.OR.DEFER_BLOCKING 0x0, P1 ;
        /*0020*/                   B2R.RESULT RZ, P2 ;
        /*0030*/                   HMMA.16816.F32 R8, R2, R4, R8 ;
        /*0040*/               @P2 BRA `(.L_x_1) ;
        /*0050*/                   FFMA R3, R3, R4, -R5 ;
        /*0060*/                   BRA `(.L_x_2) ;
.L_x_1:
        /*0070*/                   LDG.E R6, desc[UR4][R2.64] ;
        /*0080*/                   FFMA R3, R3, R4, -R5 ;
        /*0090*/                   FADD R3, R3, -R6 ;
.L_x_2:
        /*00a0*/                   VOTE.ANY P3, P0 ;
        /*00b0*/              @!P3 BRA `(.L_x_3) ;
        /*00c0*/                   LDS R7, [R1] ;
        /*00d0*/                   FADD R3, R3, -R7 ;
.L_x_3:
        /*00e0*/              @!P5 BRA `(.L_x_0) ;
        /*00f0*/                   EXIT ;
"""


def test_walk_skips_the_huge_score_paths() -> None:
    """A branch on a bar.red.or result (B2R.RESULT) or a warp vote (VOTE.ANY) selects the code of
    rows with huge scores (templates/partials/common.cuh): skipped on an ordinary tile pair whatever
    its work (here an LDG / an LDS), taken or not by the predicate's polarity."""
    loop = tile_loop(RARE_LISTING, "r", {"HMMA": 1})
    mix = dict(loop.mix)
    assert "LDG" not in mix and "LDS" not in mix and "FADD" not in mix and mix["FFMA"] == 1
    # BAR, B2R, HMMA, the two rare branches (not taken / taken), FFMA, the else's BRA, VOTE, the loop's BRA
    assert mix["BRA"] == 4 and loop.total() == 9


def test_opcode_classes_and_reduction_width() -> None:
    assert [opcode_class(o) for o in ("HMMA", "LDSM", "LDGSTS", "REDG", "LDC", "ULDC", "IMAD", "BRA", "BSSY",
                                      "FFMA", "MUFU", "F2FP")] == \
        ["tensor", "ldsm", "mem", "mem", "int", "int", "int", "ctrl", "ctrl", "fp", "fp", "fp"]
    assert sass_cost.red_width("REDG.E.ADD.F32.FTZ.RN.STRONG.GPU") == 1
    assert sass_cost.red_width("REDG.E.ADD.F32x4.FTZ.RN.STRONG.GPU") == 4
    assert sass_cost.red_width("REDG.E.ADD.F32x2.FTZ.RN.STRONG.GPU") == 2
    assert sass_cost.pair_flops("bwd", 64, 128, 64) == 10 * 128 * 64 * 64
    assert sass_cost.pair_flops("fwd", 128, 64, 32) == 4 * 64 * 32 * 128


def test_parse_spec() -> None:
    assert sass_cost.parse_spec("direction=bwd,head_dim=128,causal=true,dtype=bfloat16,knobs=stages:1") == \
        {"direction": "bwd", "head_dim": 128, "causal": True, "dtype": "bfloat16", "knobs": {"stages": 1}}


@needs_nvdisasm
@pytest.mark.parametrize("fields", [dict(direction="bwd", head_dim=64, arch="sm_90"),
                                    dict(direction="bwd", head_dim=128, arch="sm_80", causal=True),
                                    dict(direction="fwd", head_dim=64, arch="sm_90", causal=True)],
                         ids=["bwd-d64-sm90", "bwd-d128-sm80-causal", "fwd-d64-sm90-causal"])
def test_default_kernels_issue_exactly_their_work(fields: dict) -> None:
    """The solved trips make one walked trip issue the pair's HMMAs (FLOPs / 4096 over the warps), its
    16-byte copies and (backward) one fp32 dQ add per element, with no loop left unsolved; the
    diagonal tile of a causal kernel costs more than an interior one."""
    spec = KernelSpec(dtype="float16", **fields)
    mod = compile(spec)
    text = sass.disassemble(mod.cubin)
    name = mod.rendered.kernel("main").name
    t, w, d = spec.tile, spec.num_warps, spec.head_dim
    loop, per = sass_cost.measure(text, name, spec.direction, d, d, t.block_r, t.block_c, w)
    assert not loop.unsolved
    # the pair's GEMMs, plus (forward) the row sums of P~ as P~ times a ones column (dropout: per row half)
    ones = t.block_r * t.block_c / 256 * (2 if spec.dropout else 1) if spec.direction == "fwd" else 0
    assert loop.count("HMMA") * w == sass_cost.pair_flops(spec.direction, d, t.block_r, t.block_c) / 4096 + ones
    copies = (t.block_r if spec.direction == "bwd" else t.block_c) * 2 * d / 8
    assert loop.count("LDGSTS") * w * 32 == pytest.approx(copies)
    if spec.direction == "bwd":
        reds = [i for i in sass.parse(text)[name] if i.opcode in ("RED", "REDG")]  # sm_80: RED, sm_90: REDG
        width = sass_cost.red_width(reds[0].mnemonic)
        assert loop.count(reds[0].opcode) * w * 32 * width == pytest.approx(t.block_r * d)
    assert per == pytest.approx(loop.total() * w * 1e6 / sass_cost.pair_flops(spec.direction, d, t.block_r, t.block_c))
    if spec.causal:
        diag, _ = sass_cost.measure(text, name, spec.direction, d, d, t.block_r, t.block_c, w, diagonal=True)
        assert diag.total() > loop.total()


@needs_nvdisasm
def test_a_deterministic_kernel_with_its_gemms_rolled_issues_its_work() -> None:
    """The mma deterministic backward with softcap: ptxas rolls the pair's HMMAs into a loop inside the tile loop;
    the walk counts the tile loop with that loop at its solved trips, so one trip issues the pair's HMMAs and
    copies (it counted one trip of the inner loop before: 149 instructions per 1e6 FLOPs for 1620)."""
    spec = KernelSpec(direction="bwd", head_dim=64, arch="sm_90", impl="mma", dtype="bfloat16", deterministic=True,
                      softcap=True)
    mod = compile(spec)
    text, name = sass.disassemble(mod.cubin), mod.rendered.kernel("main").name
    t, w, d = spec.tile, spec.num_warps, spec.head_dim
    loop, per = sass_cost.measure(text, name, "bwd", d, d, t.block_r, t.block_c, w, dq_atomics=False)
    assert not loop.unsolved and loop.count("HMMA") * w == sass_cost.pair_flops("bwd", d, t.block_r, t.block_c) / 4096
    assert loop.count("LDGSTS") * w * 32 == pytest.approx(t.block_r * 2 * d / 8)
    assert per == pytest.approx(loop.total() * w * 1e6 / sass_cost.pair_flops("bwd", d, t.block_r, t.block_c))


@needs_nvdisasm
def test_reference_cubins_are_found_inside_a_binary(tmp_path: Path) -> None:
    """A cubin embedded in a larger file (as in a shared library's fat binary, uncompressed) is found
    whole; a wheel (zip) of such files too."""
    import zipfile

    cubin = compile(KernelSpec(direction="fwd", head_dim=64)).cubin
    blob = tmp_path / "libx.so"
    blob.write_bytes(b"\x7fELF\x02\x01junk" + b"\0" * 100 + cubin + b"tail" * 10)
    assert sass_cost.cubins_in(blob) == [cubin]
    whl = tmp_path / "x.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.write(blob, "pkg/libx.so")
    assert sass_cost.cubins_in(whl) == [cubin]
    assert sass_cost.reference_rows(blob, "flash_") == []  # fagen's kernel names carry no FA2 traits


def test_cli_prints_the_table(capsys: pytest.CaptureFixture) -> None:
    if sass.nvdisasm_path() is None:
        pytest.skip("nvdisasm not installed")
    assert sass_cost.main(["--direction", "bwd", "--dtype", "float16", "--head-dim", "64", "--arch", "sm_90",
                           "--causal", "no"]) == 0
    out = capsys.readouterr().out
    assert "instr/1e6 FLOPs" in out and "fa_bwd_d64_fp16" in out


WS_LISTING = """\
\t.section\t.text.ws,"ax",@progbits
        /*0000*/               @P0 BRA `(.L_x_9) ;
.L_x_0:
        /*0010*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4], R2 ;
        /*0020*/              @!P1 BRA `(.L_x_7) ;
.L_x_1:
        /*0030*/                   HGMMA.64x128x16.F32 R24, gdesc[UR8], R24 ;
        /*0040*/                   HGMMA.64x128x16.F32 R24, gdesc[UR12], R24, gsb0 ;
        /*0050*/                   FFMA R3, R24, R5, -R6 ;
        /*0060*/                   SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR4+0x8], RZ ;
        /*0070*/              @!P2 BRA `(.L_x_0) ;
        /*0080*/                   EXIT ;
.L_x_9:
        /*0090*/                   UTMALDG.4D [UR8], [UR6] ;
.L_x_2:
        /*00a0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4+0x8], R2 ;
        /*00b0*/                   UTMALDG.4D [UR16], [UR6] ;
        /*00c0*/                   UTMALDG.4D [UR24], [UR6] ;
        /*00d0*/              @!P3 BRA `(.L_x_2) ;
        /*00e0*/                   EXIT ;
.L_x_7:
        /*00f0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4], R2 ;
        /*0100*/              @!P1 BRA `(.L_x_7) ;
        /*0110*/                   BRA `(.L_x_1) ;
"""


def test_walk_of_a_warp_specialised_listing() -> None:
    """The out-of-line retry of a spin wait (after the last EXIT, branching back into the consumer
    loop) closes a span around the whole kernel: no loop, skipped. The consumer loop is walked
    with its HGMMAs; the producer loop is the smallest holding a TMA load (the Q load before it
    is not counted); removing the EXIT rule would pick the retry's span."""
    consumer = tile_loop(WS_LISTING, "ws", {"HGMMA": 2})
    assert (consumer.head, consumer.end) == (0x10, 0x70) and not consumer.unsolved
    assert dict(consumer.mix) == {"SYNCS": 2, "BRA": 2, "HGMMA": 2, "FFMA": 1}
    producer = tile_loop(WS_LISTING, "ws", {"UTMALDG": 2}, anchor=("UTMALDG",), smallest=True)
    assert (producer.head, producer.end) == (0xA0, 0xD0) and dict(producer.mix)["UTMALDG"] == 2
    assert producer.total() == 4
    assert tile_loop(WS_LISTING, "ws", {"UTMALDG": 2}, anchor=("UTMALDG",)).head == 0xA0


@needs_nvdisasm
@pytest.mark.parametrize("fields", [dict(head_dim=64, arch="sm_90"), dict(head_dim=128, arch="sm_80")],
                         ids=["d64-sm90", "d128-sm80"])
def test_backward_mask_math_only_on_partial_tiles(fields: dict) -> None:
    """The default causal backward: a fully visible tile walks the chunk code without mask math (as many
    selects as the non-causal kernel, at most 1% more instructions: ptxas's register allocation of the
    two kernels may leave either a few moves ahead), and a diagonal tile adds one compare and the P / dS
    selects per element on top: at most 1.3x an interior tile."""
    def walk(causal: bool, diagonal: bool):
        spec = KernelSpec(direction="bwd", dtype="float16", causal=causal, **fields)
        mod = compile(spec)
        t = spec.tile
        loop, _ = sass_cost.measure(sass.disassemble(mod.cubin), mod.rendered.kernel("main").name, "bwd",
                                    spec.head_dim, spec.head_dim, t.block_r, t.block_c, spec.num_warps,
                                    diagonal=diagonal)
        return loop, t.block_r * t.block_c // (32 * spec.num_warps)  # score elements per lane and tile

    plain, _ = walk(False, False)
    interior, _ = walk(True, False)
    diag, elements = walk(True, True)
    assert interior.total() <= 1.01 * plain.total()
    assert interior.count("FSEL") == plain.count("FSEL")
    assert diag.count("FSEL") - interior.count("FSEL") >= 2 * elements  # P and dS of every element tested
    assert diag.total() <= 1.3 * interior.total()
