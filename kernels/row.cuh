// A row's elements in the forward kernels: the fused op's rounded sum, the scalar head and
// the partial tail of a row off the vector grid, and the normalize step (y before and after
// its final rounding). Types: T is x's, R the residual's (the fused op's sum is rounded to it:
// x's type, or float32 for a float32 residual stream), S the type of the values normalized
// (R for the fused op, else T) and O the output's (the llama mode rounds x * inv_rms to it).
#pragma once

#include "common.cuh"

namespace rmsnorm {

// x + residual, rounded to R (the fused op's s)
template <typename T, typename R, int VEC>
__device__ __forceinline__ Pack<R, VEC> rounded_sum(const Pack<T, VEC>& a, const Pack<R, VEC>& b) {
    float fa[VEC], fb[VEC];
    unpack(a, fa);
    unpack(b, fb);
    Pack<R, VEC> s;
#pragma unroll
    for (int e = 0; e < VEC; ++e) s.v[e] = from_float<R>(fa[e] + fb[e]);
    return s;
}

// One element of the head or tail: everything done element-wise.
template <typename T, typename R, bool FUSED>
__device__ __forceinline__ float load_scalar(const T* x, const R* res, R* res_out, int j) {
    if (FUSED) {
        R s = from_float<R>(to_float(x[j]) + to_float(res[j]));
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

// Normalize one body vector (S) with its weights (already offset), to O.
template <typename S, typename O, typename W, int VEC>
__device__ __forceinline__ Pack<O, VEC> scale_vec(const Pack<S, VEC>& a, const float (&wv)[VEC],
                                                  float inv_rms, int flags) {
    Pack<O, VEC> o;
    float f[VEC];
    unpack(a, f);
#pragma unroll
    for (int e = 0; e < VEC; ++e) o.v[e] = normalize<O, W>(f[e], inv_rms, wv[e], flags);
    return o;
}

// Normalize one body vector.
template <typename S, typename O, typename W, int VEC>
__device__ __forceinline__ Pack<O, VEC> finish_vec(const Pack<S, VEC>& a, const W* wb, int v, bool w_vec,
                                                   float inv_rms, float w_offset, int flags) {
    float wv[VEC];
    load_weights<W, VEC>(wb, v, w_vec, w_offset, flags, wv);
    return scale_vec<S, O, W, VEC>(a, wv, inv_rms, flags);
}

// Normalize the tail (count < VEC elements from j0): from registers, or (streaming) re-read
// from src (x, or residual_out where this thread wrote it).
template <typename S, typename O, typename W, int VEC>
__device__ __forceinline__ void finish_tail(const Pack<S, VEC>& a, O* y, const W* w, int j0, int count, float inv_rms,
                                            float w_offset, int flags) {
#pragma unroll
    for (int e = 0; e < VEC - 1; ++e)
        if (e < count) y[j0 + e] = normalize<O, W>(to_float(a.v[e]), inv_rms, weight_at(w, j0 + e, w_offset, flags), flags);
}

template <typename S, typename O, typename W, int VEC>
__device__ __forceinline__ void finish_tail(const S* src, O* y, const W* w, int j0, int count, float inv_rms,
                                            float w_offset, int flags) {
    finish_tail<S, O, W, VEC>(load_partial<S, VEC>(src + j0, count), y, w, j0, count, inv_rms, w_offset, flags);
}

}  // namespace rmsnorm
