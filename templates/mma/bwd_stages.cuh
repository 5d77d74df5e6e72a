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

// ---- the 1-D main kernel's blocks (16 K/V rows per warp, transposed fragments) -------------------------
// Algorithm 4 line 7, the warp's K_j / V_j A-fragments held in registers over the Q loop (KV_IN_REGS:
// after the K/V copy has landed for every thread; warps past the block hold none).
template <int NK, int NV>
FA_DEVICE void mma_bwd_hold_kv(unsigned (&kf)[NK][4], unsigned (&vf)[NV][4], const Smem& s, int wrow, int lane, bool active) {
    if constexpr (KV_IN_REGS) {
        fa_cp_async_wait_all();
        fa_sync();
{% if VD %}
        if (active) {
#pragma unroll
            for (int kk = 0; kk < DPAD / 16; ++kk) mma_load_a(kf[kk], s.k, LD, wrow, kk * 16, lane);
#pragma unroll
            for (int kk = 0; kk < DPAD_V / 16; ++kk) mma_load_a(vf[kk], s.v, LD_V, wrow, kk * 16, lane);
        }
{% else %}
#pragma unroll
        for (int kk = 0; kk < DPAD / 16; ++kk) {
            if (!active) break;
            mma_load_a(kf[kk], s.k, LD, wrow, kk * 16, lane);
            mma_load_a(vf[kk], s.v, LD, wrow, kk * 16, lane);
        }
{% endif %}
    }
}

// Algorithm 4 line 10 for the next step (two stages): Q_i / dO_i of rows [row0, row0 + BLOCK_R) into stage
// nxt, and its lse_i / D_i rows: stored now with LSE_NOW (stage nxt is free: no registers held), else
// loaded into next_lse / next_delta for mma_bwd_stage_lse_late after the step.
FA_DEVICE void mma_bwd_prefetch(const Smem& s, MmaStepCopy& q_cp, MmaStepCopy& do_cp, int nxt, int row0, int len_q,
                                const float* lse_bh, const float* delta_bh, float d_stage, int tid, float& next_lse,
                                float& next_delta) {
    mma_step_copy(s.q + nxt * BLOCK_R * LD, q_cp, row0, len_q);
    mma_step_copy{{ "<HEAD_DIM_V, DPAD_V>" if VD else "" }}(s.do_ + nxt * BLOCK_R * {{ LDV }}, do_cp, row0, len_q);
    const int row = row0 + tid;
    if constexpr (LSE_NOW) {  // stage nxt is free (step i-1 is done with it): no registers held
        if (tid < BLOCK_R) {
            s.lse[nxt * BLOCK_R + tid] = row < len_q ? mma_lse2(lse_bh[row]) : -fa_neg_inf();
            s.delta[nxt * BLOCK_R + tid] = row < len_q ? delta_bh[row] * d_stage : 0.f;
        }
    } else if (tid < BLOCK_R && row < len_q) {
        next_lse = lse_bh[row];
        next_delta = delta_bh[row] * d_stage;
    }
}
// The next step's lse_i / D_i rows loaded by mma_bwd_prefetch (without LSE_NOW), into stage nxt.
FA_DEVICE void mma_bwd_stage_lse_late(const Smem& s, int nxt, int row0, int len_q, int tid, float next_lse,
                                      float next_delta) {
    if (tid < BLOCK_R) {
        s.lse[nxt * BLOCK_R + tid] = row0 + tid < len_q ? mma_lse2(next_lse) : -fa_neg_inf();
        s.delta[nxt * BLOCK_R + tid] = next_delta;
    }
}

