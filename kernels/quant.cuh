// The quantized output stage of the forward kernels (rms_norm_quant_kernel and its cluster
// form): y, kept in float32 before its final rounding, stored as FP8 (e4m3fn, e5m2) or int8:
// q = sat(round(y * (1 / scale))) with a static per-tensor scale read from device memory, one
// scale per row (its max |y|, reduced like the sum of squares), or one per 128-element group
// (the lanes holding a group reduce it). QuantForm is norm_row's FORM (kPlain: y rounded to T,
// the plain ops), QuantType its QTYPE. cupy_rmsnorm/_reference.py has the same arithmetic.
#pragma once

#include <cuda_fp8.h>

#include "common.cuh"
#include "row.cuh"

namespace rmsnorm {

enum QuantForm { kPlain = 0, kStatic = 1, kPerToken = 2, kPerGroup = 3 };
enum QuantType { kE4M3 = 0, kE5M2 = 1, kInt8 = 2 };
constexpr int kGroupSize = 128;       // kPerGroup: elements per scale
constexpr float kMinScaleDivisor = 512.0f;   // dynamic scales >= 1 / (QMAX * 512): zeros stay zeros
constexpr float kFloatMax = 3.40282347e+38f;    // the largest finite float (NVRTC has no FLT_MAX)

// The kernel arguments of the dynamic forms beyond Params: scales of (row, group) live at
// row * scales_row + group * scales_group (in floats; row counts every row of x, linearly);
// amax is clamped to scale_ub first (+inf: no bound).
struct QuantParams {
    long long scales_row, scales_group;
    float scale_ub;
    int pad;
};
static_assert(sizeof(QuantParams) == 24, "QuantParams: 24 bytes, as cupy_rmsnorm/_abi.py packs it");

template <int QTYPE> struct QuantMax;  // QMAX: the largest finite value, where conversion saturates
template <> struct QuantMax<kE4M3> { static constexpr float value = 448.0f; };
template <> struct QuantMax<kE5M2> { static constexpr float value = 57344.0f; };
template <> struct QuantMax<kInt8> { static constexpr float value = 127.0f; };

// Round to nearest even and saturate (an infinity too); NaN stays NaN in FP8, becomes 0 in int8.
template <int QTYPE>
__device__ __forceinline__ unsigned char quantize(float v) {
    if (QTYPE == kInt8) {
        const float c = fminf(fmaxf(v, -127.0f), 127.0f);
        return static_cast<unsigned char>(static_cast<signed char>(__float2int_rn(v == v ? c : 0.0f)));
    }
    return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, QTYPE == kE4M3 ? __NV_E4M3 : __NV_E5M2);
}

template <int QTYPE, int VEC>
__device__ __forceinline__ Pack<unsigned char, VEC> quantize_vec(const float (&y)[VEC], float inv_scale) {
    Pack<unsigned char, VEC> o;
    if (QTYPE != kInt8 && VEC >= 2) {  // two conversions per instruction (sm_89+)
#pragma unroll
        for (int e = 0; e + 1 < VEC; e += 2) {
            const __nv_fp8x2_storage_t t = __nv_cvt_float2_to_fp8x2(
                make_float2(y[e] * inv_scale, y[e + 1] * inv_scale), __NV_SATFINITE,
                QTYPE == kE4M3 ? __NV_E4M3 : __NV_E5M2);
            reinterpret_cast<__nv_fp8x2_storage_t*>(o.v)[e / 2] = t;   // .x is the low byte, as o.v[e]
        }
    } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) o.v[e] = quantize<QTYPE>(y[e] * inv_scale);
    }
    return o;
}

// A dynamic scale from the max |y| it covers: max(min(amax, ub) / QMAX, 1 / (QMAX * 512)), the
// float32 division correctly rounded. Written as max(min(amax, ub), 1 / 512) / QMAX (the same
// value: 1 / 512 is exact and rounding is monotonic), so the dividend is >= 1 / 512 and the
// quotient one product and two fused corrections (Markstein's, with 1 / QMAX rounded: what
// nvcc's division runs where its range check passes, without that check and its slow path).
// amax is never NaN (fmaxf drops NaN); +inf gives +inf. tests/test_gpu_quant.py compares every
// float32 dividend with the division.
template <int QTYPE>
__device__ __forceinline__ float dynamic_scale(float amax, float ub) {
    constexpr float qmax = QuantMax<QTYPE>::value, inv_qmax = 1.0f / QuantMax<QTYPE>::value;
    const float a = fmaxf(fminf(amax, ub), 1.0f / kMinScaleDivisor);
    const float q0 = a * inv_qmax;
    const float s = __fmaf_rn(__fmaf_rn(-q0, qmax, a), inv_qmax, q0);
    return a > kFloatMax ? a : s;
}

