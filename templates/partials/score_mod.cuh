// ---- score modifications (fagen/reference.py states the same formulas in float64) ----
// Included by the header inside namespace fa after partials/masking.cuh; uses HAS_SOFTCAP,
// HAS_ALIBI, HAS_BIAS and T. For an allowed pair (row i, key j) of one (batch b, q head h):
//   s_raw = scale * qk                                   (qk = q_i . k_j)
//   s     = HAS_SOFTCAP ? softcap * tanh(s_raw / softcap) : s_raw  (16-bit inputs: fa_tanh below)
//   s    += HAS_ALIBI ? -slope * |i + shift - j| : 0     (slope = alibi_slopes[b * stride_alibi_b + h],
//                                                        shift as the masking rule's: flash-attn's convention)
//   s    += HAS_BIAS ? bias[b*sb + h*sh + i*sq + j*sk] : 0  (bias of dtype T, stride 0 = broadcast)
// and P = softmax over the allowed keys of s. Backward: with dS = dL/ds (P o (dP - D)),
//   dL/d(s_raw) = dS * (HAS_SOFTCAP ? 1 - tanh^2(s_raw / softcap) : 1)    (score_grad_raw)
//   dL/d(qk)    = scale * dL/d(s_raw)                                     (score_bwd)
//   dBias[b, h, i, j] = dS                                                (the bias enters additively)
// so dQ = sum_j score_bwd(...) k_j, dK = sum_i score_bwd(...) q_i. A kernel that folds the
// softmax scale (or log2 e) elsewhere uses score_grad_raw and multiplies by scale once.
// A (the accumulator type: float, double for float64 specs) is a template parameter.

// SOFTCAP_TANH_APPROX (16-bit inputs, the family's choice): tanh on the SFU (fa_tanh_approx, 2^-11 relative:
// the inputs' own rounding, as FlashAttention-2/3's softcap); else libm's tanhf / tanh. The argument stays an
// IEEE division s_raw / softcap: one multiply by 1 / softcap saves a few more instructions but made ptxas spill
// in some kernels (docs/performance.md, "Softcap's tanh on the SFU").
FA_DEVICE float fa_tanh(float x) { return SOFTCAP_TANH_APPROX ? fa_tanh_approx(x) : tanhf(x); }
FA_DEVICE double fa_tanh(double x) { return tanh(x); }

struct ScoreParams {
    float scale;    // softmax scale
    float softcap;  // > 0 when HAS_SOFTCAP
    float scale_cap;  // scale / softcap when HAS_SOFTCAP (a kernel may take tanh's argument as q.k scale_cap)
    float slope;    // ALiBi slope of (b, h) when HAS_ALIBI
    long long shift;  // the masking rule's diagonal shift (mask_shift) for ALiBi's distance
    const T* bias;    // at (b, h) already: bias + b * stride_b + h * stride_h, when HAS_BIAS
    long long bias_stride_q, bias_stride_k;
};

// mp: the sequence's MaskParams (its lengths give the shift); b, h: batch and q head.
FA_DEVICE ScoreParams make_score_params(float scale, float softcap, const float* alibi_slopes, long long stride_alibi_b,
                                        const T* bias, long long stride_bias_b, long long stride_bias_h,
                                        long long stride_bias_q, long long stride_bias_k, int b, int h,
                                        const MaskParams& mp) {
    ScoreParams sp;
    sp.scale = scale;
    sp.softcap = HAS_SOFTCAP ? softcap : 0.f;
    sp.scale_cap = HAS_SOFTCAP ? scale / softcap : 0.f;
    sp.slope = 0.f;
    if constexpr (HAS_ALIBI) sp.slope = alibi_slopes[(long long)b * stride_alibi_b + h];
    sp.shift = mask_shift(mp);
    sp.bias = nullptr;
    sp.bias_stride_q = stride_bias_q;
    sp.bias_stride_k = stride_bias_k;
    if constexpr (HAS_BIAS) sp.bias = bias + (long long)b * stride_bias_b + (long long)h * stride_bias_h;
    return sp;
}