// A chunk's lane addresses: its B fragments of Q_i / dO_i, lse / D at its Q rows 2 t4, 2 t4 + 1, dS^T at rows
// wrow + g, columns 2 t4; they advance by CHUNK_ROWS rows / columns per chunk (next).
struct MmaChunkPtrs {
    const T* nm;  // mma_load_b_nmajor(.., sq, LD, c0, 0, lane) (dO_i's: + DO_FROM_Q)
    const T* km;  // mma_load_b_kmajor(.., sq, LD, c0, 0, lane) (dO_i's: + DO_FROM_Q)
    const float* lse;  // lse_i at the lane's Q rows c0 + 2 t4 (D_i's: + DELTA_FROM_LSE)
    T* ds;  // dS^T at (wrow + g, c0 + 2 t4)
{% if VD %}
    const T* dnm;  // mma_load_b_nmajor(.., sdo, LD_V, c0, 0, lane): dO_i's (rows LD_V)
    const T* dkm;  // mma_load_b_kmajor(.., sdo, LD_V, c0, 0, lane)
{% endif %}
    FA_DEVICE void next() {
        nm += CHUNK_ROWS * LD;
        km += CHUNK_ROWS * LD;
{% if VD %}
        dnm += CHUNK_ROWS * LD_V;
        dkm += CHUNK_ROWS * LD_V;
{% endif %}
        lse += CHUNK_ROWS;
        ds += CHUNK_ROWS;
    }
};

// Algorithm 4 lines 11 and 17 for a chunk (transposed: S^T = K_j Q_i^T, dP^T = V_j dO_i^T, the warp's 16
// K/V rows x CHUNK_ROWS Q rows), added into st / dpt: A = K_j / V_j (kf / vf with KV_IN_REGS, else from
// smem at the warp's rows), B = Q_i / dO_i at the chunk's pointers.
template <int CS, int NK, int NV>
FA_DEVICE void mma_bwd_chunk_sdp(float (&st)[2 * CS][4], float (&dpt)[2 * CS][4], const unsigned (&kf)[NK][4],
                                 const unsigned (&vf)[NV][4], const Smem& s, const MmaChunkPtrs& cq, int wrow, int lane) {
{% if VD %}
    // S^T over the head dim's k16 steps, dP^T over the v head dim's.
#pragma unroll
    for (int kk = 0; kk < DPAD / 16; ++kk) {
        unsigned ak[4], bq[4];
        if constexpr (KV_IN_REGS) {
#pragma unroll
            for (int x = 0; x < 4; ++x) ak[x] = kf[kk][x];
        } else {
            mma_load_a(ak, s.k, LD, wrow, kk * 16, lane);
        }
#pragma unroll
        for (int sc = 0; sc < CS; ++sc) {  // mma_load_b_nmajor(bq, sq, LD, c0 + 16 sc, kk * 16, lane)
            fa_ldmatrix_x4(bq, cq.nm + sc * 16 * LD + kk * 16);
            mma_tile(st[2 * sc], ak, bq[0], bq[1]);
            mma_tile(st[2 * sc + 1], ak, bq[2], bq[3]);
        }
    }
#pragma unroll
    for (int kk = 0; kk < DPAD_V / 16; ++kk) {
        unsigned av[4], bdo[4];
        if constexpr (KV_IN_REGS) {
#pragma unroll
            for (int x = 0; x < 4; ++x) av[x] = vf[kk][x];
        } else {
            mma_load_a(av, s.v, LD_V, wrow, kk * 16, lane);
        }
#pragma unroll
        for (int sc = 0; sc < CS; ++sc) {  // mma_load_b_nmajor(bdo, sdo, LD_V, c0 + 16 sc, kk * 16, lane)
            fa_ldmatrix_x4(bdo, cq.dnm + sc * 16 * LD_V + kk * 16);
            mma_tile(dpt[2 * sc], av, bdo[0], bdo[1]);
            mma_tile(dpt[2 * sc + 1], av, bdo[2], bdo[3]);
        }
    }
{% else %}
#pragma unroll
    for (int kk = 0; kk < DPAD / 16; ++kk) {
        unsigned ak[4], av[4], bq[4], bdo[4];
        if constexpr (KV_IN_REGS) {
#pragma unroll
            for (int x = 0; x < 4; ++x) { ak[x] = kf[kk][x]; av[x] = vf[kk][x]; }
        } else {
            mma_load_a(ak, s.k, LD, wrow, kk * 16, lane);
            mma_load_a(av, s.v, LD, wrow, kk * 16, lane);
        }
#pragma unroll
        for (int sc = 0; sc < CS; ++sc) {  // mma_load_b_nmajor(bq, sq, LD, c0 + 16 sc, kk * 16, lane)
            fa_ldmatrix_x4(bq, cq.nm + sc * 16 * LD + kk * 16);
            fa_ldmatrix_x4(bdo, cq.nm + sc * 16 * LD + DO_FROM_Q + kk * 16);
            mma_tile(st[2 * sc], ak, bq[0], bq[1]);
            mma_tile(st[2 * sc + 1], ak, bq[2], bq[3]);
            mma_tile(dpt[2 * sc], av, bdo[0], bdo[1]);
            mma_tile(dpt[2 * sc + 1], av, bdo[2], bdo[3]);
        }
    }
{% endif %}
}