// 1 / s correctly rounded, for a dynamic scale s (normal, below 2^122, or +inf: 0): the
// reciprocal's fast path (an approximation and one fused correction), which is what 1.0f / s
// runs for such s after a range check that this skips. +inf goes in as the largest float,
// whose approximate reciprocal is 0 (flushed), and so stays 0. The same test covers it.
__device__ __forceinline__ float inverse_of_scale(float s) {
    s = fminf(s, kFloatMax);
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(s));
    return __fmaf_rn(r, __fmaf_rn(-s, r, 1.0f), r);
}

// The lanes a row group of THREADS_PER_ROW threads occupies in its warp (all of it from 32 up).
template <int THREADS_PER_ROW>
__device__ __forceinline__ unsigned row_group_mask() {
    if (THREADS_PER_ROW >= 32) return 0xffffffffu;
    return ((1u << (THREADS_PER_ROW % 32)) - 1) << ((threadIdx.x % 32) & ~(THREADS_PER_ROW - 1));
}

// The max over LANES consecutive, aligned threads of a row group (a power of two; past a warp,
// through shared memory: then every thread of the block calls it). Max ignores NaN (fmaxf).
template <int LANES, int THREADS_PER_ROW>
__device__ __forceinline__ float lanes_max(float m) {
    const unsigned mask = row_group_mask<THREADS_PER_ROW>();
#pragma unroll
    for (int o = (LANES < 32 ? LANES : 32) / 2; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(mask, m, o));
    if (LANES > 32) {
        constexpr int WARPS = LANES > 32 ? LANES / 32 : 1;
        __shared__ float warp_max[32];
        const int warp = threadIdx.x / 32, first_warp = warp & ~(WARPS - 1);
        __syncthreads();                           // the previous call's reads are done
        if (threadIdx.x % 32 == 0) warp_max[warp] = m;
        __syncthreads();
        m = warp_max[first_warp];
#pragma unroll
        for (int k = 1; k < WARPS; ++k) m = fmaxf(m, warp_max[first_warp + k]);
    }
    return m;
}

// The max over the CLUSTER blocks of this block's cluster (after cluster_total: the same
// barrier protocol, one phase on; the caller's cluster_done() waits out the last one).
template <int CLUSTER>
__device__ __forceinline__ float cluster_max(float part) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    __shared__ float slot;
    cluster_wait();                            // cluster_total's last phase
    if (threadIdx.x == 0) slot = part;
    cluster_arrive();
    cluster_wait();
    const unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(&slot));
    float total = 0.f;
#pragma unroll
    for (unsigned r = 0; r < CLUSTER; ++r) {
        unsigned remote;
        float v;
        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(r));
        asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
        total = fmaxf(total, v);
    }
    cluster_arrive();
    return total;
#else
    __trap();
    return part;
#endif
}

// The max over the whole row: its group's lanes, the block's warps, the cluster's blocks.
template <int THREADS_PER_ROW, int CLUSTER>
__device__ __forceinline__ float row_max(float m) {
    m = lanes_max<(THREADS_PER_ROW < 32 ? THREADS_PER_ROW : 32), THREADS_PER_ROW>(m);
    if (THREADS_PER_ROW > 32) {
        constexpr int WARPS = THREADS_PER_ROW > 32 ? THREADS_PER_ROW / 32 : 1;
        __shared__ float warp_max[WARPS];
        const int lane = threadIdx.x % 32;
        if (lane == 0) warp_max[threadIdx.x / 32] = m;
        __syncthreads();
        m = warp_max[lane % WARPS];              // each run of WARPS lanes holds them all (max is
        m = lanes_max<WARPS, 32>(m);             // exact in any order): log2(WARPS) steps, not 5
    }
    if (CLUSTER > 1) m = cluster_max<CLUSTER>(m);
    return m;
}


