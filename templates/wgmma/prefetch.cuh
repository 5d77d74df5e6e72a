// Tensor-map prefetch of the Hopper forward's producer (FlashAttention-3's prefetch_tma_descriptor).
//
// fa_prefetch_tensormap(tmap) (PTX ISA 9.7.9.15 "prefetch, prefetchu": prefetch.tensormap [a]):
//   a hint that brings the tensor map at generic address `a` (a __grid_constant__ kernel parameter)
//   into the cache before the first TMA load reads it; no effect on any value. The emulator checks
//   that `tmap` is a tensor map (fagen/emulator/hopper.h).
//
// NOTE: rendered kernels pull this file in through a Jinja include, so it must not contain Jinja's
// opening delimiters (a brace followed by % or #).
#ifndef FAGEN_EMULATOR
FA_DEVICE void fa_prefetch_tensormap(const FaTensorMap* tmap) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900  // PTX ISA: sm_90 and later
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<unsigned long long>(tmap)) : "memory");
#endif
}
#else  // FAGEN_EMULATOR: fagen/emulator/hopper.h
FA_DEVICE void fa_prefetch_tensormap(const FaTensorMap* tmap, FAGEN_EMU_SITE) {
    fagen_emu::hopper::prefetch_tensormap(tmap, FAGEN_EMU_SITE_ARGS);
}
#endif
