// Hopper kernels used by tests/test_hopper_primitives.py and tests/test_hopper_sass.py, compiled
// after templates/partials/primitives.cuh and templates/wgmma/hopper.cuh: by NVRTC for sm_90a
// and by the CPU emulator (the same text).

// The demonstration GEMM: C[128 x 128] (fp32, row-major) = A[128 x K] B[K x 128] (fp16,
// row-major), K a multiple of 16, one block of 384 threads:
//   warpgroups 0 and 1 consume (rows 0-63 and 64-127: one wgmma m64n128k16 per 16 columns of
//   K, A K-major with a 32B swizzle, B N-major with a 128B swizzle); warpgroup 2 gives its
//   registers away and its first warp produces: one elected lane waits for a free stage, sets
//   the stage's expected bytes and issues the TMA loads (A: one 128 x 16 box; B: two 16 x 64
//   boxes). Two stages, each with a "full" mbarrier (1 arrival + 8192 tx bytes) and an "empty"
//   one (the 256 consumer threads arrive when their wgmma has retired).
#define GEMM_BK 16
#define GEMM_STAGES 2
#define GEMM_A_BYTES 4096            // 128 rows x 32 B
#define GEMM_B_BYTES 4096            // 2 boxes x 16 rows x 128 B
#define GEMM_SMEM (GEMM_STAGES * (GEMM_A_BYTES + GEMM_B_BYTES) + 64)
extern "C" __global__ void __launch_bounds__(384) hopper_gemm(const __grid_constant__ FaTensorMap tma_a,
                                                              const __grid_constant__ FaTensorMap tma_b, float* c,
                                                              int k_total) {
    unsigned char* s = fa_smem_1024();
    unsigned char* a_tiles = s;                                    // [stage][128][32 B], 32B swizzle
    unsigned char* b_tiles = s + GEMM_STAGES * GEMM_A_BYTES;       // [stage][2][16][128 B], 128B swizzle
    unsigned long long* full = reinterpret_cast<unsigned long long*>(s + GEMM_STAGES * (GEMM_A_BYTES + GEMM_B_BYTES));
    unsigned long long* empty = full + GEMM_STAGES;
    const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
    if (threadIdx.x == 0) {
        for (int st = 0; st < GEMM_STAGES; ++st) {
            fa_mbarrier_init(&full[st], 1);
            fa_mbarrier_init(&empty[st], 256);
        }
        fa_fence_barrier_init();
    }
    fa_sync();
    const int kblocks = k_total / GEMM_BK;
    if (wg == 2) {  // producer
        fa_setmaxnreg_dec<40>();
        if (t < 32 && fa_elect_one()) {
            for (int kb = 0; kb < kblocks; ++kb) {
                const int st = kb % GEMM_STAGES;
                const unsigned phase = (kb / GEMM_STAGES) & 1;
                fa_mbarrier_wait_parity(&empty[st], phase ^ 1);  // round 0: the phase before the first, complete
                fa_mbarrier_arrive_expect_tx(&full[st], GEMM_A_BYTES + GEMM_B_BYTES);
                unsigned char* bt = b_tiles + st * GEMM_B_BYTES;
                fa_tma_load_2d(a_tiles + st * GEMM_A_BYTES, &tma_a, &full[st], kb * GEMM_BK, 0);
                fa_tma_load_2d(bt, &tma_b, &full[st], 0, kb * GEMM_BK);
                fa_tma_load_2d(bt + GEMM_B_BYTES / 2, &tma_b, &full[st], 64, kb * GEMM_BK);
            }
        }
        return;
    }
    fa_setmaxnreg_inc<232>();  // consumers
    float d[64];
    for (int i = 0; i < 64; ++i) d[i] = 0.f;
    for (int kb = 0; kb < kblocks; ++kb) {
        const int st = kb % GEMM_STAGES;
        fa_mbarrier_wait_parity(&full[st], (kb / GEMM_STAGES) & 1);
        // A: 8-row groups 256 B apart (SBO), LBO unused; this warpgroup's 64 rows start 64 x 32 B in.
        const unsigned long long da = fa_wgmma_desc(a_tiles + st * GEMM_A_BYTES + wg * 64 * 32, 16, 256, FA_SWIZZLE_32B);
        // B: 64-column atoms 2048 B apart (LBO), K rows 8..15 1024 B after rows 0..7 (SBO).
        const unsigned long long db = fa_wgmma_desc(b_tiles + st * GEMM_B_BYTES, 2048, 1024, FA_SWIZZLE_128B);
        for (int i = 0; i < 64; ++i) fa_wgmma_fence_operand(d[i]);
        fa_wgmma_fence();
        fa_wgmma_m64nNk16_ss<__half, 128, 0, 1>(d, da, db, 1);
        fa_wgmma_commit_group();
        fa_wgmma_wait_group<0>();
        for (int i = 0; i < 64; ++i) fa_wgmma_fence_operand(d[i]);
        fa_mbarrier_arrive(&empty[st]);
    }
    const int w = t / 32, g = (t % 32) >> 2, q = t & 3;
    for (int i = 0; i < 64; ++i) {
        const int row = wg * 64 + 16 * w + g + 8 * ((i >> 1) & 1), col = 8 * (i / 4) + 2 * q + (i & 1);
        c[row * 128 + col] = d[i];
    }
}

