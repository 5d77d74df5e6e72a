// ---- SIMT tile movement and block-wide FP32 GEMM (included by templates/simt/*) ----
// Copy rows [row0, row0 + ROWS) of a [*, N, *, d] tensor slice (batch b, head h)
// into a ROWS x HEAD_DIM smem tile with row stride LD; rows beyond n are zero.
template <int ROWS>
FA_DEVICE void load_tile(T* __restrict__ dst, const T* __restrict__ src, int row0, int n,
                         long long stride_s) {
    for (int e = threadIdx.x; e < ROWS * HEAD_DIM; e += NUM_THREADS) {
        const int r = e / HEAD_DIM, x = e - r * HEAD_DIM;
        const int gr = row0 + r;
        dst[r * LD + x] = gr < n ? src[(long long)gr * stride_s + x] : fa_from_float<T>(0.f);
    }
}

// Block-wide C[M x N] = sum_k A(m, k) * B(n, k), FP32 FMA, fed by element accessors.
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
        float acc[TM][TN];
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
            for (int j = 0; j < TN; ++j) acc[i][j] = 0.f;
        for (int kk = 0; kk < K; ++kk) {
            float av[TM], bv[TN];
#pragma unroll
            for (int i = 0; i < TM; ++i) av[i] = a(m0 + i * RM, kk);
#pragma unroll
            for (int j = 0; j < TN; ++j) bv[j] = b(n0 + j * RN, kk);
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
        }
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
            for (int j = 0; j < TN; ++j) epilogue(m0 + i * RM, n0 + j * RN, acc[i][j]);
    }
}
