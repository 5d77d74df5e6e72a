// ---------------------------------------------------------------------------
// fagen Hopper primitives (sm_90a), part of the device-function layer: the
// asynchronous machinery of the Hopper family (templates/wgmma/). Each fa_*
// function wraps one PTX instruction, operands in PTX order. The device branch
// is inline PTX (what NVRTC compiles for sm_90a; on plain sm_90 wgmma and
// setmaxnreg trap, the rest needs sm_90); the
// emulator branch (FAGEN_EMULATOR) calls fagen/emulator/hopper.h, which
// follows the PTX ISA's documented semantics (docs/emulator.md, "Hopper").
// Section numbers are those of the PTX ISA 8.x manual.
//
// Shared memory. Swizzles act on absolute shared addresses: keep every
// swizzled tile 1024-byte aligned inside the dynamic window fa_smem_1024()
// (whose base is 1024-byte aligned on both paths). Descriptor base offset: 0.
//
// wgmma (9.7.15 "Asynchronous Warpgroup Level Matrix Multiply-Accumulate"):
//   fa_wgmma_fence()            wgmma.fence.sync.aligned
//   fa_wgmma_commit_group()     wgmma.commit_group.sync.aligned
//   fa_wgmma_wait_group<N>()    wgmma.wait_group.sync.aligned N
//   fa_wgmma_desc(p, lbo, sbo, swizzle)   the 64-bit matrix descriptor
//       (9.7.15.5.1 "Matrix Descriptor Format"): bits 0-13 start address >> 4,
//       16-29 leading dimension byte offset >> 4, 32-45 stride dimension byte
//       offset >> 4, 49-51 base offset (0), 62-63 swizzle: 0 none, 1 128B,
//       2 64B, 3 32B; swizzle is given in bytes (0, 32, 64 or 128).
//   fa_wgmma_m64nNk16_ss<E, N, TRANS_A, TRANS_B>(d, desc_a, desc_b, scale_d)
//   fa_wgmma_m64nNk16_rs<E, N, TRANS_B>(d, a, desc_b, scale_d)
//       wgmma.mma_async.sync.aligned.m64nNk16.f32.E.E: D(64xN) = A(64x16) B(16xN)
//       + (scale_d ? D : 0), fp32 accumulate, E = __half or __nv_bfloat16,
//       N = 8..256 step 8. TRANS = 0: K-major operand, 1: M/N-major. d has N/2
//       floats per thread: d[4j + i] = D[16w + g + 8((i>>1)&1)][8j + 2t + (i&1)]
//       (w = warp in the warpgroup, g = lane >> 2, t = lane % 4); a (rs) holds
//       A as mma.m16n8k16's A fragment for rows 16w..16w+15. Results are
//       usable after the wait that retires the group; fence the accumulator
//       with fa_wgmma_fence_operand so the compiler keeps accesses in order.
// mbarrier (9.7.12.15 "Parallel Synchronization and Communication
// Instructions: mbarrier"):
//   fa_mbarrier_init(bar, count), fa_mbarrier_arrive(bar) -> state,
//   fa_mbarrier_arrive_expect_tx(bar, bytes) -> state, fa_mbarrier_expect_tx,
//   fa_mbarrier_try_wait_parity(bar, parity) -> bool (true once the phase of
//   that parity has completed), fa_mbarrier_wait_parity (loops on it),
//   fa_fence_barrier_init()  fence.mbarrier_init.release.cluster,
//   fa_fence_proxy_async()   fence.proxy.async.shared::cta.
// TMA (9.7.9.25 "Data Movement and Conversion Instructions: cp.async.bulk.tensor",
// 9.7.9.26 cp.reduce.async.bulk.tensor, 9.7.9.27 bulk wait/commit groups):
//   fa_tma_load_{2,3,4}d(smem_dst, tmap, bar, c0, c1[, c2[, c3]])
//       box at element coordinates (c0 innermost) -> smem, out-of-bounds
//       elements zero; completes by complete_tx of the box's bytes on bar.
//   fa_tma_store_{2,3,4,5}d(tmap, smem_src, c...), fa_tma_reduce_add_{2,3,4,5}d
//       smem box -> global (store / add), in-bounds elements only; bulk_group. The map's
//       outer strides may come in any order (the dQ staging map steps rows before columns).
//   fa_bulk_commit_group(), fa_bulk_wait_group<N>(), fa_bulk_wait_group_read<N>()
//   fa_bulk_load(smem_dst, gmem_src, bytes, bar)   cp.async.bulk (non-tensor) global ->
//       smem, complete_tx on bar; fa_bulk_store(gmem_dst, smem_src, bytes) and
//       fa_bulk_reduce_add_f32(gmem_dst, smem_src, bytes) (cp.reduce.async.bulk .add.f32),
//       bulk_group; bytes a multiple of 16, addresses 16-byte aligned.
// stmatrix (9.7.14.5.16 "stmatrix"): fa_stmatrix_x{1,2,4}[_trans](row_addr, r):
//   row_addr a pointer into the dynamic shared memory, or its shared address (fa_shared_u32);
//   lanes 8i..8i+7 give the rows of matrix i; r[i] of lane l holds elements
//   (l>>2, 2(l%4)) and (.., +1) of matrix i (of its transpose with _trans).
// fa_setmaxnreg_inc<N>(), fa_setmaxnreg_dec<N>() (9.7.17.x "setmaxnreg"):
//   N a multiple of 8 in [24, 256], the same in the whole warpgroup.
// fa_named_barrier_sync(id, count), fa_named_barrier_arrive(id, count) (9.7.12.1
//   bar.sync / bar.arrive): `count` threads (a multiple of 32, whole warps) meet at
//   barrier id (1..15; 0 is __syncthreads'); arrive does not wait.
// fa_elect_one()  elect.sync _|p, 0xffffffff: true in exactly one lane of the
//   warp; which lane is unspecified (the emulator picks lane 31).
//
// FaTensorMap: a kernel parameter `const __grid_constant__ FaTensorMap` (ABI
// kind "tensormap", fagen/abi.py), encoded on the host by fagen/tma.py.
//
// NOTE: rendered kernels pull this file in through a Jinja include, so it must
// not contain Jinja's opening delimiters (a brace followed by % or #): write
// PTX operand lists as "{ %0, %1 }", with a space after the brace.
// ---------------------------------------------------------------------------
// The emulator pastes fagen/emulator/hopper.h into a translation unit that defines this.
#define FAGEN_HOPPER_PRIMITIVES 1
template <typename E> struct FaWgmmaElem { static constexpr bool ok = false; };
template <> struct FaWgmmaElem<__half> { static constexpr bool ok = true; };
template <> struct FaWgmmaElem<__nv_bfloat16> { static constexpr bool ok = true; };
template <int N> struct FaWgmmaShape {
    static constexpr bool ok = N >= 8 && N <= 256 && N % 8 == 0;
};
enum : int { FA_SWIZZLE_NONE = 0, FA_SWIZZLE_32B = 32, FA_SWIZZLE_64B = 64, FA_SWIZZLE_128B = 128 };