// Algorithm 4 line 14 for a chunk: Z_ij of the lane's transposed elements, bit 4n + e for element (n, e)
// (Q row i0 + c0 + n*8 + MmaAccLayout::col(lane, e), key col0 + wrow + MmaAccLayout::row(lane, e); global (row, col) =
// (row_offset + row, col_offset + col)). One Philox call covers keys 4c..4c+3 of one Q row: the 4 lanes
// g = 4a..4a+3 (same t) hold those keys for 2 Q rows x 2 key groups, each computes one call and the four
// share the keep bits. 0 without dropout.
template <int CS>
FA_DEVICE unsigned mma_bwd_chunk_keep_bits(unsigned long long seed, unsigned long long offset, long long bh,
                                           int row_offset, int col_offset, int i0, int c0, int col0, int wrow,
                                           unsigned drop_threshold, int lane, int g, int t4) {
    unsigned keep_bits = 0u;  // bit 4n + e: element (n, e) kept
    static_assert(8 * CS <= 32, "keep bits of a chunk in one word");
    if constexpr (HAS_DROPOUT) {
        const int m = g & 3;
        if ((col_offset & 3) == 0) {
#pragma unroll
            for (int n = 0; n < 2 * CS; ++n) {
                const unsigned mine = fa_keep4(seed, offset, (unsigned)bh, (unsigned)(row_offset + i0 + c0 + n * 8 + 2 * t4 + (m & 1)),
                                               (unsigned)(col_offset + col0 + wrow + (g & ~3) + (m >> 1) * 8), drop_threshold);
#pragma unroll
                for (int e = 0; e < 4; ++e)  // element e: key half e >> 1, Q column e & 1
                    keep_bits |= ((mma_shfl_u(mine, (lane & ~12) | (((e >> 1) * 2 + (e & 1)) << 2)) >> m) & 1u) << (4 * n + e);
            }
        } else {  // the 4-key groups straddle Philox calls: one call per element
            for (int n = 0; n < 2 * CS; ++n)
                for (int e = 0; e < 4; ++e)
                    keep_bits |= (fa_dropout_keep(seed, offset, (unsigned)bh, (unsigned)(row_offset + i0 + c0 + n * 8 + MmaAccLayout::col(lane, e)),
                                                  (unsigned)(col_offset + col0 + wrow + MmaAccLayout::row(lane, e)), drop_threshold) ? 1u : 0u)
                                 << (4 * n + e);
        }
    }
    return keep_bits;
}

// lse_i (exp2 domain) and D_i of the lane's Q rows c0 + 8n + 2t4 + {0, 1} of a chunk (lse: the chunk's
// pointer; D_i DELTA_FROM_LSE past it).
template <int CS>
FA_DEVICE void mma_bwd_chunk_rows(float (&lse2)[2 * CS][2], float (&dlt)[2 * CS][2], const float* lse) {
#pragma unroll
    for (int n = 0; n < 2 * CS; ++n) {
        const float2 l2 = *reinterpret_cast<const float2*>(lse + n * 8);
        const float2 d2 = *reinterpret_cast<const float2*>(lse + DELTA_FROM_LSE + n * 8);
        lse2[n][0] = l2.x;
        lse2[n][1] = l2.y;
        dlt[n][0] = d2.x;
        dlt[n][1] = d2.y;
    }
}

