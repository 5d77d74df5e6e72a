// ---- the masking rule (fagen/masking.py states the same rule in Python) ----
// Included by the header inside namespace fa for every family; uses BLOCK_R,
// BLOCK_C, IS_CAUSAL and HAS_KEY_PADDING. Causal is bottom-right aligned:
// query `row` may attend to key `col` iff col <= row + Nk - Nq. Sums of
// seqlens and offsets are taken in 64 bits (Nq + Nk may exceed 2**31).
// A tile is rows [row0, row0 + BLOCK_R) x cols [col0, col0 + BLOCK_C).
enum TileKind : int { TILE_SKIP = 0, TILE_PARTIAL = 1, TILE_FULL = 2 };

// Algorithm 4 line 12: may query `row` attend to key `col`? Rows/keys beyond
// the sequence are masked; key padding: kpm[b * Nk + col] != 0 means the key takes part.
FA_DEVICE bool allowed(int row, int col, int seqlen_q, int seqlen_k, const unsigned char* __restrict__ kpm, int b) {
    if (row < 0 || col < 0 || row >= seqlen_q || col >= seqlen_k) return false;
    if constexpr (IS_CAUSAL) {
        if ((long long)col > (long long)row + seqlen_k - seqlen_q) return false;
    }
    if constexpr (HAS_KEY_PADDING) {
        if (kpm[(long long)b * seqlen_k + col] == 0) return false;
    }
    return true;
}

// SKIP: no element of the tile is allowed (whatever the key-padding mask holds);
// FULL: every element is allowed without mask math (inside both sequences, causal
// satisfied; never with key padding, whose mask is data); PARTIAL otherwise.
FA_DEVICE TileKind tile_kind(int row0, int col0, int seqlen_q, int seqlen_k) {
    if (row0 < 0 || col0 < 0 || row0 >= seqlen_q || col0 >= seqlen_k) return TILE_SKIP;
    const long long shift = (long long)seqlen_k - seqlen_q;
    const long long row_last = ((long long)row0 + BLOCK_R <= seqlen_q ? (long long)row0 + BLOCK_R : seqlen_q) - 1;
    if constexpr (IS_CAUSAL) {
        if ((long long)col0 > row_last + shift) return TILE_SKIP;  // even the last row sees none of these keys
    }
    if constexpr (HAS_KEY_PADDING) return TILE_PARTIAL;
    if ((long long)row0 + BLOCK_R > seqlen_q || (long long)col0 + BLOCK_C > seqlen_k) return TILE_PARTIAL;
    if constexpr (IS_CAUSAL) {
        if ((long long)col0 + BLOCK_C - 1 > (long long)row0 + shift) return TILE_PARTIAL;  // the first row sees not all
    }
    return TILE_FULL;
}

// Backward inner loop bounds for the K/V block at col0: the Q rows [*row_begin, *row_end)
// whose tiles are not SKIP, row_begin a multiple of BLOCK_R (empty: both 0).
FA_DEVICE void kv_block_q_range(int col0, int seqlen_q, int seqlen_k, int* row_begin, int* row_end) {
    *row_begin = 0;
    *row_end = 0;
    if (col0 < 0 || col0 >= seqlen_k || seqlen_q <= 0) return;
    long long first = 0;
    if constexpr (IS_CAUSAL) {
        first = (long long)col0 - seqlen_k + seqlen_q;  // the first row whose diagonal reaches col0
        if (first < 0) first = 0;
        if (first >= seqlen_q) return;
    }
    *row_begin = (int)(first / BLOCK_R * BLOCK_R);
    *row_end = seqlen_q;
}

// Forward inner loop bounds for the Q block at row0: the keys [*col_begin, *col_end) whose
// tiles are not SKIP, col_begin a multiple of BLOCK_C (empty: both 0).
FA_DEVICE void q_block_kv_range(int row0, int seqlen_q, int seqlen_k, int* col_begin, int* col_end) {
    *col_begin = 0;
    *col_end = 0;
    if (row0 < 0 || row0 >= seqlen_q || seqlen_k <= 0) return;
    long long end = seqlen_k;
    if constexpr (IS_CAUSAL) {
        const long long rows_end = (long long)row0 + BLOCK_R < seqlen_q ? (long long)row0 + BLOCK_R : seqlen_q;
        end = rows_end + seqlen_k - seqlen_q;  // one past the last row's diagonal
        if (end > seqlen_k) end = seqlen_k;
        if (end < 0) end = 0;
    }
    *col_end = (int)end;
}
