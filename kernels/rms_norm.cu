// RMSNorm and fused residual-add + RMSNorm, compiled at run time by NVRTC.
//
//   rms_norm:            y = x * rsqrt(mean(x^2) + eps) * (w + weight_offset)
//   fused_add_rms_norm:  s = round_T(x + residual); residual_out = s; y = rms_norm(s)
//
// Numerics (the contract in cupy_rmsnorm/_reference.py, shared by every path):
// the sum of squares is accumulated in float32 whatever T is; the fused op
// normalizes the residual sum *after* it has been rounded to T, so it equals the
// unfused rms_norm(x + residual); LLAMA mode rounds x * inv_rms to T before the
// weight multiply (HF LlamaRMSNorm), otherwise there is one rounding at the end.
//
// Work split: a group of G threads owns one row (G <= 32: several rows per block,
// reduced with warp shuffles; G > 32: one row per block, reduced through shared
// memory). Each row is split into an unaligned head (< VEC elements, up to the
// first 16-byte boundary of x's row), a body of VEC-wide vectors and a tail, so
// every row gets 16-byte accesses whatever its offset, provided all arrays share
// x's alignment pattern (the launcher checks that and lowers VEC otherwise).
// NV > 0 keeps the body in registers (each element read from DRAM once);
// NV == 0 streams the row twice (pass 2 re-reads x, or residual_out, from L2).

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

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
    T v[N];
};

enum Flags { kLlama = 1, kHasWeight = 2 };

// Everything but the pointers, passed by value as one argument (fewer kernel
// arguments, less host work per launch). Row r of an array starts at
// (r / n_inner) * outer_stride + (r % n_inner) * inner_stride elements. The host
// side mirrors this layout in cupy_rmsnorm/_launcher.py (PARAMS_DTYPE).
struct Params {
    long long rows, n_inner;
    long long x_so, x_si, r_so, r_si, y_so, y_si, ro_so, ro_si;   // outer / inner strides
    int hidden;
    float eps, w_offset;
    int flags;
};

// Sum over the G lanes of a group (G a power of two, at most 32).
template <int G>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
    for (int o = (G < 32 ? G : 32) / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
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

template <typename T, typename W>
__device__ __forceinline__ T normalize(float v, float inv_rms, float wv, int flags) {
    float n = v * inv_rms;
    if (flags & kLlama) n = to_float(from_float<T>(n));
    return from_float<T>(n * wv);
}

template <typename W>
__device__ __forceinline__ float weight_at(const W* w, int j, float w_offset, int flags) {
    return (flags & kHasWeight) ? to_float(__ldg(w + j)) + w_offset : 1.0f;
}

// Normalize one body vector with its weights (already offset).
template <typename T, typename W, int VEC>
__device__ __forceinline__ Pack<T, VEC> scale_vec(const Pack<T, VEC>& a, const float (&wv)[VEC],
                                                  float inv_rms, int flags) {
    Pack<T, VEC> o;
#pragma unroll
    for (int e = 0; e < VEC; ++e) o.v[e] = normalize<T, W>(to_float(a.v[e]), inv_rms, wv[e], flags);
    return o;
}

template <typename W, int VEC>
__device__ __forceinline__ void weights_of(const Pack<W, VEC>& wp, float w_offset, float (&wv)[VEC]) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) wv[e] = to_float(wp.v[e]) + w_offset;
}

// Normalize one body vector; the weight comes as one aligned vector load when it can.
template <typename T, typename W, int VEC>
__device__ __forceinline__ Pack<T, VEC> finish_vec(const Pack<T, VEC>& a, const W* wb, int v, bool w_vec,
                                                   float inv_rms, float w_offset, int flags) {
    float wv[VEC];
    if (w_vec) {
        const Pack<W, VEC> wp = reinterpret_cast<const Pack<W, VEC>*>(wb)[v];  // one 16-byte load
        weights_of<W, VEC>(wp, w_offset, wv);
    } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) wv[e] = weight_at(wb, v * VEC + e, w_offset, flags);
    }
    return scale_vec<T, W, VEC>(a, wv, inv_rms, flags);
}

