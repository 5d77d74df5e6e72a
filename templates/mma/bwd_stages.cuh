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

// Algorithm 4 line 8: dK~, dV~ of a warp's 16 K/V rows (fp32 m16n8 tiles: NTK across the head dim, NTV
// across the v head dim), at home in registers (MmaKvAccRegs) or in shared memory in fragment order
// (MmaKvAccSmem, ACC_IN_SMEM: [NT][4][32] floats per warp, element (n, e) of a lane at (4 n + e) 32 + lane).
// One interface: make(s, warp, lane, active) gives the zeroed accumulator, add_vk / add_v / add_k add the
// n16 step nd (tiles 2 nd, 2 nd + 1) of A B (b: the four B registers of the step), dk(n, e, lane) and
// dv(n, e, lane) read an element at the end.
template <int NTK, int NTV>
struct MmaKvAccRegs {
    float dk_[NTK][4], dv_[NTV][4];
    template <class S>
    static FA_DEVICE MmaKvAccRegs make(const S&, int, int, bool) {
        MmaKvAccRegs a;
        if constexpr (NTK == NTV) {
#pragma unroll
            for (int n = 0; n < NTK; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) { a.dk_[n][e] = 0.f; a.dv_[n][e] = 0.f; }
        } else {
#pragma unroll
            for (int n = 0; n < NTK; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) a.dk_[n][e] = 0.f;
#pragma unroll
            for (int n = 0; n < NTV; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) a.dv_[n][e] = 0.f;
        }
        return a;
    }
    // dV~ += P^T dO_i and dK~ += tau dS^T Q_i, step nd of both (the head dims alike)
    FA_DEVICE void add_vk(int nd, const unsigned (&ap)[4], const unsigned (&bdo)[4], const unsigned (&ads)[4],
                          const unsigned (&bq)[4], int) {
        mma_tile(dv_[2 * nd], ap, bdo[0], bdo[1]);
        mma_tile(dv_[2 * nd + 1], ap, bdo[2], bdo[3]);
        mma_tile(dk_[2 * nd], ads, bq[0], bq[1]);
        mma_tile(dk_[2 * nd + 1], ads, bq[2], bq[3]);
    }
    FA_DEVICE void add_v(int nd, const unsigned (&a)[4], const unsigned (&b)[4], int) {
        mma_tile(dv_[2 * nd], a, b[0], b[1]);
        mma_tile(dv_[2 * nd + 1], a, b[2], b[3]);
    }
    FA_DEVICE void add_k(int nd, const unsigned (&a)[4], const unsigned (&b)[4], int) {
        mma_tile(dk_[2 * nd], a, b[0], b[1]);
        mma_tile(dk_[2 * nd + 1], a, b[2], b[3]);
    }
    FA_DEVICE float dk(int n, int e, int) const { return dk_[n][e]; }
    FA_DEVICE float dv(int n, int e, int) const { return dv_[n][e]; }
};
template <int NTK, int NTV>
struct MmaKvAccSmem {
    float* dk_;  // the warp's [NTK][4][32]
    float* dv_;  // [NTV][4][32]
    template <class S>
    static FA_DEVICE MmaKvAccSmem make(const S& s, int warp, int lane, bool active) {
        MmaKvAccSmem a{s.dk + warp * 16 * (8 * NTK), s.dv + warp * 16 * (8 * NTV)};
        if constexpr (NTK == NTV) {
            if (active)
                for (int x = lane; x < 16 * (8 * NTK); x += 32) { a.dk_[x] = 0.f; a.dv_[x] = 0.f; }
        } else if (active) {
            for (int x = lane; x < 16 * (8 * NTK); x += 32) a.dk_[x] = 0.f;
            for (int x = lane; x < 16 * (8 * NTV); x += 32) a.dv_[x] = 0.f;
        }
        return a;
    }
    FA_DEVICE void add_vk(int nd, const unsigned (&ap)[4], const unsigned (&bdo)[4], const unsigned (&ads)[4],
                          const unsigned (&bq)[4], int lane) {
        float tv[2][4], tk[2][4];
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                tv[n][e] = dv_[((2 * nd + n) * 4 + e) * 32 + lane];
                tk[n][e] = dk_[((2 * nd + n) * 4 + e) * 32 + lane];
            }
        mma_tile(tv[0], ap, bdo[0], bdo[1]);
        mma_tile(tv[1], ap, bdo[2], bdo[3]);
        mma_tile(tk[0], ads, bq[0], bq[1]);
        mma_tile(tk[1], ads, bq[2], bq[3]);
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                dv_[((2 * nd + n) * 4 + e) * 32 + lane] = tv[n][e];
                dk_[((2 * nd + n) * 4 + e) * 32 + lane] = tk[n][e];
            }
    }
    static FA_DEVICE void add_to(float* sm, int nd, const unsigned (&a)[4], const unsigned (&b)[4], int lane) {
        float t[2][4];
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) t[n][e] = sm[((2 * nd + n) * 4 + e) * 32 + lane];
        mma_tile(t[0], a, b[0], b[1]);
        mma_tile(t[1], a, b[2], b[3]);
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) sm[((2 * nd + n) * 4 + e) * 32 + lane] = t[n][e];
    }
    FA_DEVICE void add_v(int nd, const unsigned (&a)[4], const unsigned (&b)[4], int lane) { add_to(dv_, nd, a, b, lane); }
    FA_DEVICE void add_k(int nd, const unsigned (&a)[4], const unsigned (&b)[4], int lane) { add_to(dk_, nd, a, b, lane); }
    FA_DEVICE float dk(int n, int e, int lane) const { return dk_[(n * 4 + e) * 32 + lane]; }
    FA_DEVICE float dv(int n, int e, int lane) const { return dv_[(n * 4 + e) * 32 + lane]; }
};
// The main kernel's accumulator home (ACC_IN_SMEM, fagen.families.mma: the head dim too wide for registers).
template <bool B, class A, class C> struct MmaPick { using type = A; };
template <class A, class C> struct MmaPick<false, A, C> { using type = C; };
using MmaKvAcc = typename MmaPick<ACC_IN_SMEM, MmaKvAccSmem<NT_D, {{ NTV }}>, MmaKvAccRegs<NT_D, {{ NTV }}>>::type;