// The descriptor's swizzle field for a swizzle span in bytes (-1: invalid).
FA_DEVICE int fa_wgmma_swizzle_mode(int swizzle_bytes) {
    return swizzle_bytes == 0 ? 0 : swizzle_bytes == 128 ? 1 : swizzle_bytes == 64 ? 2 : swizzle_bytes == 32 ? 3 : -1;
}
FA_DEVICE unsigned long long fa_wgmma_desc_bits(unsigned smem_addr, unsigned lbo, unsigned sbo, int swizzle_bytes) {
    const int mode = fa_wgmma_swizzle_mode(swizzle_bytes);
    return (unsigned long long)((smem_addr & 0x3ffffu) >> 4) |
           (unsigned long long)((lbo >> 4) & 0x3fffu) << 16 |
           (unsigned long long)((sbo >> 4) & 0x3fffu) << 32 |
           (unsigned long long)(mode < 0 ? 0 : mode) << 62;
}

#ifndef FAGEN_EMULATOR
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FA_SM90A 0  // wgmma / setmaxnreg need sm_90a; elsewhere these trap
#else
#define FA_SM90A 1
#endif

struct alignas(64) FaTensorMap {
    unsigned long long opaque[16];  // CUtensorMap, as cuTensorMapEncodeTiled wrote it
};

FA_DEVICE unsigned fa_shared_u32(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }
// The dynamic shared window, 1024-byte aligned (what 128B swizzles need).
FA_DEVICE unsigned char* fa_smem_1024() {
    extern __shared__ __align__(1024) unsigned char fa_dynamic_smem_1024[];
    return fa_dynamic_smem_1024;
}
FA_DEVICE unsigned long long fa_wgmma_desc(const void* smem_ptr, unsigned lbo, unsigned sbo, int swizzle_bytes) {
    return fa_wgmma_desc_bits(fa_shared_u32(smem_ptr), lbo, sbo, swizzle_bytes);
}

FA_DEVICE void fa_wgmma_fence() {
#if FA_SM90A
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#else
    __trap();
#endif
}
FA_DEVICE void fa_wgmma_commit_group() {
#if FA_SM90A
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#else
    __trap();
#endif
}
template <int N>
FA_DEVICE void fa_wgmma_wait_group() {
    static_assert(N >= 0 && N <= 7, "fa_wgmma_wait_group<N>: 0 <= N <= 7");
#if FA_SM90A
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#else
    __trap();
#endif
}
// Keeps the compiler from moving accesses of an accumulator register across
// the wgmma instructions (they are asm volatile, the register is not theirs).
FA_DEVICE void fa_wgmma_fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }
FA_DEVICE void fa_wgmma_fence_operand(unsigned& r) { asm volatile("" : "+r"(r)::"memory"); }

