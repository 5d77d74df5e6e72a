// The Hopper family's warpgroup helpers, shared by its forward and backward: the constants of
// the 128-byte swizzle panels, the 16-bit packing of an A fragment register and the SFU's 2^x.
namespace fa {
constexpr float LOG2E = 1.4426950408889634f;
constexpr int PANEL_ELEMS = 64;  // elements per panel row (128 bytes)
// The head dim in whole panels: the width of every Q / K / V / dO tile in shared memory. Past
// HEAD_DIM (d = 96: columns 96..127) the TMA loads zero-fill (the tensor maps end at HEAD_DIM), so
// a wgmma with N = PAD_DIM computes zeros there and the k loops stop at HEAD_DIM.
constexpr int PAD_DIM = PANEL_ELEMS * PANELS;
{% if HEAD_K16 is defined %}
// An odd number of 8-column groups (d = 40, 72, ...): the k loops take HEAD_K16 k16 steps, the last one's
// upper 8 columns the TMA's zero fill.
static_assert(HEAD_DIM % 8 == 0 && HEAD_K16 * 16 == HEAD_DIM + 8 && HEAD_DIM <= PAD_DIM && PAD_DIM - HEAD_DIM < PANEL_ELEMS,
              "the head dim: k16 steps, PANELS panels");
{% else %}
static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM <= PAD_DIM && PAD_DIM - HEAD_DIM < PANEL_ELEMS,
              "the head dim: k16 steps, PANELS panels");
{% endif %}
{% if HEAD_DIM_V != HEAD_DIM %}
// v's head dim of its own (HEAD_DIM_V: V, O, dO, dV), in whole panels as HEAD_DIM is.
constexpr int PAD_DIM_V = PANEL_ELEMS * PANELS_V;
{% if HEAD_K16_V is defined %}
static_assert(HEAD_DIM_V % 8 == 0 && HEAD_K16_V * 16 == HEAD_DIM_V + 8 && HEAD_DIM_V <= PAD_DIM_V &&
              PAD_DIM_V - HEAD_DIM_V < PANEL_ELEMS, "the v head dim: k16 steps, PANELS_V panels");
{% else %}
static_assert(HEAD_DIM_V % 16 == 0 && HEAD_DIM_V <= PAD_DIM_V && PAD_DIM_V - HEAD_DIM_V < PANEL_ELEMS,
              "the v head dim: k16 steps, PANELS_V panels");
{% endif %}
{% endif %}
{% if IS_VARLEN %}
// Packed sequences (varlen): the tensor maps are over each packed tensor as one batch ([1, total, H, d];
// fagen.families.wgmma.packed_view), so row r of the sequence whose first token is tok0 (cu_seqlens[b]) is
// row tok0 + r of batch 0. A box reaching past the sequence's end loads the next sequence's rows (TMA
// zero-fills only past the packed tensor's end): the kernels mask them by the sequence's lengths (the
// forward also zeroes its last V_j rows past len_k, wg_zero_rows: P V multiplies them by the mask's zeros).
FA_DEVICE int wg_tma_row(long long tok0, int r) { return (int)(tok0 + r); }
// Rows [first, ROWS) of a swizzled tile of `panels` panels of ROWS rows x 128 bytes set to zero, thread
// t of n storing 16-byte chunks (the swizzle permutes chunks inside a row: a row's 128 bytes are its own).
template <int ROWS>
FA_DEVICE void wg_zero_rows(T* tile, int panels, int first, int t, int n) {
    const int per_panel = (ROWS - first) * 8;  // 16-byte chunks past `first` in one panel
    const uint4 zero = {0u, 0u, 0u, 0u};
    for (int x = t; x < panels * per_panel; x += n) {
        const int p = x / per_panel, y = x % per_panel;
        *reinterpret_cast<uint4*>(tile + p * ROWS * PANEL_ELEMS + (first + y / 8) * PANEL_ELEMS + 8 * (y % 8)) = zero;
    }
}
{% endif %}

