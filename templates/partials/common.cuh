// ---- masking and tile movement shared by every kernel ---------------------
// Algorithm 4 line 12: may query `row` attend to key `col`? Rows/keys beyond
// the sequence are masked; causal is bottom-right aligned (col <= row + Nk - Nq);
// key padding: kpm[b * Nk + col] != 0 means the key takes part.
FA_DEVICE bool allowed(int row, int col, int seqlen_q, int seqlen_k,
                       const unsigned char* __restrict__ kpm, int b) {
    if (row >= seqlen_q || col >= seqlen_k) return false;
    if constexpr (IS_CAUSAL) {
        if (col > row + seqlen_k - seqlen_q) return false;
    }
    if constexpr (HAS_KEY_PADDING) {
        if (kpm[(long long)b * seqlen_k + col] == 0) return false;
    }
    return true;
}

// Copy rows [row0, row0 + ROWS) of a [*, N, *, d] tensor slice (batch b, head h)
// into a dense ROWS x HEAD_DIM smem tile; rows beyond n are zero.
template <int ROWS>
FA_DEVICE void load_tile(T* __restrict__ dst, const T* __restrict__ src, int row0, int n,
                         long long stride_s) {
    for (int e = threadIdx.x; e < ROWS * HEAD_DIM; e += NUM_THREADS) {
        const int r = e / HEAD_DIM, x = e - r * HEAD_DIM;
        const int gr = row0 + r;
        dst[e] = gr < n ? src[(long long)gr * stride_s + x] : fa_from_float<T>(0.f);
    }
}

// Dropout multiplier of element (bh, row, col): 1/(1-p) if kept, 0 if dropped.
FA_DEVICE float dropout_scale(unsigned long long seed, unsigned long long offset, int bh, int row, int col,
                              unsigned int drop_threshold, float rp_keep) {
    if constexpr (HAS_DROPOUT) {
        return fa_dropout_keep(seed, offset, (unsigned int)bh, (unsigned int)row, (unsigned int)col, drop_threshold)
                   ? rp_keep : 0.f;
    } else {
        return 1.f;
    }
}