// One specialisation per N: the operand lists of wgmma.mma_async, built from
// chunks of four registers (d regs are %0..%(N/2-1); I0.. are the next ones).
#define FA_WG_S0 "%0, %1, %2, %3"
#define FA_WG_S1 "%4, %5, %6, %7"
#define FA_WG_S2 "%8, %9, %10, %11"
#define FA_WG_S3 "%12, %13, %14, %15"
#define FA_WG_S4 "%16, %17, %18, %19"
#define FA_WG_S5 "%20, %21, %22, %23"
#define FA_WG_S6 "%24, %25, %26, %27"
#define FA_WG_S7 "%28, %29, %30, %31"
#define FA_WG_S8 "%32, %33, %34, %35"
#define FA_WG_S9 "%36, %37, %38, %39"
#define FA_WG_S10 "%40, %41, %42, %43"
#define FA_WG_S11 "%44, %45, %46, %47"
#define FA_WG_S12 "%48, %49, %50, %51"
#define FA_WG_S13 "%52, %53, %54, %55"
#define FA_WG_S14 "%56, %57, %58, %59"
#define FA_WG_S15 "%60, %61, %62, %63"
#define FA_WG_S16 "%64, %65, %66, %67"
#define FA_WG_S17 "%68, %69, %70, %71"
#define FA_WG_S18 "%72, %73, %74, %75"
#define FA_WG_S19 "%76, %77, %78, %79"
#define FA_WG_S20 "%80, %81, %82, %83"
#define FA_WG_S21 "%84, %85, %86, %87"
#define FA_WG_S22 "%88, %89, %90, %91"
#define FA_WG_S23 "%92, %93, %94, %95"
#define FA_WG_S24 "%96, %97, %98, %99"
#define FA_WG_S25 "%100, %101, %102, %103"
#define FA_WG_S26 "%104, %105, %106, %107"
#define FA_WG_S27 "%108, %109, %110, %111"
#define FA_WG_S28 "%112, %113, %114, %115"
#define FA_WG_S29 "%116, %117, %118, %119"
#define FA_WG_S30 "%120, %121, %122, %123"
#define FA_WG_S31 "%124, %125, %126, %127"
#define FA_WG_R1 FA_WG_S0
#define FA_WG_R2 FA_WG_R1 ", " FA_WG_S1
#define FA_WG_R3 FA_WG_R2 ", " FA_WG_S2
#define FA_WG_R4 FA_WG_R3 ", " FA_WG_S3
#define FA_WG_R5 FA_WG_R4 ", " FA_WG_S4
#define FA_WG_R6 FA_WG_R5 ", " FA_WG_S5
#define FA_WG_R7 FA_WG_R6 ", " FA_WG_S6
#define FA_WG_R8 FA_WG_R7 ", " FA_WG_S7
#define FA_WG_R9 FA_WG_R8 ", " FA_WG_S8
#define FA_WG_R10 FA_WG_R9 ", " FA_WG_S9
#define FA_WG_R11 FA_WG_R10 ", " FA_WG_S10
#define FA_WG_R12 FA_WG_R11 ", " FA_WG_S11
#define FA_WG_R13 FA_WG_R12 ", " FA_WG_S12
#define FA_WG_R14 FA_WG_R13 ", " FA_WG_S13
#define FA_WG_R15 FA_WG_R14 ", " FA_WG_S14
#define FA_WG_R16 FA_WG_R15 ", " FA_WG_S15
#define FA_WG_R17 FA_WG_R16 ", " FA_WG_S16
#define FA_WG_R18 FA_WG_R17 ", " FA_WG_S17
#define FA_WG_R19 FA_WG_R18 ", " FA_WG_S18
#define FA_WG_R20 FA_WG_R19 ", " FA_WG_S19
#define FA_WG_R21 FA_WG_R20 ", " FA_WG_S20
#define FA_WG_R22 FA_WG_R21 ", " FA_WG_S21
#define FA_WG_R23 FA_WG_R22 ", " FA_WG_S22
#define FA_WG_R24 FA_WG_R23 ", " FA_WG_S23
#define FA_WG_R25 FA_WG_R24 ", " FA_WG_S24
#define FA_WG_R26 FA_WG_R25 ", " FA_WG_S25
#define FA_WG_R27 FA_WG_R26 ", " FA_WG_S26
#define FA_WG_R28 FA_WG_R27 ", " FA_WG_S27
#define FA_WG_R29 FA_WG_R28 ", " FA_WG_S28
#define FA_WG_R30 FA_WG_R29 ", " FA_WG_S29
#define FA_WG_R31 FA_WG_R30 ", " FA_WG_S30
#define FA_WG_R32 FA_WG_R31 ", " FA_WG_S31
#define FA_WG_C1 FA_WG_F(0)
#define FA_WG_C2 FA_WG_C1, FA_WG_F(1)
#define FA_WG_C3 FA_WG_C2, FA_WG_F(2)
#define FA_WG_C4 FA_WG_C3, FA_WG_F(3)
#define FA_WG_C5 FA_WG_C4, FA_WG_F(4)
#define FA_WG_C6 FA_WG_C5, FA_WG_F(5)
#define FA_WG_C7 FA_WG_C6, FA_WG_F(6)
#define FA_WG_C8 FA_WG_C7, FA_WG_F(7)
#define FA_WG_C9 FA_WG_C8, FA_WG_F(8)
#define FA_WG_C10 FA_WG_C9, FA_WG_F(9)
#define FA_WG_C11 FA_WG_C10, FA_WG_F(10)
#define FA_WG_C12 FA_WG_C11, FA_WG_F(11)
#define FA_WG_C13 FA_WG_C12, FA_WG_F(12)
#define FA_WG_C14 FA_WG_C13, FA_WG_F(13)
#define FA_WG_C15 FA_WG_C14, FA_WG_F(14)
#define FA_WG_C16 FA_WG_C15, FA_WG_F(15)
#define FA_WG_C17 FA_WG_C16, FA_WG_F(16)
#define FA_WG_C18 FA_WG_C17, FA_WG_F(17)
#define FA_WG_C19 FA_WG_C18, FA_WG_F(18)
#define FA_WG_C20 FA_WG_C19, FA_WG_F(19)
#define FA_WG_C21 FA_WG_C20, FA_WG_F(20)
#define FA_WG_C22 FA_WG_C21, FA_WG_F(21)
#define FA_WG_C23 FA_WG_C22, FA_WG_F(22)
#define FA_WG_C24 FA_WG_C23, FA_WG_F(23)
#define FA_WG_C25 FA_WG_C24, FA_WG_F(24)
#define FA_WG_C26 FA_WG_C25, FA_WG_F(25)
#define FA_WG_C27 FA_WG_C26, FA_WG_F(26)
#define FA_WG_C28 FA_WG_C27, FA_WG_F(27)
#define FA_WG_C29 FA_WG_C28, FA_WG_F(28)
#define FA_WG_C30 FA_WG_C29, FA_WG_F(29)
#define FA_WG_C31 FA_WG_C30, FA_WG_F(30)
#define FA_WG_C32 FA_WG_C31, FA_WG_F(31)
#define FA_WG_F(b) "+f"(d[4 * (b)]), "+f"(d[4 * (b) + 1]), "+f"(d[4 * (b) + 2]), "+f"(d[4 * (b) + 3])
template <int N> struct FaWgmmaN;
#if FA_SM90A
#define FA_WGMMA_ONE(N, K4, I0, I1, I2, I3, I4, I5, I6, TY)                                                          \
    template <int TA, int TB>                                                                                        \
    static FA_DEVICE void ss_##TY(float (&d)[N / 2], unsigned long long da, unsigned long long db, int scale_d) {   \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #I2 ", 0;\n"                                              \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." #TY "." #TY " { " FA_WG_R##K4 " }, %" #I0    \
                     ", %" #I1 ", p, 1, 1, %" #I3 ", %" #I4 ";\n}\n"                                                \
                     : FA_WG_C##K4                                                                                   \
                     : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB));                                            \
    }                                                                                                                \
    template <int TB>                                                                                                \
    static FA_DEVICE void rs_##TY(float (&d)[N / 2], const unsigned (&a)[4], unsigned long long db, int scale_d) {  \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #I5 ", 0;\n"                                              \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." #TY "." #TY " { " FA_WG_R##K4 " }, { %" #I0  \
                     ", %" #I1 ", %" #I2 ", %" #I3 " }, %" #I4 ", p, 1, 1, %" #I6 ";\n}\n"                          \
                     : FA_WG_C##K4                                                                                   \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d), "n"(TB));                  \
    }
