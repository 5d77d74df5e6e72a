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

// ---- huge scores: the exact softmax exponent (tensor-core forwards and backwards) ----
// The online softmax computes P~ = 2^(s sl2 - m sl2) as one FFMA, fmaf(s, sl2, -hi) with
// hi = fp32(m sl2). That is exact up to hi's rounding, lo = m sl2 - hi (|lo| <= ulp(hi) / 2), a
// factor 2^-lo common to the row: harmless while |hi| is small, but from |hi| ~ 2^31 on it
// overflows (P~ = inf, O = inf / inf = NaN) or underflows (l = 0) -- fp32 scores of 1e10 and up
// (bf16 inputs near 1e5, fp16 near 6e4). A row with |hi| >= FA_EXACT_FROM takes the exact
// exponent fmaf(s, sl2, -hi) - lo instead (fa_exp_lo: lo exactly, by one FMA); the warp
// decides once per tile (fa_warp_any), so the common tile keeps its one FFMA per score.
constexpr float FA_EXACT_FROM = 1024.f;  // 2^10: below it |lo| <= 2^-14, a factor below 1e-4
constexpr float FA_LOG2E = 1.4426950408889634f, FA_LN2 = 0.6931471805599453f;
FA_DEVICE bool fa_finite_from(float x, float bound) {  // bound <= |x| < inf (NaN: false)
    const float a = fabsf(x);
    return a >= bound && a <= 3.402823466e38f;
}
FA_DEVICE bool fa_exact_row(float hi) { return fa_finite_from(hi, FA_EXACT_FROM); }  // -inf: no key yet
// m sl2 = hi + lo exactly (hi = fp32(m sl2); lo by one FMA, exact: the product's rounding error)
FA_DEVICE float fa_exp_lo(float m, float sl2, float hi) { return fmaf(m, sl2, -hi); }
template <bool B> struct FaBool { static constexpr bool value = B; };  // a compile-time path tag
// Does any lane of the warp ask (one vote; every lane of the warp takes the same path)?
FA_DEVICE bool fa_warp_any(bool p) { return __any_sync(0xffffffffu, p) != 0; }
// The backward's lse in the exp2 domain, from the stored natural-log lse l: l log2 e, rounded to
// nearest. Past |l log2 e| = 2^24 (ulp >= 2) that rounding, and the stored lse's own, could put a
// score above lse by enough to overflow P (2^(ulp / 2): inf in a 16-bit P beyond 2^28, in fp32 beyond
// 2^32) into NaN gradients: such a row rounds up instead -- from l's next float (the stored lse is
// within half an ulp of the true one), the product and log2 e's own rounding one more ulp each -- so
// 2^(s sl2 - lse2) <= 1 for every score of the row. Exact gradients of rows from |lse2| >= 2^10 on
// take the forward's lse_lo (fa_lse_lo), relative to this very value.
FA_DEVICE float fa_next_up(float x) {  // the next float above a finite x (integer steps: no libm call)
    const int i = __float_as_int(x);
    return __int_as_float(x == 0.f ? 1 : (x > 0.f ? i + 1 : i - 1));
}
FA_DEVICE float fa_bwd_lse2(float l) {
    const float x = l * FA_LOG2E;
    if (!fa_finite_from(x, 16777216.f)) return x;  // below 2^24; inf / NaN as they are
    return fa_next_up(fa_next_up(fa_next_up(l) * FA_LOG2E));
}
// lse_lo of a row (forward epilogues; abi: lse_lo): the row's exact lse2 = m sl2 + log2l (log2l:
// log2 of its row sum, less log2 of the sink's o_scale with sinks) minus the backward's
// fa_bwd_lse2(lse), by one FMA (exact product); 0 for a row the backward takes as it is.
FA_DEVICE float fa_lse_lo(float lse, float m, float sl2, float log2l) {
    const float b = fa_bwd_lse2(lse);
    return fa_exact_row(b) ? fmaf(m, sl2, -b) + log2l : 0.f;
}
// The backward's exact exponent of a score: 2^(s sl2 - lse2 - lo) (lo: the row's lse_lo)
FA_DEVICE float fa_exact_arg(float s, float sl2, float lse2, float lo) { return fmaf(s, sl2, -lse2) - lo; }

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
