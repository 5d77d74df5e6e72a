"""The wgmma family's codegen knobs: the backward's code-shape choices that only trade speed, their legal
ranges and their starting points (the family's rules in :mod:`fagen.families.wgmma.bwd`), as one
:class:`~fagen.families.codegen.CodegenSet` (:data:`CODEGEN`), searched by ``fagen tune-codegen`` and
stored in ``codegen_table.json`` beside this file, as the mma family's are.
"""
from __future__ import annotations

from pathlib import Path

from fagen.families.base import FamilySpec
from fagen.families.codegen import CodegenKnob, CodegenSet, always_legal
from fagen.families.wgmma.bwd import bias_smem, dv_early, softcap_rcp, split_dkv

__all__ = ["CODEGEN", "CODEGEN_KNOBS", "TABLE_PATH"]

#: The table the stored search writes and the family reads.
TABLE_PATH = Path(__file__).with_name("codegen_table.json")


def _bwd(fs: FamilySpec) -> bool:
    return fs.direction == "bwd"


def _one_acc(fs: FamilySpec) -> bool:
    """The one-accumulator tile (head dims up to 128; not :func:`~fagen.families.wgmma.bwd.split_dkv`)."""
    return fs.direction == "bwd" and not split_dkv(fs)


def _softcap_bwd(fs: FamilySpec) -> bool:
    return fs.direction == "bwd" and fs.has("softcap")


def _alibi_only_bwd(fs: FamilySpec) -> bool:
    return fs.direction == "bwd" and fs.has("alibi") and not fs.has("softcap") and not fs.has("bias")


def _dv_early_legal(fs: FamilySpec, v: int) -> str | None:
    if v and fs.has("softcap"):
        return "with softcap P^T is computed with dS^T once dP^T has retired: dV~ += P^T dO_i cannot go earlier"
    return None


def _bias_smem_legal(fs: FamilySpec, v: int) -> str | None:
    if v and (fs.has("softcap") or fs.has("alibi")):
        return "with softcap or ALiBi the score modification reads the bias per element (score_fwd)"
    return None


CODEGEN_KNOBS: tuple[CodegenKnob, ...] = (
    CodegenKnob("dv_early", "DV_EARLY", "bool", "bwd", (0, 1), _one_acc, _dv_early_legal,
                lambda fs: int(_one_acc(fs) and dv_early(fs)),
                "dV~ += P^T dO_i issued while dP^T is in flight (else with dK~)"),
    CodegenKnob("bias_smem", "BIAS_SMEM", "bool", "bwd", (0, 1), lambda fs: _one_acc(fs) and fs.has("bias"),
                _bias_smem_legal, lambda fs: int(_one_acc(fs) and bias_smem(fs)),
                "the bias staged in shared memory per consumer warp, read by ldmatrix (else per element from "
                "global memory)"),
    CodegenKnob("softcap_rcp", "SOFTCAP_RCP", "bool", "bwd", (0, 1), _softcap_bwd, always_legal,
                lambda fs: int(_softcap_bwd(fs) and softcap_rcp(fs)),
                "softcap's tanh argument as q.k (scale / softcap), one multiply (else the IEEE division of q.k scale "
                "by softcap)"),
    CodegenKnob("alibi_fold", "ALIBI_FOLD", "bool", "bwd", (0, 1), _alibi_only_bwd, always_legal, lambda fs: 0,
                "P^T's exp2 argument with ALiBi as q.k (scale log2 e) + (-lse log2 e - slope log2 e |dist|), the scale "
                "in the exponent's FFMA (else the score q.k scale - slope |dist| first, then times log2 e)"),
    CodegenKnob("ds_row_xor", "DS_ROW_XOR", "bool", "bwd", (0, 1), _bwd, always_legal, lambda fs: 0,
                "dS^T's stmatrix addresses: one held address XORed per k step (else one held address per k step)"),
    CodegenKnob("lse_rows_rolled", "LSE_ROWS_ROLLED", "bool", "bwd", (0, 1), _bwd, always_legal, lambda fs: 0,
                "the producer's lse_i / D_i rows in a rolled loop (else unrolled)"),
)

#: The wgmma family's codegen knobs and its table.
CODEGEN = CodegenSet("wgmma", CODEGEN_KNOBS, TABLE_PATH)
