{# The forward's streamed K/V tile copy: a per-thread source pointer computed once and advanced by
   a row stride, bounds checked only on edge tiles. Rendered after mma/warp.cuh. #}
namespace fa {
// A ROWS x DPAD tile of a [*, N, *, d] slice -> smem (row stride LD) in 16-byte cp.async chunks.
// Each thread keeps one column of chunks: thread tid < ACTIVE takes column (tid % CHUNKS) * 8 of
// rows tid / CHUNKS + it * ROW_STEP (it = 0..ITERS-1), ROW_STEP = NUM_THREADS / CHUNKS rows a pass;
// when CHUNKS does not divide the thread count (head dims 96, 192, ...) the last
// NUM_THREADS - ACTIVE threads copy nothing. So a chunk's source is the thread's first chunk plus
// it * ROW_STEP rows and its destination one smem offset plus a constant. The object holds one
// pointer (the row stride is passed with each call: a kernel argument, read from the constant
// bank), so the S and O fragments keep the registers.
//
// HALF: the tile is copied by one half of the CTA's threads (THREADS = NUM_THREADS / 2, the thread's
// index taken modulo THREADS), the other half copying the other tensor of the step (fwd_copy_kv):
// each warp then sets up one copy a step instead of two.
template <int ROWS, bool HALF = false{{ TILE_DIMS }}>
struct FwdTileCopy {
{% if VD %}
    static constexpr int HEAD_DIM = DIM, DPAD = DP, LD = DP + 8;  // the tile's head dim (warp.cuh)
{% endif %}
    static constexpr int CHUNKS = DPAD / 8;
    static constexpr int THREADS = HALF ? NUM_THREADS / 2 : NUM_THREADS;
    static_assert(!HALF || THREADS % 32 == 0, "whole warps per half");
    static_assert(CHUNKS <= THREADS, "one row of 16-byte chunks per pass at least");
    static constexpr int ROW_STEP = THREADS / CHUNKS, ACTIVE = ROW_STEP * CHUNKS;
    static constexpr int ITERS = (ROWS + ROW_STEP - 1) / ROW_STEP;

    // What the object holds: the slice's row 0, column 0 (the same for every thread of the CTA; the
    // thread's first chunk is derived per tile) or the thread's own first chunk, row first_row() and
    // column column() of the slice: with varlen (the slice's sequence offset comes from memory;
    // ptxas spilled 20-24 bytes at d = 32 deriving it from the base every step) and on 16-row warps
    // when every thread copies (EVEN; the 32-row warps' registers hold S and O: there the compiler
    // places it). EVEN tiles also take the 32-bit row stride forms below (interior); with idle
    // threads (d = 96, 192) they cost more than they save.
    static constexpr bool EVEN = ACTIVE == THREADS;
    static constexpr bool HOLD_THREAD = IS_VARLEN || (EVEN && WARP_M_TILES == 1);
    const T* p;

    FA_DEVICE static int tid() { return HALF ? (int)threadIdx.x % THREADS : (int)threadIdx.x; }
    FA_DEVICE static int first_row() { return tid() / CHUNKS; }
    FA_DEVICE static int column() { return (tid() % CHUNKS) * 8; }

    FA_DEVICE FwdTileCopy(const T* base, long long stride_s)
        : p(HOLD_THREAD ? held(base + (long long)first_row() * stride_s + column()) : base) {}

    // x as a value the compiler cannot re-derive (it would rebuild the thread's pointer from the
    // kernel argument and the slice offset every step): partials/mma.cuh's fa_hold (mov.b64).
    FA_DEVICE static const T* held(const T* x) { return fa_hold(x); }

    // p + rows x row_bytes bytes as one 32 x 32 -> 64-bit multiply-add (partials/mma.cuh's
    // fa_mad_wide_u32, IMAD.WIDE.U32; in element units the compiler multiplies, then scales and adds:
    // four instructions).
    FA_DEVICE static const T* wide_offset(const T* p, unsigned rows, unsigned row_bytes) {
        return reinterpret_cast<const T*>(fa_mad_wide_u32(rows, row_bytes, reinterpret_cast<unsigned long long>(p)));
    }

    // The slice's row 0 and the thread's first chunk in it.
    FA_DEVICE const T* base(long long stride_s) const {
        return HOLD_THREAD ? p - ((long long)first_row() * stride_s + column()) : p;
    }
    FA_DEVICE const T* thread_src(long long stride_s) const {
        return HOLD_THREAD ? p : p + (long long)first_row() * stride_s + column();
    }

    // Can a slice at base with row stride stride_s take the cp.async paths (interior, edge)? Base and
    // row stride 16-byte aligned and a pass's row step, ROW_STEP rows, at most 2^31 - 1 bytes (else:
    // element copies).
    FA_DEVICE static bool vec_ok(const T* base, long long stride_s) {
        return mma_vec_ok(base, stride_s) && stride_s >= 0 && stride_s <= 0x7fffffffll / (ROW_STEP * (long long)sizeof(T));
    }

    // Is chunk `it` of this thread inside the tile (an idle thread's never; else only the last
    // pass may leave the tile)?
    FA_DEVICE static bool in_tile(int it) {
        const bool active = ACTIVE == THREADS || tid() < ACTIVE;
        if (ROWS % ROW_STEP == 0 || it < ITERS - 1) return active;
        return active && first_row() + it * ROW_STEP < ROWS;
    }

    // Rows [row0, row0 + ROWS): all inside the sequence, no key padding (an interior tile).
    FA_DEVICE void interior(T* dst, int row0, long long stride_s) const {
        // EVEN: the row stride and the pass step fit 32 bits (vec_ok) and row0 >= 0, so the tile's
        // first chunk is a 32 x 32 -> 64-bit multiply off the pointer and each further chunk one wide
        // multiply-add (IMAD.WIDE) off the one before. Else: the thread's first chunk from the
        // tile's row 0 (its byte offset in the tile, first_row() x stride + column(), and the pass's
        // row step fit 32 bits, vec_ok); chunk it is one wide multiply-add off it, s + it x step.
        const unsigned rs = (unsigned)stride_s;
        const int ps = (int)rs * ROW_STEP;
        const T* c = HOLD_THREAD ? wide_offset(p, (unsigned)row0, rs * (unsigned)sizeof(T))
                     : EVEN      ? p + (unsigned long long)(unsigned)(row0 + first_row()) * rs + column()
                                 : reinterpret_cast<const T*>(reinterpret_cast<const char*>(p + (long long)row0 * stride_s) +
                                                              (first_row() * (int)stride_s + column()) * (int)sizeof(T));
        T* d = dst + first_row() * LD + column();
        const bool col_ok = HEAD_DIM == DPAD || column() < HEAD_DIM;  // columns [HEAD_DIM, DPAD) are zero-filled
#pragma unroll
        for (int it = 0; it < ITERS; ++it) {
            const T* src = EVEN ? c : reinterpret_cast<const T*>(reinterpret_cast<const char*>(c) +
                                                                 (long long)(ps * (int)sizeof(T)) * it);
            if (in_tile(it)) fa_cp_async_16(d + it * ROW_STEP * LD, src, col_ok);
            if (EVEN) c += ps;
        }
    }

    // Rows >= n and, given a key-padding row mask (kpm + b * N), padded keys are zero-filled. A
    // rolled loop: it runs on the last tile of a sequence (and with key padding) only.
    FA_DEVICE void edge(T* dst, int row0, int n, long long stride_s, const unsigned char* kpm_row) const {
        const T* row_zero = base(stride_s);
        const T* src = thread_src(stride_s);
#pragma unroll 1
        for (int it = 0; it < ITERS; ++it) {
            if (!in_tile(it)) continue;
            const int r = first_row() + it * ROW_STEP;
            const bool valid = column() < HEAD_DIM && row0 + r < n && (kpm_row == nullptr || kpm_row[row0 + r] != 0);
            const T* s = src + (long long)(row0 + it * ROW_STEP) * stride_s;
            fa_cp_async_16(dst + r * LD + column(), valid ? s : row_zero, valid);
        }
    }

    // The tile at row0 of an n-row slice: cp.async chunks (interior tiles without bounds checks),
    // element copies for a slice that is not 16-byte aligned (vec false; every thread of the CTA
    // calls it then, HALF or not: mma_copy_tile strides over all of them).
    FA_DEVICE void operator()(T* dst, int row0, int n, long long stride_s, bool vec,
                              const unsigned char* kpm_row) const {
        if (!vec) {
            mma_copy_tile<ROWS{{ ", DIM, DP" if VD else "" }}>(dst, base(stride_s), row0, n, stride_s, false, kpm_row);
        } else if (!HAS_KEY_PADDING && row0 + ROWS <= n) {
            interior(dst, row0, stride_s);
        } else {
            edge(dst, row0, n, stride_s, kpm_row);
        }
    }
};

// K_j and V_j at key row0 of their n-row slices into dk / dv, with cp.async (vec_k, vec_v: each slice
// 16-byte aligned) or element copies. HALF copy objects and both slices aligned: the first half of
// the threads copies K, the second V (warp-uniform); else every thread both.
// k_half: is this thread in the first half ((int)threadIdx.x < FwdTileCopy<ROWS, true>::THREADS)?
{% if VD %}
template <class CK, class CV>
FA_DEVICE void fwd_copy_kv(const CK& ck, const CV& cv, T* dk, T* dv,
{% else %}
template <int ROWS, bool HALF>
FA_DEVICE void fwd_copy_kv(const FwdTileCopy<ROWS, HALF>& ck, const FwdTileCopy<ROWS, HALF>& cv, T* dk, T* dv,
{% endif %}
                           int row0, int n, long long stride_k, long long stride_v, bool vec_k, bool vec_v,
                           const unsigned char* kpm_row, bool k_half) {
    if ({{ "CK::THREADS < NUM_THREADS" if VD else "HALF" }} && vec_k && vec_v) {
        if (k_half)
            ck(dk, row0, n, stride_k, true, kpm_row);
        else
            cv(dv, row0, n, stride_v, true, kpm_row);
    } else {
        ck(dk, row0, n, stride_k, vec_k, kpm_row);
        cv(dv, row0, n, stride_v, vec_v, kpm_row);
    }
}
}  // namespace fa
