"""Algorithm 4 of FlashAttention (the backward pass), line by line: the one source of its texts.

Tri Dao, Daniel Y. Fu, Stefano Ermon, Atri Rudra, Christopher Ré. *FlashAttention: Fast and
Memory-Efficient Exact Attention with IO-Awareness*. NeurIPS 2022. arXiv:2205.14135
(Appendix B, Algorithm 4 "FlashAttention Backward Pass").

* :data:`REQUIRE` and :data:`PAPER` state the algorithm (the paper's lines, in plain text);
* :data:`ALG4` says what fagen's generated code does for each line that is a block of code: the
  templates emit it as ``// Algorithm 4 line N: ...`` comments (``alg4(N)`` in Jinja);
* :data:`ELSEWHERE` says where the remaining lines live (grid, other kernels, loop ends).

docs/algorithm4.md carries :func:`markdown` between markers; tests/test_docs.py checks that it is
current, and ``fagen.algorithm4.update("docs/algorithm4.md")`` rewrites it.
"""
from __future__ import annotations

from pathlib import Path

REQUIRE = ("Matrices Q, K, V, O, dO ∈ R^{N×d} in HBM, vectors ℓ, m ∈ R^N in HBM, on-chip SRAM of size M, "
           "softmax scaling constant τ ∈ R, masking function mask, dropout probability p_drop, "
           "pseudo-random number generator state R from the forward pass.")

#: Algorithm 4 as the paper states it (N x d matrices; the tilde marks an SRAM accumulator).
PAPER: dict[int, str] = {
    1: "Set the pseudo-random number generator state to R.",
    2: "Set block sizes B_c = ⌈M/4d⌉, B_r = min(⌈M/4d⌉, d).",
    3: "Divide Q into T_r = ⌈N/B_r⌉ blocks Q_1, …, Q_{T_r} of size B_r × d each, and divide K, V into "
       "T_c = ⌈N/B_c⌉ blocks K_1, …, K_{T_c} and V_1, …, V_{T_c}, of size B_c × d each.",
    4: "Divide O into T_r blocks O_1, …, O_{T_r} of size B_r × d each, divide dO into T_r blocks "
       "dO_1, …, dO_{T_r} of size B_r × d each, divide ℓ into T_r blocks ℓ_1, …, ℓ_{T_r} of size B_r each, "
       "divide m into T_r blocks m_1, …, m_{T_r} of size B_r each.",
    5: "Initialize dQ = (0)_{N×d} in HBM and divide it into T_r blocks dQ_1, …, dQ_{T_r} of size B_r × d "
       "each. Initialize dK = (0)_{N×d}, dV = (0)_{N×d} in HBM and divide dK, dV into T_c blocks "
       "dK_1, …, dK_{T_c} and dV_1, …, dV_{T_c}, of size B_c × d each.",
    6: "for 1 ≤ j ≤ T_c do",
    7: "Load K_j, V_j from HBM to on-chip SRAM.",
    8: "Initialize dK̃_j = (0)_{B_c×d}, dṼ_j = (0)_{B_c×d} on SRAM.",
    9: "for 1 ≤ i ≤ T_r do",
    10: "Load Q_i, O_i, dO_i, dQ_i, ℓ_i, m_i from HBM to on-chip SRAM.",
    11: "On chip, compute S_ij = τ Q_i K_jᵀ ∈ R^{B_r×B_c}.",
    12: "On chip, compute S_ij^masked = mask(S_ij).",
    13: "On chip, compute P_ij = diag(ℓ_i)⁻¹ exp(S_ij^masked − m_i) ∈ R^{B_r×B_c}.",
    14: "On chip, compute dropout mask Z_ij ∈ R^{B_r×B_c} where each entry has value 1/(1 − p_drop) with "
        "probability 1 − p_drop and value 0 with probability p_drop.",
    15: "On chip, compute P_ij^dropped = P_ij ∘ Z_ij (pointwise multiply).",
    16: "On chip, compute dṼ_j ← dṼ_j + (P_ij^dropped)ᵀ dO_i ∈ R^{B_c×d}.",
    17: "On chip, compute dP_ij^dropped = dO_i V_jᵀ ∈ R^{B_r×B_c}.",
    18: "On chip, compute dP_ij = dP_ij^dropped ∘ Z_ij (pointwise multiply).",
    19: "On chip, compute D_i = rowsum(dO_i ∘ O_i) ∈ R^{B_r}.",
    20: "On chip, compute dS_ij = P_ij ∘ (dP_ij − D_i) ∈ R^{B_r×B_c}.",
    21: "Write dQ_i ← dQ_i + τ dS_ij K_j ∈ R^{B_r×d} to HBM.",
    22: "On chip, compute dK̃_j ← dK̃_j + τ dS_ijᵀ Q_i ∈ R^{B_c×d}.",
    23: "end for",
    24: "Write dK_j ← dK̃_j, dV_j ← dṼ_j to HBM.",
    25: "end for",
    26: "Return dQ, dK, dV.",
}

