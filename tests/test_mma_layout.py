"""The mma family's accumulator-fragment coordinates are stated once, in templates/mma/warp.cuh's
``MmaAccLayout`` (PTX ISA "Matrix Fragments for mma.m16n8k16 with floating point type": element e
of lane 4g + t at row g + 8 (e >> 1), column 2t + (e & 1)); kernels take them from there. The wgmma
family's warpgroup accumulator (a different atom, m64nNk16) states its own layout in templates/wgmma/."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TEMPLATES = REPO / "templates"
#: The formula written out by hand: the row g + 8 (e >> 1) or the column 2 t4 + (e & 1).
HAND_WRITTEN = re.compile(r"\bg \+ \(e >> 1\) ?\* ?8|\b2 ?\* ?t4 \+ \(e & 1\)|\bg \+ 8 \* \(e >> 1\)")


def test_fragment_layout_is_stated_once() -> None:
    warp = (TEMPLATES / "mma" / "warp.cuh").read_text()
    assert warp.count("struct MmaAccLayout") == 1
    assert "(lane >> 2) + ((e >> 1) << 3)" in warp and "((lane & 3) << 1) + (e & 1)" in warp
    found = {p.relative_to(TEMPLATES).as_posix(): len(HAND_WRITTEN.findall(p.read_text()))
             for p in sorted(TEMPLATES.rglob("*")) if p.is_file() and not p.is_relative_to(TEMPLATES / "wgmma")}
    written = {name: n for name, n in found.items() if n}
    assert written == {}, written
    users = [name for name in found if "MmaAccLayout::" in (TEMPLATES / name).read_text()]
    assert {"mma/bwd.cu.j2", "mma/fwd.cu.j2"} <= set(users)
    # the shared keep bits (both tensor-core families) take the family's layout as a parameter
    assert "Layout::row(lane, e)" in (TEMPLATES / "partials" / "philox.cuh").read_text()


def test_layout_matches_the_isa_model() -> None:
    """The struct's two expressions, evaluated here, give the ISA's C/D fragment coordinates."""
    def row(lane: int, e: int) -> int:
        return (lane >> 2) + ((e >> 1) << 3)

    def col(lane: int, e: int) -> int:
        return ((lane & 3) << 1) + (e & 1)

    cells = {(row(lane, e), col(lane, e)) for lane in range(32) for e in range(4)}
    assert cells == {(r, c) for r in range(16) for c in range(8)}  # each of the 16 x 8 elements once
    for lane in range(32):
        g, t = lane >> 2, lane % 4
        assert [(row(lane, i), col(lane, i)) for i in range(4)] == [(g, 2 * t), (g, 2 * t + 1),
                                                                   (g + 8, 2 * t), (g + 8, 2 * t + 1)]


def test_pds_step_is_written_once() -> None:
    """The per-element P/dS step (exp2 of the final score, dropout, dS through the softcap, dBias) is
    one device function of the backward (mma_pds), run over a warp's tiles by one stage (mma_bwd_pds of
    templates/mma/bwd_stages.cuh) that the main, two-dimensional and dq kernels call."""
    bwd = re.sub(r"//[^\n]*", "", (TEMPLATES / "mma" / "bwd.cu.j2").read_text())  # code only
    stages = re.sub(r"//[^\n]*", "", (TEMPLATES / "mma" / "bwd_stages.cuh").read_text())
    two_d = re.sub(r"//[^\n]*", "", (TEMPLATES / "mma" / "bwd_2d.cu.j2").read_text())
    assert bwd.count("FA_DEVICE MmaPds mma_pds(") == 1 and "mma_pds(" not in two_d
    assert re.search(r"mma_pds(<\w+>)?\(", stages)  # the stage runs the step
    main = bwd[bwd.index('{{ entry(kernels["main"]) }}'):bwd.index('{{ entry(kernels["dq"]) }}')]
    dq = bwd[bwd.index('{{ entry(kernels["dq"]) }}'):bwd.index('{{ prepost.post_kernel(kernels) }}')]
    called = re.compile(r"mma_bwd_pds<")
    assert called.search(main) and called.search(dq) and called.search(two_d)
    for text in (main, dq, two_d):  # nothing of the step is written out again in a kernel
        assert "score_grad_raw<" not in text and "score_fwd<" not in text and "mma_exp2(" not in text
