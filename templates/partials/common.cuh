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

// ---- attention sinks (HAS_SINKS, forward epilogues) ----
// Row i's softmax runs over its scores and the sink logit s_h (which has no value). Given the
// log-sum-exp of the row's scores lse_s (-inf: no allowed key), returns the row's lse with the
// sink, logaddexp(lse_s, s_h), and sets *o_scale = exp(lse_s - lse): the factor the output,
// normalised over the scores alone, takes. A NaN row stays NaN; a row with no allowed key gets
// lse = s_h and o_scale = 0 (its output is the sink's: zero); s_h = -inf is no sink.
FA_DEVICE float fa_sink_lse(float lse_s, float sink, float* o_scale) {
    if (lse_s != lse_s || sink != sink) { *o_scale = lse_s + sink; return lse_s + sink; }
    if (sink == fa_neg_inf()) { *o_scale = 1.f; return lse_s; }
    if (lse_s == fa_neg_inf()) { *o_scale = 0.f; return sink; }
    const float d = lse_s - sink, e = expf(-fabsf(d));  // e <= 1: no overflow either way
    *o_scale = d >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
    return (d >= 0.f ? lse_s : sink) + log1pf(e);
}
FA_DEVICE double fa_sink_lse(double lse_s, double sink, double* o_scale) {
    if (lse_s != lse_s || sink != sink) { *o_scale = lse_s + sink; return lse_s + sink; }
    if (sink == (double)fa_neg_inf()) { *o_scale = 1.0; return lse_s; }
    if (lse_s == (double)fa_neg_inf()) { *o_scale = 0.0; return sink; }
    const double d = lse_s - sink, e = exp(-fabs(d));
    *o_scale = d >= 0.0 ? 1.0 / (1.0 + e) : e / (1.0 + e);
    return (d >= 0.0 ? lse_s : sink) + log1p(e);
}
