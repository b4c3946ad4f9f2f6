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
// Work split (cupy_rmsnorm/_plan.py decides): a group of ROW_THREADS threads owns one row
// (ROW_THREADS <= 32: several rows per block, reduced with warp shuffles; ROW_THREADS > 32:
// one row per block, reduced through shared memory; rms_norm_cluster_kernel: one row per
// cluster of CLUSTER blocks on CLUSTER SMs, the block sums added through distributed shared
// memory). One block per row group,
// no grid-stride loop: a loop's live state cost registers, hence occupancy.
// Each row is split into an unaligned head (< VEC elements, up to the first 16-byte
// boundary of x's row), a body of VEC-wide vectors and a tail, so every row gets 16-byte
// accesses whatever its offset, provided all arrays share x's alignment pattern (the
// launcher checks that and lowers VEC otherwise); EDGES = false compiles the common case
// (rows on the vector grid, hidden a multiple of VEC) without head and tail.
// THREAD_VECS > 0 keeps the body in registers, THREAD_VECS vectors per thread (each element
// read from DRAM once); THREAD_VECS == 0 streams the row twice (pass 2 re-reads x, or
// residual_out, from L2).
//
// Quantized output (rms_norm_quant_kernel, rms_norm_quant_cluster_kernel): the same row, but
// y is kept in float32 before its final rounding and stored as FP8 (e4m3fn, e5m2) or int8:
// q = sat(round(y * (1 / scale))) with a static per-tensor scale read from device memory,
// one scale per row (its max |y|, reduced like the sum of squares), or one per 128-element
// group (the lanes holding a group reduce it). See QuantForm and _reference.py.

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

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

enum Flags { kLlama = 1, kHasWeight = 2, kEarlyTrigger = 4 };   // Params.flags

// Everything but the pointers, passed by value as one argument (fewer kernel
// arguments, less host work per launch). Row r of an array starts at
// (r / n_inner) * outer + (r % n_inner) * inner elements. The host side packs this
// layout in cupy_rmsnorm/_launcher.py (PARAMS_DTYPE, PARAMS_BYTES, FLAGS); a CPU test
// checks that both sides agree.
struct RowStrides {
    long long outer, inner;
};

struct Params {
    long long rows, n_inner;
    RowStrides x, residual, out, residual_out;
    int hidden;
    float eps, weight_offset;
    int flags;
};
static_assert(sizeof(Params) == 96, "Params: 96 bytes, as cupy_rmsnorm/_launcher.py packs it");

// Sum over the LANES lanes of a group (a power of two; at most a warp's 32 take part).
template <int LANES>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
    for (int o = (LANES < 32 ? LANES : 32) / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
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

// A plain load, not __ldg: __ldg is an asm statement the compiler may treat as free of side
// effects and hoist out of the bounds check that guards it (it did, in the backward kernel:
// w[tid] read for tid == hidden).
template <typename W>
__device__ __forceinline__ float weight_at(const W* w, int j, float w_offset, int flags) {
    return (flags & kHasWeight) ? to_float(w[j]) + w_offset : 1.0f;
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

// The weights (offset added) of body vector v: one aligned vector load when it can.
template <typename W, int VEC>
__device__ __forceinline__ void load_weights(const W* wb, int v, bool w_vec, float w_offset, int flags,
                                             float (&wv)[VEC]) {
    if (w_vec) {
        const Pack<W, VEC> wp = reinterpret_cast<const Pack<W, VEC>*>(wb)[v];  // one 16-byte load
        weights_of<W, VEC>(wp, w_offset, wv);
    } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) wv[e] = weight_at(wb, v * VEC + e, w_offset, flags);
    }
}

// Normalize one body vector.
template <typename T, typename W, int VEC>
__device__ __forceinline__ Pack<T, VEC> finish_vec(const Pack<T, VEC>& a, const W* wb, int v, bool w_vec,
                                                   float inv_rms, float w_offset, int flags) {
    float wv[VEC];
    load_weights<W, VEC>(wb, v, w_vec, w_offset, flags, wv);
    return scale_vec<T, W, VEC>(a, wv, inv_rms, flags);
}

