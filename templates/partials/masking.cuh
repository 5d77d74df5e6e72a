// ---- the masking rule (fagen/masking.py states the same rule in Python) ----
// Included by the header inside namespace fa for every family; uses BLOCK_R, BLOCK_C,
// IS_CAUSAL, IS_TOP_LEFT, HAS_WINDOW, HAS_KEY_PADDING, HAS_ATTN_MASK and IS_VARLEN.
//
// Structural rule (per sequence; varlen: the sequence's own lengths). With
//   shift = IS_TOP_LEFT ? 0 : Nk - Nq   (bottom-right: flash-attn; top-left: torch SDPA is_causal)
// query row i may attend key j iff 0 <= i < Nq, 0 <= j < Nk and
//   causal:         j <= i + shift
//   window (l, r):  (l < 0 || j >= i + shift - l) && (r < 0 || j <= i + shift + r)
// (causal with a window (l, r) is the window (l, min(r, 0)), as flash-attn's causal
// means window right = 0). The allowed keys of a row are one band
// [i + shift - L, i + shift + R] (L, R unbounded when absent), so tiles wholly
// outside it are SKIP and never visited: the loop ranges below are tight.
// Data masks (key padding kpm[b * kpm_stride + j], attn_mask mask[b, h, i, j] with
// broadcast strides) are per-element checks (data_allowed); a tile is never FULL with them.
// Sums of seqlens and offsets are taken in 64 bits (Nq + Nk may exceed 2**31).
// A tile is rows [row0, row0 + BLOCK_R) x cols [col0, col0 + BLOCK_C).
enum TileKind : int { TILE_SKIP = 0, TILE_PARTIAL = 1, TILE_FULL = 2 };

constexpr bool HAS_DATA_MASK = HAS_KEY_PADDING || HAS_ATTN_MASK;

// One sequence's structural mask: its lengths (varlen-resolved) and the runtime window
// (ignored unless HAS_WINDOW; negative = unbounded).
struct MaskParams {
    int seqlen_q, seqlen_k;
    int window_left, window_right;
};

FA_DEVICE MaskParams make_mask_params(int seqlen_q, int seqlen_k, int window_left, int window_right) {
    MaskParams mp;
    mp.seqlen_q = seqlen_q;
    mp.seqlen_k = seqlen_k;
    mp.window_left = window_left;
    mp.window_right = window_right;
    return mp;
}

// shift: key j sits on row i's diagonal when j == i + shift.
FA_DEVICE long long mask_shift(const MaskParams& mp) {
    if constexpr (IS_TOP_LEFT) return 0;
    else return (long long)mp.seqlen_k - mp.seqlen_q;
}

// Band of allowed offsets o = j - (i + shift): -L <= o <= R. has_lo/has_hi false = unbounded.
struct MaskBand {
    bool has_lo, has_hi;
    long long lo, hi;  // valid when has_lo / has_hi
};

FA_DEVICE MaskBand mask_band(const MaskParams& mp) {
    MaskBand band;
    band.has_lo = false;
    band.has_hi = false;
    band.lo = 0;
    band.hi = 0;
    if constexpr (HAS_WINDOW) {
        if (mp.window_left >= 0) { band.has_lo = true; band.lo = -(long long)mp.window_left; }
        if (mp.window_right >= 0) { band.has_hi = true; band.hi = mp.window_right; }
    }
    if constexpr (IS_CAUSAL) {
        if (!band.has_hi || band.hi > 0) { band.has_hi = true; band.hi = 0; }
    }
    return band;
}

// Structural rule only (bounds, causal, window); no data masks.
FA_DEVICE bool allowed(int row, int col, const MaskParams& mp) {
    if (row < 0 || col < 0 || row >= mp.seqlen_q || col >= mp.seqlen_k) return false;
    const MaskBand band = mask_band(mp);
    const long long o = (long long)col - row - mask_shift(mp);
    if (band.has_lo && o < band.lo) return false;
    if (band.has_hi && o > band.hi) return false;
    return true;
}

