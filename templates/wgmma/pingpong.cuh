// Ping-pong of the Hopper forward's two consumer warpgroups (FlashAttention-3's UsePingPong, its
// warp_scheduler_barrier_sync / _arrive): the warpgroups take turns issuing their GEMMs, so one
// warpgroup's softmax runs while the tensor cores compute the other's S = Q K_j^T and P~ V_j.
// Knob `pingpong` (fagen.families.wgmma.PINGPONG); the kernel calls these only with it.
//
// Named barrier BAR_PP + w is warpgroup w's turn: both warpgroups' 256 threads meet there, warpgroup w
// with bar.sync (it waits for its turn), the other with bar.arrive (it hands the turn over, no wait).
//   wg_pp_start(wg)   before the tile loop: warpgroup 1 hands the first turn to warpgroup 0.
//   wg_pp_take(wg)    a tile loop trip, before S = Q K_j^T: wait for this warpgroup's turn.
//   wg_pp_give(wg)    the same trip, once P~ V_j is issued: the other warpgroup's turn.
//   wg_pp_end(wg)     after the tile loop: warpgroup 0 takes warpgroup 1's last hand-over, so each
//                     barrier's arrivals are matched when the CTA ends (every phase complete).
// Both warpgroups run the same trips (the K/V range is the CTA's), so on each barrier one warpgroup
// arrives as often as the other syncs: barrier BAR_PP gets 1 + trips arrivals of warpgroup 1 and
// trips + 1 syncs of warpgroup 0, barrier BAR_PP + 1 trips of each. The CTA's other named barriers
// take ids below BAR_PP (fa_named_barrier_*: ids 1..15).
//
// NOTE: rendered kernels pull this file in through a Jinja include, so it must not contain Jinja's
// opening delimiters (a brace followed by % or #).
constexpr int BAR_PP = 2;            // named barriers BAR_PP (warpgroup 0's turn) and BAR_PP + 1 (warpgroup 1's)
constexpr int PP_THREADS = 2 * 128;  // both consumer warpgroups meet at each
FA_DEVICE void wg_pp_start(int wg) {
    if (wg == 1) fa_named_barrier_arrive(BAR_PP, PP_THREADS);
}
FA_DEVICE void wg_pp_take(int wg) { fa_named_barrier_sync(BAR_PP + wg, PP_THREADS); }
FA_DEVICE void wg_pp_give(int wg) { fa_named_barrier_arrive(BAR_PP + (wg ^ 1), PP_THREADS); }
FA_DEVICE void wg_pp_end(int wg) {
    if (wg == 0) fa_named_barrier_sync(BAR_PP, PP_THREADS);
}