// ALiBi's distances (partials/score_mod.cuh's alibi_dist) of a thread's accumulator elements, from four bases: the
// forward's S (element x: row row0 + 8 ((x >> 1) & 1), column col0 + 8 (x >> 2) + (x & 1)) takes d[a][b] =
// alibi_dist(row0 + 8 a, col0 + b) and element x's distance d[(x >> 1) & 1][x & 1] - 8 (x >> 2); the backward's S^T
// (TRANSPOSED: element x's Q row row0 + 8 (x >> 2) + (x & 1), key col0 + 8 ((x >> 1) & 1)) d[a][b] = alibi_dist(row0 + b,
// col0 + 8 a) and d[(x >> 1) & 1][x & 1] + 8 (x >> 2). One add of an immediate per element, exact.
template <bool TRANSPOSED = false>
struct WgAlibi {
    float d[2][2];
    FA_DEVICE WgAlibi(int row0, int col0, const ScoreParams& sp) {
#pragma unroll
        for (int x = 0; x < 4; ++x)
            d[x >> 1][x & 1] = TRANSPOSED ? alibi_dist<float>(row0 + (x & 1), col0 + 8 * (x >> 1), sp)
                                          : alibi_dist<float>(row0 + 8 * (x >> 1), col0 + (x & 1), sp);
    }
    FA_DEVICE float at(int x) const {
        return d[(x >> 1) & 1][x & 1] + (TRANSPOSED ? 1.f : -1.f) * (float)(8 * (x >> 2));
    }
};
// Element offset of 16-byte chunk c of row `row` in a tile of ROWS-row panels, 128 bytes a row, in the 128-byte
// swizzle (PTX ISA 9.7.15.5.1: chunk c % 8 of a row in slot (c % 8) ^ (row % 8); chunk c in panel c / 8).
template <int ROWS>
FA_DEVICE int wg_swz(int row, int c) {
    return (c / 8) * ROWS * PANEL_ELEMS + row * PANEL_ELEMS + (((c % 8) ^ (row % 8)) * 8);
}
// The epilogues' readback of a warp's 16 stored rows x CH 16-byte chunks from a 128-byte-swizzled tile (chunk c
// of row r in slot (c % 8) ^ (r % 8) of its panel row): item q (lane + 32 i, q < wg_epi_items<CH>()) is row rr,
// chunk c, or no item (false). A quarter warp's 8 lanes must meet 8 distinct 16-byte slots. The whole panels'
// chunks go row by row (a quarter warp reads one panel row). The R = CH % 8 chunks of a last part panel (d = 32,
// 40, 96, 160, ...) go L = the power of two >= R lanes a row, P = 8 / L rows a quarter warp, rows whose r % 8
// differ in the bits above L's (so their slots' sets are disjoint): row by row put rows r and r + 1 in one
// quarter warp there, meeting R slots twice. A row's chunks stay on consecutive lanes (whole 32-byte sectors).
template <int CH>
FA_DEVICE constexpr int wg_epi_items() {
    constexpr int F = CH / 8 * 8, R = CH % 8, L = R > 4 ? 8 : R > 2 ? 4 : R > 1 ? 2 : 1;
    return 16 * F + (R ? 16 * L : 0);
}
template <int CH>
FA_DEVICE bool wg_epi_item(int q, int& rr, int& c) {
    constexpr int F = CH / 8 * 8, R = CH % 8, L = R > 4 ? 8 : R > 2 ? 4 : R > 1 ? 2 : 1, FD = F > 0 ? F : 1;
    if (R == 0 || q < 16 * F) {
        rr = q / FD;
        c = q % FD;
        return true;
    }
    const int h = q - 16 * F, k = h >> 3, j = h & 7;  // quarter warp k of the part panel, its lane j
    rr = 8 * (k / L) + k % L + L * (j / L);
    c = F + j % L;
    return j % L < R;
}
// Two fp32 values as the packed 16-bit pair of an A fragment register (lo in the low half).
FA_DEVICE unsigned wg_pack(float lo, float hi) {
    const T l = fa_from_float<T>(lo), h = fa_from_float<T>(hi);
    unsigned short ul, uh;
    memcpy(&ul, &l, 2);
    memcpy(&uh, &h, 2);
    return (unsigned)ul | ((unsigned)uh << 16);
}
// One warp's 16 rows of the m64nNk16 accumulator (PTX ISA "wgmma .m64nNk16 register fragment"): per
// 8-column group, element e of lane 4g + t at row g + 8 (e >> 1) and column 2t + (e & 1) of the warp's slice,
// mma.m16n8's layout (partials/philox.cuh's fa_keep_bits_m16n8 takes it).
struct WgWarpAccLayout {
    static FA_DEVICE int row(int lane, int e) { return (lane >> 2) + ((e >> 1) << 3); }
    static FA_DEVICE int col(int lane, int e) { return ((lane & 3) << 1) + (e & 1); }
};
// 2^x on the SFU (partials/primitives.cuh's fa_ex2_approx).
FA_DEVICE float wg_exp2(float x) { return fa_ex2_approx(x); }
// The forward's online softmax over one S tile of a thread's two rows (Algorithm 1's m, l update; P~ in place
// of S): row r's new extreme mn[r] (raw score; -inf scaled: no allowed key yet, P~ = 0, not NaN), alpha[r] =
// exp2((m_old - m_new) sl2), l_r[r] = alpha l + rowsum(P~). EXACT: the exponent as fmaf(s, sl2, -hi) - lo with
// lo exact (partials/common.cuh's fa_exp_lo), for a warp with a row of |hi| >= 2^10.
template <bool EXACT, int BLOCK_C>
FA_DEVICE void wg_softmax_rows(float (&s_acc)[BLOCK_C / 2], const float (&mn)[2], float (&m_r)[2], float (&l_r)[2],
                               float (&alpha)[2], float sl2) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float hi = mn[r] * sl2, neg_inf = fa_neg_inf();
        const float base_r = hi == neg_inf ? 0.f : hi;
        const float lo = EXACT && hi != neg_inf ? fa_exp_lo(mn[r], sl2, base_r) : 0.f;
        alpha[r] = wg_exp2(EXACT ? fmaf(m_r[r], sl2, -base_r) - lo : fmaf(m_r[r], sl2, -base_r));
        m_r[r] = mn[r];
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < BLOCK_C / 8; ++n)
#pragma unroll
            for (int e = 2 * r; e < 2 * r + 2; ++e) {
                const float pv = wg_exp2(EXACT ? fmaf(s_acc[4 * n + e], sl2, -base_r) - lo
                                               : fmaf(s_acc[4 * n + e], sl2, -base_r));
                sum += pv;
                s_acc[4 * n + e] = pv;
            }
        l_r[r] = alpha[r] * l_r[r] + sum;
    }
}
}  // namespace fa