#else
#define FA_WGMMA_ONE(N, K4, I0, I1, I2, I3, I4, I5, I6, TY)                                                        \
    template <int TA, int TB>                                                                                      \
    static FA_DEVICE void ss_##TY(float (&d)[N / 2], unsigned long long, unsigned long long, int) { __trap(); }   \
    template <int TB>                                                                                              \
    static FA_DEVICE void rs_##TY(float (&d)[N / 2], const unsigned (&)[4], unsigned long long, int) { __trap(); }
#endif
#define FA_WGMMA_N(N, K4, I0, I1, I2, I3, I4, I5, I6)    \
    template <> struct FaWgmmaN<N> {                     \
        FA_WGMMA_ONE(N, K4, I0, I1, I2, I3, I4, I5, I6, f16)  \
        FA_WGMMA_ONE(N, K4, I0, I1, I2, I3, I4, I5, I6, bf16) \
    };
FA_WGMMA_N(8, 1, 4, 5, 6, 7, 8, 9, 10)
FA_WGMMA_N(16, 2, 8, 9, 10, 11, 12, 13, 14)
FA_WGMMA_N(24, 3, 12, 13, 14, 15, 16, 17, 18)
FA_WGMMA_N(32, 4, 16, 17, 18, 19, 20, 21, 22)
FA_WGMMA_N(40, 5, 20, 21, 22, 23, 24, 25, 26)
FA_WGMMA_N(48, 6, 24, 25, 26, 27, 28, 29, 30)
FA_WGMMA_N(56, 7, 28, 29, 30, 31, 32, 33, 34)
FA_WGMMA_N(64, 8, 32, 33, 34, 35, 36, 37, 38)
FA_WGMMA_N(72, 9, 36, 37, 38, 39, 40, 41, 42)
FA_WGMMA_N(80, 10, 40, 41, 42, 43, 44, 45, 46)
FA_WGMMA_N(88, 11, 44, 45, 46, 47, 48, 49, 50)
FA_WGMMA_N(96, 12, 48, 49, 50, 51, 52, 53, 54)
FA_WGMMA_N(104, 13, 52, 53, 54, 55, 56, 57, 58)
FA_WGMMA_N(112, 14, 56, 57, 58, 59, 60, 61, 62)
FA_WGMMA_N(120, 15, 60, 61, 62, 63, 64, 65, 66)
FA_WGMMA_N(128, 16, 64, 65, 66, 67, 68, 69, 70)
FA_WGMMA_N(136, 17, 68, 69, 70, 71, 72, 73, 74)
FA_WGMMA_N(144, 18, 72, 73, 74, 75, 76, 77, 78)
FA_WGMMA_N(152, 19, 76, 77, 78, 79, 80, 81, 82)
FA_WGMMA_N(160, 20, 80, 81, 82, 83, 84, 85, 86)
FA_WGMMA_N(168, 21, 84, 85, 86, 87, 88, 89, 90)
FA_WGMMA_N(176, 22, 88, 89, 90, 91, 92, 93, 94)
FA_WGMMA_N(184, 23, 92, 93, 94, 95, 96, 97, 98)
FA_WGMMA_N(192, 24, 96, 97, 98, 99, 100, 101, 102)
FA_WGMMA_N(200, 25, 100, 101, 102, 103, 104, 105, 106)
FA_WGMMA_N(208, 26, 104, 105, 106, 107, 108, 109, 110)
FA_WGMMA_N(216, 27, 108, 109, 110, 111, 112, 113, 114)
FA_WGMMA_N(224, 28, 112, 113, 114, 115, 116, 117, 118)
FA_WGMMA_N(232, 29, 116, 117, 118, 119, 120, 121, 122)
FA_WGMMA_N(240, 30, 120, 121, 122, 123, 124, 125, 126)
FA_WGMMA_N(248, 31, 124, 125, 126, 127, 128, 129, 130)
FA_WGMMA_N(256, 32, 128, 129, 130, 131, 132, 133, 134)
#undef FA_WGMMA_N
#undef FA_WGMMA_ONE
template <typename E> struct FaWgmmaDispatch;
template <> struct FaWgmmaDispatch<__half> {
    template <int N, int TA, int TB>
    static FA_DEVICE void ss(float (&d)[N / 2], unsigned long long da, unsigned long long db, int s) {
        FaWgmmaN<N>::template ss_f16<TA, TB>(d, da, db, s);
    }
    template <int N, int TB>
    static FA_DEVICE void rs(float (&d)[N / 2], const unsigned (&a)[4], unsigned long long db, int s) {
        FaWgmmaN<N>::template rs_f16<TB>(d, a, db, s);
    }
};
template <> struct FaWgmmaDispatch<__nv_bfloat16> {
    template <int N, int TA, int TB>
    static FA_DEVICE void ss(float (&d)[N / 2], unsigned long long da, unsigned long long db, int s) {
        FaWgmmaN<N>::template ss_bf16<TA, TB>(d, da, db, s);
    }
    template <int N, int TB>
    static FA_DEVICE void rs(float (&d)[N / 2], const unsigned (&a)[4], unsigned long long db, int s) {
        FaWgmmaN<N>::template rs_bf16<TB>(d, a, db, s);
    }
};
template <typename E, int N, int TRANS_A, int TRANS_B>
FA_DEVICE void fa_wgmma_m64nNk16_ss(float (&d)[N / 2], unsigned long long desc_a, unsigned long long desc_b,
                                    int scale_d) {
    static_assert(FaWgmmaElem<E>::ok, "fa_wgmma_m64nNk16_ss<E>: E must be __half or __nv_bfloat16");
    static_assert(FaWgmmaShape<N>::ok, "fa_wgmma_m64nNk16_ss<E, N>: N must be 8..256 in steps of 8");
    static_assert((TRANS_A == 0 || TRANS_A == 1) && (TRANS_B == 0 || TRANS_B == 1), "TRANS_A/TRANS_B: 0 or 1");
    FaWgmmaDispatch<E>::template ss<N, TRANS_A, TRANS_B>(d, desc_a, desc_b, scale_d);
}
template <typename E, int N, int TRANS_B>
FA_DEVICE void fa_wgmma_m64nNk16_rs(float (&d)[N / 2], const unsigned (&a)[4], unsigned long long desc_b,
                                    int scale_d) {
    static_assert(FaWgmmaElem<E>::ok, "fa_wgmma_m64nNk16_rs<E>: E must be __half or __nv_bfloat16");
    static_assert(FaWgmmaShape<N>::ok, "fa_wgmma_m64nNk16_rs<E, N>: N must be 8..256 in steps of 8");
    static_assert(TRANS_B == 0 || TRANS_B == 1, "TRANS_B: 0 or 1");
    FaWgmmaDispatch<E>::template rs<N, TRANS_B>(d, a, desc_b, scale_d);
}