// SKIP: no element of the tile is allowed (whatever the data masks hold); FULL: every
// element is allowed without mask math (inside both sequences, inside the band, no data
// mask compiled in); PARTIAL otherwise.
FA_DEVICE TileKind tile_kind(int row0, int col0, const MaskParams& mp) {
    if (row0 < 0 || col0 < 0 || row0 >= mp.seqlen_q || col0 >= mp.seqlen_k) return TILE_SKIP;
    const long long shift = mask_shift(mp);
    const long long row_end = (long long)row0 + BLOCK_R < mp.seqlen_q ? (long long)row0 + BLOCK_R : mp.seqlen_q;
    const long long col_end = (long long)col0 + BLOCK_C < mp.seqlen_k ? (long long)col0 + BLOCK_C : mp.seqlen_k;
    const MaskBand band = mask_band(mp);
    // offsets j - i - shift over the tile span [col0 - (row_end - 1), (col_end - 1) - row0]
    const long long o_min = (long long)col0 - (row_end - 1) - shift, o_max = (col_end - 1) - row0 - shift;
    if ((band.has_hi && o_min > band.hi) || (band.has_lo && o_max < band.lo)) return TILE_SKIP;
    if constexpr (HAS_DATA_MASK) return TILE_PARTIAL;
    if ((long long)row0 + BLOCK_R > mp.seqlen_q || (long long)col0 + BLOCK_C > mp.seqlen_k) return TILE_PARTIAL;
    if ((band.has_hi && o_max > band.hi) || (band.has_lo && o_min < band.lo)) return TILE_PARTIAL;
    return TILE_FULL;
}

// Backward inner-loop bounds for the K/V block at col0: the Q rows [*row_begin, *row_end) whose
// tiles are not SKIP (exactly those), row_begin a multiple of BLOCK_R (empty: both 0).
FA_DEVICE void kv_block_q_range(int col0, const MaskParams& mp, int* row_begin, int* row_end) {
    *row_begin = 0;
    *row_end = 0;
    if (col0 < 0 || col0 >= mp.seqlen_k || mp.seqlen_q <= 0) return;
    const long long shift = mask_shift(mp);
    const long long col_last = ((long long)col0 + BLOCK_C < mp.seqlen_k ? (long long)col0 + BLOCK_C : mp.seqlen_k) - 1;
    const MaskBand band = mask_band(mp);
    long long first = 0, last = (long long)mp.seqlen_q - 1;  // rows i with i + shift + lo <= col_last, i + shift + hi >= col0
    if (band.has_hi && col0 - shift - band.hi > first) first = col0 - shift - band.hi;
    if (band.has_lo && col_last - shift - band.lo < last) last = col_last - shift - band.lo;
    if (first > last) return;
    *row_begin = (int)(first / BLOCK_R * BLOCK_R);
    *row_end = (int)(last + 1);
}

// Forward inner-loop bounds for the Q block at row0: the keys [*col_begin, *col_end) whose tiles
// are not SKIP (exactly those), col_begin a multiple of BLOCK_C (empty: both 0).
FA_DEVICE void q_block_kv_range(int row0, const MaskParams& mp, int* col_begin, int* col_end) {
    *col_begin = 0;
    *col_end = 0;
    if (row0 < 0 || row0 >= mp.seqlen_q || mp.seqlen_k <= 0) return;
    const long long shift = mask_shift(mp);
    const long long row_last = ((long long)row0 + BLOCK_R < mp.seqlen_q ? (long long)row0 + BLOCK_R : mp.seqlen_q) - 1;
    const MaskBand band = mask_band(mp);
    long long first = 0, last = (long long)mp.seqlen_k - 1;  // keys j with row0 + shift + lo <= j <= row_last + shift + hi
    if (band.has_lo && row0 + shift + band.lo > first) first = row0 + shift + band.lo;
    if (band.has_hi && row_last + shift + band.hi < last) last = row_last + shift + band.hi;
    if (first > last) return;
    *col_begin = (int)(first / BLOCK_C * BLOCK_C);
    *col_end = (int)(last + 1);
}