// The sum of `part` over the CLUSTER blocks of this block's cluster, through distributed shared
// memory; the same value, added in the same order, in every block. Every thread of the
// cluster calls it once; the caller then calls cluster_done() before exiting, so no block
// leaves while another may still read its shared memory.
template <int CLUSTER>
__device__ __forceinline__ float cluster_sum(float part) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    __shared__ float slot;
    if (threadIdx.x == 0) slot = part;
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
    const unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(&slot));
    float total = 0.f;
#pragma unroll
    for (unsigned r = 0; r < CLUSTER; ++r) {
        unsigned remote;
        float v;
        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(r));
        asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
        total += v;
    }
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
    return total;
#else
    __trap();   // clusters need sm_90; the launcher never plans them below
    return part;
#endif
}

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

// -- quantized output ------------------------------------------------------------------------
// QuantForm: the norm_row template's FORM (kPlain: y rounded to T, the plain ops); QuantType:
// its QTYPE. The host side mirrors both enums and QuantParams in cupy_rmsnorm/_launcher.py
// (QUANT_FORMS, QUANT_TYPES, QUANT_PARAMS_DTYPE); a CPU test reads both sides.
enum QuantForm { kPlain = 0, kStatic = 1, kPerToken = 2, kPerGroup = 3 };
enum QuantType { kE4M3 = 0, kE5M2 = 1, kInt8 = 2 };
constexpr int kGroupSize = 128;       // kPerGroup: elements per scale
constexpr float kMinScaleDivisor = 512.0f;   // dynamic scales >= 1 / (QMAX * 512): zeros stay zeros

// The kernel arguments of the dynamic forms beyond Params: scales of (row, group) live at
// row * scales_row + group * scales_group (in floats; row counts every row of x, linearly);
// amax is clamped to scale_ub first (+inf: no bound).
struct QuantParams {
    long long scales_row, scales_group;
    float scale_ub;
    int pad;
};
static_assert(sizeof(QuantParams) == 24, "QuantParams: 24 bytes, as cupy_rmsnorm/_launcher.py packs it");

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
            o.v[e] = static_cast<unsigned char>(t & 0xff);      // .x is the low byte
            o.v[e + 1] = static_cast<unsigned char>(t >> 8);
        }
    } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) o.v[e] = quantize<QTYPE>(y[e] * inv_scale);
    }
    return o;
}

// A dynamic scale from the max |y| it covers: max(min(amax, ub) / QMAX, 1 / (QMAX * 512)).
template <int QTYPE>
__device__ __forceinline__ float dynamic_scale(float amax, float ub) {
    constexpr float qmax = QuantMax<QTYPE>::value;
    return fmaxf(fminf(amax, ub) / qmax, 1.0f / (qmax * kMinScaleDivisor));
}

// The lanes a row group of ROW_THREADS threads occupies in its warp (all of it from 32 up).
template <int ROW_THREADS>
__device__ __forceinline__ unsigned row_group_mask() {
    if (ROW_THREADS >= 32) return 0xffffffffu;
    return ((1u << (ROW_THREADS % 32)) - 1) << ((threadIdx.x % 32) & ~(ROW_THREADS - 1));
}

// The max over LANES consecutive, aligned threads of a row group (a power of two; past a warp,
// through shared memory: then every thread of the block calls it). Max ignores NaN (fmaxf).
template <int LANES, int ROW_THREADS>
__device__ __forceinline__ float lanes_max(float m) {
    const unsigned mask = row_group_mask<ROW_THREADS>();
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

// The max over the CLUSTER blocks of this block's cluster (after cluster_sum: the same
// barrier protocol, one phase on; the caller's cluster_done() waits out the last one).
template <int CLUSTER>
__device__ __forceinline__ float cluster_max(float part) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    __shared__ float slot;
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");   // cluster_sum's last phase
    if (threadIdx.x == 0) slot = part;
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
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
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
    return total;
#else
    __trap();
    return part;
#endif
}

