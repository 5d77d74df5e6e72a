// The Hopper family's attn_mask and bias (rendered with either only): the per-element reads of
// partials/masking.cuh's data mask (mask[b, h, row, col] != 0: the pair takes part) and
// partials/score_mod.cuh's bias (s += bias[b, h, row, col], score_fwd), stride 0 = broadcast, at the
// positions inside the sequence (varlen too), and the backward's dBias = dL/ds (plain stores: each
// (b, h, row, col) is one step of one CTA). An m64nNk16 accumulator gives each thread, per 8-column
// group n, the elements 4n + e at accumulator row r0 + 8 (e >> 1) and column 8n + 2 t4 + (e & 1):
// in the forward (rows = Q rows) elements 4n and 4n + 1 are two adjacent keys of one row, one 2-element
// load where the key stride is 1 and the address aligned (wg_rows_vec); in the backward (rows = keys,
// S^T) they are two Q rows of one key, one load each. Pairs outside the sequences are never read.
namespace fa {
// This thread's two rows (row0, row0 + 8) of a [B, H, Nq, Nk] operand at (b, h): element (row r, col) at
// p[r] + col * sk (the rows' offsets hoisted out of the tile loop).
template <typename E>
struct WgRows {
    const E* p[2];
    long long sk;
};
template <typename E>
FA_DEVICE WgRows<E> wg_rows(const E* base, long long stride_b, long long stride_h, long long stride_q, long long stride_k,
                            int b, int h, int row0) {
    WgRows<E> w;
    const E* bh = base + (long long)b * stride_b + (long long)h * stride_h;
    w.p[0] = bh + (long long)row0 * stride_q;
    w.p[1] = bh + (long long)(row0 + 8) * stride_q;
    w.sk = stride_k;
    return w;
}
// Whether the warp reads its keys two at a time: key stride 1 and every lane's row start aligned to two
// elements (then 2 t4 + 8n + j0, even, keeps each pair aligned). Warp-uniform.
template <typename E>
FA_DEVICE bool wg_rows_vec(const WgRows<E>& w) {
    const bool ok = w.sk == 1 && ((((unsigned long long)w.p[0] | (unsigned long long)w.p[1]) & (2 * sizeof(E) - 1)) == 0);
    return !fa_warp_any(!ok);
}
// Two adjacent 16-bit elements, one 4-byte load.
struct alignas(4) WgT2 {
    T x, y;
};

{% if HAS_ATTN_MASK %}
// Forward, a tile with mask math (`lo` / `hi`: each row's band of allowed columns relative to the thread's
// first, j0 + 2 t4, as wg_row_band gives them; empty for a row past len_q, none past len_k): an element
// takes part iff it is in its row's band, its key is not padded and the mask holds it; the others take
// MASKED; seen[r] records whether row r has a taking part element in the thread's columns. The mask is
// read only inside the band (so inside both sequences). The common tile (every element of the warp's
// inside its band, keys two at a time: `vec`, wg_rows_vec) reads one pair per load and tests no band; the
// others (a band's edge, the sequences' ends, other mask layouts: a warp vote) test and read per element.
template <int N>
FA_DEVICE void wg_mask_scores_q(float (&s)[N], const WgRows<unsigned char>& mr, bool vec, int j0, int t4,
                                const int (&lo)[2], const int (&hi)[2], const unsigned char* kpm_b, unsigned (&seen)[2],
                                float masked) {
    const int c0 = j0 + 2 * t4;
    bool inside = vec;
#pragma unroll
    for (int r = 0; r < 2; ++r) inside = inside && lo[r] <= 0 && hi[r] >= 8 * (N / 4 - 1) + 1;
    if (fa_warp_any(!inside)) {
        // bit x of the words: element x takes part (a rolled loop: the tile's registers stay as they are)
        unsigned okw[(N + 31) / 32];
#pragma unroll
        for (int w = 0; w < (N + 31) / 32; ++w) okw[w] = 0u;
#pragma unroll 1
        for (int x = 0; x < N; ++x) {
            const int e = x & 3, r = e >> 1, c = 8 * (x >> 2) + (e & 1);
            bool ok = c >= (r ? lo[1] : lo[0]) && c <= (r ? hi[1] : hi[0]);
            if constexpr (HAS_KEY_PADDING) ok = ok && kpm_b[c0 + c] != 0;
            ok = ok && (r ? mr.p[1] : mr.p[0])[(long long)(c0 + c) * mr.sk] != 0;
            okw[x >> 5] |= (ok ? 1u : 0u) << (x & 31);
        }
#pragma unroll
        for (int x = 0; x < N; ++x) {
            const bool ok = ((okw[x >> 5] >> (x & 31)) & 1u) != 0u;
            seen[(x >> 1) & 1] |= ok ? 1u : 0u;
            if (!ok) s[x] = masked;
        }
    } else {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const unsigned char* p = mr.p[r] + c0;
            unsigned any = 0u;  // the OR of the row's taking part pairs: seen once per row, not per element
#pragma unroll
            for (int n = 0; n < N / 4; ++n) {
                unsigned two = *reinterpret_cast<const unsigned short*>(p + 8 * n);
                if constexpr (HAS_KEY_PADDING) {
                    if (kpm_b[c0 + 8 * n] == 0) two &= 0xff00u;
                    if (kpm_b[c0 + 8 * n + 1] == 0) two &= 0x00ffu;
                }
                any |= two;
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    if ((two & (0xffu << (8 * e))) == 0u) s[4 * n + 2 * r + e] = masked;
            }
            seen[r] |= any != 0u ? 1u : 0u;
        }
    }
}
{% endif %}
{% if HAS_BIAS %}
// Forward: the final scores s = score_fwd(q.k) of the tile's elements inside both sequences (the others
// are masked after: no bias read). With the bias the only score modification s = q.k scale + bias; the
// common tile (the warp's rows and keys inside the sequences, keys two at a time: `vec`, wg_rows_vec) reads
// one pair per load and tests no bounds; the others (the sequences' ends, other bias layouts: a warp vote)
// test and read per element.
template <int N>
FA_DEVICE void wg_bias_scores_q(float (&s)[N], const WgRows<T>& br, bool vec, int row0, int j0, int t4, int len_q,
                                int len_k, const ScoreParams& sp) {
    const int c0 = j0 + 2 * t4;
    const bool inside = !(HAS_SOFTCAP || HAS_ALIBI) && vec && j0 + 2 * N <= len_k && row0 + 8 < len_q;
    if (fa_warp_any(!inside)) {
        if constexpr (HAS_SOFTCAP || HAS_ALIBI) {
            const WgAlibi<> ad(row0, c0, sp);
#pragma unroll
            for (int x = 0; x < N; ++x) {
                const int row = row0 + 8 * ((x >> 1) & 1), col = c0 + 8 * (x >> 2) + (x & 1);
                if (row < len_q && col < len_k) s[x] = score_fwd_at<float>(s[x], row, col, ad.at(x), sp);
            }
        } else {
            // the elements' bias (0 outside the sequences) gathered by a rolled loop (the tile's registers stay as
            // they are), then s = q.k scale + bias as on the common tile
            float bv[N];
#pragma unroll 1
            for (int x = 0; x < N; ++x) {
                const int r = (x >> 1) & 1, row = row0 + 8 * r, col = c0 + 8 * (x >> 2) + (x & 1);
                bv[x] = row < len_q && col < len_k ? fa_to_float((r ? br.p[1] : br.p[0])[(long long)col * br.sk]) : 0.f;
            }
#pragma unroll
            for (int x = 0; x < N; ++x) s[x] = fmaf(s[x], sp.scale, bv[x]);
        }
    } else {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const T* p = br.p[r] + c0;
#pragma unroll
            for (int n = 0; n < N / 4; ++n) {
                const WgT2 two = *reinterpret_cast<const WgT2*>(p + 8 * n);
                s[4 * n + 2 * r] = fmaf(s[4 * n + 2 * r], sp.scale, fa_to_float(two.x));
                s[4 * n + 2 * r + 1] = fmaf(s[4 * n + 2 * r + 1], sp.scale, fa_to_float(two.y));
            }
        }
    }
}
{% endif %}
// Backward: this thread's two keys (key0, key0 + 8) of a [B, H, Nq, Nk] operand at (b, q head h): element
// (Q row q, key r) at p + 8 r sk + q * sq (wg_key_ptr); key r is inside the sequence iff 8 r < kin (a key past it
// is never touched);
// sq8 = 8 sq where a Q block's offsets are non-negative and fit 32 bits (off32), so a step's elements are a
// pointer plus a constant times sq8, one wide multiply-add each (wg_keys_at, wg_key_elem).
template <typename E>
struct WgKeys {
    E* p;
    long long sq, sk8;
    unsigned sq8;
    int kin;
    bool off32;
};
template <typename E>
FA_DEVICE WgKeys<E> wg_keys(E* base, long long stride_b, long long stride_h, long long stride_q, long long stride_k, int b,
                            int h, int key0, int len_k) {
    WgKeys<E> w;
    w.p = base + (long long)b * stride_b + (long long)h * stride_h + (long long)key0 * stride_k;
    w.sq = stride_q;
    w.sk8 = 8 * stride_k;
    w.kin = len_k - key0;
    w.off32 = stride_q >= 0 && stride_q * BLOCK_R < (1ll << 31);
    w.sq8 = w.off32 ? (unsigned)(8 * stride_q) : 0u;
    return w;
}
// Key r's (0 or 1, possibly a runtime value) row start: one pointer kept, the other an add away.
template <typename E>
FA_DEVICE E* wg_key_ptr(const WgKeys<E>& w, int r) {
    return r ? w.p + w.sk8 : w.p;
}
// A step's pointers: q[r] at Q row i0 + 2 t4 of key r; element x (Q row i0 + 8 (x >> 2) + 2 t4 + (x & 1), key
// (x >> 1) & 1) is q[(x >> 1) & 1] + ((x >> 2) sq8 + (x & 1) sq8 / 8) (wg_key_elem: 32-bit offsets, off32).
template <typename E>
struct WgKeysStep {
    E* q[2];
};
template <typename E>
FA_DEVICE WgKeysStep<E> wg_keys_at(const WgKeys<E>& w, int i0, int t4) {
    WgKeysStep<E> st;
#pragma unroll
    for (int r = 0; r < 2; ++r) st.q[r] = wg_key_ptr(w, r) + (long long)(i0 + 2 * t4) * w.sq;
    return st;
}
template <typename E>
FA_DEVICE E& wg_key_elem(const WgKeysStep<E>& st, unsigned sq8, int x) {
    return st.q[(x >> 1) & 1][(unsigned long long)(sq8 * (unsigned)(x >> 2) + (x & 1) * (sq8 >> 3))];
}
{% if BIAS_SMEM is defined %}
// Backward, the bias through shared memory (BIAS_SMEM, the bias the only score modification): each warp
// stages its 16 keys x the step's BLOCK_R Q rows (row r: 32 bytes, its two 8-key halves swapped where
// (r >> 2) & 1, so ldmatrix meets no bank conflict), zero outside the sequences, and reads them back with
// ldmatrix.trans as its S^T elements' layout: four per instruction, no per-element address.
FA_DEVICE int wg_bias_sm_at(int row, int h) { return row * 16 + 8 * (h ^ ((row >> 2) & 1)); }
// The warp's fill for Q rows from i0 (bw: its first key's column of Q row 0; kin: its keys inside the
// sequence, 16 when all): 16-byte cp.async where `vec` (key stride 1, rows 16-byte aligned) and every key
// is inside (a row past len_q zero-filled, not read), else element by element (a rolled loop, bounds
// tests). The caller waits (cp.async) and syncs the warp before reading.
FA_DEVICE void wg_bias_fill(T* sw, const T* bw, long long sq, long long sk, bool vec, int i0, int len_q, int kin,
                            int lane) {
    __syncwarp();  // the previous step's ldmatrix reads of sw came first
    if (vec && kin >= 16) {
        // lane: rows lane / 2 + 16 i, keys 8 (lane & 1) + 0..7; every row of the lane swizzled alike
        const int r0 = lane >> 1;
        const T* src = bw + (long long)(i0 + r0) * sq + 8 * (lane & 1);
        T* dst = sw + wg_bias_sm_at(r0, lane & 1);
        const int left = len_q - i0 - r0;  // row r0 + 16 i is inside iff 16 i < left
#pragma unroll
        for (int i = 0; i < BLOCK_R / 16; ++i) fa_cp_async_16(dst + 16 * 16 * i, src + (16 * i) * sq, 16 * i < left);
        fa_cp_async_commit();
    } else {
#pragma unroll 1
        for (int e = lane; e < 16 * BLOCK_R; e += 32) {
            const int row = e >> 4, k = e & 15;
            const float v = i0 + row < len_q && k < kin ? fa_to_float(bw[(long long)(i0 + row) * sq + k * sk]) : 0.f;
            sw[wg_bias_sm_at(row, k >> 3) + (k & 7)] = fa_from_float<T>(v);
        }
    }
}
// The step's bias in S^T's layout: element x (Q row 8 (x >> 2) + 2 t4 + (x & 1), key g + 8 ((x >> 1) & 1)) is
// half x & 1 of bf[x >> 3][(x & 7) >> 1] (wg_bias_at).
FA_DEVICE void wg_bias_frags(const T* sw, int lane, unsigned (&bf)[BLOCK_R / 16][4]) {
    fa_cp_async_wait_all();
    __syncwarp();  // every lane's copies / stores landed
    const int m = lane >> 3;  // matrix m of an x4: Q rows 8 (m >> 1) + (lane & 7) of the 16, keys 8 (m & 1) + 0..7
    const T* at = sw + wg_bias_sm_at(8 * (m >> 1) + (lane & 7), m & 1);
#pragma unroll
    for (int k = 0; k < BLOCK_R / 16; ++k) fa_ldmatrix_x4_trans(bf[k], at + 16 * 16 * k);
}
FA_DEVICE float wg_bias_at(const unsigned (&bf)[BLOCK_R / 16][4], int x) {
    const unsigned w = bf[x >> 3][(x & 7) >> 1];
    T two[2];
    memcpy(two, &w, sizeof(w));
    return fa_to_float(two[x & 1]);
}
{% endif %}
{% if HAS_ATTN_MASK %}
// Backward: whether the mask lets Q row q (q_in: q < len_q) and key r of the thread take part (true outside
// the sequences, where P^T is 0 already: nothing read).
FA_DEVICE bool wg_mask_ok_k(const WgKeys<const unsigned char>& mk, int q, bool q_in, int r) {
    // r may be a runtime value (a rolled loop): selects, not an indexed (local memory) array
    return !(q_in && 8 * r < mk.kin) || wg_key_ptr(mk, r)[(long long)q * mk.sq] != 0;
}
// The same for the step's elements of a tile with mask math, bit x % 32 of word x / 32 (element x: Q row
// i0 + 8 (x >> 2) + 2 t4 + (x & 1), key (x >> 1) & 1): a rolled loop, so the tile's registers stay as they are.
FA_DEVICE void wg_mask_bits_k(const WgKeys<const unsigned char>& mk, int i0, int t4, int len_q, unsigned (&okw)[BLOCK_R / 64]) {
#pragma unroll
    for (int w = 0; w < BLOCK_R / 64; ++w) okw[w] = 0u;
#pragma unroll 1
    for (int x = 0; x < BLOCK_R / 2; ++x) {
        const int q = i0 + 8 * (x >> 2) + 2 * t4 + (x & 1);
        okw[x >> 5] |= (wg_mask_ok_k(mk, q, q < len_q, (x >> 1) & 1) ? 1u : 0u) << (x & 31);
    }
}
{% endif %}
{% if HAS_BIAS_GRAD %}
// Backward: dBias = dL/ds = P^T (dP^T - D) of the element (D unscaled: the producer stages D as is with
// dBias) at Q row q and key r, stored inside both sequences.
FA_DEVICE void wg_store_dbias(const WgKeys<float>& db, int q, bool q_in, int r, float ds) {
    if (q_in && 8 * r < db.kin) wg_key_ptr(db, r)[(long long)q * db.sq] = ds;
}
// dS^T = P^T (dP^T rp - D) scale in place of dP^T (rp = 1 / (1 - p) with dropout, else 1; dlt holds D),
// its unscaled value to dBias first: `inside` (the step's rows and the thread's keys inside the sequences,
// 32-bit offsets) stores without bounds tests.
FA_DEVICE void wg_ds_dbias(const float (&p)[BLOCK_R / 2], float (&dp)[BLOCK_R / 2], const float* dlt, float scale, float rp,
                           int i0, int t4, int len_q, const WgKeys<float>& db, bool inside) {
    if (inside) {
        const WgKeysStep<float> st = wg_keys_at(db, i0, t4);
#pragma unroll
        for (int x = 0; x < BLOCK_R / 2; ++x) {
            const float ds = p[x] * fmaf(dp[x], rp, -dlt[8 * (x >> 2) + 2 * t4 + (x & 1)]);
            wg_key_elem(st, db.sq8, x) = ds;
            dp[x] = ds * scale;
        }
    } else {
        // per element with bounds tests (64-bit offsets), unrolled: no indexed (local memory) array
#pragma unroll
        for (int x = 0; x < BLOCK_R / 2; ++x) {
            const float ds = p[x] * fmaf(dp[x], rp, -dlt[8 * (x >> 2) + 2 * t4 + (x & 1)]);
            const int q = i0 + 8 * (x >> 2) + 2 * t4 + (x & 1);
            wg_store_dbias(db, q, q < len_q, (x >> 1) & 1, ds);
            dp[x] = ds * scale;
        }
    }
}
{% endif %}
}  // namespace fa
