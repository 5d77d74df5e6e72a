// ---------------------------------------------------------------------------
// fagen tensor-core primitives (sm_80+), part of the device-function layer.
// Included by primitives.cuh. Each function has a device branch (inline PTX,
// what NVRTC compiles) and an emulator branch (FAGEN_EMULATOR): a warp
// collective of fagen/emulator/shim.h that follows the PTX ISA's documented
// fragment layouts, or for cp.async an adversarial queue.
//
//   fa_mma_m16n8k16<E>(d, a, b)   d += A(16x16, row) * B(16x8, col), fp32
//                                 accumulate; E = __half or __nv_bfloat16.
//       PTX ISA "Matrix Fragments for mma.m16n8k16 with floating point type",
//       g = lane >> 2, t = lane % 4:
//         a[r] = {A[g + 8(r&1)][2t + 8(r>>1)], A[..][.. + 1]}  (low half first)
//         b[r] = {B[2t + 8r][g], B[2t + 8r + 1][g]}
//         d[i] = D[g + 8(i>>1)][2t + (i&1)]
//   fa_ldmatrix_x{1,2,4}[_trans](r, row_addr)
//       ldmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16: lanes 8i..8i+7
//       pass the shared address of rows 0..7 of matrix i (16 B each, 16-byte
//       aligned; lanes past 8*num pass anything); lane l gets in r[i] elements
//       (l>>2, 2(l%4)) and (l>>2, 2(l%4)+1) of matrix i, or of its transpose.
//   fa_cp_async_16(smem_dst, gmem_src, valid)   16-byte cp.async.cg; when
//       !valid the destination is zero-filled and gmem_src is not read.
//   fa_cp_async_commit()    cp.async.commit_group
//   fa_cp_async_wait<N>()   cp.async.wait_group N: this thread's copies of all
//                           but its N most recent committed groups have landed
//   fa_cp_async_wait_all()  cp.async.wait_all (= commit + wait_group 0)
//   fa_red_add_f32x2(p, a, b)   p[0] += a, p[1] += b in global memory, each add
//       atomic (relaxed, gpu scope), nothing returned; p 8-byte aligned. sm_90:
//       one vector reduction, red.global.add.v2.f32 (PTX ISA "red": .v2.f32
//       needs sm_90 and .global); before sm_90 two red.global.add.f32.
//   fa_mov_b32(x), fa_mov_b64(x)   mov.b32 / mov.b64: x unchanged. A copy whose source the C++
//       compiler (NVVM) cannot see through: a loop invariant so produced is held in a register over
//       the loop rather than re-derived from its inputs on every trip. fa_hold(v): the same for a
//       bool or a pointer. ptxas does see through a mov, and still rematerialises what it can
//       recompute from the thread index (the lane arithmetic); for that, fa_pin below.
//   fa_shfl_idx_b32(x, src)   shfl.sync.idx.b32 d, x, src, 0x1f, 0xffffffff (the whole warp, converged):
//       lane l gets lane (src_l & 31)'s x (PTX ISA "shfl.sync": c = 0x1f, no segments, so every source
//       lane is in range). fa_pin(x): x through a shuffle from the lane itself, unchanged, by an
//       exchange ptxas cannot recompute, so what was derived before it stays in its register over a
//       loop; fa_pin_if<ON>(x): fa_pin(x) where ON, else x.
//   fa_mad_wide_u32(a, b, c)   mad.wide.u32: the 64-bit a * b (both 32-bit unsigned) plus c,
//       modulo 2^64 (PTX ISA "mad": .wide gives the full 64-bit product of the 32-bit operands).
// cp.async data is visible to the issuing thread after its wait, and to the
// other threads of the block only after a barrier that follows that wait.
// The emulator enforces this: a destination holds NaN poison from the issue
// until the issuing thread's wait. Order plain shared stores before ldmatrix
// reads of them with fa_sync() (or __syncwarp within one warp).
//
// NOTE: primitives.cuh pulls this file in through a Jinja include, so it must
// not contain Jinja's opening delimiters (a brace followed by % or #): write
// PTX operand lists as "{ %0, %1 }", with a space after the brace.
// ---------------------------------------------------------------------------
template <typename E> struct FaMmaElem { static constexpr bool ok = false; };
template <> struct FaMmaElem<__half> { static constexpr bool ok = true; };
template <> struct FaMmaElem<__nv_bfloat16> { static constexpr bool ok = true; };

#ifndef FAGEN_EMULATOR
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define FA_SM80 0  // these PTX instructions need sm_80; calling them traps
#else
#define FA_SM80 1
#endif

FA_DEVICE unsigned fa_smem_u32(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }

FA_DEVICE void fa_mma_m16n8k16_impl(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2], const __half*) {
#if FA_SM80
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 { %0, %1, %2, %3 }, { %4, %5, %6, %7 }, { %8, %9 }, "
        "{ %0, %1, %2, %3 };\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    __trap();
#endif
}
FA_DEVICE void fa_mma_m16n8k16_impl(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                    const __nv_bfloat16*) {
#if FA_SM80
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 { %0, %1, %2, %3 }, { %4, %5, %6, %7 }, { %8, %9 }, "
        "{ %0, %1, %2, %3 };\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    __trap();
#endif
}
template <typename E>
FA_DEVICE void fa_mma_m16n8k16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    static_assert(FaMmaElem<E>::ok, "fa_mma_m16n8k16<E>: E must be __half or __nv_bfloat16");
    fa_mma_m16n8k16_impl(d, a, b, static_cast<const E*>(nullptr));
}

#if FA_SM80
#define FA_LDMATRIX(NAME, QUAL, N, OUTS, ...)                                                 \
    FA_DEVICE void NAME(unsigned (&r)[N], const void* row_addr) {                             \
        asm volatile("ldmatrix.sync.aligned.m8n8." QUAL ".shared.b16 " OUTS ", [%" #N "];\n" \
                     : __VA_ARGS__                                                            \
                     : "r"(fa_smem_u32(row_addr)));                                           \
    }
#else
#define FA_LDMATRIX(NAME, QUAL, N, OUTS, ...) \
    FA_DEVICE void NAME(unsigned (&r)[N], const void* row_addr) { __trap(); }
#endif
FA_LDMATRIX(fa_ldmatrix_x1, "x1", 1, "{ %0 }", "=r"(r[0]))
FA_LDMATRIX(fa_ldmatrix_x2, "x2", 2, "{ %0, %1 }", "=r"(r[0]), "=r"(r[1]))
FA_LDMATRIX(fa_ldmatrix_x4, "x4", 4, "{ %0, %1, %2, %3 }", "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]))
FA_LDMATRIX(fa_ldmatrix_x1_trans, "x1.trans", 1, "{ %0 }", "=r"(r[0]))
FA_LDMATRIX(fa_ldmatrix_x2_trans, "x2.trans", 2, "{ %0, %1 }", "=r"(r[0]), "=r"(r[1]))
FA_LDMATRIX(fa_ldmatrix_x4_trans, "x4.trans", 4, "{ %0, %1, %2, %3 }", "=r"(r[0]), "=r"(r[1]), "=r"(r[2]),
            "=r"(r[3]))
#undef FA_LDMATRIX

FA_DEVICE void fa_cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
#if FA_SM80
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(fa_smem_u32(smem_dst)),
                 "l"(__cvta_generic_to_global(gmem_src)), "r"(valid ? 16 : 0)
                 : "memory");
#else
    __trap();