// ---------------------------------------------------------------- mbarrier
FA_DEVICE void fa_mbarrier_init(unsigned long long* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(fa_shared_u32(bar)), "r"(count) : "memory");
}
FA_DEVICE unsigned long long fa_mbarrier_arrive(unsigned long long* bar) {
    unsigned long long state;
    asm volatile("mbarrier.arrive.shared::cta.b64 %0, [%1];\n" : "=l"(state) : "r"(fa_shared_u32(bar)) : "memory");
    return state;
}
FA_DEVICE unsigned long long fa_mbarrier_arrive_expect_tx(unsigned long long* bar, unsigned tx_bytes) {
    unsigned long long state;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 %0, [%1], %2;\n"
                 : "=l"(state)
                 : "r"(fa_shared_u32(bar)), "r"(tx_bytes)
                 : "memory");
    return state;
}
FA_DEVICE void fa_mbarrier_expect_tx(unsigned long long* bar, unsigned tx_bytes) {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(fa_shared_u32(bar)),
                 "r"(tx_bytes)
                 : "memory");
}
FA_DEVICE bool fa_mbarrier_try_wait_parity(unsigned long long* bar, unsigned parity) {
    unsigned done;
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(fa_shared_u32(bar)), "r"(parity)
        : "memory");
    return done != 0;
}
FA_DEVICE void fa_mbarrier_wait_parity(unsigned long long* bar, unsigned parity) {
    while (!fa_mbarrier_try_wait_parity(bar, parity)) {
    }
}
FA_DEVICE void fa_fence_barrier_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
FA_DEVICE void fa_fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// --------------------------------------------------------------------- TMA
#define FA_TMA_MAP(t) "l"(reinterpret_cast<unsigned long long>(t))
FA_DEVICE void fa_tma_load_2d(void* dst, const FaTensorMap* tmap, unsigned long long* bar, int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, { %2, %3 }], "
        "[%4];\n" ::"r"(fa_shared_u32(dst)),
        FA_TMA_MAP(tmap), "r"(c0), "r"(c1), "r"(fa_shared_u32(bar))
        : "memory");
}
FA_DEVICE void fa_tma_load_3d(void* dst, const FaTensorMap* tmap, unsigned long long* bar, int c0, int c1, int c2) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, { %2, %3, %4 }], "
        "[%5];\n" ::"r"(fa_shared_u32(dst)),
        FA_TMA_MAP(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(fa_shared_u32(bar))
        : "memory");
}
FA_DEVICE void fa_tma_load_4d(void* dst, const FaTensorMap* tmap, unsigned long long* bar, int c0, int c1, int c2,
                              int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], "
        "[%1, { %2, %3, %4, %5 }], [%6];\n" ::"r"(fa_shared_u32(dst)),
        FA_TMA_MAP(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(fa_shared_u32(bar))
        : "memory");
}
#define FA_TMA_OUT(NAME, OP)                                                                                   \
    FA_DEVICE void NAME##_2d(const FaTensorMap* tmap, const void* src, int c0, int c1) {                      \
        asm volatile(OP ".2d.global.shared::cta" FA_TMA_##NAME##_MODE " [%0, { %2, %3 }], [%1];\n" ::FA_TMA_MAP( \
                         tmap),                                                                                \
                     "r"(fa_shared_u32(src)), "r"(c0), "r"(c1)                                                 \
                     : "memory");                                                                              \
    }                                                                                                          \
    FA_DEVICE void NAME##_3d(const FaTensorMap* tmap, const void* src, int c0, int c1, int c2) {              \
        asm volatile(OP ".3d.global.shared::cta" FA_TMA_##NAME##_MODE " [%0, { %2, %3, %4 }], [%1];\n" ::      \
                         FA_TMA_MAP(tmap),                                                                     \
                     "r"(fa_shared_u32(src)), "r"(c0), "r"(c1), "r"(c2)                                        \
                     : "memory");                                                                              \
    }                                                                                                          \
    FA_DEVICE void NAME##_4d(const FaTensorMap* tmap, const void* src, int c0, int c1, int c2, int c3) {      \
        asm volatile(OP ".4d.global.shared::cta" FA_TMA_##NAME##_MODE " [%0, { %2, %3, %4, %5 }], [%1];\n" ::  \
                         FA_TMA_MAP(tmap),                                                                     \
                     "r"(fa_shared_u32(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)                               \
                     : "memory");                                                                              \
    }                                                                                                          \
    FA_DEVICE void NAME##_5d(const FaTensorMap* tmap, const void* src, int c0, int c1, int c2, int c3, int c4) { \
        asm volatile(OP ".5d.global.shared::cta" FA_TMA_##NAME##_MODE " [%0, { %2, %3, %4, %5, %6 }], [%1];\n" :: \
                         FA_TMA_MAP(tmap),                                                                     \
                     "r"(fa_shared_u32(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)                      \
                     : "memory");                                                                              \
    }
