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

template <typename T, int VEC>
__device__ __forceinline__ float vector_squares(const Pack<T, VEC>& a) {
    float q[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) q[e] = square(to_float(a.v[e]));
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

// One row (or, with CLUSTER > 1, the share of one row of block `rank` of its cluster).
// EDGES: a row may start off x's 16-byte grid or end in a partial vector (head and tail);
// without it every row is whole vectors, a compile-time fact that saves registers.
template <typename T, typename W, bool FUSED, int VEC, int ROW_THREADS, int THREAD_VECS, bool EDGES, int CLUSTER>
__device__ __forceinline__ void norm_row(const T* x, const T* res, T* y, T* res_out, const W* w,
                                         const Params& p, long long block_id, int rank) {
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

    wait_for_previous_kernel();                  // no global memory access before this
    if (flags & kEarlyTrigger) allow_next_kernel();
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
#pragma unroll
                        for (int e = 0; e < VEC; ++e)
                            keep[i].v[e] = from_float<T>(to_float(keep[i].v[e]) + to_float(other[FUSED ? i : 0].v[e]));
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
#pragma unroll
                            for (int e = 0; e < VEC; ++e)
                                a[k].v[e] = from_float<T>(to_float(a[k].v[e]) + to_float(b[FUSED ? k : 0].v[e]));
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

