// Bulk-copy staging (sm_90): global memory brought into shared memory by cp.async.bulk (the
// Tensor Memory Accelerator), an mbarrier per stage counting the bytes in (used by
// rms_norm_backward_staged_kernel). Below sm_90 they compile to nothing.
#pragma once

namespace rmsnorm {

// A shared-memory pointer as the 32-bit shared address the instructions take.
__device__ __forceinline__ unsigned shared_address(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// A stage's mbarrier (at shared address `bar`, 8 bytes): one arrival a phase, stage_expect's.
__device__ __forceinline__ void stage_init(unsigned bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
#endif
}

// Make the initialised barriers visible to the other threads and to the bulk copies.
__device__ __forceinline__ void stage_init_fence() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// The barrier's one arrival, announcing `bytes` to come from bulk copies.
__device__ __forceinline__ void stage_expect(unsigned bar, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
#endif
}

// Copy `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to shared memory.
__device__ __forceinline__ void stage_copy(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
#endif
}

// Wait until the barrier's phase of this parity has completed (its bytes have landed).
__device__ __forceinline__ void stage_wait(unsigned bar, unsigned parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile(
        "{\n\t.reg .pred done;\n"
        "STAGE_WAIT:\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
        "@!done bra STAGE_WAIT;\n\t}" ::"r"(bar), "r"(parity) : "memory");
#endif
}

}  // namespace rmsnorm