#define FA_TMA_fa_tma_store_MODE ".tile.bulk_group"
#define FA_TMA_fa_tma_reduce_add_MODE ".add.tile.bulk_group"
FA_TMA_OUT(fa_tma_store, "cp.async.bulk.tensor")
FA_TMA_OUT(fa_tma_reduce_add, "cp.reduce.async.bulk.tensor")
#undef FA_TMA_OUT
#undef FA_TMA_fa_tma_store_MODE
#undef FA_TMA_fa_tma_reduce_add_MODE
#undef FA_TMA_MAP
FA_DEVICE void fa_bulk_load(void* smem_dst, const void* gmem_src, unsigned bytes, unsigned long long* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                     fa_shared_u32(smem_dst)),
                 "l"(gmem_src), "r"(bytes), "r"(fa_shared_u32(bar))
                 : "memory");
}
FA_DEVICE void fa_bulk_store(void* gmem_dst, const void* smem_src, unsigned bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(gmem_dst),
                 "r"(fa_shared_u32(smem_src)), "r"(bytes)
                 : "memory");
}
FA_DEVICE void fa_bulk_reduce_add_f32(float* gmem_dst, const float* smem_src, unsigned bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(gmem_dst),
                 "r"(fa_shared_u32(smem_src)), "r"(bytes)
                 : "memory");
}
FA_DEVICE void fa_bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N>
FA_DEVICE void fa_bulk_wait_group() {
    static_assert(N >= 0, "fa_bulk_wait_group<N>: N >= 0");
    asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}
template <int N>
FA_DEVICE void fa_bulk_wait_group_read() {
    static_assert(N >= 0, "fa_bulk_wait_group_read<N>: N >= 0");
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}

// ---------------------------------------------------------------- stmatrix
#define FA_STMATRIX(NAME, QUAL, N, REGS, ...)                                                                      \
    FA_DEVICE void NAME(unsigned row_saddr, const unsigned (&r)[N]) {                                             \
        asm volatile("stmatrix.sync.aligned.m8n8." QUAL ".shared.b16 [%0], " REGS ";\n" ::"r"(row_saddr),          \
                     __VA_ARGS__                                                                                   \
                     : "memory");                                                                                  \
    }                                                                                                              \
    FA_DEVICE void NAME(void* row_addr, const unsigned (&r)[N]) { NAME(fa_shared_u32(row_addr), r); }
