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

// Algorithm 4 line 21 in the 1-D main kernel (dQ~_i += tau dS K_j, fp32 atomics into dQ~ rows of
// (b, h): dq_bh, row stride dq_rs): A = tau dS via ldmatrix.trans of dS^T (sds, tau folded in), B = K_j
// (sk) via ldmatrix.trans; the warps share the output tiles. A fully masked row (lse = -inf, stored as
// +inf in slse) keeps dQ exactly 0 (no 0 * NaN from K). DQ_2D: one (32 Q rows x 32 columns) block
// per warp. Otherwise item it of DQ_ITEMS is Q-row tile it / DQ_WPM with the DQ_NCW column tiles from
// (it % DQ_WPM) * DQ_NCW: a warp loads its tile's dS fragments once per step and adds its columns,
// DQ_NCC at a time, from two row pointers computed once (rows g, g + 8 of the tile) with constant
// offsets. A fully visible tile (rows inside the sequence, every row with an allowed key) at a head dim
// of whole k16 steps adds with no guard at all; otherwise the row guards are computed once per item.
FA_DEVICE void mma_bwd_dq_add(const T* sds, const T* sk, const float* slse, float* dq_bh, long long dq_rs, int i0,
                              int len_q, bool full, int warp, int lane) {
    const int g = lane >> 2, t4 = lane & 3;
    const bool dq_unguarded = HEAD_DIM == DPAD && full;
    if constexpr (DQ_2D) {
        const int mr0 = (warp / (DPAD / 32)) * 32, nc0 = (warp % (DPAD / 32)) * 32;  // the warp's block
        float acc[2][4][4] = {};  // [m16 tile][n8 tile][fragment]
        bool row_ok[4];  // the lane's rows mr0 + g + 8 q: inside the sequence, some allowed key
#pragma unroll
        for (int q = 0; q < 4; ++q)
            row_ok[q] = i0 + mr0 + g + 8 * q < len_q && (full || slse[mr0 + g + 8 * q] != -fa_neg_inf());
#pragma unroll
        for (int kk = 0; kk < BLOCK_C / 16; ++kk) {
            unsigned af[2][4];
#pragma unroll
            for (int m = 0; m < 2; ++m) mma_load_a_trans(af[m], sds, DS_LD, mr0 + 16 * m, kk * 16, lane);
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                unsigned bk[4];
                mma_load_b_kmajor(bk, sk, LD, kk * 16, nc0 + 16 * c, lane);
#pragma unroll
                for (int m = 0; m < 2; ++m) {
                    mma_tile(acc[m][2 * c], af[m], bk[0], bk[1]);
                    mma_tile(acc[m][2 * c + 1], af[m], bk[2], bk[3]);
                }
            }
        }
        // the lane's rows mr0 + g + 8 q (q < 4) of the Q block: one pointer, constant 8-row steps
        float* dq_row[4];
        dq_row[0] = dq_bh + (long long)(i0 + mr0 + g) * dq_rs + nc0 + 2 * t4;
#pragma unroll
        for (int q = 1; q < 4; ++q) dq_row[q] = dq_row[q - 1] + 8 * dq_rs;
        if (dq_unguarded) {  // a fully visible tile inside the sequence: no guard at all
#pragma unroll
            for (int q = 0; q < 4; ++q)
#pragma unroll
                for (int c = 0; c < 4; ++c)
                    fa_red_add_f32x2(dq_row[q] + 8 * c, acc[q >> 1][c][2 * (q & 1)], acc[q >> 1][c][2 * (q & 1) + 1]);
        } else {
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                if (row_ok[q]) {
#pragma unroll
                    for (int c = 0; c < 4; ++c)
                        fa_red_add_f32x2(dq_row[q] + 8 * c, acc[q >> 1][c][2 * (q & 1)], acc[q >> 1][c][2 * (q & 1) + 1]);
                }
            }
        }
    } else
#pragma unroll
    for (int k = 0; k < DQ_PER_WARP; ++k) {
        const int it = warp + k * NUM_WARPS;
        if (DQ_ITEMS % NUM_WARPS != 0 && it >= DQ_ITEMS) break;  // warp-uniform
        const int mt = it / DQ_WPM, nc0 = (it % DQ_WPM) * DQ_NCW;
        unsigned af[BLOCK_C / 16][4];
#pragma unroll
        for (int kk = 0; kk < BLOCK_C / 16; ++kk) mma_load_a_trans(af[kk], sds, DS_LD, mt * 16, kk * 16, lane);
        const int r0 = mt * 16 + g;  // this lane's rows r0 and r0 + 8 of the Q block
        bool row_ok[2] = {true, true};
        if (!dq_unguarded) {
#pragma unroll
            for (int r = 0; r < 2; ++r)
                row_ok[r] = i0 + r0 + 8 * r < len_q && (full || slse[r0 + 8 * r] != -fa_neg_inf());
        }
        float* dq_r0 = dq_bh + (long long)(i0 + r0) * dq_rs + nc0 * 16 + 2 * t4;
        float* const dq_row[2] = {dq_r0, dq_r0 + 8 * dq_rs};
#pragma unroll
        for (int cc = 0; cc < DQ_NCW; cc += DQ_NCC) {
            float acc[2 * DQ_NCC][4] = {};
#pragma unroll
            for (int kk = 0; kk < BLOCK_C / 16; ++kk)
#pragma unroll
                for (int c = 0; c < DQ_NCC; ++c) {
                    unsigned bk[4];
                    mma_load_b_kmajor(bk, sk, LD, kk * 16, (nc0 + cc + c) * 16, lane);
                    mma_tile(acc[2 * c], af[kk], bk[0], bk[1]);
                    mma_tile(acc[2 * c + 1], af[kk], bk[2], bk[3]);
                }
            if (dq_unguarded) {
#pragma unroll
                for (int c = 0; c < 2 * DQ_NCC; ++c)
#pragma unroll
                    for (int r = 0; r < 2; ++r)
                        fa_red_add_f32x2(dq_row[r] + (cc * 2 + c) * 8, acc[c][2 * r], acc[c][2 * r + 1]);
                continue;
            }
            if constexpr (HEAD_DIM == DPAD) {  // one guard per row over its 2 DQ_NCC reductions
#pragma unroll
                for (int r = 0; r < 2; ++r)
                    if (row_ok[r]) {
#pragma unroll
                        for (int c = 0; c < 2 * DQ_NCC; ++c)
                            fa_red_add_f32x2(dq_row[r] + (cc * 2 + c) * 8, acc[c][2 * r], acc[c][2 * r + 1]);
                    }
                continue;
            }
#pragma unroll
            for (int c = 0; c < 2 * DQ_NCC; ++c)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int off = (cc * 2 + c) * 8;  // column (nc0 * 16 + off + 2 t4) of dQ
                    if constexpr (HEAD_DIM % 2 == 0) {  // both columns in or both past the head dim
                        if (row_ok[r] && nc0 * 16 + off + MmaAccLayout::col(lane, 0) < HEAD_DIM)
                            fa_red_add_f32x2(dq_row[r] + off, acc[c][2 * r], acc[c][2 * r + 1]);
                    } else {
#pragma unroll
                        for (int x = 0; x < 2; ++x)
                            if (row_ok[r] && nc0 * 16 + off + MmaAccLayout::col(lane, x) < HEAD_DIM)
                                fa_atomic_add(dq_row[r] + off + x, acc[c][2 * r + x]);
                    }
                }
        }
    }
}
}  // namespace fa
