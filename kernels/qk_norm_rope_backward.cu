// QK norm + RoPE, backward (qk_norm_rope.cuh: the forward's formulas, numerics and work
// split), compiled at run time by NVRTC (one program; cupy_rmsnorm/_compile.py).
//
// Per head, in float32, with do the gradient of the output: dy = do rotated by -theta (the
// rotation's transpose, rope.cuh; channels past rotary_dim as they are), then the norm's
// backward: r = inv_rms, xhat = x * r, g = dy * w', dx = r * (g - xhat * mean(g * xhat)),
// dweight += dy * xhat (kLlama: xhat rounded to T, as the forward multiplied it), q's heads
// into dq_weight's sums and k's into dk_weight's. Each thread keeps its channels' sums in
// registers over its block's items, in order; the block's groups are added in group order into
// its partial row ([q's head_dim | k's]) or, one block, dweight itself; the reduction kernel
// (backward.cuh) adds the partial rows in a fixed order. No float atomics: the same bits every run.
// More than 8 elements a thread (heads past 256 channels) take more than 128 registers (dy, x,
// g and the two dweight sums of each): one block an SM, not two that spill (the launcher fits
// the grid to the occupancy).

#include "common.cuh"
#include "reduce.cuh"
#include "backward.cuh"
#include "rope.cuh"
#include "qk_norm_rope.cuh"

