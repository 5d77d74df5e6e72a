// The Hopper family's warpgroup helpers, shared by its forward and backward: the constants of
// the 128-byte swizzle panels, the 16-bit packing of an A fragment register and the SFU's 2^x.
namespace fa {
constexpr float LOG2E = 1.4426950408889634f;
constexpr int PANEL_ELEMS = 64;  // elements per panel row (128 bytes)
// The head dim in whole panels: the width of every Q / K / V / dO tile in shared memory. Past
// HEAD_DIM (d = 96: columns 96..127) the TMA loads zero-fill (the tensor maps end at HEAD_DIM), so
// a wgmma with N = PAD_DIM computes zeros there and the k loops stop at HEAD_DIM.
constexpr int PAD_DIM = PANEL_ELEMS * PANELS;
static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM <= PAD_DIM && PAD_DIM - HEAD_DIM < PANEL_ELEMS,
              "the head dim: k16 steps, PANELS panels");
{% if HEAD_DIM_V != HEAD_DIM %}
// v's head dim of its own (HEAD_DIM_V: V, O, dO, dV), in whole panels as HEAD_DIM is.
constexpr int PAD_DIM_V = PANEL_ELEMS * PANELS_V;
static_assert(HEAD_DIM_V % 16 == 0 && HEAD_DIM_V <= PAD_DIM_V && PAD_DIM_V - HEAD_DIM_V < PANEL_ELEMS,
              "the v head dim: k16 steps, PANELS_V panels");
{% endif %}
{% if IS_VARLEN %}
// Packed sequences (varlen): the tensor maps are over each packed tensor as one batch ([1, total, H, d];
// fagen.families.wgmma.packed_view), so row r of the sequence whose first token is tok0 (cu_seqlens[b]) is
// row tok0 + r of batch 0. A box reaching past the sequence's end loads the next sequence's rows (TMA
// zero-fills only past the packed tensor's end): the kernels mask them by the sequence's lengths.
FA_DEVICE int wg_tma_row(long long tok0, int r) { return (int)(tok0 + r); }
{% endif %}

// Two fp32 values as the packed 16-bit pair of an A fragment register (lo in the low half).
FA_DEVICE unsigned wg_pack(float lo, float hi) {
    const T l = fa_from_float<T>(lo), h = fa_from_float<T>(hi);
    unsigned short ul, uh;
    memcpy(&ul, &l, 2);
    memcpy(&uh, &h, 2);
    return (unsigned)ul | ((unsigned)uh << 16);
}
// 2^x on the SFU (partials/primitives.cuh's fa_ex2_approx).
FA_DEVICE float wg_exp2(float x) { return fa_ex2_approx(x); }
}  // namespace fa