// Data masks, per element: key padding (kpm[b * kpm_stride_b + col] != 0: the key takes part;
// kpm_stride_b is the kernel's seqlen_k argument) and attn_mask (mask[b*sb + h*sh + row*sq + col*sk]
// != 0; stride 0 = broadcast). row/col are positions inside the sequence (varlen too).
struct DataMask {
    const unsigned char* kpm;
    long long kpm_stride_b;
    const unsigned char* mask;
    long long stride_b, stride_h, stride_q, stride_k;
};

FA_DEVICE DataMask make_data_mask(const unsigned char* kpm, long long kpm_stride_b, const unsigned char* mask,
                                  long long stride_b, long long stride_h, long long stride_q, long long stride_k) {
    DataMask dm;
    dm.kpm = kpm;
    dm.kpm_stride_b = kpm_stride_b;
    dm.mask = mask;
    dm.stride_b = stride_b;
    dm.stride_h = stride_h;
    dm.stride_q = stride_q;
    dm.stride_k = stride_k;
    return dm;
}

FA_DEVICE bool data_allowed(int b, int h, int row, int col, const DataMask& dm) {
    if constexpr (HAS_KEY_PADDING) {
        if (dm.kpm[(long long)b * dm.kpm_stride_b + col] == 0) return false;
    }
    if constexpr (HAS_ATTN_MASK) {
        if (dm.mask[(long long)b * dm.stride_b + (long long)h * dm.stride_h + (long long)row * dm.stride_q +
                    (long long)col * dm.stride_k] == 0) return false;
    }
    return true;
}

// The whole rule for one element: structural and data masks.
FA_DEVICE bool allowed(int b, int h, int row, int col, const MaskParams& mp, const DataMask& dm) {
    return allowed(row, col, mp) && data_allowed(b, h, row, col, dm);
}

// ---- sequences: where row r of batch b lives (varlen: packed, cu_seqlens) ----
// non-varlen: lengths are the seqlen args, q_tok0 = b * seqlen_q (k_tok0 = b * seqlen_k);
// varlen (IS_VARLEN): the seqlen args are the max lengths, len_q = cu_q[b + 1] - cu_q[b],
// q_tok0 = cu_q[b] (likewise for k); a CTA whose block start is >= its length returns.
struct SeqInfo {
    long long q_tok0, k_tok0;
    int len_q, len_k;
};

FA_DEVICE SeqInfo fa_seq(int b, int seqlen_q, int seqlen_k, const int* cu_q, const int* cu_k) {
    SeqInfo si;
    if constexpr (IS_VARLEN) {
        si.q_tok0 = cu_q[b];
        si.k_tok0 = cu_k[b];
        si.len_q = (int)(cu_q[b + 1] - cu_q[b]);
        si.len_k = (int)(cu_k[b + 1] - cu_k[b]);
    } else {
        si.q_tok0 = (long long)b * seqlen_q;
        si.k_tok0 = (long long)b * seqlen_k;
        si.len_q = seqlen_q;
        si.len_k = seqlen_k;
    }
    return si;
}

// Element offset of (sequence b, row r, head h) in a [B, N, H, d] tensor (varlen: packed [total, H, d],
// stride_b ignored); tok0 is si.q_tok0 or si.k_tok0 for the tensor's sequence.
FA_DEVICE long long fa_row_offset(long long tok0, int b, int r, int h, long long stride_b, long long stride_s,
                                  long long stride_h) {
    if constexpr (IS_VARLEN) return (tok0 + r) * stride_s + (long long)h * stride_h;
    else return (long long)b * stride_b + (long long)r * stride_s + (long long)h * stride_h;
}

// lse / delta element of (b, h, row r): [B, H, Nq] (stride_lse_b = H*Nq, stride_lse_h = Nq) or,
// varlen, [H, total_q] (stride_lse_b = 0, stride_lse_h = total_q) indexed at q_tok0 + r.
FA_DEVICE long long fa_lse_index(const SeqInfo& si, int b, int h, int r, long long stride_lse_b, long long stride_lse_h) {
    return (long long)b * stride_lse_b + (long long)h * stride_lse_h + (IS_VARLEN ? si.q_tok0 : 0) + r;
}

// GQA: the kv head q head h reads (heads = g * heads_kv).
FA_DEVICE int fa_kv_head(int h, int heads, int heads_kv) { return h / (heads / heads_kv); }
