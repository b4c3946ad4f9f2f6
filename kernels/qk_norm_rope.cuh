// QK norm + RoPE (Qwen3, Gemma 3, OLMo 2): what the forward (qk_norm_rope.cu) and the backward
// (qk_norm_rope_backward.cu) share. Per head of q and of k, RMSNorm over head_dim, then the
// rotary embedding of its first rotary_dim channels:
//
//   y   = x * inv_rms(x) * w'        w' = w + weight_offset; kLlama rounds x * inv_rms to T first
//   o   = y rotated                  channel j < rotary_dim with its partner (rope.cuh)
//   out = o rounded to T             once, after the rotation
//
// Numerics (the contract in cupy_rmsnorm/_reference.py): float32 throughout; a head's sum of
// squares in the canonical tree (reduce.cuh), so a head's bits depend on the head and its
// token's angles alone, whatever else the call holds.
//
// Work split (cupy_rmsnorm/_plan.py: qk_rope_plan, qk_rope_backward_plan): a group of LANES
// threads (a power of two up to 32) holds one head, VECS vectors of VEC elements a thread,
// element j = e + VEC * (lane + LANES * i) (the canonical tree's order). The head stays in
// registers from its load to its store: a channel's partner is in the same vector
// (PAIRS < VEC), in another lane (a shuffle) or in another of this thread's vectors; only
// PAIRS = 0 (NeoX halves that are not a power of two) exchanges the head through shared
// memory. Heads are rows of whole vectors on the vector grid (the launcher lowers VEC until
// every head of q, k and the outputs starts on it).
#pragma once

#include "common.cuh"
#include "rope.cuh"

namespace rmsnorm {

// QkRopeParams.flags: Flags' kLlama, kHasWeight (q_weight and k_weight), kEarlyTrigger and this
// (positions are int64, else int32); the backward's also BackwardFlags' kWeightGrad and
// kDirectWeight (backward.cuh).
enum QkRopeFlags { kInt64Positions = 512 };

// Of a thread's VECS vectors, the first ROTATING may hold rotated channels: all for
// interleaved pairs (rotary_dim known at run time), those below 2 * PAIRS for NeoX halves.
template <int VEC, int LANES, int VECS, int PAIRS>
struct Rotating {
    static constexpr int below = (2 * PAIRS + VEC * LANES - 1) / (VEC * LANES);
    static constexpr int value = PAIRS <= 1 ? VECS : (below < VECS ? below : VECS);
};

// The partners' values of a thread's rotating vectors (PAIRS > 0): from this vector, from lane
// lane ^ (PAIRS / VEC) of the group (every lane of the warp takes part), or from this thread's
// vector i ^ (PAIRS / (VEC * LANES)).
template <int VEC, int LANES, int VECS, int PAIRS>
__device__ __forceinline__ void partner_values(const float (&y)[VECS][VEC],
                                               float (&yp)[Rotating<VEC, LANES, VECS, PAIRS>::value][VEC]) {
    constexpr int ROTATING = Rotating<VEC, LANES, VECS, PAIRS>::value;
#pragma unroll
    for (int i = 0; i < ROTATING; ++i)
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            if constexpr (PAIRS < VEC) yp[i][e] = y[i][e ^ PAIRS];
            else if constexpr (PAIRS < VEC * LANES) yp[i][e] = __shfl_xor_sync(0xffffffffu, y[i][e], PAIRS / VEC);
            else yp[i][e] = y[i ^ (PAIRS / (VEC * LANES))][e];
        }
}

}  // namespace rmsnorm
