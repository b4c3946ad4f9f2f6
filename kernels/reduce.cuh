// A row's total from its threads' partial sums (the row-total ladder, at the end): the
// forward's sum of squares in one canonical tree per hidden size, and the backward's sums.
//
// A row's sum of squares is a complete binary tree over the element index j, padded with
// zeros to a power of two, adding low index bits first. Threads hold the row in the strided
// order j = e + VEC * (lane + 32 * (warp + WARPS * (rank + CLUSTER * i))) (e: element of a
// vector; i: the thread's i-th vector, or the streamed loop's i-th step), so the tree is, in
// this order: each vector's elements, the lanes (xor butterflies 1, 2, 4, ...), the warps,
// the cluster's blocks, and only then the steps i, each kept apart until then (in "slots").
// Every plan computes that same tree: a power-of-two split only moves the line between the
// levels, and a zero (a slot or lane past the row's end) adds nothing, squares being >= 0.
// cupy_rmsnorm/_reference.py (canonical_sum_of_squares) is the same tree in NumPy.
#pragma once

#include "common.cuh"

namespace rmsnorm {

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
__device__ __forceinline__ float block_total(const float (*warp_sums)[WARPS], int count, bool first_round) {
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

// ---- The row-total ladder ------------------------------------------------------------------
// Every kernel turns its threads' partial sums into a row's total through these: the lanes
// (xor butterflies), the block's warps through shared memory (THREADS_PER_ROW > 32), the
// cluster's blocks through distributed shared memory (CLUSTER > 1). Two orders, each fixed:
// the forward's canonical tree (row_total) and the backward's sums (row_sums, below).

// The canonical total of a row held in registers: part[i] is the squares of this thread's
// vector i. warp_sums (the caller's shared memory, SLOTS x WARPS) is needed past 32 threads a
// row. Every thread of the group gets the total. Clusters: first_round as for cluster_total.
template <int SLOTS, int THREADS_PER_ROW, int CLUSTER = 1, int WARPS = 1>
__device__ __forceinline__ float row_total(float (&part)[SLOTS], float (*warp_sums)[WARPS] = nullptr) {
    using Lanes = SlotSums<SLOTS, (THREADS_PER_ROW < 32 ? THREADS_PER_ROW : 32)>;
    Lanes::over_lanes(part);
    if constexpr (THREADS_PER_ROW <= 32) {
        return Lanes::slot_tree(part);
    } else {                                     // one row per block: on to the warps
        static_assert(WARPS == THREADS_PER_ROW / 32, "warp_sums: a column per warp");
        const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
        for (int r = 0; r < Lanes::KEPT; ++r)
            if (lane < Lanes::HOLDERS) warp_sums[Lanes::held(lane, r)][warp] = part[r];
        __syncthreads();
        return block_total<SLOTS, WARPS, CLUSTER>(warp_sums, SLOTS, true);
    }
}

// The canonical total of a streamed row (a block or a cluster a row), BATCH steps at a time:
// batch(step, part) sets part[k] to this thread's squares of step `step + k`. Every thread of
// the block calls it and gets the total.
template <int BATCH, int WARPS, int CLUSTER, typename Batch>
__device__ __forceinline__ float row_total(int steps, float (&warp_sums)[kEpoch][WARPS], const Batch& batch) {
    static_assert(kEpoch % BATCH == 0, "epochs of whole batches");
    using Lanes = SlotSums<BATCH, 32>;
    __shared__ float epoch_levels[kEpochLevels], folded;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float total = 0.f;
#pragma unroll 1
    for (int e0 = 0; e0 < steps; e0 += kEpoch) {
        const int count = min(kEpoch, steps - e0);
#pragma unroll 1
        for (int b0 = 0; b0 < count; b0 += BATCH) {
            float part[BATCH];
            batch(e0 + b0, part);
            Lanes::over_lanes(part);
            if (lane < BATCH) warp_sums[b0 + Lanes::held(lane, 0)][warp] = part[0];
        }
        __syncthreads();
        const float t = epoch_total<WARPS, CLUSTER>(warp_sums, count, e0 == 0);
        if (steps <= kEpoch) total = t;          // one epoch: the usual case
        else if (threadIdx.x == 0) push_epoch(epoch_levels, e0 / kEpoch, t);
    }
    if (steps > kEpoch) {
        if (threadIdx.x == 0) folded = fold_epochs(epoch_levels, steps / kEpoch + (steps % kEpoch != 0));
        __syncthreads();
        total = folded;
    }
    return total;
}

// Sum over the LANES lanes of a group (a power of two; at most a warp's 32 take part), high
// bits first: the backward's order.
template <int LANES>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
    for (int o = (LANES < 32 ? LANES : 32) / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The backward's sums of (a[j], b[j]) over a row group, for ROWS rows at once: each over the
// lanes, then (THREADS_PER_ROW > 32, one group per block) the block's warps through
// warp_sums, each warp's sum read by lanes warp, warp + WARPS, ... so that log2(WARPS)
// butterflies give every lane the total (the tree of 32 lanes with zeros past WARPS, less its
// additions of zero, which are a row's chain of latency with one row a block). Not the
// canonical tree: the backward recomputes inv_rms in this order of its own. `reads` false:
// this thread skips the warps' level (its a, b keep their warp's sums). Each row's sums take
// the same operations in the same order whatever ROWS is.
template <int THREADS_PER_ROW, int ROWS, int WARPS>
__device__ __forceinline__ void row_sums(float (&a)[ROWS], float (&b)[ROWS], float2 (&warp_sums)[ROWS][WARPS],
                                         bool reads) {
#pragma unroll
    for (int j = 0; j < ROWS; ++j) {
        a[j] = group_sum<THREADS_PER_ROW>(a[j]);
        b[j] = group_sum<THREADS_PER_ROW>(b[j]);
    }
    if (THREADS_PER_ROW > 32) {
        const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
        for (int j = 0; j < ROWS; ++j)
            if (lane == 0) warp_sums[j][warp] = make_float2(a[j], b[j]);
        __syncthreads();
        if (reads) {
#pragma unroll
            for (int j = 0; j < ROWS; ++j) {
                const float2 s = warp_sums[j][lane % WARPS];
                a[j] = group_sum<WARPS>(s.x);
                b[j] = group_sum<WARPS>(s.y);
            }
        }
    }
}

// The same with a buffer of its own: `parity` alternates step by step, so one __syncthreads
// per step suffices (a buffer is written again only two steps later, after every thread has
// passed the next step's barrier, hence read this one).
template <int THREADS_PER_ROW, int ROWS>
__device__ __forceinline__ void row_sums(float (&a)[ROWS], float (&b)[ROWS], int parity) {
    constexpr int WARPS = THREADS_PER_ROW > 32 ? THREADS_PER_ROW / 32 : 1;
    __shared__ float2 warp_sums[2][ROWS][WARPS];
    row_sums<THREADS_PER_ROW, ROWS, WARPS>(a, b, warp_sums[parity], true);
}

template <int THREADS_PER_ROW>
__device__ __forceinline__ void row_sums(float& a, float& b, int parity) {
    float as[1] = {a}, bs[1] = {b};
    row_sums<THREADS_PER_ROW, 1>(as, bs, parity);
    a = as[0];
    b = bs[0];
}

}  // namespace rmsnorm