FA_STMATRIX(fa_stmatrix_x1, "x1", 1, "{ %1 }", "r"(r[0]))
FA_STMATRIX(fa_stmatrix_x2, "x2", 2, "{ %1, %2 }", "r"(r[0]), "r"(r[1]))
FA_STMATRIX(fa_stmatrix_x4, "x4", 4, "{ %1, %2, %3, %4 }", "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]))
FA_STMATRIX(fa_stmatrix_x1_trans, "x1.trans", 1, "{ %1 }", "r"(r[0]))
FA_STMATRIX(fa_stmatrix_x2_trans, "x2.trans", 2, "{ %1, %2 }", "r"(r[0]), "r"(r[1]))
FA_STMATRIX(fa_stmatrix_x4_trans, "x4.trans", 4, "{ %1, %2, %3, %4 }", "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]))
#undef FA_STMATRIX

// ------------------------------------------------- registers, elections
template <int N>
FA_DEVICE void fa_setmaxnreg_inc() {
    static_assert(N % 8 == 0 && N >= 24 && N <= 256, "fa_setmaxnreg_inc<N>: N a multiple of 8 in [24, 256]");
#if FA_SM90A
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
#else
    __trap();
#endif
}
template <int N>
FA_DEVICE void fa_setmaxnreg_dec() {
    static_assert(N % 8 == 0 && N >= 24 && N <= 256, "fa_setmaxnreg_dec<N>: N a multiple of 8 in [24, 256]");
#if FA_SM90A
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
#else
    __trap();
#endif
}
FA_DEVICE void fa_named_barrier_sync(unsigned id, unsigned count) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
FA_DEVICE void fa_named_barrier_arrive(unsigned id, unsigned count) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
FA_DEVICE bool fa_elect_one() {
    unsigned elected;
    asm volatile("{\n.reg .pred p;\nelect.sync _|p, 0xffffffff;\nselp.u32 %0, 1, 0, p;\n}\n" : "=r"(elected));
    return elected != 0;
}
#undef FA_SM90A
#else  // FAGEN_EMULATOR: fagen/emulator/hopper.h
FA_DEVICE unsigned fa_shared_u32(const void* p, FAGEN_EMU_SITE) {
    return fagen_emu::hopper::shared_addr(p, "fa_shared_u32", FAGEN_EMU_SITE_ARGS);
}
FA_DEVICE unsigned char* fa_smem_1024() { return fagen_emu_dynamic_smem(); }  // 1024-byte aligned (runtime.h)
FA_DEVICE unsigned long long fa_wgmma_desc(const void* smem_ptr, unsigned lbo, unsigned sbo, int swizzle_bytes,
                                           FAGEN_EMU_SITE) {
    if (fa_wgmma_swizzle_mode(swizzle_bytes) < 0)
        fagen_emu_fail("fa_wgmma_desc at %s:%d: swizzle %d is not 0, 32, 64 or 128 (bytes)", FAGEN_EMU_SITE_ARGS,
                       swizzle_bytes);
    const unsigned addr = fagen_emu::hopper::shared_addr(smem_ptr, "fa_wgmma_desc", FAGEN_EMU_SITE_ARGS);
    return fa_wgmma_desc_bits(addr, lbo, sbo, swizzle_bytes);
}
FA_DEVICE void fa_wgmma_fence(FAGEN_EMU_SITE) { fagen_emu::hopper::wgmma_fence(FAGEN_EMU_SITE_ARGS); }
FA_DEVICE void fa_wgmma_commit_group(FAGEN_EMU_SITE) { fagen_emu::hopper::wgmma_commit(FAGEN_EMU_SITE_ARGS); }
template <int N>
FA_DEVICE void fa_wgmma_wait_group(FAGEN_EMU_SITE) {
    static_assert(N >= 0 && N <= 7, "fa_wgmma_wait_group<N>: 0 <= N <= 7");
    fagen_emu::hopper::wgmma_wait(unsigned(N), FAGEN_EMU_SITE_ARGS);
}
FA_DEVICE void fa_wgmma_fence_operand(float&) {}
FA_DEVICE void fa_wgmma_fence_operand(unsigned&) {}
template <typename E, int N, int TRANS_A, int TRANS_B>
FA_DEVICE void fa_wgmma_m64nNk16_ss(float (&d)[N / 2], unsigned long long desc_a, unsigned long long desc_b,
                                    int scale_d, FAGEN_EMU_SITE) {
    static_assert(FaWgmmaElem<E>::ok, "fa_wgmma_m64nNk16_ss<E>: E must be __half or __nv_bfloat16");
    static_assert(FaWgmmaShape<N>::ok, "fa_wgmma_m64nNk16_ss<E, N>: N must be 8..256 in steps of 8");
    static_assert((TRANS_A == 0 || TRANS_A == 1) && (TRANS_B == 0 || TRANS_B == 1), "TRANS_A/TRANS_B: 0 or 1");
    fagen_emu::hopper::wgmma(std::is_same<E, __nv_bfloat16>::value, N, TRANS_A, TRANS_B, d, nullptr, desc_a, desc_b,
                             scale_d, FAGEN_EMU_SITE_ARGS);
}
template <typename E, int N, int TRANS_B>
FA_DEVICE void fa_wgmma_m64nNk16_rs(float (&d)[N / 2], const unsigned (&a)[4], unsigned long long desc_b,
                                    int scale_d, FAGEN_EMU_SITE) {
    static_assert(FaWgmmaElem<E>::ok, "fa_wgmma_m64nNk16_rs<E>: E must be __half or __nv_bfloat16");
    static_assert(FaWgmmaShape<N>::ok, "fa_wgmma_m64nNk16_rs<E, N>: N must be 8..256 in steps of 8");
    static_assert(TRANS_B == 0 || TRANS_B == 1, "TRANS_B: 0 or 1");
    fagen_emu::hopper::wgmma(std::is_same<E, __nv_bfloat16>::value, N, 0, TRANS_B, d, a, 0, desc_b, scale_d,
                             FAGEN_EMU_SITE_ARGS);
}
FA_DEVICE void fa_mbarrier_init(unsigned long long* bar, unsigned count, FAGEN_EMU_SITE) {
    fagen_emu::hopper::mbar_init(bar, count, FAGEN_EMU_SITE_ARGS);
}
FA_DEVICE unsigned long long fa_mbarrier_arrive(unsigned long long* bar, FAGEN_EMU_SITE) {
    return fagen_emu::hopper::mbar_arrive(bar, 0, true, "fa_mbarrier_arrive", FAGEN_EMU_SITE_ARGS);
}
FA_DEVICE unsigned long long fa_mbarrier_arrive_expect_tx(unsigned long long* bar, unsigned tx_bytes, FAGEN_EMU_SITE) {
    return fagen_emu::hopper::mbar_arrive(bar, tx_bytes, true, "fa_mbarrier_arrive_expect_tx", FAGEN_EMU_SITE_ARGS);
}
FA_DEVICE void fa_mbarrier_expect_tx(unsigned long long* bar, unsigned tx_bytes, FAGEN_EMU_SITE) {
    fagen_emu::hopper::mbar_arrive(bar, tx_bytes, false, "fa_mbarrier_expect_tx", FAGEN_EMU_SITE_ARGS);
}
FA_DEVICE bool fa_mbarrier_try_wait_parity(unsigned long long* bar, unsigned parity, FAGEN_EMU_SITE) {
    return fagen_emu::hopper::mbar_wait(bar, parity, FAGEN_EMU_SITE_ARGS);
}
FA_DEVICE void fa_mbarrier_wait_parity(unsigned long long* bar, unsigned parity, FAGEN_EMU_SITE) {
    while (!fagen_emu::hopper::mbar_wait(bar, parity, FAGEN_EMU_SITE_ARGS)) {
    }
}
FA_DEVICE void fa_fence_barrier_init() { fagen_emu::hopper::fence_barrier_init(); }
FA_DEVICE void fa_fence_proxy_async(FAGEN_EMU_SITE) { fagen_emu::hopper::fence_proxy_async(FAGEN_EMU_SITE_ARGS); }
FA_DEVICE void fa_tma_load_2d(void* dst, const FaTensorMap* tmap, unsigned long long* bar, int c0, int c1,
                              FAGEN_EMU_SITE) {
    const int c[5] = {c0, c1, 0, 0, 0};
    fagen_emu::hopper::tma(fagen_emu::hopper::kTmaLoad, 2, dst, tmap, bar, c, FAGEN_EMU_SITE_ARGS);
}
FA_DEVICE void fa_tma_load_3d(void* dst, const FaTensorMap* tmap, unsigned long long* bar, int c0, int c1, int c2,
                              FAGEN_EMU_SITE) {
    const int c[5] = {c0, c1, c2, 0, 0};
    fagen_emu::hopper::tma(fagen_emu::hopper::kTmaLoad, 3, dst, tmap, bar, c, FAGEN_EMU_SITE_ARGS);
}
FA_DEVICE void fa_tma_load_4d(void* dst, const FaTensorMap* tmap, unsigned long long* bar, int c0, int c1, int c2,
                              int c3, FAGEN_EMU_SITE) {
    const int c[5] = {c0, c1, c2, c3, 0};
    fagen_emu::hopper::tma(fagen_emu::hopper::kTmaLoad, 4, dst, tmap, bar, c, FAGEN_EMU_SITE_ARGS);
}
#define FA_TMA_OUT(NAME, KIND)                                                                              \
    FA_DEVICE void NAME##_2d(const FaTensorMap* tmap, const void* src, int c0, int c1, FAGEN_EMU_SITE) {   \
        const int c[5] = {c0, c1, 0, 0, 0};                                                                 \
        fagen_emu::hopper::tma(KIND, 2, const_cast<void*>(src), tmap, nullptr, c, FAGEN_EMU_SITE_ARGS);    \
    }                                                                                                       \
    FA_DEVICE void NAME##_3d(const FaTensorMap* tmap, const void* src, int c0, int c1, int c2,             \
                             FAGEN_EMU_SITE) {                                                              \
        const int c[5] = {c0, c1, c2, 0, 0};                                                                \
        fagen_emu::hopper::tma(KIND, 3, const_cast<void*>(src), tmap, nullptr, c, FAGEN_EMU_SITE_ARGS);    \
    }                                                                                                       \
    FA_DEVICE void NAME##_4d(const FaTensorMap* tmap, const void* src, int c0, int c1, int c2, int c3,     \
                             FAGEN_EMU_SITE) {                                                              \
        const int c[5] = {c0, c1, c2, c3, 0};                                                               \
        fagen_emu::hopper::tma(KIND, 4, const_cast<void*>(src), tmap, nullptr, c, FAGEN_EMU_SITE_ARGS);    \
    }                                                                                                       \
    FA_DEVICE void NAME##_5d(const FaTensorMap* tmap, const void* src, int c0, int c1, int c2, int c3,     \
                             int c4, FAGEN_EMU_SITE) {                                                      \
        const int c[5] = {c0, c1, c2, c3, c4};                                                              \
        fagen_emu::hopper::tma(KIND, 5, const_cast<void*>(src), tmap, nullptr, c, FAGEN_EMU_SITE_ARGS);    \
    }