// Algorithm 4 line 24 in the 1-D main kernel: dK_j = dK~ (tau already folded into dS), dV_j = dV~
// dv_scale (1 / (1 - p) with dropout), the warp's keys col0 + wrow + row(lane, e) inside the sequence,
// columns inside the head dims (DK, DV); a padded key's gradients are exactly 0 (0 * NaN in q or dO cannot
// leak in). JOINT: one pass over both (the same head dim), else dK then dV.
template <bool JOINT, int NTK, int NTV, int DK, int DV, class Acc>
FA_DEVICE void mma_bwd_store_dkdv(const Acc& acc, T* dk, T* dv, const SeqInfo& si, int b, int hk, long long stride_dk_b,
                                  long long stride_dk_s, long long stride_dk_h, long long stride_dv_b,
                                  long long stride_dv_s, long long stride_dv_h, int col0, int wrow, int lane,
                                  bool active, int len_k, const unsigned char* kpm_b, float dv_scale) {
    if constexpr (JOINT) {
#pragma unroll
        for (int n = 0; n < NTK; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = col0 + wrow + MmaAccLayout::row(lane, e);
                const int x = n * 8 + MmaAccLayout::col(lane, e);
                const float dkv = acc.dk(n, e, lane), dvv = acc.dv(n, e, lane);
                if (active && col < len_k && x < DK) {
                    const bool padded = HAS_KEY_PADDING && kpm_b[col] == 0;
                    dk[fa_row_offset(si.k_tok0, b, col, hk, stride_dk_b, stride_dk_s, stride_dk_h) + x] = fa_from_float<T>(padded ? 0.f : dkv);
                    dv[fa_row_offset(si.k_tok0, b, col, hk, stride_dv_b, stride_dv_s, stride_dv_h) + x] = fa_from_float<T>(padded ? 0.f : dvv * dv_scale);
                }
            }
    } else {
#pragma unroll
        for (int n = 0; n < NTK; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = col0 + wrow + MmaAccLayout::row(lane, e);
                const int x = n * 8 + MmaAccLayout::col(lane, e);
                const float dkv = acc.dk(n, e, lane);
                if (active && col < len_k && x < DK) {
                    const bool padded = HAS_KEY_PADDING && kpm_b[col] == 0;
                    dk[fa_row_offset(si.k_tok0, b, col, hk, stride_dk_b, stride_dk_s, stride_dk_h) + x] = fa_from_float<T>(padded ? 0.f : dkv);
                }
            }
#pragma unroll
        for (int n = 0; n < NTV; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = col0 + wrow + MmaAccLayout::row(lane, e);
                const int x = n * 8 + MmaAccLayout::col(lane, e);
                const float dvv = acc.dv(n, e, lane);
                if (active && col < len_k && x < DV) {
                    const bool padded = HAS_KEY_PADDING && kpm_b[col] == 0;
                    dv[fa_row_offset(si.k_tok0, b, col, hk, stride_dv_b, stride_dv_s, stride_dv_h) + x] = fa_from_float<T>(padded ? 0.f : dvv * dv_scale);
                }
            }
    }
}
}  // namespace fa