#endif
}
FA_DEVICE void fa_cp_async_commit() {
#if FA_SM80
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
template <int N>
FA_DEVICE void fa_cp_async_wait() {
    static_assert(N >= 0, "fa_cp_async_wait<N>: N >= 0");
#if FA_SM80
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}
FA_DEVICE void fa_cp_async_wait_all() {
#if FA_SM80
    asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}
FA_DEVICE void fa_red_add_f32x2(float* p, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("red.relaxed.gpu.global.add.v2.f32 [%0], { %1, %2 };\n" ::"l"(__cvta_generic_to_global(p)), "f"(a),
                 "f"(b)
                 : "memory");
#else
    asm volatile("red.relaxed.gpu.global.add.f32 [%0], %1;\n" ::"l"(__cvta_generic_to_global(p)), "f"(a) : "memory");
    asm volatile("red.relaxed.gpu.global.add.f32 [%0], %1;\n" ::"l"(__cvta_generic_to_global(p + 1)), "f"(b) : "memory");
#endif
}
FA_DEVICE unsigned fa_mov_b32(unsigned x) {
    unsigned y;
    asm volatile("mov.b32 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}
FA_DEVICE unsigned long long fa_mov_b64(unsigned long long x) {
    unsigned long long y;
    asm volatile("mov.b64 %0, %1;\n" : "=l"(y) : "l"(x));
    return y;
}
FA_DEVICE unsigned fa_shfl_idx_b32(unsigned x, unsigned src) {
    unsigned y;
    asm volatile("shfl.sync.idx.b32 %0, %1, %2, 0x1f, 0xffffffff;\n" : "=r"(y) : "r"(x), "r"(src));
    return y;
}
FA_DEVICE unsigned long long fa_mad_wide_u32(unsigned a, unsigned b, unsigned long long c) {
    unsigned long long r;
    asm("mad.wide.u32 %0, %1, %2, %3;\n" : "=l"(r) : "r"(a), "r"(b), "l"(c));
    return r;
}
#undef FA_SM80
#else  // FAGEN_EMULATOR: warp collectives and the cp.async queue of shim.h
template <typename E>
FA_DEVICE void fa_mma_m16n8k16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2], FAGEN_EMU_SITE) {
    static_assert(FaMmaElem<E>::ok, "fa_mma_m16n8k16<E>: E must be __half or __nv_bfloat16");
    fagen_emu::mma_m16n8k16<std::is_same<E, __nv_bfloat16>::value>(d, a, b, FAGEN_EMU_SITE_ARGS);
}
FA_DEVICE void fa_ldmatrix_x1(unsigned (&r)[1], const void* row_addr, FAGEN_EMU_SITE) {
    fagen_emu::ldmatrix<1, false>(r, row_addr, FAGEN_EMU_SITE_ARGS);
}
FA_DEVICE void fa_ldmatrix_x2(unsigned (&r)[2], const void* row_addr, FAGEN_EMU_SITE) {
    fagen_emu::ldmatrix<2, false>(r, row_addr, FAGEN_EMU_SITE_ARGS);
}
FA_DEVICE void fa_ldmatrix_x4(unsigned (&r)[4], const void* row_addr, FAGEN_EMU_SITE) {
    fagen_emu::ldmatrix<4, false>(r, row_addr, FAGEN_EMU_SITE_ARGS);
}
FA_DEVICE void fa_ldmatrix_x1_trans(unsigned (&r)[1], const void* row_addr, FAGEN_EMU_SITE) {
    fagen_emu::ldmatrix<1, true>(r, row_addr, FAGEN_EMU_SITE_ARGS);
}
FA_DEVICE void fa_ldmatrix_x2_trans(unsigned (&r)[2], const void* row_addr, FAGEN_EMU_SITE) {
    fagen_emu::ldmatrix<2, true>(r, row_addr, FAGEN_EMU_SITE_ARGS);
}
FA_DEVICE void fa_ldmatrix_x4_trans(unsigned (&r)[4], const void* row_addr, FAGEN_EMU_SITE) {
    fagen_emu::ldmatrix<4, true>(r, row_addr, FAGEN_EMU_SITE_ARGS);
}
FA_DEVICE void fa_cp_async_16(void* smem_dst, const void* gmem_src, bool valid, FAGEN_EMU_SITE) {
    fagen_emu::cp_async_16(smem_dst, gmem_src, valid, FAGEN_EMU_SITE_ARGS);
}
FA_DEVICE void fa_cp_async_commit() { fagen_emu::cp_async_commit(); }
template <int N>
FA_DEVICE void fa_cp_async_wait(FAGEN_EMU_SITE) {
    static_assert(N >= 0, "fa_cp_async_wait<N>: N >= 0");
    fagen_emu::cp_async_wait(unsigned(N), FAGEN_EMU_SITE_ARGS);
}
FA_DEVICE void fa_cp_async_wait_all(FAGEN_EMU_SITE) { fagen_emu::cp_async_wait_all(FAGEN_EMU_SITE_ARGS); }
FA_DEVICE unsigned fa_mov_b32(unsigned x) { return x; }
FA_DEVICE unsigned long long fa_mov_b64(unsigned long long x) { return x; }
FA_DEVICE unsigned fa_shfl_idx_b32(unsigned x, unsigned src, FAGEN_EMU_SITE) {
    return __shfl_sync(0xffffffffu, x, int(src & 31u), 32, FAGEN_EMU_SITE_ARGS);
}
FA_DEVICE unsigned long long fa_mad_wide_u32(unsigned a, unsigned b, unsigned long long c) {
    return (unsigned long long)a * b + c;
}
FA_DEVICE void fa_red_add_f32x2(float* p, float a, float b, FAGEN_EMU_SITE) {
    if (reinterpret_cast<uintptr_t>(p) & 7u)
        fagen_emu_fail("fa_red_add_f32x2 at %s:%d: address %p is not 8-byte aligned", fagen_emu_file, fagen_emu_line,
                       static_cast<void*>(p));
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
}
#endif
FA_DEVICE bool fa_hold(bool b) { return fa_mov_b32(b ? 1u : 0u) != 0u; }
template <typename P>
FA_DEVICE P* fa_hold(P* p) {
    return reinterpret_cast<P*>(fa_mov_b64(reinterpret_cast<unsigned long long>(p)));
}
// x unchanged, through a shuffle from the lane itself (every lane of the warp, converged): ptxas
// cannot recompute the result, so a loop invariant so produced is held in a register over the loop,
// where from a plain value (fa_mov_b32's too: ptxas sees through a mov) it would re-derive the lane
// and warp arithmetic from the thread index on every trip. fa_pin of a pointer: two shuffles.
FA_DEVICE int fa_pin(int x) { return (int)fa_shfl_idx_b32((unsigned)x, threadIdx.x & 31u); }
template <typename P>
FA_DEVICE P* fa_pin(P* p) {
    const unsigned long long v = reinterpret_cast<unsigned long long>(p);
    const unsigned lane = threadIdx.x & 31u;
    return reinterpret_cast<P*>((unsigned long long)fa_shfl_idx_b32((unsigned)(v >> 32), lane) << 32 |
                                fa_shfl_idx_b32((unsigned)v, lane));
}
// fa_pin where ON (a kernel's compile-time choice), else v as it is.
template <bool ON, typename V>
FA_DEVICE V fa_pin_if(V v) {
    if constexpr (ON) return fa_pin(v);
    else return v;
}
