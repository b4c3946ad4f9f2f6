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
// Batch invariance: the sum of squares is one canonical tree per hidden size, whatever the
// plan (see "The sum of squares" below), so a row's bits depend on the row alone, not on
// the rows beside it or the plan they chose (rows that start off the vector grid aside).
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

// A row's first element: (outer, inner) in 64-bit arithmetic, or with FLAT (the launcher's
// promise: n_inner == 1 and every offset of the call's arrays under 2^31) one 32-bit multiply.
template <bool FLAT>
__device__ __forceinline__ long long row_offset(long long outer, long long inner, const RowStrides& s) {
    if (FLAT) return (int)outer * (int)s.outer;
    return outer * s.outer + inner * s.inner;
}

// Sum over the LANES lanes of a group (a power of two; at most a warp's 32 take part).
template <int LANES>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
    for (int o = (LANES < 32 ? LANES : 32) / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// ---- The sum of squares: one canonical tree per hidden size ---------------------------------
// A row's sum of squares is a complete binary tree over the element index j, padded with
// zeros to a power of two, adding low index bits first. Threads hold the row in the strided
// order j = e + VEC * (lane + 32 * (warp + WARPS * (rank + CLUSTER * i))) (e: element of a
// vector; i: the thread's i-th vector, or the streamed loop's i-th step), so the tree is, in
// this order: each vector's elements, the lanes (xor butterflies 1, 2, 4, ...), the warps,
// the cluster's blocks, and only then the steps i, each kept apart until then (in "slots").
// Every plan computes that same tree: a power-of-two split only moves the line between the
// levels, and a zero (a slot or lane past the row's end) adds nothing, squares being >= 0.
// cupy_rmsnorm/_reference.py (canonical_sum_of_squares) is the same tree in NumPy.

__host__ __device__ constexpr int log2_of(int n) { return n > 1 ? 1 + log2_of(n / 2) : 0; }

// q[0] + ... + q[N - 1] as a binary tree over the index, low bits first (N a power of two).
template <int N>
__device__ __forceinline__ float pairwise_sum(float (&q)[N]) {
#pragma unroll
    for (int w = 1; w < N; w *= 2)
#pragma unroll
        for (int k = 0; k < N; k += 2 * w) q[k] += q[k + w];
    return q[0];
}

// __fmul_rn: the square is rounded on its own, never fused into the add that follows (an FMA
// would round differently from a plan that adds this square in another thread).
__device__ __forceinline__ float square(float f) { return __fmul_rn(f, f); }

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

template <typename T, int VEC>
__device__ __forceinline__ float vector_squares(const Pack<T, VEC>& a) {
    float q[VEC];
    unpack(a, q);
#pragma unroll
    for (int e = 0; e < VEC; ++e) q[e] = square(q[e]);
    return pairwise_sum(q);
}

// c ? a : b, as a select of the values: the compiler may otherwise select the address of
// one of two array elements, and a computed address puts the array in local memory.
__device__ __forceinline__ float pick(bool c, float a, float b) {
    float r;
    asm("{ .reg .pred c; setp.ne.b32 c, %3, 0; selp.f32 %0, %1, %2, c; }" : "=f"(r) : "f"(a), "f"(b), "r"((int)c));
    return r;
}

// SLOTS partial sums per thread (a power of two), each summed over the LANES lanes of a group
// (a power of two up to 32; xor butterflies, lane bits low to high). Each exchange also halves
// the slots a lane goes on with (a reduce-scatter: the lane whose bit is 0 keeps the lower
// half), so SLOTS slots cost SLOTS - 1 + log2(LANES / SLOTS) shuffles, not SLOTS x log2(LANES).
// Afterwards lane l keeps KEPT slots, p[r] being slot held(l, r); lanes alike in their low H
// bits hold the same values (float addition is commutative).
template <int SLOTS, int LANES>
struct SlotSums {
    static constexpr int H = log2_of(SLOTS < LANES ? SLOTS : LANES);   // halving exchanges
    static constexpr int KEPT = SLOTS >> H;
    static constexpr int HOLDERS = 1 << H;    // lanes 0 .. HOLDERS - 1 hold every slot once

    __device__ static int held(int lane, int r) {   // lane bit k carries slot bit log2(SLOTS) - 1 - k
        int s = r;
#pragma unroll
        for (int k = 0; k < H; ++k) s += ((lane >> k) & 1) * (SLOTS >> (k + 1));
        return s;
    }

    __device__ static void over_lanes(float (&p)[SLOTS]) {
        const int lane = threadIdx.x % 32;
#pragma unroll
        for (int k = 0; k < H; ++k) {
            const int half = SLOTS >> (k + 1);
            const bool upper = (lane >> k) & 1;
#pragma unroll
            for (int r = 0; r < SLOTS / 2; ++r) {   // (a constant trip count: unrolled in full)
                if (r >= half) break;
                const float give = pick(upper, p[r], p[r + half]);
                const float keep = pick(upper, p[r + half], p[r]);
                p[r] = keep + __shfl_xor_sync(0xffffffffu, give, 1 << k);
            }
        }
#pragma unroll
        for (int o = HOLDERS; o < LANES; o *= 2)
#pragma unroll
            for (int r = 0; r < KEPT; ++r) p[r] += __shfl_xor_sync(0xffffffffu, p[r], o);
    }

    // After over_lanes (and any levels above it): the slots' binary tree, slot bits low to
    // high (a lane's own KEPT slots, then across the holders); every lane gets the total.
    __device__ static float slot_tree(float (&p)[SLOTS]) {
#pragma unroll
        for (int w = 1; w < KEPT; w *= 2)
#pragma unroll
            for (int r = 0; r < KEPT; r += 2 * w) p[r] += p[r + w];
        float t = p[0];
#pragma unroll
        for (int k = H - 1; k >= 0; --k) t += __shfl_xor_sync(0xffffffffu, t, 1 << k);
        return t;
    }
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void cluster_arrive() {
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
#endif

// The last levels of a cluster's tree: p (SlotSums<SLOTS, WARPS>::over_lanes done) holds this
// block's slots; sum each slot over the CLUSTER blocks through distributed shared memory, as
// a binary tree over the rank, then the slots' tree. Every thread of the cluster calls it, in
// every round (first_round: no call before it in this kernel); the caller then calls
// cluster_done() before exiting, so no block leaves while another may still read it.
template <int SLOTS, int WARPS, int CLUSTER>
__device__ __forceinline__ float cluster_total(float (&p)[SLOTS], bool first_round) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    using Warps = SlotSums<SLOTS, WARPS>;
    __shared__ float block_sums[SLOTS];
    if (!first_round) cluster_wait();          // every block has read the last round's sums
    if (threadIdx.x < Warps::HOLDERS) {
#pragma unroll
        for (int r = 0; r < Warps::KEPT; ++r) block_sums[Warps::held(threadIdx.x, r)] = p[r];
    }
    cluster_arrive();
    cluster_wait();
    // lane l reads block l % CLUSTER: each group of CLUSTER lanes reduces the whole cluster
    const unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(block_sums));
    const unsigned rank = threadIdx.x % CLUSTER;
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    float q[SLOTS];
#pragma unroll
    for (int s = 0; s < SLOTS; ++s)
        asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(q[s]) : "r"(remote + 4u * s) : "memory");
    cluster_arrive();                          // done reading the other blocks
    using Ranks = SlotSums<SLOTS, CLUSTER>;
    Ranks::over_lanes(q);
    return Ranks::slot_tree(q);
#else
    __trap();   // clusters need sm_90; the launcher never plans them below
    return p[0];
#endif
}

