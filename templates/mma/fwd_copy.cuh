{# The forward's streamed K/V tile copy: a per-thread source pointer computed once and advanced by
   a row stride, bounds checked only on edge tiles. Rendered after mma/warp.cuh. #}
namespace fa {
// A ROWS x DPAD tile of a [*, N, *, d] slice -> smem (row stride LD) in 16-byte cp.async chunks.
// Thread tid takes chunks e = tid + it * NUM_THREADS (it = 0..ITERS-1): tile row e / CHUNKS,
// column (e % CHUNKS) * 8. When NUM_THREADS is a multiple of CHUNKS every chunk of a thread sits
// in one column, ROW_STEP rows apart, so its source is one pointer plus it * ROW_STEP rows and its
// destination one smem offset plus a constant; otherwise (head dims whose DPAD / 8 does not
// divide the thread count) each chunk's row and column are derived from e. The object holds only
// that pointer (the row stride is passed with each call: a kernel argument, read from the
// constant bank), so the S and O fragments keep the registers.
template <int ROWS>
struct FwdTileCopy {
    static constexpr int CHUNKS = DPAD / 8, TOTAL = ROWS * CHUNKS;
    static constexpr int ITERS = (TOTAL + NUM_THREADS - 1) / NUM_THREADS;
    static constexpr bool FIXED_COL = NUM_THREADS % CHUNKS == 0;
    static constexpr int ROW_STEP = FIXED_COL ? NUM_THREADS / CHUNKS : 0;

    const T* src;  // FIXED_COL: the slice's row r0, column c of this thread's first chunk; else row 0

    FA_DEVICE static int first_row() { return FIXED_COL ? (int)threadIdx.x / CHUNKS : 0; }
    FA_DEVICE static int column() { return FIXED_COL ? ((int)threadIdx.x % CHUNKS) * 8 : 0; }

    FA_DEVICE FwdTileCopy(const T* base, long long stride_s)
        : src(FIXED_COL ? base + (long long)first_row() * stride_s + column() : base) {}

    // Is chunk `it` of this thread inside the tile (only the last one may not be)?
    FA_DEVICE static bool in_tile(int it) {
        if constexpr (TOTAL % NUM_THREADS == 0) return true;
        if (it < ITERS - 1) return true;
        return (int)threadIdx.x + it * NUM_THREADS < TOTAL;
    }

    // Rows [row0, row0 + ROWS): all inside the sequence, no key padding (an interior tile).
    FA_DEVICE void interior(T* dst, int row0, long long stride_s) const {
        if constexpr (FIXED_COL) {
            const T* s = src + (long long)row0 * stride_s;
            const long long step = (long long)ROW_STEP * stride_s;
            T* d = dst + first_row() * LD + column();
            const bool col_ok = column() < HEAD_DIM;  // columns [HEAD_DIM, DPAD) are zero-filled
#pragma unroll
            for (int it = 0; it < ITERS; ++it)
                if (in_tile(it)) fa_cp_async_16(d + it * ROW_STEP * LD, s + it * step, col_ok);
        } else {
            edge(dst, row0, row0 + ROWS, stride_s, nullptr);
        }
    }

    // Rows >= n and, given a key-padding row mask (kpm + b * N), padded keys are zero-filled.
    FA_DEVICE void edge(T* dst, int row0, int n, long long stride_s, const unsigned char* kpm_row) const {
#pragma unroll
        for (int it = 0; it < ITERS; ++it) {
            if (!in_tile(it)) continue;
            const int e = (int)threadIdx.x + it * NUM_THREADS;
            const int r = FIXED_COL ? first_row() + it * ROW_STEP : e / CHUNKS;
            const int cc = FIXED_COL ? column() : (e - r * CHUNKS) * 8;
            const bool valid = cc < HEAD_DIM && row0 + r < n && (kpm_row == nullptr || kpm_row[row0 + r] != 0);
            const T* s = FIXED_COL ? src + (long long)(row0 + it * ROW_STEP) * stride_s
                                   : src + (long long)(row0 + r) * stride_s + cc;
            fa_cp_async_16(dst + r * LD + cc, valid ? s : src, valid);
        }
    }

    // The tile at row0 of an n-row slice: cp.async chunks (interior tiles without bounds checks),
    // element copies for a slice that is not 16-byte aligned (vec false, base the slice's row 0).
    FA_DEVICE void operator()(T* dst, const T* base, int row0, int n, long long stride_s, bool vec,
                              const unsigned char* kpm_row) const {
        if (!vec) {
            mma_copy_tile<ROWS>(dst, base, row0, n, stride_s, false, kpm_row);
        } else if (!HAS_KEY_PADDING && row0 + ROWS <= n) {
            interior(dst, row0, stride_s);
        } else {
            edge(dst, row0, n, stride_s, kpm_row);
        }
    }
};
}  // namespace fa
