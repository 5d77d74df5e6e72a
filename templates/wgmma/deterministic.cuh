// The Hopper family's deterministic backward (rendered with deterministic only): dQ_i's reduce-adds
// into dq_accum in a fixed order. dq_sem holds one int32 turn counter per (batch, q head, Q block),
// zeroed by the launcher for every call (fagen.abi.DQ_SEM). The K/V blocks that reach Q block i are
// one run [j_first(i), j_last(i)] (the mask is a band: partials/masking.cuh's q_block_kv_range); the
// CTA of K/V block j adds its dQ_i when the counter holds j - j_first(i) (its turn), after every
// lower K/V block's add has completed, and then advances it. So dQ_i = (((0 + dQ_i,j_first) +
// dQ_i,j_first+1) + ...) in fp32, the same sum on every run whatever the hardware's schedule.
// Deadlock-free: a CTA only waits on CTAs of the same (batch, kv head) with a lower K/V block, i.e. a
// lower linear block index (blockIdx.x is fastest), and CTAs are launched in ascending linear
// index; the lowest K/V block reaching i never waits on i.
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
// The turn counter of (batch b, q head hq, the Q block at row i0): [i0 / BLOCK_R][b][hq] (gridDim.y is the
// batch), 32-bit (fagen.abi.dq_sem_count elements, B H Nq / BLOCK_R < 2^31); nothing kept in registers
// beyond b (the producer warp's 24).
FA_DEVICE unsigned wg_dq_sem_index(int b, int hq, int heads, int i0) {
    return ((unsigned)i0 / BLOCK_R * gridDim.y + (unsigned)b) * (unsigned)heads + (unsigned)hq;
}
// K/V block j's turn at the Q block at row i0: how many lower K/V blocks reach it (j - j_first(i)).
FA_DEVICE int wg_dq_turn(int j, int i0, const MaskParams& mp) {
    int c0, c1;
    q_block_kv_range(i0, mp, &c0, &c1);
    return j - c0 / BLOCK_C;
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