namespace rmsnorm {

// The backward's blocks hold at most this many threads (cupy_rmsnorm/_plan.py:
// QK_ROPE_BACKWARD_BLOCK): the size of their shared memory.
constexpr int kQkBackwardBlock = 256;

// The backward's (QK_ROPE_BACKWARD_PARAMS_DTYPE): a block takes items_per_block (token, head)
// items, numbered token by token, q's heads then k's; dq and dk are fresh.
struct QkRopeBackwardParams {
    long long tokens, n_inner, items_per_block;
    RowStrides dq_out, dk_out, q, k, dq, dk, cos, sin, positions;
    long long dq_out_head, dk_out_head, q_head, k_head, dq_head, dk_head;
    long long cache_row, max_position;
    int q_heads, k_heads, head_dim, rotary_dim;
    float eps, weight_offset;
    int flags, unused;
};
static_assert(sizeof(QkRopeBackwardParams) == 264, "QkRopeBackwardParams: 264 bytes, as cupy_rmsnorm/_abi.py packs it");

template <typename T, typename W, typename C, int VEC, int LANES, int VECS, int PAIRS, bool CACHE>
__global__ void __launch_bounds__(kQkBackwardBlock, VECS * VEC > 8 ? 1 : 2)
qk_norm_rope_backward_kernel(const T* dq_out, const T* dk_out, const T* q, const T* k, T* dq, T* dk,
                             const W* q_weight, const W* k_weight, const C* cos, const C* sin, const void* positions,
                             float* partials, W* dweight, const QkRopeBackwardParams p) {
    using VecT = Pack<T, VEC>;
    static_assert(LANES <= 32 && (LANES & (LANES - 1)) == 0 && VECS >= 1 && (VECS & (VECS - 1)) == 0,
                  "a head's group: a power of two of lanes up to a warp, a power of two of vectors each");
    static_assert(PAIRS >= 0 && (PAIRS & (PAIRS - 1)) == 0, "PAIRS: a power of two, or 0");
    constexpr int GROUPS = kQkBackwardBlock / LANES;          // heads in flight a block
    constexpr int SPAN = LANES * VECS * VEC;
    constexpr int ROTATING = Rotating<VEC, LANES, VECS, PAIRS>::value;
    __shared__ float shared[kQkBackwardBlock * VECS * VEC];  // the exchange (PAIRS = 0), then the groups' sums

    const int group = threadIdx.x / LANES, lane = threadIdx.x % LANES;
    const int heads = p.q_heads + p.k_heads, head_dim = p.head_dim, rd = p.rotary_dim, n = head_dim / VEC;
    const int flags = p.flags;
    const long long items = p.tokens * heads;
    const long long begin = blockIdx.x * p.items_per_block, end = min(begin + p.items_per_block, items);
    long long item = begin + group;              // this group's item, its token and head
    long long token = item / heads;
    int head = (int)(item - token * heads);
    float* head_values = shared + group * SPAN;
    const DweightRow<W> out_row{partials + blockIdx.x * 2LL * head_dim, dweight, (flags & kDirectWeight) != 0};
    wait_for_previous_kernel();

    float dwq[VECS][VEC], dwk[VECS][VEC];        // this thread's channels' dweight terms, items in order
#pragma unroll
    for (int i = 0; i < VECS; ++i)
#pragma unroll
        for (int e = 0; e < VEC; ++e) dwq[i][e] = dwk[i][e] = 0.f;
    // every thread of the block runs the same iterations (the shuffles need whole warps)
    for (long long base = begin; base < end; base += GROUPS) {
        const bool active = item < end;
        const bool is_q = head < p.q_heads;
        const int h = is_q ? head : head - p.q_heads;
        long long outer, inner;
        split_rows(active ? token : 0, p.n_inner, outer, inner);
        const VecT* dov = reinterpret_cast<const VecT*>(
            is_q ? dq_out + row_offset<false>(outer, inner, p.dq_out) + h * p.dq_out_head
                 : dk_out + row_offset<false>(outer, inner, p.dk_out) + h * p.dk_out_head);
        const VecT* xv = reinterpret_cast<const VecT*>(is_q ? q + row_offset<false>(outer, inner, p.q) + h * p.q_head
                                                            : k + row_offset<false>(outer, inner, p.k) + h * p.k_head);
        VecT* dxv = reinterpret_cast<VecT*>(is_q ? dq + row_offset<false>(outer, inner, p.dq) + h * p.dq_head
                                                 : dk + row_offset<false>(outer, inner, p.dk) + h * p.dk_head);
        const W* wr = is_q ? q_weight : k_weight;
        const bool w_vec = (flags & kHasWeight) && reinterpret_cast<unsigned long long>(wr) % sizeof(Pack<W, VEC>) == 0;

        VecT kdo[VECS], kx[VECS];
        float c[PAIRS > 0 ? ROTATING : 1][VEC], s[PAIRS > 0 ? ROTATING : 1][VEC];   // s: the partner's sin
        TokenAngles<C, CACHE, PAIRS> angles{};
        if (active) {
#pragma unroll
            for (int i = 0; i < VECS; ++i) {
                const int v = lane + i * LANES;
                if (v < n) { kdo[i] = dov[v]; kx[i] = xv[v]; }
            }
            angles = token_angles<C, CACHE, PAIRS>(cos, sin, positions, flags & kInt64Positions,
                                                   row_offset<false>(outer, inner, p.cos),
                                                   row_offset<false>(outer, inner, p.sin),
                                                   row_offset<false>(outer, inner, p.positions), p.cache_row,
                                                   p.max_position, rd);
            if constexpr (PAIRS > 0) {
#pragma unroll
                for (int i = 0; i < ROTATING; ++i) {
                    const int v = lane + i * LANES, j0 = v * VEC;
                    if (v >= n || j0 >= rd) continue;
                    if (j0 + VEC <= rd) {
                        angles.template vector<VEC, true>(j0, c[i], s[i]);
                    } else {
#pragma unroll
                        for (int e = 0; e < VEC; ++e)
                            if (j0 + e < rd) {
                                c[i][e] = angles.cos_at(j0 + e);
                                s[i][e] = angles.sin_at(partner_of<PAIRS>(j0 + e, 0));
                            }
                    }
                }
            }
        }
        float d[VECS][VEC];                      // do as floats, then dy: do rotated by -theta
#pragma unroll
        for (int i = 0; i < VECS; ++i) {
            if (active && lane + i * LANES < n) unpack(kdo[i], d[i]);
            else {
#pragma unroll
                for (int e = 0; e < VEC; ++e) d[i][e] = 0.f;
            }
        }
        if constexpr (PAIRS > 0) {
            float dp[ROTATING][VEC];
            partner_values<VEC, LANES, VECS, PAIRS>(d, dp);
#pragma unroll
            for (int i = 0; i < ROTATING; ++i)
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    const int j = (lane + i * LANES) * VEC + e;
                    if (active && lane + i * LANES < n && j < rd)
                        d[i][e] = rotate<true>(d[i][e], dp[i][e], c[i][e], s[i][e], first_of_pair<PAIRS>(j, 0));
                }
        } else {
#pragma unroll
            for (int i = 0; i < VECS; ++i) {
                const int v = lane + i * LANES;
                if (v < n) {
#pragma unroll
                    for (int e = 0; e < VEC; ++e) head_values[v * VEC + e] = d[i][e];
                }
            }
            __syncwarp();
            const int half = rd / 2;
#pragma unroll
            for (int i = 0; i < VECS; ++i)
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    const int j = (lane + i * LANES) * VEC + e;
                    if (active && lane + i * LANES < n && j < rd) {
                        const int pj = partner_of<0>(j, half);
                        d[i][e] = rotate<true>(d[i][e], head_values[pj], angles.cos_at(j), angles.sin_at(pj),
                                               first_of_pair<0>(j, half));
                    }
                }
            __syncwarp();                        // read before the next item's values land
        }

