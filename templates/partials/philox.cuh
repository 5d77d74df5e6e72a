// ---------------------------------------------------------------------------
// Dropout keep-mask: counter-based Philox4x32-10 (Salmon et al., SC'11).
// Algorithm 4 line 1 ("set RNG state to R") is the pair (seed, offset); the
// mask of element (b, h, row, col) is a pure function of those values, so it
// does not depend on tiles, thread mapping or kernel (forward == backward):
//   key     = (seed_lo, seed_hi ^ offset_hi)
//   counter = (col >> 2, row, b * H + h, offset_lo)
//   r       = Philox4x32-10(counter, key)[col & 3]
//   keep   <=> r >= drop_threshold, drop_threshold = floor(p * 2^32)
// The numpy twin is fagen/philox.py.
// ---------------------------------------------------------------------------
struct FaU32x4 { unsigned int x, y, z, w; };

FA_DEVICE FaU32x4 fa_philox4x32_10(FaU32x4 c, unsigned int k0, unsigned int k1) {
    const unsigned int M0 = 0xD2511F53u, M1 = 0xCD9E8D57u;
    const unsigned int W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        const unsigned int hi0 = fa_umulhi(M0, c.x), lo0 = M0 * c.x;
        const unsigned int hi1 = fa_umulhi(M1, c.z), lo1 = M1 * c.z;
        c = FaU32x4{hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
        k0 += W0;
        k1 += W1;
    }
    return c;
}

// True when element (bh, row, col) survives dropout (Algorithm 4 line 14).
FA_DEVICE bool fa_dropout_keep(unsigned long long seed, unsigned long long offset,
                               unsigned int bh, unsigned int row, unsigned int col,
                               unsigned int drop_threshold) {
    const FaU32x4 r = fa_philox4x32_10(
        FaU32x4{col >> 2, row, bh, (unsigned int)(offset & 0xffffffffull)},
        (unsigned int)(seed & 0xffffffffull),
        (unsigned int)(seed >> 32) ^ (unsigned int)(offset >> 32));
    const unsigned int w = (col & 3u) == 0u ? r.x : (col & 3u) == 1u ? r.y : (col & 3u) == 2u ? r.z : r.w;
    return w >= drop_threshold;
}

// Keep bits of the four keys (col & ~3) + w, w = 0..3, of query `row` (bit w is fa_dropout_keep of key
// (col & ~3) + w): the one Philox call whose four words are theirs. The tensor-core families take a
// thread quad's keep bits from it (templates/mma/warp.cuh, templates/wgmma/dropout.cuh).
FA_DEVICE unsigned fa_keep4(unsigned long long seed, unsigned long long offset, unsigned bh, unsigned row,
                            unsigned col, unsigned drop_threshold) {
    const FaU32x4 r = fa_philox4x32_10(
        FaU32x4{col >> 2, row, bh, (unsigned)(offset & 0xffffffffull)},
        (unsigned)(seed & 0xffffffffull), (unsigned)(seed >> 32) ^ (unsigned)(offset >> 32));
    return (unsigned)(r.x >= drop_threshold) | ((unsigned)(r.y >= drop_threshold) << 1) |
           ((unsigned)(r.z >= drop_threshold) << 2) | ((unsigned)(r.w >= drop_threshold) << 3);
}

// Dropout keep bits of a thread's m16n8 accumulator elements over NT n8 tiles: bit 4n + e is element
// (n, e), at row row0 + Layout::row(lane, e) and column col0 + 8n + Layout::col(lane, e), both global
// (row0: the warp's first row; the caller adds row_offset / col_offset). Layout is the family's statement
// of the m16n8 accumulator (templates/mma/warp.cuh's MmaAccLayout; each warp's 16 rows of wgmma's m64nN
// one, templates/wgmma/warpgroup.cuh's WgWarpAccLayout): element e of lane 4g + t at row g + 8 (e >> 1),
// columns 2t and 2t + 1 for e & 1. With col0 a multiple of 4 (warp-uniform) one Philox call covers keys
// 4c..4c+3 of one row: lanes t = 2b and 2b + 1 of a quad hold keys 4c..4c+1 and 4c+2..4c+3 of the rows of
// their elements 0 and 2, each computes one row's call (fa_keep4: lane t & 1's elements 2 (t & 1)) and
// they swap the bits. Otherwise the 4-key groups straddle calls: one call per element, in a rolled loop
// (the caller's fragments stay indexed by constants, so they stay in registers). Word: an unsigned type
// of at least 4 NT bits.
template <class Layout, int NT, typename Word>
FA_DEVICE Word fa_keep_bits_m16n8(unsigned long long seed, unsigned long long offset, unsigned bh, int row0, int col0,
                                  unsigned drop_threshold, int lane) {
    static_assert(NT * 4 <= int(8 * sizeof(Word)), "keep bits of the NT tiles in one word");
    Word kb = 0;
    if ((col0 & 3) == 0) {  // warp-uniform
        const int c = Layout::col(lane, 0), hsel = (c >> 1) & 1;  // lane's first column; which row's call it makes
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const unsigned mine = fa_keep4(seed, offset, bh, (unsigned)(row0 + Layout::row(lane, 2 * hsel)),
                                           (unsigned)(col0 + 8 * n + c), drop_threshold);
            const unsigned other = __shfl_xor_sync(0xffffffffu, mine, 1);
            const unsigned lo = hsel ? other : mine, hi = hsel ? mine : other;  // elements 0, 1 / 2, 3
            kb |= (Word)(((lo >> (2 * hsel)) & 3u) | (((hi >> (2 * hsel)) & 3u) << 2)) << (4 * n);
        }
    } else {
        for (int x = 0; x < NT * 4; ++x) {
            const int n = x >> 2, e = x & 3;
            if (fa_dropout_keep(seed, offset, bh, (unsigned)(row0 + Layout::row(lane, e)),
                                (unsigned)(col0 + 8 * n + Layout::col(lane, e)), drop_threshold))
                kb |= (Word)1 << x;
        }
    }
    return kb;
}
