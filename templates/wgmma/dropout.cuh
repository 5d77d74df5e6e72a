// The Hopper family's dropout keep bits (rendered with dropout only), on partials/philox.cuh's
// stream: element (bh, row, col) is kept iff word col & 3 of Philox4x32-10 at counter
// (col >> 2, row, bh, offset_lo), key (seed_lo, seed_hi ^ offset_hi) is >= drop_threshold
// (fa_dropout_keep), so the bits are the other families' whatever the tiles. An m64nNk16
// accumulator gives each thread, per 8-column group n, the elements 4n + e at accumulator row
// r0 + 8 (e >> 1) and column 8n + 2 t4 + (e & 1) (r0 = 16 warp + g): mma.m16n8's fragment, so one
// Philox call covers four elements of a thread quad as in templates/mma. The forward's (rows = Q rows)
// are partials/philox.cuh's fa_keep_bits_m16n8, shared with mma; the backward's (rows = keys) follow.
namespace fa {
// Backward (accumulator rows are keys, S^T): keep bits of the elements 4n + e, n < NG <= 8 (bit 4n + e),
// at key key0 + 8 (e >> 1) and Q row row0 + 8n + 2 t4 + (e & 1), both global (key0 = the key of
// accumulator row g). One Philox call covers keys 4c..4c+3 of one Q row: with key0 - (g & 3) a multiple
// of 4 the lanes g = 4a + m, m = 0..3 (same t4) hold them for 2 Q rows x 2 key halves; lane m computes
// the call of Q row 2 t4 + (m & 1), key half m >> 1, whose bit j is lane j's element e = m: the four
// lanes transpose the 4 x 4 bits (row m, lane m's call, at nibble m of a 16-bit word) in two shuffles,
// with lane m ^ 2 (keeping the columns j of m's half), then with m ^ 1 (keeping column m), and gather
// column m's bits 4r + m to r with one multiply (no two partial products meet, so nothing carries).
// Otherwise one call per element, in a rolled loop.
template <int NG>
FA_DEVICE unsigned wg_keep_bits_k(unsigned long long seed, unsigned long long offset, unsigned bh, int row0, int key0,
                                  unsigned drop_threshold, int lane) {
    static_assert(NG * 4 <= 32, "keep bits of a chunk in one word");
    const int t4 = lane & 3, m = (lane >> 2) & 3;
    unsigned kb = 0u;
    if (((key0 - m) & 3) == 0) {  // warp-uniform
        const unsigned half = (m & 2) ? 0xccccu : 0x3333u, col = 0x1111u << m;
#pragma unroll
        for (int n = 0; n < NG; ++n) {
            const unsigned mine = fa_keep4(seed, offset, bh, (unsigned)(row0 + 8 * n + 2 * t4 + (m & 1)),
                                           (unsigned)(key0 - m + 8 * (m >> 1)), drop_threshold);
            unsigned w = mine << (4 * m);
            w = (w | __shfl_xor_sync(0xffffffffu, w, 8)) & half;  // rows m, m ^ 2; the columns of m's half
            w = (w | __shfl_xor_sync(0xffffffffu, w, 4)) & col;   // every row, column m: bit 4r + m
            kb |= ((((w >> m) * 0x1248u) >> 12) & 0xfu) << (4 * n);  // bit 4r -> 12 + r
        }
    } else {
        for (int x = 0; x < NG * 4; ++x) {
            const int n = x >> 2, e = x & 3;
            if (fa_dropout_keep(seed, offset, bh, (unsigned)(row0 + 8 * n + 2 * t4 + (e & 1)), (unsigned)(key0 + 8 * (e >> 1)),
                                drop_threshold))
                kb |= 1u << x;
        }
    }
    return kb;
}
}  // namespace fa