// The max over the whole row: its group's lanes, the block's warps, the cluster's blocks.
template <int ROW_THREADS, int CLUSTER>
__device__ __forceinline__ float row_max(float m) {
    m = lanes_max<(ROW_THREADS < 32 ? ROW_THREADS : 32), ROW_THREADS>(m);
    if (ROW_THREADS > 32) {
        constexpr int WARPS = ROW_THREADS > 32 ? ROW_THREADS / 32 : 1;
        __shared__ float warp_max[WARPS];
        const int lane = threadIdx.x % 32;
        if (lane == 0) warp_max[threadIdx.x / 32] = m;
        __syncthreads();
        m = lane < WARPS ? warp_max[lane] : 0.f;
        m = lanes_max<32, 32>(m);
    }
    if (CLUSTER > 1) m = cluster_max<CLUSTER>(m);
    return m;
}

template <typename T, int FORM> struct OutElem { using type = unsigned char; };  // quantized: bytes
template <typename T> struct OutElem<T, kPlain> { using type = T; };

// What the quantized output stage needs of a row, as norm_row left it (see there).
template <typename T, typename W, int VEC, int THREAD_VECS, bool PREFETCH_W>
struct RowState {
    const Pack<T, VEC> (&keep)[THREAD_VECS > 0 ? THREAD_VECS : 1];
    const Pack<W, VEC> (&wk)[PREFETCH_W ? THREAD_VECS : 1];
    const T* src;                   // streamed rows re-read their body here (residual_out when fused)
    const W* w;
    int head, n_body, first, step, tail_start, tid;
    bool has_head, has_tail, w_vec, prefetch_w;
    float head_v, tail_v, head_w, tail_w, w_offset;
    int flags;
    float inv_rms;

    // y (before its final rounding) of body vector v, this thread's k-th (0 when streamed)
    __device__ __forceinline__ void body_y(int k, int v, float (&y)[VEC]) const {
        const Pack<T, VEC> a = THREAD_VECS > 0 ? keep[THREAD_VECS > 0 ? k : 0]
                                               : reinterpret_cast<const Pack<T, VEC>*>(src + head)[v];
        float wv[VEC];
        if (prefetch_w) weights_of<W, VEC>(wk[PREFETCH_W ? k : 0], w_offset, wv);
        else load_weights<W, VEC>(w + head, v, w_vec, w_offset, flags, wv);
#pragma unroll
        for (int e = 0; e < VEC; ++e) y[e] = normalized<T>(to_float(a.v[e]), inv_rms, wv[e], flags);
    }
    __device__ __forceinline__ float head_y() const { return normalized<T>(head_v, inv_rms, head_w, flags); }
    __device__ __forceinline__ float tail_y() const { return normalized<T>(tail_v, inv_rms, tail_w, flags); }
};

// The kernel arguments of a quantized launch, for norm_row.
struct QuantArgs {
    unsigned char* q;
    const float* scale;             // kStatic: the per-tensor scale
    float* scales;                  // kPerToken, kPerGroup: written
    QuantParams p;
};

template <int VEC, int ROW_THREADS, int THREAD_VECS, class Body, class F>
__device__ __forceinline__ void each_body_vector(const Body& row, F&& f) {
    if (THREAD_VECS > 0) {
#pragma unroll
        for (int k = 0; k < (THREAD_VECS > 0 ? THREAD_VECS : 1); ++k) {
            const int v = row.first + k * row.step;
            if (v < row.n_body) f(k, v);
        }
    } else {
#pragma unroll 4
        for (int v = row.first; v < row.n_body; v += row.step) f(0, v);
    }
}

