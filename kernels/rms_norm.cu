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

template <typename T, typename W>
__device__ __forceinline__ T normalize(float v, float inv_rms, float wv, int flags) {
    float n = v * inv_rms;
    if (flags & kLlama) n = to_float(from_float<T>(n));
    return from_float<T>(n * wv);
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

// One row (or, with CLUSTER > 1, the share of one row of block `rank` of its cluster).
// EDGES: a row may start off x's 16-byte grid or end in a partial vector (head and tail);
// without it every row is whole vectors, a compile-time fact that saves registers.
template <typename T, typename W, bool FUSED, int VEC, int ROW_THREADS, int THREAD_VECS, bool EDGES, int CLUSTER>
__device__ __forceinline__ void norm_row(const T* x, const T* res, T* y, T* res_out, const W* w,
                                         const Params& p, long long block_id, int rank) {
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

}  // namespace rmsnorm

