// The Hopper family's deterministic backward (rendered with deterministic only): dQ_i's reduce-adds
// into dq_accum in a fixed order that is also the order in which the CTAs arrive, so a CTA waits for
// its turn only as long as an add takes, not for other CTAs' steps. dq_sem holds one int32 turn counter
// per (Q block, batch, q head, copy), zeroed by the launcher for every call (fagen.abi.DQ_SEM); dq_accum
// holds DQ_COPIES partial sums per q head (fagen.abi.DQ_COPIES), which the post kernel adds.
//
// The CTA of K/V block j is linear block gridDim.x - 1 - blockIdx.x (the highest K/V block first). The
// K/V blocks reaching Q block i are one run [j_first(i), j_last(i)] (the mask is a band:
// partials/masking.cuh's q_block_kv_range), and the Q blocks K/V block j reaches one run too. Two
// visit orders:
//  - rotated, where every K/V block of the sequence reaches every Q block and there are no more K/V
//    blocks than Q blocks (wg_det_rotates: a spec without a causal mask or a window): K/V
//    block j starts at Q block j and wraps around to Q block 0. At step s it visits Q block j + s, so at
//    Q block i the K/V blocks j <= i arrive first, in descending order (step i - j), and those j > i after
//    their wrap, in descending order again (step n_q - j + i > i). Copy 0 takes the first run's adds, copy
//    1 the second's, each in descending j.
//  - in order (any other band: causal, a window): K/V block j visits its Q blocks from its first, which
//    does not decrease with j, so at Q block i the higher K/V blocks arrive first: copy 0 takes every add
//    in descending j.
// So K/V block j's turn at Q block i (wg_dq_turn) is top - j, top the highest K/V block of its copy
// reaching i, and dQ_i = (copy 0: ((0 + dQ_i,top) + dQ_i,top-1) + ...) + (copy 1: ...) in fp32: the same
// sums on every run whatever the hardware's schedule.
// Deadlock-free: a CTA only waits on CTAs of the same (batch, kv head) with a higher K/V block, i.e. a
// lower linear block index (blockIdx.x is fastest), and CTAs are launched in ascending linear index; the
// highest K/V block of a copy never waits.
//
// Each PTX instruction is wrapped once; the emulator branch (fagen/emulator/hopper.h) runs one block
// at a time, so a wait that the value in memory does not satisfy at once can never complete: it is
// reported (EmulatorDeadlockError, naming the semaphore and both values) instead of spinning.
#ifndef FAGEN_EMULATOR
// ld.acquire.gpu: the value, and what the releasing thread wrote before its release, visible.
FA_DEVICE int fa_ld_acquire_gpu(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}
// red.release.gpu.add: what this thread wrote (and waited for) before it, visible to an acquirer.
FA_DEVICE void fa_red_release_gpu_add(int* p, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
// Orders the generic-proxy semaphore accesses with the async-proxy (bulk / TMA) accesses of global memory.
FA_DEVICE void fa_fence_proxy_async_global() { asm volatile("fence.proxy.async.global;\n" ::: "memory"); }
// Spins until sems[index] == value.
FA_DEVICE void fa_sem_wait_eq(const int* sems, unsigned index, int value) {
    while (fa_ld_acquire_gpu(sems + index) != value) {
    }
}
#else  // FAGEN_EMULATOR: fagen/emulator/hopper.h
FA_DEVICE int fa_ld_acquire_gpu(const int* p) { return fagen_emu::hopper::sem_load(p); }
FA_DEVICE void fa_red_release_gpu_add(int* p, int v) { fagen_emu::hopper::sem_add(p, v); }
FA_DEVICE void fa_fence_proxy_async_global() {}  // one fiber at a time: nothing to order
FA_DEVICE void fa_sem_wait_eq(const int* sems, unsigned index, int value, FAGEN_EMU_SITE) {
    fagen_emu::hopper::sem_wait_eq(sems, index, value, FAGEN_EMU_SITE_ARGS);
}
#endif

namespace fa {
// Whether this sequence's K/V blocks visit their Q blocks rotated (above): a spec without a causal mask or a
// window (every K/V block reaches every Q block) and n_kv <= n_q. Uniform per sequence. A spec with either
// keeps the visits in order (its band is full for a Q block or two at most, or only for windows as wide as
// the sequence), and the compiler drops the rotation's code.
FA_DEVICE bool wg_det_rotates(const MaskParams& mp) {
    if constexpr (IS_CAUSAL || HAS_WINDOW) {
        return false;
    } else {
        const int n_kv = (mp.seqlen_k + BLOCK_C - 1) / BLOCK_C, n_q = (mp.seqlen_q + BLOCK_R - 1) / BLOCK_R;
        return n_kv >= 1 && n_kv <= n_q;
    }
}
// The Q block (its row) of the step at row qb of [i_begin, i_end): qb itself in order; rotated (i_begin = 0,
// i_end = len_q), qb + j BLOCK_R wrapped around past the last Q block. Recomputed per step from j, so the loop
// keeps no more state than the visits in order.
FA_DEVICE int wg_det_row(int qb, int j, bool rot, int i_end) {
    if (!rot) return qb;
    const int i0 = qb + j * BLOCK_R, span = (i_end + BLOCK_R - 1) / BLOCK_R * BLOCK_R;
    return i0 < span ? i0 : i0 - span;
}
// K/V block j's copy at the Q block at row i0: 1 where its rotated visits reach it after their wrap.
FA_DEVICE int wg_dq_copy(int j, int i0, bool rot) { return rot && j * BLOCK_R > i0 ? 1 : 0; }
// The turn counter of (batch b, q head hq, the Q block at row i0, copy c): [i0 / BLOCK_R][b][hq][c] (gridDim.y
// is the batch), 32-bit (fagen.abi.dq_sem_count elements, < 2^31); worked out at the step's loads
// (wg_dq_stage_turn).
FA_DEVICE unsigned wg_dq_sem_index(int b, int hq, int heads, int i0, int c) {
    return (((unsigned)i0 / BLOCK_R * gridDim.y + (unsigned)b) * (unsigned)heads + (unsigned)hq) * DQ_COPIES + (unsigned)c;
}
// K/V block j's turn at the Q block at row i0: how many K/V blocks of its copy add before it, top - j with
// top the highest K/V block reaching the Q block (j_last), in copy 0 of a rotated sequence at most the Q
// block's index (the K/V blocks that reach it before their wrap).
FA_DEVICE int wg_dq_turn(int j, int i0, bool rot, const MaskParams& mp) {
    int c0, c1;
    q_block_kv_range(i0, mp, &c0, &c1);
    int top = (c1 - 1) / BLOCK_C;
    if (rot && j * BLOCK_R <= i0 && i0 / BLOCK_R < top) top = i0 / BLOCK_R;
    return top - j;
}
// At the loads of the step of (q head hq, the Q block at row i0): what its reduce-add needs, kept in shared
// memory until then (dqc[4]: the dq_accum head of its copy, i0, the counter, the turn), so the producer keeps
// nothing live for it between the two.
FA_DEVICE void wg_dq_stage_turn(int* dqc, int j, int b, int hq, int heads, int i0, bool rot, const MaskParams& mp) {
    const int copy = wg_dq_copy(j, i0, rot);
    dqc[0] = hq * DQ_COPIES + copy;
    dqc[1] = i0;
    dqc[2] = (int)wg_dq_sem_index(b, hq, heads, i0, copy);
    dqc[3] = wg_dq_turn(j, i0, rot, mp);
}
// Waits for K/V block j's turn at the Q block's counter, then orders the reduce-add after the acquire.
FA_DEVICE void wg_dq_turn_wait(const int* dq_sem, unsigned index, int turn) {
    fa_sem_wait_eq(dq_sem, index, turn);
    fa_fence_proxy_async_global();
}
// After the reduce-add has completed (cp.async.bulk.wait_group 0, not .read: the adds written, not only
// the staging tile read): passes the turn to the next K/V block.
FA_DEVICE void wg_dq_turn_pass(int* dq_sem, unsigned index) {
    fa_fence_proxy_async_global();
    fa_red_release_gpu_add(dq_sem + index, 1);
}
}  // namespace fa
