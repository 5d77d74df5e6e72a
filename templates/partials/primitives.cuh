// ---------------------------------------------------------------------------
// fagen device-function layer.
// Every CUDA built-in that is not plain C++ arithmetic (barriers, warp
// collectives, atomics, intrinsics, dynamic shared memory) is reached through
// the fa_* functions below. The device branch is what NVRTC compiles; the host
// branch (FAGEN_EMULATOR) is what the CPU emulator compiles, on top of the
// emulator's shim (fagen/emulator/shim.h), which supplies threadIdx/blockIdx,
// __syncthreads, __shfl_xor_sync, atomicAdd as fiber-aware host functions.
// Kernel bodies use only these, so both paths compile the same kernel text.
// ---------------------------------------------------------------------------
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef FAGEN_EMULATOR
#define FA_DEVICE __device__ __forceinline__
// Base of the block's dynamic shared memory (the whole smem layout lives here).
FA_DEVICE unsigned char* fa_smem() {
    extern __shared__ __align__(16) unsigned char fa_dynamic_smem[];
    return fa_dynamic_smem;
}
FA_DEVICE void fa_sync() { __syncthreads(); }
// A block barrier that also returns whether any thread's p is true (bar.red.or.pred)
FA_DEVICE bool fa_sync_or(bool p) { return __syncthreads_or(p ? 1 : 0) != 0; }
FA_DEVICE float fa_warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}
// max that propagates NaN (fmaxf drops it): NaN in -> NaN out, as torch's max.
FA_DEVICE float fa_nanmax(float a, float b) { return (a != a || b != b) ? a + b : fmaxf(a, b); }
FA_DEVICE float fa_warp_max(float x) {  // NaN-propagating
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fa_nanmax(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
FA_DEVICE void fa_atomic_add(float* addr, float v) { atomicAdd(addr, v); }
// float64 accumulators (the SIMT family computes fp64 specs in double; atomicAdd(double*) is sm_60+).
FA_DEVICE double fa_warp_sum(double x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}
FA_DEVICE double fa_nanmax(double a, double b) { return (a != a || b != b) ? a + b : fmax(a, b); }
FA_DEVICE double fa_warp_max(double x) {  // NaN-propagating
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fa_nanmax(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
FA_DEVICE void fa_atomic_add(double* addr, double v) { atomicAdd(addr, v); }
FA_DEVICE unsigned int fa_umulhi(unsigned int a, unsigned int b) { return __umulhi(a, b); }
FA_DEVICE float fa_neg_inf() { return __int_as_float(0xff800000u); }
// 2^x on the SFU (ex2.approx.ftz: relative error ~2^-22, results below 2^-126 flush to 0,
// 2^-inf = 0, NaN stays NaN); the emulator computes it exactly.
FA_DEVICE float fa_ex2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
// tanh on the SFU (tanh.approx.f32, sm_75+: maximum relative error 2^-10.987 by the PTX ISA,
// subnormal results not flushed; tanh(+-0) = +-0, tanh(+-inf) = +-1, NaN stays NaN); the emulator
// computes it exactly.
FA_DEVICE float fa_tanh_approx(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
#else  // FAGEN_EMULATOR: host implementations over the emulator shim
#define FA_DEVICE inline  // not static: explicit specialisations take no storage class
FA_DEVICE unsigned char* fa_smem() { return fagen_emu_dynamic_smem(); }
// FAGEN_EMU_SITE: the caller's file/line, so emulator deadlock reports name
// the kernel line that reached the barrier (shim.h).
FA_DEVICE void fa_sync(FAGEN_EMU_SITE) { __syncthreads(FAGEN_EMU_SITE_ARGS); }
FA_DEVICE bool fa_sync_or(bool p, FAGEN_EMU_SITE) { return __syncthreads_or(p ? 1 : 0, FAGEN_EMU_SITE_ARGS) != 0; }
FA_DEVICE float fa_warp_sum(float x, FAGEN_EMU_SITE) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o, 32, FAGEN_EMU_SITE_ARGS);
    return x;
}
FA_DEVICE float fa_nanmax(float a, float b) { return (a != a || b != b) ? a + b : fmaxf(a, b); }
FA_DEVICE float fa_warp_max(float x, FAGEN_EMU_SITE) {  // NaN-propagating
    for (int o = 16; o > 0; o >>= 1) x = fa_nanmax(x, __shfl_xor_sync(0xffffffffu, x, o, 32, FAGEN_EMU_SITE_ARGS));
    return x;
}
FA_DEVICE void fa_atomic_add(float* addr, float v) { atomicAdd(addr, v); }
FA_DEVICE double fa_warp_sum(double x, FAGEN_EMU_SITE) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o, 32, FAGEN_EMU_SITE_ARGS);
    return x;
}
FA_DEVICE double fa_nanmax(double a, double b) { return (a != a || b != b) ? a + b : fmax(a, b); }
FA_DEVICE double fa_warp_max(double x, FAGEN_EMU_SITE) {  // NaN-propagating
    for (int o = 16; o > 0; o >>= 1) x = fa_nanmax(x, __shfl_xor_sync(0xffffffffu, x, o, 32, FAGEN_EMU_SITE_ARGS));
    return x;
}
FA_DEVICE void fa_atomic_add(double* addr, double v) { atomicAdd(addr, v); }
FA_DEVICE unsigned int fa_umulhi(unsigned int a, unsigned int b) {
    return (unsigned int)(((unsigned long long)a * (unsigned long long)b) >> 32);
}
FA_DEVICE float fa_neg_inf() { return -__builtin_huge_valf(); }
FA_DEVICE float fa_ex2_approx(float x) { return exp2f(x); }
FA_DEVICE float fa_tanh_approx(float x) { return tanhf(x); }
#endif

// Tensor-core primitives (mma.sync, ldmatrix, cp.async; sm_80+): partials/mma.cuh.
// Rendered kernels get it through the Jinja include on the next line; to C++
// that line is a comment, so this file read verbatim compiles without them.
// {% include "partials/mma.cuh" %}

// dtype <-> fp32 conversions (cuda_fp16.h / cuda_bf16.h work on both paths).
FA_DEVICE float fa_to_float(float x) { return x; }
FA_DEVICE float fa_to_float(__half x) { return __half2float(x); }
FA_DEVICE float fa_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
FA_DEVICE double fa_to_float(double x) { return x; }  // float64 stays double (the accumulator type)
template <typename T> FA_DEVICE T fa_from_float(float x);
template <> FA_DEVICE float fa_from_float<float>(float x) { return x; }
template <> FA_DEVICE double fa_from_float<double>(float x) { return x; }
// From a double accumulator: T = double keeps every bit, other dtypes round once via float.
template <typename T> FA_DEVICE T fa_from_float(double x) { return fa_from_float<T>((float)x); }
template <> FA_DEVICE double fa_from_float<double>(double x) { return x; }
template <> FA_DEVICE __half fa_from_float<__half>(float x) { return __float2half_rn(x); }
template <> FA_DEVICE __nv_bfloat16 fa_from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
