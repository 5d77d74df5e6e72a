// ---- dropout shared by every kernel (the masking rule is partials/masking.cuh) ----
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
