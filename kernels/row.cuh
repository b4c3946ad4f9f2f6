// A row's elements in the forward kernels: the fused op's rounded sum, the scalar head and
// the partial tail of a row off the vector grid, and the normalize step (y before and after
// its final rounding).
#pragma once

#include "common.cuh"

namespace rmsnorm {

// x + residual, rounded to T (the fused op's s)
template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> rounded_sum(const Pack<T, VEC>& a, const Pack<T, VEC>& b) {
    float fa[VEC], fb[VEC];
    unpack(a, fa);
    unpack(b, fb);
    Pack<T, VEC> s;
#pragma unroll
    for (int e = 0; e < VEC; ++e) s.v[e] = from_float<T>(fa[e] + fb[e]);
    return s;
}

// One element of the head or tail: everything done element-wise.
template <typename T, typename W, bool FUSED>
__device__ __forceinline__ float load_scalar(const T* x, const T* res, T* res_out, int j) {
    if (FUSED) {
        T s = from_float<T>(to_float(x[j]) + to_float(res[j]));
        res_out[j] = s;
        return to_float(s);
    }
    return to_float(x[j]);
}

// The tail as the partial vector it is in the canonical tree: its count < VEC elements,
// element by element, then zeros (whose squares add nothing).
template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> load_partial(const T* p, int count) {
    Pack<T, VEC> a;
#pragma unroll
    for (int e = 0; e < VEC; ++e) a.v[e] = e < count ? p[e] : from_float<T>(0.f);
    return a;
}

template <typename T, int VEC>
__device__ __forceinline__ void store_partial(T* p, const Pack<T, VEC>& a, int count) {
#pragma unroll
    for (int e = 0; e < VEC - 1; ++e)
        if (e < count) p[e] = a.v[e];
}

// y before its final rounding: x * inv_rms * w (LLAMA: x * inv_rms rounded to T first). The
// quantized forms quantize this value; the plain forms round it to T.
template <typename T>
__device__ __forceinline__ float normalized(float v, float inv_rms, float wv, int flags) {
    float n = v * inv_rms;
    if (flags & kLlama) n = to_float(from_float<T>(n));
    return n * wv;
}

template <typename T, typename W>
__device__ __forceinline__ T normalize(float v, float inv_rms, float wv, int flags) {
    return from_float<T>(normalized<T>(v, inv_rms, wv, flags));
}

// Normalize one body vector with its weights (already offset).
template <typename T, typename W, int VEC>
__device__ __forceinline__ Pack<T, VEC> scale_vec(const Pack<T, VEC>& a, const float (&wv)[VEC],
                                                  float inv_rms, int flags) {
    Pack<T, VEC> o;
    float f[VEC];
    unpack(a, f);
#pragma unroll
    for (int e = 0; e < VEC; ++e) o.v[e] = normalize<T, W>(f[e], inv_rms, wv[e], flags);
    return o;
}

// Normalize one body vector.
template <typename T, typename W, int VEC>
__device__ __forceinline__ Pack<T, VEC> finish_vec(const Pack<T, VEC>& a, const W* wb, int v, bool w_vec,
                                                   float inv_rms, float w_offset, int flags) {
    float wv[VEC];
    load_weights<W, VEC>(wb, v, w_vec, w_offset, flags, wv);
    return scale_vec<T, W, VEC>(a, wv, inv_rms, flags);
}

// Normalize the tail (count < VEC elements from j0): from registers, or (streaming) re-read
// from src (x, or residual_out where this thread wrote it).
template <typename T, typename W, int VEC>
__device__ __forceinline__ void finish_tail(const Pack<T, VEC>& a, T* y, const W* w, int j0, int count, float inv_rms,
                                            float w_offset, int flags) {
#pragma unroll
    for (int e = 0; e < VEC - 1; ++e)
        if (e < count) y[j0 + e] = normalize<T, W>(to_float(a.v[e]), inv_rms, weight_at(w, j0 + e, w_offset, flags), flags);
}

template <typename T, typename W, int VEC>
__device__ __forceinline__ void finish_tail(const T* src, T* y, const W* w, int j0, int count, float inv_rms,
                                            float w_offset, int flags) {
    finish_tail<T, W, VEC>(load_partial<T, VEC>(src + j0, count), y, w, j0, count, inv_rms, w_offset, flags);
}

}  // namespace rmsnorm
