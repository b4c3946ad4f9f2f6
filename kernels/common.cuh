// Device code every kernel program shares: storage types and 16-byte vectors, row
// addressing, weights, cluster barriers and programmatic dependent launch.
//
// The kernels' ABI (the Params structs, flags and enums below and in the programs) is
// mirrored on the host by cupy_rmsnorm/_abi.py; a CPU test reads both sides.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace rmsnorm {

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
    return __bfloat162float(v);
}

// Round to nearest even: the rounding of torch, NumPy and ml_dtypes.
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

// Select<B, A, C>::type: A when B, else C (NVRTC has no <type_traits>).
template <bool B, typename A, typename C> struct Select { using type = A; };
template <typename A, typename C> struct Select<false, A, C> { using type = C; };

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
    T v[N];
};

// A vector's elements as floats.
template <typename T, int VEC>
__device__ __forceinline__ void unpack(const Pack<T, VEC>& a, float (&f)[VEC]) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) f[e] = to_float(a.v[e]);
}

// bf16 is a float's upper half: of a pair in one 32-bit word, the low element is the word
// shifted up and the high one the word masked (an instruction each; converted one by one, the
// high element was first moved down, then shifted back up: two).
template <int VEC>
__device__ __forceinline__ void unpack(const Pack<__nv_bfloat16, VEC>& a, float (&f)[VEC]) {
    if constexpr (VEC % 2 == 0) {
        const unsigned* u = reinterpret_cast<const unsigned*>(&a);
#pragma unroll
        for (int e = 0; e < VEC; e += 2) {
            f[e] = __uint_as_float(u[e / 2] << 16);
            f[e + 1] = __uint_as_float(u[e / 2] & 0xffff0000u);
        }
    } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) f[e] = to_float(a.v[e]);
    }
}

// Params.flags (and the backward's, which adds its own bits above these).
enum Flags { kLlama = 1, kHasWeight = 2, kEarlyTrigger = 4 };

// Row r of an array starts at (r / n_inner) * outer + (r % n_inner) * inner elements: an
// array's leading axes as at most two strided levels (cupy_rmsnorm/_layout.py).
struct RowStrides {
    long long outer, inner;
};

// Row r's indices on its two leading axes.
__device__ __forceinline__ void split_rows(long long r, long long n_inner, long long& outer, long long& inner) {
    outer = r, inner = 0;
    if (n_inner != 1) { outer = r / n_inner; inner = r - outer * n_inner; }
}

// A row's first element: (outer, inner) in 64-bit arithmetic, or with FLAT (the launcher's
// promise: n_inner == 1 and every offset of the call's arrays under 2^31) one 32-bit multiply.
template <bool FLAT>
__device__ __forceinline__ long long row_offset(long long outer, long long inner, const RowStrides& s) {
    if (FLAT) return (int)outer * (int)s.outer;
    return outer * s.outer + inner * s.inner;
}

__host__ __device__ constexpr int log2_of(int n) { return n > 1 ? 1 + log2_of(n / 2) : 0; }

// w' = w + weight_offset. An offset of 0 comes as -0 (cupy_rmsnorm/_abi.py), and w + -0 is
// w for every w, -0 included: the weight as it is (_reference.offset_weight). A plain load,
// not __ldg: __ldg is an asm statement the compiler may treat as free of side effects and
// hoist out of the bounds check that guards it (it did: w[tid] read for tid == hidden).
template <typename W>
__device__ __forceinline__ float weight_at(const W* w, int j, float w_offset, int flags) {
    return (flags & kHasWeight) ? to_float(w[j]) + w_offset : 1.0f;
}

template <typename W, int VEC>
__device__ __forceinline__ void weights_of(const Pack<W, VEC>& wp, float w_offset, float (&wv)[VEC]) {
    unpack(wp, wv);
#pragma unroll
    for (int e = 0; e < VEC; ++e) wv[e] += w_offset;
}

// The weights (offset added) of body vector v: one aligned vector load when it can.
template <typename W, int VEC>
__device__ __forceinline__ void load_weights(const W* wb, int v, bool w_vec, float w_offset, int flags,
                                             float (&wv)[VEC]) {
    if (w_vec) {
        const Pack<W, VEC> wp = reinterpret_cast<const Pack<W, VEC>*>(wb)[v];  // one vector load
        weights_of<W, VEC>(wp, w_offset, wv);
    } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) wv[e] = weight_at(wb, v * VEC + e, w_offset, flags);
    }
}

// Thread-block clusters (sm_90): a row split over several blocks meets at these barriers.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void cluster_arrive() {
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
#endif

// Before a cluster's block exits: no block leaves while another may still read its shared memory.
__device__ __forceinline__ void cluster_done() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// Programmatic dependent launch (sm_90): when the launcher allows this kernel to start
// before the previous kernel in the stream has finished, its blocks get resident and do
// their set-up, then wait here until that kernel's writes are visible. Without the
// launch attribute (or before sm_90) it costs nothing.
__device__ __forceinline__ void wait_for_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Let the next kernel in the stream launch (its blocks become resident and wait in
// wait_for_previous_kernel). kEarlyTrigger: right after this kernel's own wait; otherwise
// when this block is done. Early is best when the next grid cannot crowd the SMs that free
// up first (the launcher decides, _plan.early_trigger).
__device__ __forceinline__ void allow_next_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// The block's index in a grid of x then y blocks (the launcher splits counts past 2^31 - 1).
__device__ __forceinline__ long long linear_block() {
    return (long long)blockIdx.y * gridDim.x + blockIdx.x;
}

}  // namespace rmsnorm