// Every other primitive once (for the SASS check): stmatrix, TMA store / reduce-add, non-tensor bulk
// load / store / reduce-add, bulk groups, register-A wgmma, bf16, N = 8 and 256.
extern "C" __global__ void __launch_bounds__(256) hopper_rest(const __grid_constant__ FaTensorMap tmap, float* out,
                                                              int flag) {
    unsigned char* smem = fa_smem_1024();
    unsigned long long* bar = reinterpret_cast<unsigned long long*>(smem + 65536);
    if (threadIdx.x == 0) {
        fa_mbarrier_init(bar, 1);
        fa_fence_barrier_init();
        fa_mbarrier_arrive_expect_tx(bar, 8192 + 256);
        fa_tma_load_3d(smem, &tmap, bar, 0, flag, 1);
        fa_tma_load_4d(smem + 4096, &tmap, bar, 0, flag, 1, 2);
        fa_bulk_load(smem + 16384, out, 256, bar);
    }
    fa_sync();
    fa_mbarrier_wait_parity(bar, 0);
    const unsigned long long da = fa_wgmma_desc(smem, 16, 256, FA_SWIZZLE_32B);
    const unsigned long long db = fa_wgmma_desc(smem + 8192, 2048, 1024, FA_SWIZZLE_128B);
    float e[4], f[128];
    for (int i = 0; i < 4; ++i) e[i] = 0.f;
    for (int i = 0; i < 128; ++i) f[i] = 0.f;
    unsigned ar[4] = {1u, 2u, 3u, (unsigned)flag};
    fa_wgmma_fence();
    fa_wgmma_m64nNk16_rs<__nv_bfloat16, 8, 1>(e, ar, db, 0);
    fa_wgmma_m64nNk16_ss<__half, 256, 1, 0>(f, da, db, 0);
    fa_wgmma_commit_group();
    fa_wgmma_wait_group<0>();
    unsigned r[4];
    for (int i = 0; i < 4; ++i) {
        __half2 h = __floats2half2_rn(e[i] + f[2 * i], f[2 * i + 1] + f[127 - i]);
        r[i] = *reinterpret_cast<unsigned*>(&h);
    }
    __half* c = reinterpret_cast<__half*>(smem + 32768);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    fa_stmatrix_x4(c + lane * 8 + warp * 1024, r);
    fa_stmatrix_x4_trans(c + lane * 8 + warp * 1024 + 256, r);
    unsigned r1[1] = {r[0]}, r2[2] = {r[0], r[1]};
    fa_stmatrix_x1(c + lane * 8 + warp * 1024 + 512, r1);
    fa_stmatrix_x2_trans(c + lane * 8 + warp * 1024 + 768, r2);
    fa_fence_proxy_async();
    if (warp < 4) fa_named_barrier_sync(1, 128);
    else fa_named_barrier_arrive(1, 128);
    fa_sync();
    if (threadIdx.x == 0) {
        fa_tma_store_2d(&tmap, c, 0, flag);
        fa_tma_reduce_add_2d(&tmap, c, 0, flag);
        fa_tma_reduce_add_3d(&tmap, c, 0, flag, 0);
        fa_tma_reduce_add_4d(&tmap, c, 0, flag, 0, 1);
        fa_bulk_store(out, c, 256);
        fa_bulk_reduce_add_f32(out + 64, reinterpret_cast<const float*>(c), 256);
        fa_bulk_commit_group();
        fa_bulk_wait_group_read<0>();
        fa_bulk_wait_group<0>();
    }
    out[threadIdx.x] = e[0] + f[0] + (fa_mbarrier_try_wait_parity(bar, 1) ? 1.f : 0.f);
}
