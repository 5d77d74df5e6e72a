// ---- masking and dropout shared by every kernel -----------------------------
// Algorithm 4 line 12: may query `row` attend to key `col`? Rows/keys beyond
// the sequence are masked; causal is bottom-right aligned (col <= row + Nk - Nq);
// key padding: kpm[b * Nk + col] != 0 means the key takes part.
FA_DEVICE bool allowed(int row, int col, int seqlen_q, int seqlen_k,
                       const unsigned char* __restrict__ kpm, int b) {
    if (row >= seqlen_q || col >= seqlen_k) return false;
    if constexpr (IS_CAUSAL) {
        if (col > (long long)row + seqlen_k - seqlen_q) return false;  // 64-bit: Nq + Nk may exceed 2**31
    }
    if constexpr (HAS_KEY_PADDING) {
        if (kpm[(long long)b * seqlen_k + col] == 0) return false;
    }
    return true;
}

// Dropout multiplier of element (bh, row, col): 1/(1-p) if kept, 0 if dropped.
FA_DEVICE float dropout_scale(unsigned long long seed, unsigned long long offset, long long bh, int row, int col,
                              unsigned int drop_threshold, float rp_keep) {
    if constexpr (HAS_DROPOUT) {
        return fa_dropout_keep(seed, offset, (unsigned int)bh, (unsigned int)row, (unsigned int)col, drop_threshold)
                   ? rp_keep : 0.f;
    } else {
        return 1.f;
    }
}