#: Algorithm 4 line -> what the generated block implements (the templates' ``alg4(N)`` comments).
ALG4: dict[int, str] = {
    1: "set the RNG state to R = (seed, offset)",
    2: "block sizes B_c, B_r (compiled in from the spec)",
    6: "for each K/V block j (one thread block per (j, batch, head))",
    7: "load K_j, V_j from HBM to SRAM",
    8: "initialise dK~_j = dV~_j = 0 on SRAM",
    9: "for each Q block i",
    10: "load Q_i, dO_i, lse_i (= m_i + log l_i), D_i to SRAM",
    11: "S_ij = tau Q_i K_j^T",
    12: "S_ij^masked = mask(S_ij)",
    13: "P_ij = diag(l_i)^-1 exp(S_ij^masked - m_i) = exp(S_ij - lse_i)",
    14: "Z_ij = Philox keep-mask (replayed, not stored)",
    15: "P_ij^dropped = P_ij o Z_ij / (1 - p)",
    16: "dV~_j += (P_ij^dropped)^T dO_i",
    17: "dP_ij^dropped = dO_i V_j^T",
    18: "dP_ij = dP_ij^dropped o Z_ij / (1 - p)",
    19: "D_i = rowsum(dO_i o O_i) (precomputed by the preprocess kernel, eq. 13)",
    20: "dS_ij = P_ij o (dP_ij - D_i)",
    21: "dQ_i += tau dS_ij K_j (fp32 atomics in HBM)",
    22: "dK~_j += tau dS_ij^T Q_i",
    24: "write dK_j, dV_j to HBM",
}

#: The lines that are not a block of the main kernel, and where they live instead.
ELSEWHERE: dict[int, str] = {
    3: "tile index arithmetic: K/V block j starts at row j·B_c, Q block i at row i·B_r",
    4: "the same row offsets index O (through D_i), dO and lse = m + log ℓ",
    5: "the preprocess kernel zeroes the fp32 dQ accumulator; dK_j, dV_j are written whole at line 24",
    23: "a block-wide barrier before the next Q block reuses the SRAM tiles",
    25: "end of the thread block (the outer loop is the grid)",
    26: "the postprocess kernel converts the fp32 dQ accumulator to the input dtype",
}

BEGIN = "<!-- BEGIN fagen.algorithm4.markdown() -->"
END = "<!-- END fagen.algorithm4.markdown() -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown() -> str:
    """The statement of Algorithm 4 and fagen's line-by-line map, as a Markdown table."""
    rows = [f"**Require:** {_cell(REQUIRE)}", "",
            "| line | Algorithm 4 (Dao et al., 2022) | fagen |", "|---|---|---|"]
    for line in sorted(PAPER):
        ours = f"`{ALG4[line]}`" if line in ALG4 else ELSEWHERE[line]
        rows.append(f"| {line} | {_cell(PAPER[line])} | {_cell(ours)} |")
    return "\n".join(rows) + "\n"


def update(path: str | Path) -> bool:
    """Rewrite the text between :data:`BEGIN` and :data:`END` in ``path``; True if it changed."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{BEGIN}\n{markdown()}{END}{tail}"
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text

