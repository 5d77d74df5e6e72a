{# Warp-level building blocks of the mma family: fragment loads through ldmatrix,
   C -> A fragment packing, tile copies through cp.async. Rendered after the header
   (which defines T, HEAD_DIM, LD, DPAD, BLOCK_R/C, NUM_THREADS and the family's decisions). #}
namespace fa {
// ---- mma family: warp-level building blocks --------------------------------
// Fragment layouts follow the PTX ISA ("Matrix Fragments for mma.m16n8k16 with
// floating point type", "Warp-level matrix load instruction: ldmatrix"):
//   lane = 4 * g + t (g = groupID 0..7, t = thread in group 0..3);
//   C/D 16x8 fp32: d[0..1] = (row g, cols 2t, 2t+1), d[2..3] = (row g + 8, same cols);
//   A 16x16: a[0] = (row g, k 2t..2t+1), a[1] = (row g+8, ..), a[2] = (row g, k 2t+8..), a[3] = (row g+8, k 2t+8..);
//   B 16x8: b[0] = (k 2t..2t+1, col g), b[1] = (k 2t+8.., col g).
// So the C fragments of two adjacent n8 tiles, packed pairwise, are the A fragment of
// the next product (P^T, dS^T, P stay in registers).
static_assert(DPAD == (HEAD_DIM + 15) / 16 * 16, "DPAD: the head dim padded to the MMA k extent (zero columns)");

// The m16n8 fp32 accumulator fragment, stated once for every kernel of the family: lane = 4 g + t
// holds elements e = 0..3 of a 16 x 8 tile at row g + 8 (e >> 1), column 2 t + (e & 1) (the C/D
// layout above; element e of n8 tile n of a 16 x 8N fragment is at column 8 n + col(lane, e)).
struct MmaAccLayout {
    static FA_DEVICE int row(int lane, int e) { return (lane >> 2) + ((e >> 1) << 3); }
    static FA_DEVICE int col(int lane, int e) { return ((lane & 3) << 1) + (e & 1); }
};
static_assert(LD == DPAD + 8, "smem row stride: DPAD + 8 elements (odd number of 16-byte units: ldmatrix conflict-free)");
{% if VD %}
// A v head dim of its own (HEAD_DIM_V: V_j, dO_i, O, dV): its tiles' rows are DPAD_V + 8 elements.
static_assert(DPAD_V == (HEAD_DIM_V + 15) / 16 * 16 && LD_V == DPAD_V + 8, "v head dim: padded, smem row stride");
// The tile copies below take the tile's head dim (DIM, padded DP; default q/k's): inside them the
// names HEAD_DIM, DPAD and LD stand for the tile's (local constants shadowing the module's).
{% endif %}
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

// Two fp32 values -> one 32-bit register of two T (lo in the low half: the lower column).
FA_DEVICE unsigned mma_pack(float lo, float hi) {
    const T l = fa_from_float<T>(lo), h = fa_from_float<T>(hi);
    unsigned short ul, uh;
    memcpy(&ul, &l, 2);
    memcpy(&uh, &h, 2);
    return (unsigned)ul | ((unsigned)uh << 16);
}

// d += A * B for one 16x8 tile; b0/b1 the two B registers of that tile.
FA_DEVICE void mma_tile(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    const unsigned bb[2] = {b0, b1};
    fa_mma_m16n8k16<T>(d, a, bb);
}

// The lane's element offset of those four loads at (0, 0) in a tile of row stride ld (each lane passes
// the address of one 16-byte row of one of the four 8 x 8 matrices): mma_load_a (rows lane % 16, column
// half lane / 16), mma_load_b_nmajor and mma_load_a_trans (rows lane % 8 of matrices lane / 8 = (row
// half lane / 16, column half (lane / 8) % 2)), mma_load_b_kmajor (the same with the halves swapped).
FA_DEVICE int mma_lane_a(int lane, int ld) { return (lane & 15) * ld + (lane >> 4) * 8; }
FA_DEVICE int mma_lane_nm(int lane, int ld) { return ((lane & 7) + (lane >> 4) * 8) * ld + ((lane >> 3) & 1) * 8; }
FA_DEVICE int mma_lane_km(int lane, int ld) { return ((lane & 7) + ((lane >> 3) & 1) * 8) * ld + (lane >> 4) * 8; }

// A fragment (rows r0..r0+15, k c0..c0+15) of a row-major smem tile X[row][k]: A = X.
FA_DEVICE void mma_load_a(unsigned (&a)[4], const T* base, int ld, int r0, int c0, int lane) {
    fa_ldmatrix_x4(a, base + r0 * ld + c0 + mma_lane_a(lane, ld));
}
// A fragment (rows m0.., k k0..) of a tile stored transposed, X[k][m]: A = X^T.
FA_DEVICE void mma_load_a_trans(unsigned (&a)[4], const T* base, int ld, int m0, int k0, int lane) {
    fa_ldmatrix_x4_trans(a, base + k0 * ld + m0 + mma_lane_nm(lane, ld));
}
// B fragments of the n8 tiles n0 and n0 + 8 (b[0..1] and b[2..3]) over k k0..k0+15 of a
// tile stored n-major, X[n][k] (B = X^T, e.g. K for S = Q K^T).
FA_DEVICE void mma_load_b_nmajor(unsigned (&b)[4], const T* base, int ld, int n0, int k0, int lane) {
    fa_ldmatrix_x4(b, base + n0 * ld + k0 + mma_lane_nm(lane, ld));
}
// The same from a tile stored k-major, X[k][n] (B = X, e.g. V for O = P V): ldmatrix.trans.
FA_DEVICE void mma_load_b_kmajor(unsigned (&b)[4], const T* base, int ld, int k0, int n0, int lane) {
    fa_ldmatrix_x4_trans(b, base + k0 * ld + n0 + mma_lane_km(lane, ld));
}

// The masking rule (partials/masking.cuh: bounds, causal with its alignment, window), key padding
// (kpm_b = kpm + b * seqlen_k) and attn_mask (mask_bh at (b, h), strides msq/msk; 0 = broadcast).
FA_DEVICE bool mma_allowed(int row, int col, const MaskParams& mp, const unsigned char* kpm_b,
                           const unsigned char* mask_bh = nullptr, long long msq = 0, long long msk = 0) {
    if (!allowed(row, col, mp)) return false;
    if constexpr (HAS_KEY_PADDING) {
        if (kpm_b[col] == 0) return false;
    }
    if constexpr (HAS_ATTN_MASK) return mask_bh[(long long)row * msq + (long long)col * msk] != 0;
    return true;
}

// Scores other than scale * q.k (softcap, ALiBi, bias): the kernels take score_fwd on the fp32
// accumulator and fold log2 e in afterwards; without them scale * log2 e is one multiply.
constexpr bool HAS_SCORE_MOD = HAS_SOFTCAP || HAS_ALIBI || HAS_BIAS;

FA_DEVICE float mma_shfl_xor(float x, int m) { return __shfl_xor_sync(0xffffffffu, x, m); }
FA_DEVICE unsigned mma_shfl_xor_u(unsigned x, int m) { return __shfl_xor_sync(0xffffffffu, x, m); }
FA_DEVICE unsigned mma_shfl_u(unsigned x, int src) { return __shfl_sync(0xffffffffu, x, src); }


// 2^x on the SFU (partials/primitives.cuh's fa_ex2_approx).
FA_DEVICE float mma_exp2(float x) { return fa_ex2_approx(x); }

// Can a tensor slice be copied in 16-byte units (base and row stride 16-byte aligned)?
FA_DEVICE bool mma_vec_ok(const T* base, long long stride_s) {
    return (((unsigned long long)base | (unsigned long long)(stride_s * (long long)sizeof(T))) & 15ull) == 0ull;
}

// Rows [row0, row0 + ROWS) x HEAD_DIM of a [*, N, *, d] slice -> smem (row stride LD), as
// 16-byte cp.async copies of the caller's open group; rows >= n, columns [HEAD_DIM, DPAD)
// and, given a key-padding row mask (kpm + b * N), padded keys are zero-filled -- a padded
// key takes no part, so nothing it holds (even NaN) reaches a product through 0 * x.
// Unaligned slices fall back to element copies.
template <int ROWS{{ TILE_DIMS }}>
FA_DEVICE void mma_copy_tile(T* dst, const T* src, int row0, int n, long long stride_s, bool vec,
                             const unsigned char* kpm_row = nullptr) {
{% if VD %}
    constexpr int HEAD_DIM = DIM, DPAD = DP, LD = DP + 8;  // the tile's head dim
{% endif %}
    constexpr int CHUNKS = DPAD / 8;
    for (int e = threadIdx.x; e < ROWS * CHUNKS; e += NUM_THREADS) {
        const int r = e / CHUNKS, c = (e - r * CHUNKS) * 8;
        const bool valid = row0 + r < n && c < HEAD_DIM && (kpm_row == nullptr || kpm_row[row0 + r] != 0);
        const T* s = valid ? src + (long long)(row0 + r) * stride_s + c : src;
        T* d = dst + r * LD + c;
        if (vec) {
            fa_cp_async_16(d, s, valid);
        } else {
            for (int x = 0; x < 8; ++x) d[x] = valid ? s[x] : fa_from_float<T>(0.f);
        }
    }
}

// mma_copy_tile with the per-chunk index arithmetic hoisted: when the threads tile the rows evenly
// (NUM_THREADS a multiple of the DPAD / 8 chunks of a row, ROWS x chunks a multiple of NUM_THREADS),
// thread tid copies chunk tid % chunks of rows tid / chunks + k * (NUM_THREADS / chunks), its
// source advanced by a fixed stride, and rows past n (or a head dim short of DPAD) are tested only
// on an edge tile. Same result as mma_copy_tile (which it falls back to otherwise, and for
// unaligned slices or a key-padding row mask).
template <int ROWS{{ TILE_DIMS }}>
FA_DEVICE void mma_copy_rows(T* dst, const T* src, int row0, int n, long long stride_s, bool vec) {
{% if VD %}
    constexpr int HEAD_DIM = DIM, DPAD = DP, LD = DP + 8;  // the tile's head dim
{% endif %}
    constexpr int CHUNKS = DPAD / 8;
    constexpr bool EVEN = NUM_THREADS % CHUNKS == 0 && (ROWS * CHUNKS) % NUM_THREADS == 0;
    if constexpr (EVEN) {
        if (vec) {
            constexpr int RSTEP = NUM_THREADS / CHUNKS, ITERS = ROWS * CHUNKS / NUM_THREADS;
            const int r = threadIdx.x / CHUNKS, c = (threadIdx.x % CHUNKS) * 8;
            const T* s = src + (long long)(row0 + r) * stride_s + c;
            T* d = dst + r * LD + c;
            const long long step = (long long)RSTEP * stride_s;
            if (row0 + ROWS <= n && (HEAD_DIM == DPAD || c < HEAD_DIM)) {  // interior tile: no bounds
#pragma unroll
                for (int k = 0; k < ITERS; ++k) fa_cp_async_16(d + k * RSTEP * LD, s + k * step, true);
            } else {
#pragma unroll
                for (int k = 0; k < ITERS; ++k) {
                    const bool valid = row0 + r + k * RSTEP < n && c < HEAD_DIM;
                    fa_cp_async_16(d + k * RSTEP * LD, valid ? s + k * step : src, valid);
                }
            }
            return;
        }
    }
    if (vec) {
        mma_copy_tile<ROWS{{ ", DIM, DP" if VD else "" }}>(dst, src, row0, n, stride_s, true);
        return;
    }
    for (int e = threadIdx.x; e < ROWS * CHUNKS; e += NUM_THREADS) {  // unaligned slice: element copies
        const int r = e / CHUNKS, c = (e - r * CHUNKS) * 8;
        const bool valid = row0 + r < n && c < HEAD_DIM;
        const T* sp = src + (long long)(row0 + r) * stride_s + c;
        T* d = dst + r * LD + c;
        for (int x = 0; x < 8; ++x) d[x] = valid ? sp[x] : fa_from_float<T>(0.f);
    }
}
}  // namespace fa