// The quantized output stage of one row (or a cluster block's share of it): scales, then q.
// r: the row's linear index (for its scales); rank: the block's in its cluster.
template <int VEC, int ROW_THREADS, int THREAD_VECS, int CLUSTER, int FORM, int QTYPE, class Row>
__device__ __forceinline__ void store_quantized(const Row& row, unsigned char* qr, float static_scale,
                                                const QuantArgs& quant, long long r, int rank) {
    using QVec = Pack<unsigned char, VEC>;
    QVec* qv = reinterpret_cast<QVec*>(qr + row.head);
    float* const row_scales = quant.scales + r * quant.p.scales_row;
    if constexpr (FORM == kPerGroup) {
        // Rows start on the vector grid (the launcher makes sure: no head, no tail) and a group
        // is GROUP consecutive vectors: LANES consecutive threads of one block at one k, over
        // SPAN consecutive k (a group longer than the row group's share of a step).
        constexpr int GROUP = kGroupSize / VEC;
        constexpr int LANES = GROUP < ROW_THREADS ? GROUP : ROW_THREADS;
        constexpr int SPAN = GROUP / LANES;
        static_assert(SPAN == 1 || (CLUSTER == 1 && THREAD_VECS % SPAN == 0), "a group: one block's k-runs");
        const float ub = quant.p.scale_ub;
        if constexpr (THREAD_VECS > 0) {
#pragma unroll
            for (int k0 = 0; k0 < THREAD_VECS; k0 += SPAN) {
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
                m = lanes_max<LANES, ROW_THREADS>(m);      // every thread: it may synchronize the block
                const int v0 = row.first + k0 * row.step;  // whole groups: all of it is there, or none
                if (v0 < row.n_body) {
                    const float s = dynamic_scale<QTYPE>(m, ub);
                    if (v0 % GROUP == 0) row_scales[(v0 / GROUP) * quant.p.scales_group] = s;
                    const float inv = 1.0f / s;
#pragma unroll
                    for (int j = 0; j < SPAN; ++j) qv[v0 + j * row.step] = quantize_vec<QTYPE, VEC>(y[j], inv);
                }
            }
        } else {
            static_assert(SPAN == 1, "streamed rows: blocks of at least a group");
            for (int base = rank * ROW_THREADS; base < row.n_body; base += row.step) {   // alike in the block
                const int v = base + row.tid;
                float y[VEC];
                float m = 0.f;
                if (v < row.n_body) {
                    row.body_y(0, v, y);
#pragma unroll
                    for (int e = 0; e < VEC; ++e) m = fmaxf(m, fabsf(y[e]));
                }
                m = lanes_max<LANES, ROW_THREADS>(m);
                if (v < row.n_body) {
                    const float s = dynamic_scale<QTYPE>(m, ub);
                    if (v % GROUP == 0) row_scales[(v / GROUP) * quant.p.scales_group] = s;
                    qv[v] = quantize_vec<QTYPE, VEC>(y, 1.0f / s);
                }
            }
        }
    } else {
        float inv_scale;
        if (FORM == kStatic) {
            inv_scale = 1.0f / static_scale;
        } else {                        // kPerToken: a first pass for the row's max |y|
            float m = 0.f;
            if (row.has_head) m = fabsf(row.head_y());
            if (row.has_tail) m = fmaxf(m, fabsf(row.tail_y()));
            each_body_vector<VEC, ROW_THREADS, THREAD_VECS>(row, [&](int k, int v) {
                float y[VEC];
                row.body_y(k, v, y);
#pragma unroll
                for (int e = 0; e < VEC; ++e) m = fmaxf(m, fabsf(y[e]));
            });
            const float s = dynamic_scale<QTYPE>(row_max<ROW_THREADS, CLUSTER>(m), quant.p.scale_ub);
            if (row.tid == 0 && rank == 0) row_scales[0] = s;
            inv_scale = 1.0f / s;
        }
        if (row.has_head) qr[row.tid] = quantize<QTYPE>(row.head_y() * inv_scale);
        if (row.has_tail) qr[row.tail_start + row.tid] = quantize<QTYPE>(row.tail_y() * inv_scale);
        each_body_vector<VEC, ROW_THREADS, THREAD_VECS>(row, [&](int k, int v) {
            float y[VEC];
            row.body_y(k, v, y);
            qv[v] = quantize_vec<QTYPE, VEC>(y, inv_scale);
        });
    }
}

