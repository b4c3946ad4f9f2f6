// Gated RMSNorm, forward (rms_norm_gated.cuh: the formulas and numerics), compiled at run time
// by NVRTC (one program; cupy_rmsnorm/_compile.py). VECS_PER_THREAD > 0 keeps a group's x and z
// in registers; 0 streams long groups (the second pass re-reads them).

#include "common.cuh"
#include "reduce.cuh"
#include "row.cuh"
#include "rms_norm_gated.cuh"

namespace rmsnorm {

// Everything but the pointers (mirrored by cupy_rmsnorm/_abi.py's GATED_PARAMS_DTYPE). Rows
// are groups; row r's weight is w + (r % groups) * hidden.
struct GatedParams {
    long long rows, n_inner;
    RowStrides x, gate, out;
    int hidden, groups;
    float eps, weight_offset;
    int flags, unused;
};
static_assert(sizeof(GatedParams) == 88, "GatedParams: 88 bytes, as cupy_rmsnorm/_abi.py packs it");

// The vector's share of the group's sum of squares: of x, or (GATE_FIRST) of h = x * act(z).
template <typename T, int VEC, bool GATE_FIRST, int ACT>
__device__ __forceinline__ float gated_squares(const Pack<T, VEC>& a, const Pack<T, VEC>& b) {
    float q[VEC];
    unpack(a, q);
    if (GATE_FIRST) {
        float z[VEC];
        unpack(b, z);
#pragma unroll
        for (int e = 0; e < VEC; ++e) q[e] *= activation<ACT>(z[e]);
    }
#pragma unroll
    for (int e = 0; e < VEC; ++e) q[e] = square(q[e]);
    return pairwise_sum(q);
}

// y of one vector (see the top of the file).
template <typename T, typename O, int VEC, bool GATE_FIRST, int ACT>
__device__ __forceinline__ Pack<O, VEC> gated_vector(const Pack<T, VEC>& a, const Pack<T, VEC>& b,
                                                     const float (&wv)[VEC], float inv_rms, int flags) {
    float x[VEC], z[VEC];
    unpack(a, x);
    unpack(b, z);
    Pack<O, VEC> o;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
        const float g = activation<ACT>(z[e]);
        float y;
        if (GATE_FIRST) {
            y = normalized<O>(x[e] * g, inv_rms, wv[e], flags);
        } else {
            float p = normalized<O>(x[e], inv_rms, wv[e], flags);
            if (flags & kRoundProduct) p = to_float(from_float<O>(p));
            y = p * g;
        }
        o.v[e] = from_float<O>(y);
    }
    return o;
}

// A group of THREADS_PER_ROW threads owns one row (up to 32: several rows a block of 256,
// reduced with warp shuffles; more: one row a block), as the plain forward kernel's plans.
template <typename T, typename W, typename O, int VEC, int THREADS_PER_ROW, int VECS_PER_THREAD, bool GATE_FIRST,
          int ACT>
__global__ void __launch_bounds__(THREADS_PER_ROW > 256 ? THREADS_PER_ROW : 256,
                                  THREADS_PER_ROW > 256 ? 1024 / THREADS_PER_ROW : 3)