template <typename T, typename W, bool FUSED, int VEC, int G, int NV>
__global__ void __launch_bounds__(G > 256 ? G : 256, G > 256 ? 1024 / G : 3)
rms_norm_kernel(const T* x, const T* res, T* y, T* res_out, const W* w, const Params p) {
    const long long rows = p.rows, n_inner = p.n_inner;
    const int hidden = p.hidden;
    const float eps = p.eps, w_offset = p.w_offset;
    const int flags = p.flags;
    using VecT = Pack<T, VEC>;
    constexpr int WARPS = G > 32 ? G / 32 : 1;
    __shared__ float warp_sums[2][WARPS];

    static_assert(G >= VEC, "a group must cover a head or tail of up to VEC - 1 elements");
    const int tid = threadIdx.x % G;             // lane within the row group
    const int group = threadIdx.x / G;
    const long long rows_per_block = blockDim.x / G;
    int parity = 0;

    for (long long base = blockIdx.x * rows_per_block; base < rows;
         base += (long long)gridDim.x * rows_per_block, parity ^= 1) {
        const long long row = base + group;
        const bool active = row < rows;          // only false for G <= 32 (several rows per block)
        const long long r = active ? row : 0;
        long long outer = r, inner = 0;
        if (n_inner != 1) { outer = r / n_inner; inner = r - outer * n_inner; }
        const T* xr = x + outer * p.x_so + inner * p.x_si;
        const T* rr = FUSED ? res + outer * p.r_so + inner * p.r_si : nullptr;
        T* yr = y + outer * p.y_so + inner * p.y_si;
        T* ror = FUSED ? res_out + outer * p.ro_so + inner * p.ro_si : nullptr;

        // Head: elements before x's row reaches a 16-byte boundary (all arrays share
        // that alignment pattern, the launcher made sure); tail: what is left after the
        // last whole vector. Both are shorter than VEC <= G, so a thread holds at most
        // one element of each, in a register.
        const int mis = (int)((reinterpret_cast<unsigned long long>(xr) / sizeof(T)) & (VEC - 1));
        const int head = min((VEC - mis) & (VEC - 1), hidden);
        const int n_body = (hidden - head) / VEC;
        const int tail_start = head + n_body * VEC;
        const bool has_head = active && tid < head;
        const bool has_tail = active && tid < hidden - tail_start;
        const bool w_vec = (flags & kHasWeight) &&
            ((reinterpret_cast<unsigned long long>(w + head) % sizeof(Pack<W, VEC>)) == 0);

        float ss = 0.f, head_v = 0.f, tail_v = 0.f, head_w = 1.f, tail_w = 1.f;
        VecT keep[NV > 0 ? NV : 1];              // the row's body, kept for the second pass
        // Short rows: the weights are fetched with the row, not after the reduction, so
        // their latency is off the critical path (only where registers allow).
        constexpr bool PREFETCH_W = NV == 1;
        Pack<W, VEC> wk[PREFETCH_W ? NV : 1];
        const bool prefetch_w = PREFETCH_W && w_vec;
        const VecT* xv = reinterpret_cast<const VecT*>(xr + head);
        const VecT* rv = reinterpret_cast<const VecT*>(rr + head);
        VecT* rov = reinterpret_cast<VecT*>(ror + head);
        if (active) {
            if (NV > 0) {
                VecT other[FUSED && NV > 0 ? NV : 1];
#pragma unroll
                for (int i = 0; i < NV; ++i) {  // issue every body load before the first use
                    const int v = tid + i * G;
                    if (v < n_body) { keep[i] = xv[v]; if (FUSED) other[i] = rv[v]; }
                }
                if (prefetch_w) {
#pragma unroll
                    for (int i = 0; i < NV; ++i) {
                        const int v = tid + i * G;
                        if (v < n_body) wk[i] = reinterpret_cast<const Pack<W, VEC>*>(w + head)[v];
                    }
                }
                // head and tail loads go out while the body loads are in flight
                if (has_head) head_v = load_scalar<T, W, FUSED>(xr, rr, ror, tid);
                if (has_tail) tail_v = load_scalar<T, W, FUSED>(xr, rr, ror, tail_start + tid);
#pragma unroll
                for (int i = 0; i < NV; ++i) {
                    const int v = tid + i * G;
                    if (v < n_body) {
                        if (FUSED) {
#pragma unroll
                            for (int e = 0; e < VEC; ++e)
                                keep[i].v[e] = from_float<T>(to_float(keep[i].v[e]) + to_float(other[FUSED ? i : 0].v[e]));
                            rov[v] = keep[i];
                        }
#pragma unroll
                        for (int e = 0; e < VEC; ++e) { float f = to_float(keep[i].v[e]); ss += f * f; }
                    }
                }
            } else {
                if (has_head) head_v = load_scalar<T, W, FUSED>(xr, rr, ror, tid);
                if (has_tail) tail_v = load_scalar<T, W, FUSED>(xr, rr, ror, tail_start + tid);
#pragma unroll 4
                for (int v = tid; v < n_body; v += G) {
                    VecT a = xv[v];
                    if (FUSED) {
                        VecT b = rv[v];
#pragma unroll
                        for (int e = 0; e < VEC; ++e)
                            a.v[e] = from_float<T>(to_float(a.v[e]) + to_float(b.v[e]));
                        rov[v] = a;
                    }
#pragma unroll
                    for (int e = 0; e < VEC; ++e) { float f = to_float(a.v[e]); ss += f * f; }
                }
            }
            ss += head_v * head_v + tail_v * tail_v;
            if (has_head) head_w = weight_at(w, tid, w_offset, flags);
            if (has_tail) tail_w = weight_at(w, tail_start + tid, w_offset, flags);
        }

        ss = group_sum<G>(ss);
        if (G > 32) {
            // Two buffers by iteration parity: the next row's writes cannot race this row's reads.
            const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
            if (lane == 0) warp_sums[parity][warp] = ss;
            __syncthreads();
            ss = lane < WARPS ? warp_sums[parity][lane] : 0.f;
            ss = group_sum<32>(ss);
        }
        if (!active) continue;
        const float inv_rms = rsqrtf(ss / (float)hidden + eps);

        if (has_head) yr[tid] = normalize<T, W>(head_v, inv_rms, head_w, flags);
        if (has_tail) yr[tail_start + tid] = normalize<T, W>(tail_v, inv_rms, tail_w, flags);
        // The body comes from registers, or (streaming) is re-read: from residual_out
        // when FUSED, where this same thread wrote the rounded sum.
        const T* src = FUSED ? ror : xr;
        VecT* yv = reinterpret_cast<VecT*>(yr + head);
        const VecT* sv = reinterpret_cast<const VecT*>(src + head);
        const W* wb = w + head;
        if (NV > 0) {
#pragma unroll
            for (int i = 0; i < NV; ++i) {
                const int v = tid + i * G;
                if (v >= n_body) continue;
                if (prefetch_w) {
                    float wv[VEC];
                    weights_of<W, VEC>(wk[PREFETCH_W ? i : 0], w_offset, wv);
                    yv[v] = scale_vec<T, W, VEC>(keep[i], wv, inv_rms, flags);
                } else {
                    yv[v] = finish_vec<T, W, VEC>(keep[i], wb, v, w_vec, inv_rms, w_offset, flags);
                }
            }
        } else {
#pragma unroll 4
            for (int v = tid; v < n_body; v += G) {
                const VecT a = sv[v];               // one 16-byte load, not one per element
                yv[v] = finish_vec<T, W, VEC>(a, wb, v, w_vec, inv_rms, w_offset, flags);
            }
        }
    }
}

}  // namespace rmsnorm