// What the quantized output stage needs of a row, as norm_row left it (see there): its values
// of type S (the fused op's sum or x), rounded to N (x's type) in llama mode.
template <typename S, typename N, typename W, int VEC, int VECS_PER_THREAD, bool PREFETCH_W>
struct RowState {
    const Pack<S, VEC> (&keep)[VECS_PER_THREAD > 0 ? VECS_PER_THREAD : 1];
    const Pack<W, VEC> (&wk)[PREFETCH_W ? VECS_PER_THREAD : 1];
    const S* src;                   // streamed rows re-read their body here (residual_out when fused)
    const W* w;
    int head, n_body, first, step, tail_at, tail, tid;   // tail_at: the tail's start from the body's
    bool has_head, has_tail, w_vec, prefetch_w;          // has_tail: this thread owns the tail's vector
    float head_v, head_w, w_offset;
    int flags;
    float inv_rms;

    // y (before its final rounding) of body vector v, this thread's k-th (0 when streamed)
    __device__ __forceinline__ void body_y(int k, int v, float (&y)[VEC]) const {
        const Pack<S, VEC> a = VECS_PER_THREAD > 0 ? keep[VECS_PER_THREAD > 0 ? k : 0]
                                               : reinterpret_cast<const Pack<S, VEC>*>(src + head)[v];
        float wv[VEC];
        if (prefetch_w) weights_of<W, VEC>(wk[PREFETCH_W ? k : 0], w_offset, wv);
        else load_weights<W, VEC>(w + head, v, w_vec, w_offset, flags, wv);
        unpack(a, y);
#pragma unroll
        for (int e = 0; e < VEC; ++e) y[e] = normalized<N>(y[e], inv_rms, wv[e], flags);
    }
    // y of the tail's partial vector (this thread's k-th; elements past the row: 0)
    __device__ __forceinline__ void tail_y(int k, float (&y)[VEC]) const {
        const Pack<S, VEC> a = VECS_PER_THREAD > 0 ? keep[VECS_PER_THREAD > 0 ? k : 0]
                                               : load_partial<S, VEC>(src + head + tail_at, tail);
#pragma unroll
        for (int e = 0; e < VEC; ++e)
            y[e] = e < tail ? normalized<N>(to_float(a.v[e]), inv_rms, weight_at(w + head, tail_at + e, w_offset, flags),
                                            flags)
                            : 0.f;
    }
    __device__ __forceinline__ float head_y() const { return normalized<N>(head_v, inv_rms, head_w, flags); }
};

// The kernel arguments of a quantized launch, for norm_row.
struct QuantArgs {
    unsigned char* q;
    const float* scale;             // kStatic: the per-tensor scale
    float* scales;                  // kPerToken, kPerGroup: written
    QuantParams p;
};

template <int VEC, int THREADS_PER_ROW, int VECS_PER_THREAD, class Body, class F>
__device__ __forceinline__ void each_body_vector(const Body& row, F&& f) {
    if (VECS_PER_THREAD > 0) {
#pragma unroll
        for (int k = 0; k < (VECS_PER_THREAD > 0 ? VECS_PER_THREAD : 1); ++k) {
            const int v = row.first + k * row.step;
            if (v < row.n_body) f(k, v);
        }
    } else {
#pragma unroll 4
        for (int v = row.first; v < row.n_body; v += row.step) f(0, v);
    }
}

// f(k) for the thread owning the tail's partial vector (its k-th; 0 when streamed).
template <int VECS_PER_THREAD, class Row, class F>
__device__ __forceinline__ void with_tail(const Row& row, F&& f) {
    if (!row.has_tail) return;
    if (VECS_PER_THREAD > 0) {
#pragma unroll
        for (int k = 0; k < (VECS_PER_THREAD > 0 ? VECS_PER_THREAD : 1); ++k)
            if (row.first + k * row.step == row.n_body) f(k);
    } else {
        f(0);
    }
}