// s_raw -> softcapped s_raw (identity without HAS_SOFTCAP).
template <typename A>
FA_DEVICE A score_softcap(A s_raw, const ScoreParams& sp) {
    if constexpr (HAS_SOFTCAP) {
        const A cap = (A)sp.softcap;
        return cap * fa_tanh(s_raw / cap);
    } else {
        return s_raw;
    }
}

// ALiBi's distance i + shift - j of element (row, col) in A (float: exact below 2^24 in magnitude, else the
// conversion's rounding; double: exact). A thread whose elements lie at compile-time offsets from a base element
// takes the base's distance once and each element's as base - k (one add of an immediate, exact): score_fwd_at.
template <typename A>
FA_DEVICE A alibi_dist(long long row, long long col, const ScoreParams& sp) {
    return (A)(row + sp.shift - col);
}
// s - slope |dist|: one fused multiply-add, the |.| an operand modifier.
FA_DEVICE float alibi_fma(float s, float dist, float slope) { return fmaf(fabsf(dist), -slope, s); }
FA_DEVICE double alibi_fma(double s, double dist, float slope) { return fma(fabs(dist), -(double)slope, s); }

// s plus the position-dependent additive terms (ALiBi + bias) of element (row, col), dist its alibi_dist.
template <typename A>
FA_DEVICE A score_add_at(A s, int row, int col, A dist, const ScoreParams& sp) {
    if constexpr (HAS_ALIBI) s = alibi_fma(s, dist, sp.slope);
    if constexpr (HAS_BIAS) {
        s += (A)fa_to_float(sp.bias[(long long)row * sp.bias_stride_q + (long long)col * sp.bias_stride_k]);
    }
    return s;
}

// The position-dependent additive terms (ALiBi + bias) of element (row, col); 0 without them.
template <typename A>
FA_DEVICE A score_additive(int row, int col, const ScoreParams& sp) {
    return score_add_at<A>((A)0, row, col, alibi_dist<A>(row, col, sp), sp);
}

// qk = q . k of an allowed pair -> the final score s the softmax takes; dist: the element's alibi_dist (unused
// without HAS_ALIBI).
template <typename A>
FA_DEVICE A score_fwd_at(A qk, int row, int col, A dist, const ScoreParams& sp) {
    // without ALiBi or a bias: the empty additive term's + 0 stays (an FADD that makes -0 +0), as the kernels were
    // measured with it (without it ptxas spills 56 bytes in the wgmma forward with softcap at d = 64 x 192 keys)
    if constexpr (!HAS_ALIBI && !HAS_BIAS) return score_softcap<A>(qk * (A)sp.scale, sp) + (A)0;
    return score_add_at<A>(score_softcap<A>(qk * (A)sp.scale, sp), row, col, dist, sp);
}
template <typename A>
FA_DEVICE A score_fwd(A qk, int row, int col, const ScoreParams& sp) {
    return score_fwd_at<A>(qk, row, col, alibi_dist<A>(row, col, sp), sp);
}

// dS = dL/ds -> dL/d(s_raw) with s_raw = scale * qk.
template <typename A>
FA_DEVICE A score_grad_raw(A ds, A qk, const ScoreParams& sp) {
    if constexpr (HAS_SOFTCAP) {
        const A t = fa_tanh(qk * (A)sp.scale / (A)sp.softcap);
        return ds * ((A)1 - t * t);
    } else {
        return ds;
    }
}

// dS = dL/ds -> dL/d(qk) (scale included): dQ_i += score_bwd(...) k_j, dK_j += score_bwd(...) q_i.
template <typename A>
FA_DEVICE A score_bwd(A ds, A qk, const ScoreParams& sp) {
    return score_grad_raw<A>(ds, qk, sp) * (A)sp.scale;
}
