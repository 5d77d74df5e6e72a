// ---- SIMT tile movement and block-wide FP32 GEMM (included by templates/simt/*) ----
// Acc: the type every on-chip accumulator, score and row statistic has -- double for a float64
// spec (so float64 keeps double precision end to end), float otherwise.
using Acc = {{ acc }};
FA_DEVICE float fa_exp(float x) { return expf(x); }
FA_DEVICE double fa_exp(double x) { return exp(x); }
FA_DEVICE float fa_log(float x) { return logf(x); }
FA_DEVICE double fa_log(double x) { return log(x); }
FA_DEVICE float fa_fma(float a, float b, float c) { return fmaf(a, b, c); }
FA_DEVICE double fa_fma(double a, double b, double c) { return fma(a, b, c); }

// Element offset of row 0 of batch b's sequence in a [B, N, H, d] tensor (stride_b, stride_s), or,
// packed (IS_VARLEN: [total, H, d], stride_b ignored), of its first token tok0.
FA_DEVICE long long seq_base(int b, long long tok0, long long stride_b, long long stride_s) {
    return IS_VARLEN ? tok0 * stride_s : (long long)b * stride_b;
}
// Element offset of row 0 of (batch b, head h) in lse / delta: [B, H, Nq] or, packed, [H, total_q].
FA_DEVICE long long lse_base(int b, int h, long long q_tok0, long long stride_lse_b, long long stride_lse_h) {
    return (long long)b * stride_lse_b + (long long)h * stride_lse_h + (IS_VARLEN ? q_tok0 : 0);
}

// Copy rows [row0, row0 + ROWS) of a [*, N, *, W] tensor slice (batch b, head h)
// into a ROWS x W smem tile with row stride LDW; rows beyond n are zero. W, LDW: HEAD_DIM, LD
// (q, k), or HEAD_DIM_V, LD_V (v, dO).
template <int ROWS, int W = HEAD_DIM, int LDW = LD>
FA_DEVICE void load_tile(T* __restrict__ dst, const T* __restrict__ src, int row0, int n,
                         long long stride_s) {
    for (int e = threadIdx.x; e < ROWS * W; e += NUM_THREADS) {
        const int r = e / W, x = e - r * W;
        const int gr = row0 + r;
        dst[r * LDW + x] = gr < n ? src[(long long)gr * stride_s + x] : fa_from_float<T>(0.f);
    }
}

// Block-wide C[M x N] = sum_k A(m, k) * B(n, k), FMA in Acc (fp32; fp64 for float64), fed by element accessors.
// Each thread owns a TM x TN register micro-tile whose rows are m0 + i*(M/TM) and columns
// n0 + j*(N/TN): a warp's threads take consecutive n0, so B reads walk consecutive smem
// rows (conflict-free with the padded strides) and A reads are broadcasts.
// epilogue(m, n, acc) consumes each result; no barrier inside.
template <int M, int N, int K, typename FA, typename FB, typename FE>
FA_DEVICE void block_gemm(FA a, FB b, FE epilogue) {
    constexpr int TM = 4, TN = 4;
    static_assert(M % TM == 0 && N % TN == 0, "block_gemm: M and N must be multiples of 4");
    constexpr int RM = M / TM, RN = N / TN;
    for (int t = threadIdx.x; t < RM * RN; t += NUM_THREADS) {
        const int m0 = t / RN, n0 = t - m0 * RN;
        Acc acc[TM][TN];
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
            for (int j = 0; j < TN; ++j) acc[i][j] = 0.f;
        for (int kk = 0; kk < K; ++kk) {
            Acc av[TM], bv[TN];
#pragma unroll
            for (int i = 0; i < TM; ++i) av[i] = a(m0 + i * RM, kk);
#pragma unroll
            for (int j = 0; j < TN; ++j) bv[j] = b(n0 + j * RN, kk);
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < TN; ++j) acc[i][j] = fa_fma(av[i], bv[j], acc[i][j]);
        }
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
            for (int j = 0; j < TN; ++j) epilogue(m0 + i * RM, n0 + j * RN, acc[i][j]);
    }
}