// One row (or, with CLUSTER > 1, the share of one row of block `rank` of its cluster).
// EDGES: a row may start off x's 16-byte grid or end in a partial vector (head and tail);
// without it every row is whole vectors, a compile-time fact that saves registers.
// FORM != kPlain: the output is quant.q (QTYPE bytes, at out's row strides), not y.
template <typename T, typename W, bool FUSED, int VEC, int ROW_THREADS, int THREAD_VECS, bool EDGES, int CLUSTER,
          int FORM = kPlain, int QTYPE = kE4M3>
__device__ __forceinline__ void norm_row(const T* x, const T* res, T* y, T* res_out, const W* w,
                                         const Params& p, long long block_id, int rank,
                                         const QuantArgs& quant = QuantArgs()) {
    using VecT = Pack<T, VEC>;
    constexpr int WARPS = ROW_THREADS > 32 ? ROW_THREADS / 32 : 1;
    static_assert(ROW_THREADS >= VEC, "a group must cover a head or tail of up to VEC - 1 elements");
    static_assert(CLUSTER == 1 || ROW_THREADS > 32, "clusters split rows of a block each");
    __shared__ float warp_sums[WARPS];

    const int hidden = p.hidden, flags = p.flags;
    const float w_offset = p.weight_offset;
    const int tid = threadIdx.x % ROW_THREADS;   // lane within the row group
    const long long row = block_id * (blockDim.x / ROW_THREADS) + threadIdx.x / ROW_THREADS;
    const bool active = row < p.rows;            // false only in the last block of small groups
    const long long r = active ? row : 0;
    long long outer = r, inner = 0;
    if (p.n_inner != 1) { outer = r / p.n_inner; inner = r - outer * p.n_inner; }
    const T* xr = x + outer * p.x.outer + inner * p.x.inner;
    const T* rr = FUSED ? res + outer * p.residual.outer + inner * p.residual.inner : nullptr;
    T* yr = y + outer * p.out.outer + inner * p.out.inner;
    T* ror = FUSED ? res_out + outer * p.residual_out.outer + inner * p.residual_out.inner : nullptr;

    // Head: elements before x's row reaches a 16-byte boundary (all arrays share that
    // alignment pattern, the launcher made sure); tail: what is left after the last whole
    // vector. Both are shorter than VEC <= ROW_THREADS, so a thread holds at most one
    // element of each, in a register; with a cluster, block 0 takes them.
    int head = 0, n_body = hidden / VEC, tail_start = hidden;
    if (EDGES) {
        const int mis = (int)((reinterpret_cast<unsigned long long>(xr) / sizeof(T)) & (VEC - 1));
        head = min((VEC - mis) & (VEC - 1), hidden);
        n_body = (hidden - head) / VEC;
        tail_start = head + n_body * VEC;
    }
    const bool has_head = EDGES && active && rank == 0 && tid < head;
    const bool has_tail = EDGES && active && rank == 0 && tid < hidden - tail_start;
    const bool w_vec = (flags & kHasWeight) &&
        ((reinterpret_cast<unsigned long long>(w + head) % sizeof(Pack<W, VEC>)) == 0);
    const int first = rank * ROW_THREADS + tid;  // this thread's first body vector
    constexpr int STEP = ROW_THREADS * CLUSTER;  // and the stride between its vectors

    float ss = 0.f, head_v = 0.f, tail_v = 0.f, head_w = 1.f, tail_w = 1.f;
    VecT keep[THREAD_VECS > 0 ? THREAD_VECS : 1];   // the row's body, kept for the second pass
    // Short rows: the weights are fetched with the row, not after the reduction, so their
    // latency is off the critical path (only where registers allow).
    constexpr bool PREFETCH_W = THREAD_VECS == 1;
    Pack<W, VEC> wk[PREFETCH_W ? THREAD_VECS : 1];
    const bool prefetch_w = PREFETCH_W && w_vec;
    const VecT* xv = reinterpret_cast<const VecT*>(xr + head);
    const VecT* rv = reinterpret_cast<const VecT*>(rr + head);
    VecT* rov = reinterpret_cast<VecT*>(ror + head);

    wait_for_previous_kernel();                  // no global memory access before this
    if (flags & kEarlyTrigger) allow_next_kernel();
    const float static_scale = FORM == kStatic ? *quant.scale : 0.f;   // issued early, used at the end
    if (active) {
        if (THREAD_VECS > 0) {
            VecT other[FUSED && THREAD_VECS > 0 ? THREAD_VECS : 1];
#pragma unroll
            for (int i = 0; i < THREAD_VECS; ++i) {   // issue every body load before the first use
                const int v = first + i * STEP;
                if (v < n_body) { keep[i] = xv[v]; if (FUSED) other[i] = rv[v]; }
            }
            if (prefetch_w) {
#pragma unroll
                for (int i = 0; i < THREAD_VECS; ++i) {
                    const int v = first + i * STEP;
                    if (v < n_body) wk[i] = reinterpret_cast<const Pack<W, VEC>*>(w + head)[v];
                }
            }
            // head and tail loads go out while the body loads are in flight
            if (has_head) head_v = load_scalar<T, W, FUSED>(xr, rr, ror, tid);
            if (has_tail) tail_v = load_scalar<T, W, FUSED>(xr, rr, ror, tail_start + tid);
#pragma unroll
            for (int i = 0; i < THREAD_VECS; ++i) {
                const int v = first + i * STEP;
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
            for (int v = first; v < n_body; v += STEP) {
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
        if (EDGES) {
            ss += head_v * head_v + tail_v * tail_v;
            if (has_head) head_w = weight_at(w, tid, w_offset, flags);
            if (has_tail) tail_w = weight_at(w, tail_start + tid, w_offset, flags);
        }
    }

    ss = group_sum<ROW_THREADS>(ss);
    if (ROW_THREADS > 32) {                      // one row per block: add up the warps
        const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
        if (lane == 0) warp_sums[warp] = ss;
        __syncthreads();
        ss = lane < WARPS ? warp_sums[lane] : 0.f;
        ss = group_sum<32>(ss);
    }
    if (CLUSTER > 1) ss = cluster_sum<CLUSTER>(ss);   // and the blocks of the cluster
    if (!active) return;                         // (never with a cluster: it shares one row)
    const float inv_rms = rsqrtf(ss / (float)hidden + p.eps);
    if (FORM != kPlain) {
        const RowState<T, W, VEC, THREAD_VECS, PREFETCH_W> row{
            keep, wk, FUSED ? ror : xr, w, head, n_body, first, STEP, tail_start, tid, has_head, has_tail, w_vec,
            prefetch_w, head_v, tail_v, head_w, tail_w, w_offset, flags, inv_rms};
        store_quantized<VEC, ROW_THREADS, THREAD_VECS, CLUSTER, FORM, QTYPE>(
            row, quant.q + outer * p.out.outer + inner * p.out.inner, static_scale, quant, r, rank);
        return;
    }

    if (has_head) yr[tid] = normalize<T, W>(head_v, inv_rms, head_w, flags);
    if (has_tail) yr[tail_start + tid] = normalize<T, W>(tail_v, inv_rms, tail_w, flags);
    // The body comes from registers, or (streaming) is re-read: from residual_out when
    // FUSED, where this same thread wrote the rounded sum.
    const T* src = FUSED ? ror : xr;
    VecT* yv = reinterpret_cast<VecT*>(yr + head);
    const VecT* sv = reinterpret_cast<const VecT*>(src + head);
    const W* wb = w + head;
    if (THREAD_VECS > 0) {
#pragma unroll
        for (int i = 0; i < THREAD_VECS; ++i) {
            const int v = first + i * STEP;
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
        for (int v = first; v < n_body; v += STEP) {
            const VecT a = sv[v];                // one 16-byte load, not one per element
            yv[v] = finish_vec<T, W, VEC>(a, wb, v, w_vec, inv_rms, w_offset, flags);
        }
    }
}

// The grid has one block per group of rows_per_block rows (blockDim.x / ROW_THREADS), in x
// then y
// (the launcher splits counts past 2^31 - 1 blocks).
__device__ __forceinline__ long long linear_block() {
    return (long long)blockIdx.y * gridDim.x + blockIdx.x;
}

template <typename T, typename W, bool FUSED, int VEC, int ROW_THREADS, int THREAD_VECS, bool EDGES>
__global__ void __launch_bounds__(ROW_THREADS > 256 ? ROW_THREADS : 256,
                                  ROW_THREADS > 256 ? 1024 / ROW_THREADS : 3)
rms_norm_kernel(const T* x, const T* res, T* y, T* res_out, const W* w, const Params p) {
    norm_row<T, W, FUSED, VEC, ROW_THREADS, THREAD_VECS, EDGES, 1>(x, res, y, res_out, w, p, linear_block(), 0);
    if (!(p.flags & kEarlyTrigger)) allow_next_kernel();
}

// The quantized forms: q (QTYPE bytes) at out's row strides instead of y; kernels/rms_norm.cu's
// QuantForm says which scales. The launch geometry is the plain kernel's.
template <typename T, typename W, bool FUSED, int VEC, int ROW_THREADS, int THREAD_VECS, bool EDGES, int FORM, int QTYPE>
__global__ void __launch_bounds__(ROW_THREADS > 256 ? ROW_THREADS : 256,
                                  ROW_THREADS > 256 ? 1024 / ROW_THREADS : 3)
rms_norm_quant_kernel(const T* x, const T* res, unsigned char* q, T* res_out, const W* w, const float* scale,
                      float* scales, const Params p, const QuantParams qp) {
    static_assert(FORM != kPlain && (FORM != kPerGroup || !EDGES), "a quantized form; groups: whole vectors");
    norm_row<T, W, FUSED, VEC, ROW_THREADS, THREAD_VECS, EDGES, 1, FORM, QTYPE>(
        x, res, nullptr, res_out, w, p, linear_block(), 0, QuantArgs{q, scale, scales, qp});
    if (!(p.flags & kEarlyTrigger)) allow_next_kernel();
}

// A row split over a cluster of CLUSTER blocks (few long rows: more SMs per row). The grid's
// x extent is a multiple of CLUSTER, so a cluster's blocks are CLUSTER consecutive linear blocks.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define RMSNORM_CLUSTER_DIMS(c)
#else
#define RMSNORM_CLUSTER_DIMS(c) __cluster_dims__(c, 1, 1)
#endif

template <typename T, typename W, bool FUSED, int VEC, int ROW_THREADS, int THREAD_VECS, bool EDGES, int CLUSTER>
__global__ void RMSNORM_CLUSTER_DIMS(CLUSTER) __launch_bounds__(ROW_THREADS, 1)
rms_norm_cluster_kernel(const T* x, const T* res, T* y, T* res_out, const W* w, const Params p) {
    const long long b = linear_block();
    norm_row<T, W, FUSED, VEC, ROW_THREADS, THREAD_VECS, EDGES, CLUSTER>(x, res, y, res_out, w, p, b / CLUSTER,
                                                                         (int)(b % CLUSTER));
    if (!(p.flags & kEarlyTrigger)) allow_next_kernel();
    cluster_done();
}

template <typename T, typename W, bool FUSED, int VEC, int ROW_THREADS, int THREAD_VECS, bool EDGES, int CLUSTER,
          int FORM, int QTYPE>
__global__ void RMSNORM_CLUSTER_DIMS(CLUSTER) __launch_bounds__(ROW_THREADS, 1)
rms_norm_quant_cluster_kernel(const T* x, const T* res, unsigned char* q, T* res_out, const W* w,
                              const float* scale, float* scales, const Params p, const QuantParams qp) {
    static_assert(FORM != kPlain && (FORM != kPerGroup || !EDGES), "a quantized form; groups: whole vectors");
    const long long b = linear_block();
    norm_row<T, W, FUSED, VEC, ROW_THREADS, THREAD_VECS, EDGES, CLUSTER, FORM, QTYPE>(
        x, res, nullptr, res_out, w, p, b / CLUSTER, (int)(b % CLUSTER), QuantArgs{q, scale, scales, qp});
    if (!(p.flags & kEarlyTrigger)) allow_next_kernel();
    cluster_done();
}

}  // namespace rmsnorm