// Two fp32 m16n8 accumulator tiles (n8 tiles n, n + 1: 16 x 16) as the 16-bit A fragment of the next GEMM.
FA_DEVICE void mma_pack_a(unsigned (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
    a[0] = mma_pack(lo[0], lo[1]);
    a[1] = mma_pack(lo[2], lo[3]);
    a[2] = mma_pack(hi[0], hi[1]);
    a[3] = mma_pack(hi[2], hi[3]);
}

// A chunk's P^T and tau dS^T as A fragments (sub-chunk sc: 16 K/V rows x 16 Q rows), and dS^T -> smem for
// dQ (row = K/V row, column = Q row) unless IS_DETERMINISTIC (the dq kernel recomputes it).
template <int CS>
FA_DEVICE void mma_bwd_chunk_pack(unsigned (&ap)[CS][4], unsigned (&ads)[CS][4], const float (&st)[2 * CS][4],
                                  const float (&dpt)[2 * CS][4], T* ds) {
#pragma unroll
    for (int sc = 0; sc < CS; ++sc) {
        mma_pack_a(ap[sc], st[2 * sc], st[2 * sc + 1]);
        mma_pack_a(ads[sc], dpt[2 * sc], dpt[2 * sc + 1]);
    }
    if constexpr (!IS_DETERMINISTIC) {
#pragma unroll
        for (int sc = 0; sc < CS; ++sc) {
            unsigned* ds_lo = reinterpret_cast<unsigned*>(ds + 16 * sc);  // rows wrow + g, wrow + g + 8
            unsigned* ds_hi = reinterpret_cast<unsigned*>(ds + 16 * sc + 8 * DS_LD);
            ds_lo[0] = ads[sc][0];
            ds_hi[0] = ads[sc][1];
            ds_lo[4] = ads[sc][2];
            ds_hi[4] = ads[sc][3];
        }
    }
}

// Algorithm 4 lines 16 and 22 for a chunk: dV~ += P^T dO_i (A = P^T from registers, B = dO_i via
// ldmatrix.trans) and dK~ += tau dS^T Q_i (A = tau dS^T, B = Q_i via ldmatrix.trans: tau folded into dS).
template <int CS, class Acc>
FA_DEVICE void mma_bwd_chunk_dkdv(Acc& acc, const unsigned (&ap)[CS][4], const unsigned (&ads)[CS][4],
                                  const MmaChunkPtrs& cq, int lane) {
{% if VD %}
    // dV~ over the v head dim, dK~ over the head dim (each its own n16 steps).
#pragma unroll
    for (int sc = 0; sc < CS; ++sc)
#pragma unroll
    for (int nd = 0; nd < DPAD_V / 16; ++nd) {
        unsigned bdo[4];  // mma_load_b_kmajor(bdo, sdo, LD_V, c0 + 16 sc, nd * 16, lane)
        fa_ldmatrix_x4_trans(bdo, cq.dkm + sc * 16 * LD_V + nd * 16);
        acc.add_v(nd, ap[sc], bdo, lane);
    }
#pragma unroll
    for (int sc = 0; sc < CS; ++sc)
#pragma unroll
    for (int nd = 0; nd < DPAD / 16; ++nd) {
        unsigned bq[4];  // mma_load_b_kmajor(bq, sq, LD, c0 + 16 sc, nd * 16, lane)
        fa_ldmatrix_x4_trans(bq, cq.km + sc * 16 * LD + nd * 16);
        acc.add_k(nd, ads[sc], bq, lane);
    }
{% else %}
#pragma unroll
    for (int sc = 0; sc < CS; ++sc)
#pragma unroll
    for (int nd = 0; nd < DPAD / 16; ++nd) {
        unsigned bdo[4], bq[4];  // mma_load_b_kmajor(bdo, sdo, LD, c0 + 16 sc, nd * 16, lane)
        fa_ldmatrix_x4_trans(bdo, cq.km + sc * 16 * LD + DO_FROM_Q + nd * 16);
        fa_ldmatrix_x4_trans(bq, cq.km + sc * 16 * LD + nd * 16);
        acc.add_vk(nd, ap[sc], bdo, ads[sc], bq, lane);
    }
{% endif %}
}

// Algorithm 4 line 21 in the 1-D main kernel, DQ_2D: dQ~_i += tau dS K_j (fp32 atomics into the dQ~ rows
// of (b, h) in dq_accum, fp32 [tokens, heads, HEAD_DIM]) in (32 Q rows x 32 columns) blocks, one per warp: A = tau dS via
// ldmatrix.trans of dS^T (tau folded in), B = K_j via ldmatrix.trans. A fully masked row (lse = -inf,
// stored as +inf in slse) keeps dQ exactly 0 (no 0 * NaN from K); a fully visible tile inside the sequence
// (unguarded) adds with no guard at all.
FA_DEVICE void mma_bwd_dq_blocks(const Smem& s, const float* slse, float* dq_accum, const SeqInfo& si, int heads, int h, int i0, int len_q,
                                 bool full, bool unguarded, int warp, int lane, int g, int t4) {
    const long long dq_rs = (long long)heads * HEAD_DIM;  // dQ~ row stride (fp32 [tokens, heads, HEAD_DIM])
    float* const dq_bh = dq_accum + ((long long)si.q_tok0 * heads + h) * HEAD_DIM;  // dQ~ row 0 of (b, h)
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
        for (int m = 0; m < 2; ++m) mma_load_a_trans(af[m], s.ds, DS_LD, mr0 + 16 * m, kk * 16, lane);
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            unsigned bk[4];
            mma_load_b_kmajor(bk, s.k, LD, kk * 16, nc0 + 16 * c, lane);
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
    if (unguarded) {  // a fully visible tile inside the sequence: no guard at all
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
}

// Algorithm 4 line 21 in the 1-D main kernel otherwise: the warps share (16 Q rows x 16 columns) output
// tiles. Item `it` of DQ_ITEMS is Q-row tile it / DQ_WPM with the DQ_NCW column tiles from (it % DQ_WPM) *
// DQ_NCW: a warp loads its tile's dS fragments once per step and adds its columns, DQ_NCC at a time, from
// two row pointers computed once (rows g, g + 8 of the tile) with constant offsets; the row guards (as
// mma_bwd_dq_blocks) computed once per item, none where unguarded.
FA_DEVICE void mma_bwd_dq_tiles(const Smem& s, const float* slse, float* dq_accum, const SeqInfo& si, int heads, int h, int i0, int len_q,
                                bool full, bool unguarded, int warp, int lane, int g, int t4) {
    const long long dq_rs = (long long)heads * HEAD_DIM;  // dQ~ row stride (fp32 [tokens, heads, HEAD_DIM])
    float* const dq_bh = dq_accum + ((long long)si.q_tok0 * heads + h) * HEAD_DIM;  // dQ~ row 0 of (b, h)
#pragma unroll
    for (int k = 0; k < DQ_PER_WARP; ++k) {
        const int it = warp + k * NUM_WARPS;
        if (DQ_ITEMS % NUM_WARPS != 0 && it >= DQ_ITEMS) break;  // warp-uniform
        const int mt = it / DQ_WPM, nc0 = (it % DQ_WPM) * DQ_NCW;
        unsigned af[BLOCK_C / 16][4];
#pragma unroll
        for (int kk = 0; kk < BLOCK_C / 16; ++kk) mma_load_a_trans(af[kk], s.ds, DS_LD, mt * 16, kk * 16, lane);
        const int r0 = mt * 16 + g;  // this lane's rows r0 and r0 + 8 of the Q block
        bool row_ok[2] = {true, true};
        if (!unguarded) {
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
                    mma_load_b_kmajor(bk, s.k, LD, kk * 16, (nc0 + cc + c) * 16, lane);
                    mma_tile(acc[2 * c], af[kk], bk[0], bk[1]);
                    mma_tile(acc[2 * c + 1], af[kk], bk[2], bk[3]);
                }
            if (unguarded) {
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