// The levels above the warps: warp_sums[s][w] is slot s of warp w (slots past `count` count
// as zeros); the sum per slot over the warps, then over the cluster's blocks, then the slots'
// tree. Every warp computes it, lane l reading warp l % WARPS (the same total in every thread).
template <int SLOTS, int WARPS, int CLUSTER>
__device__ __forceinline__ float block_total(const float (&warp_sums)[SLOTS][WARPS], int count, bool first_round) {
    const int w = threadIdx.x % WARPS;
    float p[SLOTS];
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) p[s] = s < count ? warp_sums[s][w] : 0.f;
    using Warps = SlotSums<SLOTS, WARPS>;
    Warps::over_lanes(p);
    if (CLUSTER == 1) return Warps::slot_tree(p);
    return cluster_total<SLOTS, WARPS, CLUSTER>(p, first_round);
}

// A row too long for registers is summed an epoch of kEpoch steps at a time: warp_sums[s][w]
// is step s's sum over warp w's lanes (steps past `count` count as zeros); each step's sum
// over the warps (by warp s % WARPS), over the cluster's blocks, then the steps' tree. One
// value per lane at a time: the streamed kernel is short of registers. Every thread calls
// it, after a __syncthreads (first_round: the row's first epoch). A long row's epochs are
// then added as a binary counter (push_epoch: level k holds the tree of 2^k epochs), which
// one thread keeps, and folded at the end with zeros for padding (fold_epochs).
constexpr int kEpoch = 32;                   // steps per epoch: a warp's lanes hold them all
constexpr int kEpochLevels = 32;