// The quantized output stage of one row (or a cluster block's share of it): scales, then q.
// qr, row_scales: the row's q and its scales (dynamic forms); rank: the block's in its cluster.
template <int VEC, int THREADS_PER_ROW, int VECS_PER_THREAD, int CLUSTER, bool EDGES, int FORM, int QTYPE, bool FLAT, class Row>
__device__ __forceinline__ void store_quantized(const Row& row, unsigned char* qr, float* row_scales,
                                                float static_scale, const QuantArgs& quant, int rank) {
    using QVec = Pack<unsigned char, VEC>;
    QVec* qv = reinterpret_cast<QVec*>(qr + row.head);
    if constexpr (FORM == kPerGroup) {
        // Rows start on the vector grid (the launcher makes sure: no head, no tail) and a group
        // is GROUP consecutive vectors: LANES consecutive threads of one block at one k, over
        // SPAN consecutive k (a group longer than the row group's share of a step).
        constexpr int GROUP = kGroupSize / VEC;
        constexpr int LANES = GROUP < THREADS_PER_ROW ? GROUP : THREADS_PER_ROW;
        constexpr int SPAN = GROUP / LANES;
        static_assert(SPAN == 1 || (CLUSTER == 1 && VECS_PER_THREAD % SPAN == 0), "a group: one block's k-runs");
        const float ub = quant.p.scale_ub;
        const long long group_stride = quant.p.scales_group;    // the scale of the group of vector v:
        const auto group_at = [&](int v) {
            return FLAT ? (int)(v / GROUP) * (int)group_stride : (v / GROUP) * group_stride;
        };
        // A thread's VECS_PER_THREAD vectors of a step each lie in another group (SPAN 1) of LANES
        // lanes of one warp: their maxima are reduced and scattered together, after which lane
        // i of the LANES holds the max of its k = i / (LANES / VECS_PER_THREAD), so each lane works
        // out one scale (not VECS_PER_THREAD) and the others fetch the inverses they need.
        constexpr bool SCATTER = VECS_PER_THREAD > 1 && SPAN == 1 && LANES <= 32 && VECS_PER_THREAD <= LANES;
        if constexpr (SCATTER) {
            constexpr int K = SCATTER ? VECS_PER_THREAD : 1, SHARE = LANES / K;   // lanes per k after
            const unsigned mask = row_group_mask<THREADS_PER_ROW>();
            const int lane = threadIdx.x % 32;
            float y[K][VEC];
            float m[K];
#pragma unroll
            for (int k = 0; k < K; ++k) {
                const int v = row.first + k * row.step;
                m[k] = 0.f;
                if (v < row.n_body) {
                    row.body_y(k, v, y[k]);
#pragma unroll
                    for (int e = 0; e < VEC; ++e) m[k] = fmaxf(m[k], fabsf(y[k][e]));
                }
            }
#pragma unroll
            for (int o = LANES / 2, c = K; c > 1; o /= 2, c /= 2) {   // keep half, send half
                const bool upper = lane & o;
#pragma unroll
                for (int i = 0; i < c / 2; ++i) {
                    const float keep = upper ? m[i + c / 2] : m[i], send = upper ? m[i] : m[i + c / 2];
                    m[i] = fmaxf(keep, __shfl_xor_sync(mask, send, o));
                }
            }
#pragma unroll
            for (int o = SHARE / 2; o > 0; o /= 2) m[0] = fmaxf(m[0], __shfl_xor_sync(mask, m[0], o));
            const int mine = (lane % LANES) / SHARE, v_mine = row.first + mine * row.step;
            const float s = dynamic_scale<QTYPE>(m[0], ub);
            if (lane % SHARE == 0 && v_mine < row.n_body) row_scales[group_at(v_mine)] = s;
            const float inv_mine = inverse_of_scale(s);
#pragma unroll
            for (int k = 0; k < K; ++k) {
                const int v = row.first + k * row.step;
                const float inv = __shfl_sync(mask, inv_mine, (lane & ~(LANES - 1)) + k * SHARE);
                if (v < row.n_body) qv[v] = quantize_vec<QTYPE, VEC>(y[k], inv);
            }
        } else if constexpr (VECS_PER_THREAD > 0) {
#pragma unroll
            for (int k0 = 0; k0 < VECS_PER_THREAD; k0 += SPAN) {
                float y[SPAN][VEC];
                float m = 0.f;
#pragma unroll
                for (int j = 0; j < SPAN; ++j) {
                    const int v = row.first + (k0 + j) * row.step;
                    if (v < row.n_body) {
                        row.body_y(k0 + j, v, y[j]);
#pragma unroll
                        for (int e = 0; e < VEC; ++e) m = fmaxf(m, fabsf(y[j][e]));
                    }
                }
                m = lanes_max<LANES, THREADS_PER_ROW>(m);      // every thread: it may synchronize the block
                const int v0 = row.first + k0 * row.step;  // whole groups: all of it is there, or none
                if (v0 < row.n_body) {
                    const float s = dynamic_scale<QTYPE>(m, ub);
                    if (v0 % GROUP == 0) row_scales[group_at(v0)] = s;
                    const float inv = inverse_of_scale(s);
#pragma unroll
                    for (int j = 0; j < SPAN; ++j) qv[v0 + j * row.step] = quantize_vec<QTYPE, VEC>(y[j], inv);
                }
            }
        } else {
            static_assert(SPAN == 1, "streamed rows: blocks of at least a group");
            for (int base = rank * THREADS_PER_ROW; base < row.n_body; base += row.step) {   // alike in the block
                const int v = base + row.tid;
                float y[VEC];
                float m = 0.f;
                if (v < row.n_body) {
                    row.body_y(0, v, y);
#pragma unroll
                    for (int e = 0; e < VEC; ++e) m = fmaxf(m, fabsf(y[e]));
                }
                m = lanes_max<LANES, THREADS_PER_ROW>(m);
                if (v < row.n_body) {
                    const float s = dynamic_scale<QTYPE>(m, ub);
                    if (v % GROUP == 0) row_scales[group_at(v)] = s;
                    qv[v] = quantize_vec<QTYPE, VEC>(y, inverse_of_scale(s));
                }
            }
        }
    } else {
        // kPerToken, rows in registers on the vector grid: the body's y, kept from the first pass
        // for the second rather than computed again (rows with edges need those registers)
        constexpr bool KEEP_Y = FORM == kPerToken && VECS_PER_THREAD > 0 && !EDGES;
        float kept_y[KEEP_Y ? VECS_PER_THREAD : 1][VEC];
        float inv_scale;
        if (FORM == kStatic) {
            inv_scale = 1.0f / static_scale;
        } else {                        // kPerToken: a first pass for the row's max |y|
            float m = 0.f;
            if (row.has_head) m = fabsf(row.head_y());
            with_tail<VECS_PER_THREAD>(row, [&](int k) {
                float y[VEC];
                row.tail_y(k, y);
#pragma unroll
                for (int e = 0; e < VEC; ++e) m = fmaxf(m, fabsf(y[e]));
            });
            each_body_vector<VEC, THREADS_PER_ROW, VECS_PER_THREAD>(row, [&](int k, int v) {
                float (&y)[VEC] = kept_y[KEEP_Y ? k : 0];
                row.body_y(k, v, y);
#pragma unroll
                for (int e = 0; e < VEC; ++e) m = fmaxf(m, fabsf(y[e]));
            });
            const float s = dynamic_scale<QTYPE>(row_max<THREADS_PER_ROW, CLUSTER>(m), quant.p.scale_ub);
            if (row.tid == 0 && rank == 0) row_scales[0] = s;
            inv_scale = 1.0f / s;   // once a row (inverse_of_scale spilled 4 bytes in a 1024-thread cluster kernel)
        }
        if (row.has_head) qr[row.tid] = quantize<QTYPE>(row.head_y() * inv_scale);
        with_tail<VECS_PER_THREAD>(row, [&](int k) {
            float y[VEC];
            row.tail_y(k, y);
            unsigned char* qt = qr + row.head + row.tail_at;
#pragma unroll
            for (int e = 0; e < VEC - 1; ++e)
                if (e < row.tail) qt[e] = quantize<QTYPE>(y[e] * inv_scale);
        });
        each_body_vector<VEC, THREADS_PER_ROW, VECS_PER_THREAD>(row, [&](int k, int v) {
            if (KEEP_Y) {
                qv[v] = quantize_vec<QTYPE, VEC>(kept_y[KEEP_Y ? k : 0], inv_scale);
            } else {
                float y[VEC];
                row.body_y(k, v, y);
                qv[v] = quantize_vec<QTYPE, VEC>(y, inv_scale);
            }
        });
    }
}

}  // namespace rmsnorm