        // the norm's backward: the head's two sums, then dx and the dweight terms
        float g[VECS][VEC], xf[VECS][VEC];
        float ss = 0.f, sg = 0.f;
#pragma unroll
        for (int i = 0; i < VECS; ++i) {
            const int v = lane + i * LANES;
            if (active && v < n) {
                float wv[VEC];
                load_weights<W, VEC>(wr, v, w_vec, p.weight_offset, flags, wv);
                unpack(kx[i], xf[i]);
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    g[i][e] = d[i][e] * wv[e];
                    ss += xf[i][e] * xf[i][e];
                    sg += g[i][e] * xf[i][e];
                }
            }
        }
        row_sums<LANES>(ss, sg, 0);
        if (active) {
            const float2 stats = row_statistics(ss, sg, head_dim, p.eps);
            const float inv_rms = stats.x, mean = stats.y;
#pragma unroll
            for (int i = 0; i < VECS; ++i) {
                const int v = lane + i * LANES;
                if (v >= n) continue;
                VecT dx;
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    const float xhat = xf[i][e] * inv_rms;
                    dx.v[e] = from_float<T>(inv_rms * (g[i][e] - xhat * mean));
                    const float term = d[i][e] * xhat_for_weight<T>(xf[i][e], inv_rms, flags);
                    dwq[i][e] = is_q ? dwq[i][e] + term : dwq[i][e];
                    dwk[i][e] = is_q ? dwk[i][e] : dwk[i][e] + term;
                }
                dxv[v] = dx;
            }
        }
        item += GROUPS;                          // the next item: token by token, q's heads then k's
        head += GROUPS;
        while (head >= heads) { head -= heads; ++token; }
    }

    if (flags & kWeightGrad) {                   // the groups' sums, added in group order: q's, then k's
        __syncthreads();                         // (the exchange is done with the shared memory)
#pragma unroll
        for (int part = 0; part < 2; ++part) {
#pragma unroll
            for (int i = 0; i < VECS; ++i)
#pragma unroll
                for (int e = 0; e < VEC; ++e)
                    shared[group * SPAN + (lane + i * LANES) * VEC + e] = part == 0 ? dwq[i][e] : dwk[i][e];
            __syncthreads();
            for (int j = threadIdx.x; j < head_dim; j += blockDim.x) {
                float t = 0.f;
#pragma unroll
                for (int other = 0; other < GROUPS; ++other) t += shared[other * SPAN + j];
                out_row.put(part * head_dim + j, t);
            }
            __syncthreads();
        }
    }
    allow_next_kernel();
}

}  // namespace rmsnorm