template <int WARPS, int CLUSTER>
__device__ __forceinline__ float epoch_total(const float (&warp_sums)[kEpoch][WARPS], int count, bool first_round) {
    __shared__ float step_sums[kEpoch];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (CLUSTER > 1 && !first_round) cluster_wait();   // every block has read the last epoch's
#endif
    for (int s = warp; s < kEpoch; s += WARPS) {
        float t = s < count ? warp_sums[s][lane % WARPS] : 0.f;
#pragma unroll
        for (int o = 1; o < WARPS; o *= 2) t += __shfl_xor_sync(0xffffffffu, t, o);
        if (lane == 0) step_sums[s] = t;
    }
    const float* sums = step_sums;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (CLUSTER > 1) {
        __shared__ float cluster_sums[kEpoch];
        cluster_arrive();
        cluster_wait();
        const unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(step_sums));
        unsigned remote;
        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(lane % CLUSTER));
        for (int s = warp; s < kEpoch; s += WARPS) {
            float t;
            asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(t) : "r"(remote + 4u * s) : "memory");
#pragma unroll
            for (int o = 1; o < CLUSTER; o *= 2) t += __shfl_xor_sync(0xffffffffu, t, o);
            if (lane == 0) cluster_sums[s] = t;
        }
        cluster_arrive();                        // done reading the other blocks
        sums = cluster_sums;
    }
#endif
    __syncthreads();
    float t = sums[lane];
#pragma unroll
    for (int o = 1; o < kEpoch; o *= 2) t += __shfl_xor_sync(0xffffffffu, t, o);
    return t;
}

__device__ __forceinline__ void push_epoch(float* levels, int index, float t) {
    int k = 0;
    for (; (index >> k) & 1; ++k) t = levels[k] + t;
    levels[k] = t;
}