FA_TMA_OUT(fa_tma_store, fagen_emu::hopper::kTmaStore)
FA_TMA_OUT(fa_tma_reduce_add, fagen_emu::hopper::kTmaReduceAdd)
#undef FA_TMA_OUT
FA_DEVICE void fa_bulk_load(void* smem_dst, const void* gmem_src, unsigned bytes, unsigned long long* bar,
                            FAGEN_EMU_SITE) {
    fagen_emu::hopper::bulk(fagen_emu::hopper::kTmaLoad, smem_dst, const_cast<void*>(gmem_src), bytes, bar,
                            "fa_bulk_load", FAGEN_EMU_SITE_ARGS);
}
FA_DEVICE void fa_bulk_store(void* gmem_dst, const void* smem_src, unsigned bytes, FAGEN_EMU_SITE) {
    fagen_emu::hopper::bulk(fagen_emu::hopper::kTmaStore, const_cast<void*>(smem_src), gmem_dst, bytes, nullptr,
                            "fa_bulk_store", FAGEN_EMU_SITE_ARGS);
}
FA_DEVICE void fa_bulk_reduce_add_f32(float* gmem_dst, const float* smem_src, unsigned bytes, FAGEN_EMU_SITE) {
    fagen_emu::hopper::bulk(fagen_emu::hopper::kTmaReduceAdd, const_cast<float*>(smem_src), gmem_dst, bytes,
                            nullptr, "fa_bulk_reduce_add_f32", FAGEN_EMU_SITE_ARGS);
}
FA_DEVICE void fa_bulk_commit_group() { fagen_emu::hopper::bulk_commit(); }
template <int N>
FA_DEVICE void fa_bulk_wait_group(FAGEN_EMU_SITE) {
    static_assert(N >= 0, "fa_bulk_wait_group<N>: N >= 0");
    fagen_emu::hopper::bulk_wait(unsigned(N), FAGEN_EMU_SITE_ARGS);
}
template <int N>
FA_DEVICE void fa_bulk_wait_group_read(FAGEN_EMU_SITE) {
    static_assert(N >= 0, "fa_bulk_wait_group_read<N>: N >= 0");
    fagen_emu::hopper::bulk_wait(unsigned(N), FAGEN_EMU_SITE_ARGS);
}
#define FA_STMATRIX(NAME, N, TRANS)                                                                              \
    FA_DEVICE void NAME(void* row_addr, const unsigned (&r)[N], FAGEN_EMU_SITE) {                               \
        fagen_emu::hopper::stmatrix<N, TRANS>(row_addr, r, #NAME, FAGEN_EMU_SITE_ARGS);                          \
    }                                                                                                             \
    FA_DEVICE void NAME(unsigned row_saddr, const unsigned (&r)[N], FAGEN_EMU_SITE) {                           \
        fagen_emu::hopper::stmatrix<N, TRANS>(fagen_emu::hopper::shared_ptr(row_saddr, #NAME, FAGEN_EMU_SITE_ARGS), \
                                              r, #NAME, FAGEN_EMU_SITE_ARGS);                                     \
    }
FA_STMATRIX(fa_stmatrix_x1, 1, false)
FA_STMATRIX(fa_stmatrix_x2, 2, false)
FA_STMATRIX(fa_stmatrix_x4, 4, false)
FA_STMATRIX(fa_stmatrix_x1_trans, 1, true)
FA_STMATRIX(fa_stmatrix_x2_trans, 2, true)
FA_STMATRIX(fa_stmatrix_x4_trans, 4, true)
#undef FA_STMATRIX
template <int N>
FA_DEVICE void fa_setmaxnreg_inc(FAGEN_EMU_SITE) {
    static_assert(N % 8 == 0 && N >= 24 && N <= 256, "fa_setmaxnreg_inc<N>: N a multiple of 8 in [24, 256]");
    fagen_emu::hopper::setmaxnreg(N, true, FAGEN_EMU_SITE_ARGS);
}
template <int N>
FA_DEVICE void fa_setmaxnreg_dec(FAGEN_EMU_SITE) {
    static_assert(N % 8 == 0 && N >= 24 && N <= 256, "fa_setmaxnreg_dec<N>: N a multiple of 8 in [24, 256]");
    fagen_emu::hopper::setmaxnreg(N, false, FAGEN_EMU_SITE_ARGS);
}
FA_DEVICE void fa_named_barrier_sync(unsigned id, unsigned count, FAGEN_EMU_SITE) {
    fagen_emu::hopper::named_barrier(id, count, true, FAGEN_EMU_SITE_ARGS);
}
FA_DEVICE void fa_named_barrier_arrive(unsigned id, unsigned count, FAGEN_EMU_SITE) {
    fagen_emu::hopper::named_barrier(id, count, false, FAGEN_EMU_SITE_ARGS);
}
FA_DEVICE bool fa_elect_one(FAGEN_EMU_SITE) { return fagen_emu::hopper::elect_one(FAGEN_EMU_SITE_ARGS); }
#endif
