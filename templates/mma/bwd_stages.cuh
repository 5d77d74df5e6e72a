{# The mma backward's stages as device functions, shared by its kernels: the one-dimensional main
   kernel (16 K/V rows per warp, transposed fragments), the two-dimensional one (mma/bwd_2d.cu.j2)
   and the deterministic dq kernel. Rendered inside mma/bwd.cu.j2 after mma_pds (the per-element
   step). Force-inlined (FA_DEVICE): the compiler sees the code the kernels spelled out before. #}
namespace fa {
// ---- mma backward: stages ---------------------------------------------------
// A fragment view: the caller's accumulator tiles as one index space. Element (n, e) is element e
// (MmaAccLayout) of the caller's n-th m16n8 tile of S (or P) and of dP (or dS); at(n, e) returns the
// pair's inputs (MmaPdsIn) in the caller's (thread, value) -> (Q row, key) layout: the 1-D kernel's
// transposed tiles (S^T: rows are keys), the 2-D kernel's and the dq kernel's S tiles.
struct MmaPdsIn {
    int row, col;     // the pair's Q row and key (the score modifications' and the bias gradient's)
    bool ok;          // an allowed pair (always true where the caller zeroes masked pairs after)
    bool keep;        // Z_ij (dropout's keep bit)
    float lse2, dlt;  // lse in the exp2 domain and D (or ds_scale x D) of the pair's Q row
    float lo;         // the row's lse_lo (EXACT only)
    float* dbias;     // dL/ds of the pair, or nullptr
};

// Algorithm 4 lines 13-20 over a warp's NT score tiles, the one S -> P -> dS of the family:
// P = exp2(s log2 e - lse2) (with the score modifications, from the final score), dropped by Z,
// dS = P (dP Z / (1 - p) - D) through the softcap, times ds_scale (mma_pds, per element). S(n, e) and
// DP(n, e) return the caller's registers (float&): S in, P out; dP in, dS out.
template <bool EXACT, int NT, class SAt, class DpAt, class In>
FA_DEVICE void mma_bwd_pds(SAt&& S, DpAt&& DP, In&& at, float scale_log2, float ds_scale, float rp_keep,
                           const ScoreParams& sp) {
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const MmaPdsIn x = at(n, e);
            float& s = S(n, e);
            float& dp = DP(n, e);
            const MmaPds r = mma_pds<EXACT>(s, dp, x.ok, x.keep, x.lse2, x.dlt, scale_log2, ds_scale, rp_keep, x.row, x.col,
                                            sp, x.dbias, x.lo);
            s = r.p;
            dp = r.ds;
        }
}

// Algorithm 4 line 12 for the plain score: masked pairs take no part, P and dS exactly 0 whatever dP or
// D hold (ok(n, e): the pair is allowed; the caller's band or the whole rule).
template <int NT, class SAt, class DpAt, class Ok>
FA_DEVICE void mma_bwd_zero_masked(SAt&& S, DpAt&& DP, Ok&& ok) {
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const bool o = ok(n, e);
            float& s = S(n, e);
            float& dp = DP(n, e);
            s = o ? s : 0.f;
            dp = o ? dp : 0.f;
        }
}
}  // namespace fa