__device__ __forceinline__ float fold_epochs(const float* levels, int count) {
    float t = 0.f;
    for (int k = 0; (count >> k) != 0; ++k)
        if ((count >> k) & 1) t = levels[k] + t;
    return t;
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

// A plain load, not __ldg: __ldg is an asm statement the compiler may treat as free of side
// effects and hoist out of the bounds check that guards it (it did, in the backward kernel:
// w[tid] read for tid == hidden).
// w' = w + weight_offset. An offset of 0 comes as -0 (cupy_rmsnorm/_launcher.py), and
// w + -0 is w for every w, -0 included: the weight as it is (_reference.offset_weight).
template <typename W>
__device__ __forceinline__ float weight_at(const W* w, int j, float w_offset, int flags) {
    return (flags & kHasWeight) ? to_float(w[j]) + w_offset : 1.0f;
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
constexpr float kFloatMax = 3.40282347e+38f;    // the largest finite float (NVRTC has no FLT_MAX)

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
        m = warp_max[lane % WARPS];              // each run of WARPS lanes holds them all (max is
        m = lanes_max<WARPS, 32>(m);             // exact in any order): log2(WARPS) steps, not 5
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
    int head, n_body, first, step, tail_at, tail, tid;   // tail_at: the tail's start from the body's
    bool has_head, has_tail, w_vec, prefetch_w;          // has_tail: this thread owns the tail's vector
    float head_v, head_w, w_offset;
    int flags;
    float inv_rms;

    // y (before its final rounding) of body vector v, this thread's k-th (0 when streamed)
    __device__ __forceinline__ void body_y(int k, int v, float (&y)[VEC]) const {
        const Pack<T, VEC> a = THREAD_VECS > 0 ? keep[THREAD_VECS > 0 ? k : 0]
                                               : reinterpret_cast<const Pack<T, VEC>*>(src + head)[v];
        float wv[VEC];
        if (prefetch_w) weights_of<W, VEC>(wk[PREFETCH_W ? k : 0], w_offset, wv);
        else load_weights<W, VEC>(w + head, v, w_vec, w_offset, flags, wv);
        unpack(a, y);
#pragma unroll
        for (int e = 0; e < VEC; ++e) y[e] = normalized<T>(y[e], inv_rms, wv[e], flags);
    }
    // y of the tail's partial vector (this thread's k-th; elements past the row: 0)
    __device__ __forceinline__ void tail_y(int k, float (&y)[VEC]) const {
        const Pack<T, VEC> a = THREAD_VECS > 0 ? keep[THREAD_VECS > 0 ? k : 0]
                                               : load_partial<T, VEC>(src + head + tail_at, tail);
#pragma unroll
        for (int e = 0; e < VEC; ++e)
            y[e] = e < tail ? normalized<T>(to_float(a.v[e]), inv_rms, weight_at(w + head, tail_at + e, w_offset, flags),
                                            flags)
                            : 0.f;
    }
    __device__ __forceinline__ float head_y() const { return normalized<T>(head_v, inv_rms, head_w, flags); }
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

// f(k) for the thread owning the tail's partial vector (its k-th; 0 when streamed).
template <int THREAD_VECS, class Row, class F>
__device__ __forceinline__ void with_tail(const Row& row, F&& f) {
    if (!row.has_tail) return;
    if (THREAD_VECS > 0) {
#pragma unroll
        for (int k = 0; k < (THREAD_VECS > 0 ? THREAD_VECS : 1); ++k)
            if (row.first + k * row.step == row.n_body) f(k);
    } else {
        f(0);
    }
}

// The quantized output stage of one row (or a cluster block's share of it): scales, then q.
// qr, row_scales: the row's q and its scales (dynamic forms); rank: the block's in its cluster.
template <int VEC, int ROW_THREADS, int THREAD_VECS, int CLUSTER, bool EDGES, int FORM, int QTYPE, bool FLAT, class Row>
__device__ __forceinline__ void store_quantized(const Row& row, unsigned char* qr, float* row_scales,
                                                float static_scale, const QuantArgs& quant, int rank) {
    using QVec = Pack<unsigned char, VEC>;
    QVec* qv = reinterpret_cast<QVec*>(qr + row.head);
    if constexpr (FORM == kPerGroup) {
        // Rows start on the vector grid (the launcher makes sure: no head, no tail) and a group
        // is GROUP consecutive vectors: LANES consecutive threads of one block at one k, over
        // SPAN consecutive k (a group longer than the row group's share of a step).
        constexpr int GROUP = kGroupSize / VEC;
        constexpr int LANES = GROUP < ROW_THREADS ? GROUP : ROW_THREADS;
        constexpr int SPAN = GROUP / LANES;
        static_assert(SPAN == 1 || (CLUSTER == 1 && THREAD_VECS % SPAN == 0), "a group: one block's k-runs");
        const float ub = quant.p.scale_ub;
        const long long group_stride = quant.p.scales_group;    // the scale of the group of vector v:
        const auto group_at = [&](int v) {
            return FLAT ? (int)(v / GROUP) * (int)group_stride : (v / GROUP) * group_stride;
        };
        // A thread's THREAD_VECS vectors of a step each lie in another group (SPAN 1) of LANES
        // lanes of one warp: their maxima are reduced and scattered together, after which lane
        // i of the LANES holds the max of its k = i / (LANES / THREAD_VECS), so each lane works
        // out one scale (not THREAD_VECS) and the others fetch the inverses they need.
        constexpr bool SCATTER = THREAD_VECS > 1 && SPAN == 1 && LANES <= 32 && THREAD_VECS <= LANES;
        if constexpr (SCATTER) {
            constexpr int K = SCATTER ? THREAD_VECS : 1, SHARE = LANES / K;   // lanes per k after
            const unsigned mask = row_group_mask<ROW_THREADS>();
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
        } else if constexpr (THREAD_VECS > 0) {
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
                    if (v0 % GROUP == 0) row_scales[group_at(v0)] = s;
                    const float inv = inverse_of_scale(s);
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
                    if (v % GROUP == 0) row_scales[group_at(v)] = s;
                    qv[v] = quantize_vec<QTYPE, VEC>(y, inverse_of_scale(s));
                }
            }
        }
    } else {
        // kPerToken, rows in registers on the vector grid: the body's y, kept from the first pass
        // for the second rather than computed again (rows with edges need those registers)
        constexpr bool KEEP_Y = FORM == kPerToken && THREAD_VECS > 0 && !EDGES;
        float kept_y[KEEP_Y ? THREAD_VECS : 1][VEC];
        float inv_scale;
        if (FORM == kStatic) {
            inv_scale = 1.0f / static_scale;
        } else {                        // kPerToken: a first pass for the row's max |y|
            float m = 0.f;
            if (row.has_head) m = fabsf(row.head_y());
            with_tail<THREAD_VECS>(row, [&](int k) {
                float y[VEC];
                row.tail_y(k, y);
#pragma unroll
                for (int e = 0; e < VEC; ++e) m = fmaxf(m, fabsf(y[e]));
            });
            each_body_vector<VEC, ROW_THREADS, THREAD_VECS>(row, [&](int k, int v) {
                float (&y)[VEC] = kept_y[KEEP_Y ? k : 0];
                row.body_y(k, v, y);
#pragma unroll
                for (int e = 0; e < VEC; ++e) m = fmaxf(m, fabsf(y[e]));
            });
            const float s = dynamic_scale<QTYPE>(row_max<ROW_THREADS, CLUSTER>(m), quant.p.scale_ub);
            if (row.tid == 0 && rank == 0) row_scales[0] = s;
            inv_scale = 1.0f / s;   // once a row (inverse_of_scale spilled 4 bytes in a 1024-thread cluster kernel)
        }
        if (row.has_head) qr[row.tid] = quantize<QTYPE>(row.head_y() * inv_scale);
        with_tail<THREAD_VECS>(row, [&](int k) {
            float y[VEC];
            row.tail_y(k, y);
            unsigned char* qt = qr + row.head + row.tail_at;
#pragma unroll
            for (int e = 0; e < VEC - 1; ++e)
                if (e < row.tail) qt[e] = quantize<QTYPE>(y[e] * inv_scale);
        });
        each_body_vector<VEC, ROW_THREADS, THREAD_VECS>(row, [&](int k, int v) {
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

// One row (or, with CLUSTER > 1, the share of one row of block `rank` of its cluster).
// EDGES: a row may start off x's 16-byte grid or end in a partial vector (head and tail);
// without it every row is whole vectors, a compile-time fact that saves registers.
// FORM != kPlain: the output is quant.q (QTYPE bytes, at out's row strides), not y.
template <typename T, typename W, bool FUSED, int VEC, int ROW_THREADS, int THREAD_VECS, bool EDGES, int CLUSTER,
          int FORM = kPlain, int QTYPE = kE4M3, bool FLAT = false>
__device__ __forceinline__ void norm_row(const T* x, const T* res, T* y, T* res_out, const W* w,
                                         const Params& p, long long block_id, int rank,
                                         const QuantArgs& quant = QuantArgs()) {
    using VecT = Pack<T, VEC>;
    constexpr int WARPS = ROW_THREADS > 32 ? ROW_THREADS / 32 : 1;
    constexpr int SLOTS = THREAD_VECS > 0 ? THREAD_VECS : kEpoch;   // partial sums per thread
    static_assert(ROW_THREADS >= VEC, "a group must cover a head of up to VEC - 1 elements");
    static_assert(CLUSTER == 1 || ROW_THREADS > 32, "clusters split rows of a block each");
    static_assert(THREAD_VECS > 0 || ROW_THREADS > 32, "a streamed row has a block of its own");
    static_assert((ROW_THREADS & (ROW_THREADS - 1)) == 0 && (SLOTS & (SLOTS - 1)) == 0 && (CLUSTER & (CLUSTER - 1)) == 0,
                  "the canonical tree needs power-of-two splits");
    __shared__ float warp_sums[SLOTS][WARPS];   // slot s of warp w

    const int hidden = p.hidden, flags = p.flags;
    const float w_offset = p.weight_offset;
    // The block's rows as the plan launches them (rows_per_block): one a block past 32 threads,
    // else groups sharing blocks of 256 threads. Compile-time, so that with one row a block its
    // index and addresses are the block's (uniform registers), not each thread's.
    constexpr int ROWS_PER_BLOCK = ROW_THREADS > 32 ? 1 : 256 / ROW_THREADS;
    const int tid = threadIdx.x % ROW_THREADS;   // lane within the row group
    const long long row = block_id * ROWS_PER_BLOCK + (ROWS_PER_BLOCK > 1 ? threadIdx.x / ROW_THREADS : 0);
    const bool active = row < p.rows;            // false only in the last block of small groups
    const long long r = active ? row : 0;
    long long outer = r, inner = 0;
    if (!FLAT && p.n_inner != 1) { outer = r / p.n_inner; inner = r - outer * p.n_inner; }
    const T* xr = x + row_offset<FLAT>(outer, inner, p.x);
    const T* rr = FUSED ? res + row_offset<FLAT>(outer, inner, p.residual) : nullptr;
    T* yr = y + row_offset<FLAT>(outer, inner, p.out);
    T* ror = FUSED ? res_out + row_offset<FLAT>(outer, inner, p.residual_out) : nullptr;

    // Head: elements before x's row reaches a 16-byte boundary (all arrays share that
    // alignment pattern, the launcher made sure); tail: what is left after the last whole
    // vector. Both are shorter than VEC <= ROW_THREADS. The head's elements go one to a
    // thread, in a register (with a cluster, block 0 takes them); the tail is the partial
    // vector of index n_body, which the thread owning that index takes, as the canonical
    // tree has it. (A row with a head is summed in a tree of its own: its vectors do not
    // start on the canonical tree's.)
    int head = 0, n_body = hidden / VEC, tail_start = hidden;
    if (EDGES) {
        const int mis = (int)((reinterpret_cast<unsigned long long>(xr) / sizeof(T)) & (VEC - 1));
        head = min((VEC - mis) & (VEC - 1), hidden);
        n_body = (hidden - head) / VEC;
        tail_start = head + n_body * VEC;
    }
    const int tail = hidden - tail_start;
    const int first = rank * ROW_THREADS + tid;  // this thread's first body vector
    constexpr int STEP = ROW_THREADS * CLUSTER;  // and the stride between its vectors
    const bool has_head = EDGES && active && rank == 0 && tid < head;
    const bool has_tail = EDGES && active && tail > 0 && first <= n_body && (n_body - first) % STEP == 0;
    const bool w_vec = (flags & kHasWeight) &&
        ((reinterpret_cast<unsigned long long>(w + head) % sizeof(Pack<W, VEC>)) == 0);

    float total, head_v = 0.f;                   // the row's sum of squares; this thread's head element
    VecT keep[THREAD_VECS > 0 ? THREAD_VECS : 1];   // the row's body, kept for the second pass
    // Short rows: the weights are fetched with the row, not after the reduction, so their
    // latency is off the critical path (only where registers allow).
    constexpr bool PREFETCH_W = THREAD_VECS == 1;
    Pack<W, VEC> wk[PREFETCH_W ? THREAD_VECS : 1];
    const bool prefetch_w = PREFETCH_W && w_vec;
    // the body's start in each array; the head and tail are addressed from it (fewer live pointers)
    const T* xb = xr + head;
    const T* rb = FUSED ? rr + head : nullptr;
    T* rob = FUSED ? ror + head : nullptr;
    const VecT* xv = reinterpret_cast<const VecT*>(xb);
    const VecT* rv = reinterpret_cast<const VecT*>(rb);
    VecT* rov = reinterpret_cast<VecT*>(rob);
    const int tail_at = n_body * VEC;            // the tail's start, from the body's
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

    // q (out's row strides) and the row's scales: their addresses here, not at the end of the
    // row, where the compiler recomputed the row's index from the thread's for them (run AC)
    unsigned char* const qr = FORM != kPlain ? quant.q + row_offset<FLAT>(outer, inner, p.out) : nullptr;
    float* const row_scales = FORM == kPerToken || FORM == kPerGroup
        ? quant.scales + (FLAT ? (int)r * (int)quant.p.scales_row : r * quant.p.scales_row) : nullptr;
    wait_for_previous_kernel();                  // no global memory access before this
    if (flags & kEarlyTrigger) allow_next_kernel();
    const float static_scale = FORM == kStatic ? *quant.scale : 0.f;   // issued early, used at the end
    if constexpr (THREAD_VECS > 0) {
        float part[SLOTS];                       // slot i: the squares of this thread's vector i
#pragma unroll
        for (int i = 0; i < SLOTS; ++i) part[i] = 0.f;
        if (active) {
            VecT other[FUSED && THREAD_VECS > 0 ? THREAD_VECS : 1];
#pragma unroll
            for (int i = 0; i < THREAD_VECS; ++i) {   // issue every body load before the first use
                const int v = first + i * STEP;
                if (v < n_body) {
                    keep[i] = xv[v];
                    if (FUSED) other[i] = rv[v];
                } else if (EDGES && v == n_body) {       // the tail, in the same registers
                    keep[i] = load_partial<T, VEC>(xb + tail_at, tail);
                    if (FUSED) other[i] = load_partial<T, VEC>(rb + tail_at, tail);
                }
            }
            if (prefetch_w) {
#pragma unroll
                for (int i = 0; i < THREAD_VECS; ++i) {
                    const int v = first + i * STEP;
                    if (v < n_body) wk[i] = reinterpret_cast<const Pack<W, VEC>*>(w + head)[v];
                }
            }
            // the head's load goes out while the body loads are in flight
            if (has_head) head_v = load_scalar<T, W, FUSED>(xb, rb, rob, tid - head);
            const float head_ss = square(head_v);
#pragma unroll
            for (int i = 0; i < THREAD_VECS; ++i) {
                const int v = first + i * STEP;
                if (v < n_body || (EDGES && v == n_body)) {
                    if (FUSED) {
                        keep[i] = rounded_sum(keep[i], other[FUSED ? i : 0]);
                        if (v < n_body) rov[v] = keep[i];
                        else store_partial<T, VEC>(rob + tail_at, keep[i], tail);
                    }
                    part[i] = vector_squares<T, VEC>(keep[i]);
                }
            }
            if (has_head) part[0] += head_ss;
        }
        using Lanes = SlotSums<SLOTS, (ROW_THREADS < 32 ? ROW_THREADS : 32)>;
        Lanes::over_lanes(part);
        if (ROW_THREADS <= 32) {
            total = Lanes::slot_tree(part);
        } else {                                 // one row per block: on to the warps
#pragma unroll
            for (int r = 0; r < Lanes::KEPT; ++r)
                if (lane < Lanes::HOLDERS) warp_sums[Lanes::held(lane, r)][warp] = part[r];
            __syncthreads();
            total = block_total<SLOTS, WARPS, CLUSTER>(warp_sums, SLOTS, true);
        }
    } else {
        // Streamed: an unbounded number of steps i. BATCH steps at a time are summed over the
        // lanes; their warp sums wait in shared memory for the rest of an epoch of kEpoch steps.
        constexpr int BATCH = FUSED ? 2 : 4;   // (FUSED: two arrays' loads in flight)
        static_assert(kEpoch % BATCH == 0, "epochs of whole batches");
        using Lanes = SlotSums<BATCH, 32>;
        __shared__ float epoch_levels[kEpochLevels], row_total;
        const int n_vec = n_body + (tail > 0);   // vectors, the tail's included
        const int steps = n_vec / STEP + (n_vec % STEP != 0);
        const float head_ss = has_head ? square(load_scalar<T, W, FUSED>(xb, rb, rob, tid - head)) : 0.f;
#pragma unroll 1
        for (int e0 = 0; e0 < steps; e0 += kEpoch) {
            const int count = min(kEpoch, steps - e0);
#pragma unroll 1
            for (int b0 = 0; b0 < count; b0 += BATCH) {
                const unsigned v0 = first + unsigned(e0 + b0) * STEP;   // (unsigned: no overflow past the row)
                // Issue the batch's loads before the first use; unchecked where the whole batch
                // is in the row (all but the last), so that they can all go out at once.
                const bool whole = active && v0 + (BATCH - 1) * STEP < unsigned(n_body);
                VecT a[BATCH], b[FUSED ? BATCH : 1];
                if (whole) {
#pragma unroll
                    for (int k = 0; k < BATCH; ++k) { a[k] = xv[v0 + k * STEP]; if (FUSED) b[FUSED ? k : 0] = rv[v0 + k * STEP]; }
                } else {
#pragma unroll
                    for (int k = 0; k < BATCH; ++k) {
                        const unsigned v = v0 + k * STEP;
                        if (active && v < unsigned(n_body)) {
                            a[k] = xv[v];
                            if (FUSED) b[FUSED ? k : 0] = rv[v];
                        } else if (EDGES && has_tail && v == unsigned(n_body)) {
                            a[k] = load_partial<T, VEC>(xb + tail_at, tail);
                            if (FUSED) b[FUSED ? k : 0] = load_partial<T, VEC>(rb + tail_at, tail);
                        }
                    }
                }
                float part[BATCH];
#pragma unroll
                for (int k = 0; k < BATCH; ++k) {
                    const unsigned v = v0 + k * STEP;
                    const bool is_tail = EDGES && !whole && has_tail && v == unsigned(n_body);
                    part[k] = e0 + b0 + k == 0 ? head_ss : 0.f;
                    if (whole || (active && v < unsigned(n_body)) || is_tail) {
                        if (FUSED) {
                            a[k] = rounded_sum(a[k], b[FUSED ? k : 0]);
                            if (is_tail) store_partial<T, VEC>(rob + tail_at, a[k], tail);
                            else rov[v] = a[k];
                        }
                        part[k] += vector_squares<T, VEC>(a[k]);
                    }
                }
                Lanes::over_lanes(part);
                if (lane < BATCH) warp_sums[b0 + Lanes::held(lane, 0)][warp] = part[0];
            }
            __syncthreads();
            const float t = epoch_total<WARPS, CLUSTER>(warp_sums, count, e0 == 0);
            if (steps <= kEpoch) total = t;      // one epoch: the usual case
            else if (threadIdx.x == 0) push_epoch(epoch_levels, e0 / kEpoch, t);
        }
        if (steps > kEpoch) {
            if (threadIdx.x == 0) row_total = fold_epochs(epoch_levels, steps / kEpoch + (steps % kEpoch != 0));
            __syncthreads();
            total = row_total;
        }
    }
    if (!active) return;                         // (never with a cluster: it shares one row)
    const float inv_rms = rsqrtf(total / (float)hidden + p.eps);
    if constexpr (FORM != kPlain) {
        // the head element and its weight, as the plain output below takes them
        const float head_x = has_head ? (THREAD_VECS == 0 ? to_float((FUSED ? rob : xb)[tid - head]) : head_v) : 0.f;
        const float head_w = has_head ? weight_at(w + head, tid - head, w_offset, flags) : 1.f;
        const RowState<T, W, VEC, THREAD_VECS, PREFETCH_W> row{
            keep, wk, FUSED ? ror : xr, w, head, n_body, first, STEP, tail_at, tail, tid, has_head, has_tail, w_vec,
            prefetch_w, head_x, head_w, w_offset, flags, inv_rms};
        store_quantized<VEC, ROW_THREADS, THREAD_VECS, CLUSTER, EDGES, FORM, QTYPE, FLAT>(row, qr, row_scales,
                                                                                          static_scale, quant, rank);
        return;
    }

    // The body comes from registers, or (streaming) is re-read: from residual_out when
    // FUSED, where this same thread wrote the rounded sum.
    T* yb = yr + head;
    const T* sb = FUSED ? rob : xb;
    VecT* yv = reinterpret_cast<VecT*>(yb);
    const VecT* sv = reinterpret_cast<const VecT*>(sb);
    const W* wb = w + head;
    if (THREAD_VECS > 0) {
#pragma unroll
        for (int i = 0; i < THREAD_VECS; ++i) {
            const int v = first + i * STEP;
            if (EDGES && v == n_body) finish_tail<T, W, VEC>(keep[i], yb, wb, tail_at, tail, inv_rms, w_offset, flags);
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
    // The head comes last (a streamed row re-reads it, and its tail, as it does the body).
    if (has_head) {
        const int j = tid - head;                // (< 0: before the body)
        if (THREAD_VECS == 0) head_v = to_float(sb[j]);
        yb[j] = normalize<T, W>(head_v, inv_rms, weight_at(wb, j, w_offset, flags), flags);
    }
    if (THREAD_VECS == 0 && has_tail) finish_tail<T, W, VEC>(sb, yb, wb, tail_at, tail, inv_rms, w_offset, flags);
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
// QuantForm says which scales. The launch geometry is the plain kernel's; FLAT: rows at 32-bit
// offsets (row_offset; LaunchPlan.flat says where). The dynamic forms on the vector grid keep
// their row's y in registers (per token: KEEP_Y; per group: SCATTER): in a block of 64-256
// threads a row they are held to 48 registers (10 blocks of 128 an SM; at 55-63 registers, 8),
// which costs the per-token form a spill of up to 12 bytes and measured faster (benchmarks/
// NOTES.md 29, 30).
template <int FORM, bool EDGES, int ROW_THREADS>
constexpr int quant_min_blocks_of_256() {
    return (FORM == kPerToken || FORM == kPerGroup) && !EDGES && ROW_THREADS > 32 ? 5 : 3;
}

template <typename T, typename W, bool FUSED, int VEC, int ROW_THREADS, int THREAD_VECS, bool EDGES, int FORM,
          int QTYPE, bool FLAT>
__global__ void __launch_bounds__(ROW_THREADS > 256 ? ROW_THREADS : 256,
                                  ROW_THREADS > 256 ? 1024 / ROW_THREADS
                                                    : quant_min_blocks_of_256<FORM, EDGES, ROW_THREADS>())
rms_norm_quant_kernel(const T* x, const T* res, unsigned char* q, T* res_out, const W* w, const float* scale,
                      float* scales, const Params p, const QuantParams qp) {
    static_assert(FORM != kPlain && (FORM != kPerGroup || !EDGES), "a quantized form; groups: whole vectors");
    norm_row<T, W, FUSED, VEC, ROW_THREADS, THREAD_VECS, EDGES, 1, FORM, QTYPE, FLAT>(
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

