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
// read only inside the band (so inside both sequences); two keys at a time where `vec` (wg_rows_vec) and
// the tile's keys are all inside the sequence.
template <int N>
FA_DEVICE void wg_mask_scores_q(float (&s)[N], const WgRows<unsigned char>& mr, bool vec, bool cols_in, int j0, int t4,
                                const int (&lo)[2], const int (&hi)[2], const unsigned char* kpm_b, unsigned (&seen)[2],
                                float masked) {
    const int c0 = j0 + 2 * t4;
    if (vec && cols_in) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const bool row_in = lo[r] <= hi[r];  // a row past len_q has an empty band: nothing read
            const unsigned char* p = mr.p[r] + c0;
#pragma unroll
            for (int n = 0; n < N / 4; ++n) {
                const unsigned short two = row_in ? *reinterpret_cast<const unsigned short*>(p + 8 * n) : (unsigned short)0;
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int c = 8 * n + e, x = 4 * n + 2 * r + e;
                    bool ok = c >= lo[r] && c <= hi[r] && ((two >> (8 * e)) & 0xffu) != 0u;
                    if constexpr (HAS_KEY_PADDING) ok = ok && kpm_b[c0 + c] != 0;
                    seen[r] |= ok ? 1u : 0u;
                    if (!ok) s[x] = masked;
                }
            }
        }
    } else {
#pragma unroll
        for (int x = 0; x < N; ++x) {
            const int e = x & 3, r = e >> 1, c = 8 * (x >> 2) + (e & 1);
            bool ok = c >= lo[r] && c <= hi[r];
            if constexpr (HAS_KEY_PADDING) ok = ok && kpm_b[c0 + c] != 0;
            ok = ok && mr.p[r][(long long)(c0 + c) * mr.sk] != 0;
            seen[r] |= ok ? 1u : 0u;
            if (!ok) s[x] = masked;
        }
    }
}
{% endif %}
{% if HAS_BIAS %}
// Forward: the final scores s = score_fwd(q.k) of the tile's elements inside both sequences (the others
// are masked after: no bias read). With the bias the only score modification s = q.k scale + bias, two
// keys' bias at a time where `vec` (wg_rows_vec) and the tile's keys are all inside the sequence.
template <int N>
FA_DEVICE void wg_bias_scores_q(float (&s)[N], const WgRows<T>& br, bool vec, bool cols_in, int row0, int j0, int t4,
                                int len_q, int len_k, const ScoreParams& sp) {
    const int c0 = j0 + 2 * t4;
    if (!(HAS_SOFTCAP || HAS_ALIBI) && vec && cols_in) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const bool row_in = row0 + 8 * r < len_q;
            const T* p = br.p[r] + c0;
#pragma unroll
            for (int n = 0; n < N / 4; ++n) {
                float bx = 0.f, by = 0.f;
                if (row_in) {
                    const WgT2 two = *reinterpret_cast<const WgT2*>(p + 8 * n);
                    bx = fa_to_float(two.x);
                    by = fa_to_float(two.y);
                }
                s[4 * n + 2 * r] = fmaf(s[4 * n + 2 * r], sp.scale, bx);
                s[4 * n + 2 * r + 1] = fmaf(s[4 * n + 2 * r + 1], sp.scale, by);
            }
        }
    } else {
#pragma unroll
        for (int x = 0; x < N; ++x) {
            const int row = row0 + 8 * ((x >> 1) & 1), col = c0 + 8 * (x >> 2) + (x & 1);
            if (row < len_q && col < len_k) s[x] = score_fwd<float>(s[x], row, col, sp);
        }
    }
}
{% endif %}
{% if HAS_ATTN_MASK or HAS_BIAS_GRAD %}
// Backward: this thread's two keys (key0, key0 + 8) of a [B, H, Nq, Nk] operand at (b, q head h): element
// (Q row q, key r) at p[r] + q * sq; in[r]: key r is inside the sequence (a key past it is never touched).
template <typename E>
struct WgKeys {
    E* p[2];
    long long sq;
    bool in[2];
};
template <typename E>
FA_DEVICE WgKeys<E> wg_keys(E* base, long long stride_b, long long stride_h, long long stride_q, long long stride_k, int b,
                            int h, int key0, int len_k) {
    WgKeys<E> w;
    E* bh = base + (long long)b * stride_b + (long long)h * stride_h;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        w.p[r] = bh + (long long)(key0 + 8 * r) * stride_k;
        w.in[r] = key0 + 8 * r < len_k;
    }
    w.sq = stride_q;
    return w;
}
{% endif %}
{% if HAS_ATTN_MASK %}
// Backward: whether the mask lets Q row q (q < len_q) and key r of the thread take part (true outside the
// sequences, where P^T is 0 already: nothing read).
FA_DEVICE bool wg_mask_ok_k(const WgKeys<const unsigned char>& mk, int q, bool q_in, int r) {
    return !(q_in && mk.in[r]) || mk.p[r][(long long)q * mk.sq] != 0;
}
{% endif %}
{% if HAS_BIAS_GRAD %}
// Backward: dBias = dL/ds = P^T (dP^T - D) of the element (D unscaled: the producer stages D as is with
// dBias) at Q row q and key r, stored inside both sequences.
FA_DEVICE void wg_store_dbias(const WgKeys<float>& db, int q, bool q_in, int r, float ds) {
    if (q_in && db.in[r]) db.p[r][(long long)q * db.sq] = ds;
}
// dS^T = P^T (dP^T rp - D) scale in place of dP^T (rp = 1 / (1 - p) with dropout, else 1; dlt holds D),
// its unscaled value to dBias first.
FA_DEVICE void wg_ds_dbias(const float (&p)[BLOCK_R / 2], float (&dp)[BLOCK_R / 2], const float* dlt, float scale, float rp,
                           int i0, int t4, int len_q, const WgKeys<float>& db) {
#pragma unroll
    for (int x = 0; x < BLOCK_R / 2; ++x) {
        const int c = 8 * (x >> 2) + 2 * t4 + (x & 1);
        const float ds = p[x] * fmaf(dp[x], rp, -dlt[c]);
        wg_store_dbias(db, i0 + c, i0 + c < len_q, (x >> 1) & 1, ds);
        dp[x] = ds * scale;
    }
}
{% endif %}
}  // namespace fa