rms_norm_gated_kernel(const T* x, const T* gate, O* y, const W* w, const GatedParams p) {
    using VecT = Pack<T, VEC>;
    constexpr int WARPS = THREADS_PER_ROW > 32 ? THREADS_PER_ROW / 32 : 1;
    constexpr int SLOTS = VECS_PER_THREAD > 0 ? VECS_PER_THREAD : kEpoch;
    constexpr int ROWS_PER_BLOCK = THREADS_PER_ROW > 32 ? 1 : 256 / THREADS_PER_ROW;
    static_assert(VECS_PER_THREAD > 0 || THREADS_PER_ROW > 32, "a streamed row has a block of its own");
    __shared__ float warp_sums[SLOTS][WARPS];

    const int tid = threadIdx.x % THREADS_PER_ROW;
    const long long row = linear_block() * ROWS_PER_BLOCK + (ROWS_PER_BLOCK > 1 ? threadIdx.x / THREADS_PER_ROW : 0);
    const bool active = row < p.rows;
    const long long r = active ? row : 0;
    long long outer, inner;
    split_rows(r, p.n_inner, outer, inner);
    const VecT* xv = reinterpret_cast<const VecT*>(x + row_offset<false>(outer, inner, p.x));
    const VecT* zv = reinterpret_cast<const VecT*>(gate + row_offset<false>(outer, inner, p.gate));
    Pack<O, VEC>* yv = reinterpret_cast<Pack<O, VEC>*>(y + row_offset<false>(outer, inner, p.out));
    const int hidden = p.hidden, n = hidden / VEC, flags = p.flags;
    const W* wr = w + (p.groups > 1 ? (long long)(r % p.groups) * hidden : 0);
    const bool w_vec = (flags & kHasWeight) && reinterpret_cast<unsigned long long>(wr) % sizeof(Pack<W, VEC>) == 0;
    wait_for_previous_kernel();                  // no global memory access before this
    if (flags & kEarlyTrigger) allow_next_kernel();

    if constexpr (VECS_PER_THREAD > 0) {
        // The weights come with the row, not after the reduction (their latency off the
        // critical path), where they take at most 32 bytes of registers a thread.
        constexpr bool PREFETCH_W = VECS_PER_THREAD * sizeof(Pack<W, VEC>) <= 32;
        const bool prefetch_w = PREFETCH_W && w_vec;
        VecT kx[VECS_PER_THREAD], kz[VECS_PER_THREAD];
        Pack<W, VEC> kw[PREFETCH_W ? VECS_PER_THREAD : 1];
        float part[SLOTS];                       // slot i: the squares of this thread's vector i
#pragma unroll
        for (int i = 0; i < SLOTS; ++i) part[i] = 0.f;
        if (active) {
#pragma unroll
            for (int i = 0; i < VECS_PER_THREAD; ++i) {   // every load before the first use
                const int v = tid + i * THREADS_PER_ROW;
                if (v < n) { kx[i] = xv[v]; kz[i] = zv[v]; }
            }
            if (prefetch_w) {
#pragma unroll
                for (int i = 0; i < VECS_PER_THREAD; ++i) {
                    const int v = tid + i * THREADS_PER_ROW;
                    if (v < n) kw[PREFETCH_W ? i : 0] = reinterpret_cast<const Pack<W, VEC>*>(wr)[v];
                }
            }
#pragma unroll
            for (int i = 0; i < VECS_PER_THREAD; ++i)
                if (tid + i * THREADS_PER_ROW < n) part[i] = gated_squares<T, VEC, GATE_FIRST, ACT>(kx[i], kz[i]);
        }
        const float total = row_total<SLOTS, THREADS_PER_ROW>(part, warp_sums);
        const float inv_rms = rsqrtf(total / (float)hidden + p.eps);
#pragma unroll
        for (int i = 0; i < VECS_PER_THREAD; ++i) {
            const int v = tid + i * THREADS_PER_ROW;
            if (!active || v >= n) continue;
            float wv[VEC];
            if (prefetch_w) weights_of<W, VEC>(kw[PREFETCH_W ? i : 0], p.weight_offset, wv);
            else load_weights<W, VEC>(wr, v, w_vec, p.weight_offset, flags, wv);
            yv[v] = gated_vector<T, O, VEC, GATE_FIRST, ACT>(kx[i], kz[i], wv, inv_rms, flags);
        }
    } else {
        // Streamed: one step (a vector a thread) at a time, in the same tree as a row held in
        // registers (reduce.cuh: row_total).
        const int steps = (n + THREADS_PER_ROW - 1) / THREADS_PER_ROW;
        const float total = row_total<1, WARPS, 1>(steps, warp_sums, [&](int step, float (&part)[1]) {
            const int v = step * THREADS_PER_ROW + tid;
            part[0] = v < n ? gated_squares<T, VEC, GATE_FIRST, ACT>(xv[v], zv[v]) : 0.f;
        });
        const float inv_rms = rsqrtf(total / (float)hidden + p.eps);
#pragma unroll 2
        for (int v = tid; v < n; v += THREADS_PER_ROW) {
            float wv[VEC];
            load_weights<W, VEC>(wr, v, w_vec, p.weight_offset, flags, wv);
            yv[v] = gated_vector<T, O, VEC, GATE_FIRST, ACT>(xv[v], zv[v], wv, inv_rms, flags);
        }
    }
    if (!(flags & kEarlyTrigger)) allow_next_kernel();
}

}  // namespace rmsnorm
