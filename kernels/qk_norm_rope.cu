// QK norm + RoPE, forward (qk_norm_rope.cuh: the formulas, numerics and work split), compiled
// at run time by NVRTC (one program; cupy_rmsnorm/_compile.py). The block holds one token's
// heads (q's, then k's) or several tokens': grid.x runs over tokens, grid.y over chunks of a
// token's heads, so a token's groups are neighbours and read its angles from the same lines.

#include "common.cuh"
#include "reduce.cuh"
#include "row.cuh"
#include "rope.cuh"
#include "qk_norm_rope.cuh"

namespace rmsnorm {

// Blocks of the shared-memory exchange (PAIRS = 0) hold at most this many threads
// (cupy_rmsnorm/_plan.py: QK_ROPE_EXCHANGE_BLOCK): the size of their shared memory.
constexpr int kQkExchangeBlock = 256;

// Everything but the pointers (mirrored by cupy_rmsnorm/_abi.py's QK_ROPE_PARAMS_DTYPE). Tokens
// are q's leading axes as two strided levels (outer x inner); each array of tokens gives a
// token's first element (RowStrides), the head-major ones also the step from head to head.
// cos / sin: the rows of transformers' convention; cache_row, max_position: the
// cos_sin_cache's (vLLM's, FlashInfer's: cos points at it).
struct QkRopeParams {
    long long tokens, n_inner;
    RowStrides q, k, out_q, out_k, cos, sin, positions;
    long long q_head, k_head, out_q_head, out_k_head;
    long long cache_row, max_position;
    int q_heads, k_heads, head_dim, rotary_dim;
    float eps, weight_offset;
    int flags, unused;
};
static_assert(sizeof(QkRopeParams) == 208, "QkRopeParams: 208 bytes, as cupy_rmsnorm/_abi.py packs it");

// A forward thread's head. The plan's split, read back from the launch (qk_rope_plan): each of
// the gridDim.y chunks has ceil(heads / gridDim.y) heads; a token's groups take a whole number
// of warps (a warp never holds two tokens), and a block blockDim.x / that many tokens.
struct ForwardItem {
    long long token;
    int head;
    bool active;
};

template <int LANES>
__device__ __forceinline__ ForwardItem forward_item(long long tokens, int heads) {
    const int per_block = (heads + (int)gridDim.y - 1) / (int)gridDim.y;
    const int token_threads = (per_block * LANES + 31) / 32 * 32;
    const int in_block = (int)threadIdx.x / token_threads;
    const int group = ((int)threadIdx.x - in_block * token_threads) / LANES;
    ForwardItem it;
    it.token = (long long)blockIdx.x * ((int)blockDim.x / token_threads) + in_block;
    it.head = (int)blockIdx.y * per_block + group;
    it.active = it.token < tokens && group < per_block && it.head < heads;
    return it;
}

template <typename T, typename W, typename C, int VEC, int LANES, int VECS, int PAIRS, bool CACHE>
__global__ void __launch_bounds__(512)
qk_norm_rope_kernel(const T* q, const T* k, T* out_q, T* out_k, const W* q_weight, const W* k_weight,
                    const C* cos, const C* sin, const void* positions, const QkRopeParams p) {
    using VecT = Pack<T, VEC>;
    static_assert(LANES <= 32 && (LANES & (LANES - 1)) == 0 && VECS >= 1 && (VECS & (VECS - 1)) == 0,
                  "a head's group: a power of two of lanes up to a warp, a power of two of vectors each");
    static_assert(PAIRS >= 0 && (PAIRS & (PAIRS - 1)) == 0, "PAIRS: a power of two, or 0");
    constexpr int SPAN = LANES * VECS * VEC;                   // a head's elements, padded
    constexpr int ROTATING = Rotating<VEC, LANES, VECS, PAIRS>::value;
    __shared__ float exchange[PAIRS == 0 ? kQkExchangeBlock * VECS * VEC : 1];

    const ForwardItem it = forward_item<LANES>(p.tokens, p.q_heads + p.k_heads);
    const int lane = threadIdx.x % LANES;
    const bool is_q = it.head < p.q_heads;
    const int h = is_q ? it.head : it.head - p.q_heads;
    long long outer, inner;
    split_rows(it.active ? it.token : 0, p.n_inner, outer, inner);
    const VecT* xv = reinterpret_cast<const VecT*>(is_q ? q + row_offset<false>(outer, inner, p.q) + h * p.q_head
                                                        : k + row_offset<false>(outer, inner, p.k) + h * p.k_head);
    VecT* yv = reinterpret_cast<VecT*>(is_q ? out_q + row_offset<false>(outer, inner, p.out_q) + h * p.out_q_head
                                            : out_k + row_offset<false>(outer, inner, p.out_k) + h * p.out_k_head);
    const W* wr = is_q ? q_weight : k_weight;
    const int flags = p.flags, head_dim = p.head_dim, rd = p.rotary_dim, n = head_dim / VEC;
    const bool w_vec = (flags & kHasWeight) && reinterpret_cast<unsigned long long>(wr) % sizeof(Pack<W, VEC>) == 0;
    wait_for_previous_kernel();                  // no global memory access before this
    if (flags & kEarlyTrigger) allow_next_kernel();

    // The weights come with the head, where they take at most 32 bytes of registers a thread;
    // the angles too (their latency, a position and then its cache row, off the critical path)
    // where they take at most 16 registers; past that (heads of more than 256 channels) they
    // would be live across the reduction beside 16 elements of the head: loaded after it.
    constexpr bool PREFETCH_W = VECS * sizeof(Pack<W, VEC>) <= 32;
    constexpr bool PREFETCH_ANGLES = ROTATING * VEC <= 8;
    const bool prefetch_w = PREFETCH_W && w_vec;
    VecT kx[VECS];
    Pack<W, VEC> kw[PREFETCH_W ? VECS : 1];
    float c[PAIRS > 0 ? ROTATING : 1][VEC], s[PAIRS > 0 ? ROTATING : 1][VEC];
    float part[VECS];                            // slot i: the squares of this thread's vector i
#pragma unroll
    for (int i = 0; i < VECS; ++i) part[i] = 0.f;
    TokenAngles<C, CACHE, PAIRS> angles{};
    auto load_angles = [&]() {                   // the angles of this thread's rotated vectors
        if constexpr (PAIRS > 0) {
#pragma unroll
            for (int i = 0; i < ROTATING; ++i) {
                const int v = lane + i * LANES, j0 = v * VEC;
                if (v >= n || j0 >= rd) continue;
                if (j0 + VEC <= rd) {
                    angles.template vector<VEC, false>(j0, c[i], s[i]);
                } else {                         // the last rotated vector, in part
#pragma unroll
                    for (int e = 0; e < VEC; ++e)
                        if (j0 + e < rd) { c[i][e] = angles.cos_at(j0 + e); s[i][e] = angles.sin_at(j0 + e); }
                }
            }
        }
    };
    if (it.active) {
#pragma unroll
        for (int i = 0; i < VECS; ++i) {         // every load before the first use
            const int v = lane + i * LANES;
            if (v < n) kx[i] = xv[v];
        }
        if (prefetch_w) {
#pragma unroll
            for (int i = 0; i < VECS; ++i) {
                const int v = lane + i * LANES;
                if (v < n) kw[PREFETCH_W ? i : 0] = reinterpret_cast<const Pack<W, VEC>*>(wr)[v];
            }
        }
        angles = token_angles<C, CACHE, PAIRS>(cos, sin, positions, flags & kInt64Positions,
                                               row_offset<false>(outer, inner, p.cos),
                                               row_offset<false>(outer, inner, p.sin),
                                               row_offset<false>(outer, inner, p.positions), p.cache_row,
                                               p.max_position, rd);
        if (PREFETCH_ANGLES) load_angles();
#pragma unroll
        for (int i = 0; i < VECS; ++i)
            if (lane + i * LANES < n) part[i] = vector_squares<T, VEC>(kx[i]);
    }
    const float inv_rms = rsqrtf(row_total<VECS, LANES>(part) / (float)head_dim + p.eps);
    if (!PREFETCH_ANGLES && it.active) load_angles();

    float y[VECS][VEC];                          // the normalized head, in float32
#pragma unroll
    for (int i = 0; i < VECS; ++i) {
        const int v = lane + i * LANES;
        if (it.active && v < n) {
            float wv[VEC], xf[VEC];
            if (prefetch_w) weights_of<W, VEC>(kw[PREFETCH_W ? i : 0], p.weight_offset, wv);
            else load_weights<W, VEC>(wr, v, w_vec, p.weight_offset, flags, wv);
            unpack(kx[i], xf);
#pragma unroll
            for (int e = 0; e < VEC; ++e) y[i][e] = normalized<T>(xf[e], inv_rms, wv[e], flags);
        } else {
#pragma unroll
            for (int e = 0; e < VEC; ++e) y[i][e] = 0.f;
        }
    }

    if constexpr (PAIRS > 0) {
        float yp[ROTATING][VEC];
        partner_values<VEC, LANES, VECS, PAIRS>(y, yp);
#pragma unroll
        for (int i = 0; i < VECS; ++i) {
            const int v = lane + i * LANES;
            if (!it.active || v >= n) continue;
            VecT o;
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                const int j = v * VEC + e, r = i < ROTATING ? i : 0;
                const float out = i < ROTATING && j < rd
                    ? rotate<false>(y[i][e], yp[r][e], c[r][e], s[r][e], first_of_pair<PAIRS>(j, 0)) : y[i][e];
                o.v[e] = from_float<T>(out);
            }
            yv[v] = o;
        }
    } else {                                     // NeoX halves of any size: through shared memory
        float* head_values = exchange + (threadIdx.x / LANES) * SPAN;
#pragma unroll
        for (int i = 0; i < VECS; ++i) {
            const int v = lane + i * LANES;
            if (v < n) {
#pragma unroll
                for (int e = 0; e < VEC; ++e) head_values[v * VEC + e] = y[i][e];
            }
        }
        __syncwarp();
        const int half = rd / 2;
#pragma unroll
        for (int i = 0; i < VECS; ++i) {
            const int v = lane + i * LANES;
            if (!it.active || v >= n) continue;
            VecT o;
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                const int j = v * VEC + e;
                const float out = j < rd ? rotate<false>(y[i][e], head_values[partner_of<0>(j, half)], angles.cos_at(j),
                                                          angles.sin_at(j), first_of_pair<0>(j, half))
                                         : y[i][e];
                o.v[e] = from_float<T>(out);
            }
            yv[v] = o;
        }
    }
    if (!(flags & kEarlyTrigger)) allow_next_kernel();
}

}  // namespace rmsnorm
