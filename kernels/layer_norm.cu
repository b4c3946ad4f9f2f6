// LayerNorm forward, compiled at run time by NVRTC (program "layer_norm";
// cupy_rmsnorm/_compile.py): plain, fused add (FUSED) and adaLN modulation (MODULATE).
//
//   s    = FUSED ? round_R(x + residual) : x          (residual_out = s)
//   mean = sum(s) / K,  var = sum((s - mean)^2) / K   (two passes over the row in registers)
//   a    = ((s - mean) * rstd) * w + b,  rstd = 1 / sqrt(var + eps)
//   y    = round_O(MODULATE ? a * (1 + scale) + shift : a)
//
// Both sums take the canonical tree (reduce.cuh): a row's bits depend on the row alone, and
// cupy_rmsnorm/_layer_norm_reference.py computes the same tree and the same float32 steps.
// Types: T x's, R the residual's (T, or float32 for a float32 residual stream), W the
// weight's and bias's (one type: a launcher widens a 16-bit one to float32 when they
// differ, exactly), M shift's and scale's, O the output's. Unused pointers may be null.
//
// The launcher picks VEC so that every row of x, residual, out, residual_out, shift and
// scale starts on a VEC-element boundary and hidden % VEC == 0 (VEC = 1 always does: the
// scalar fallback); weight and bias are checked here. A row is THREADS_PER_ROW threads of
// VECS_PER_THREAD vectors each, kept in registers.

#include "common.cuh"
#include "reduce.cuh"
#include "row.cuh"
#include "layer_norm.cuh"

namespace rmsnorm {

// Everything but the pointers (mirrored by tests/cpu/test_compile_layer_norm.py's
// LAYER_NORM_PARAMS_DTYPE). shift / scale rows follow x's rows through their own strides: a
// stride 0 broadcasts ((B, 1, D) beside (B, S, D): inner 0; (D,): both 0).
struct LayerNormParams {
    long long rows, n_inner;
    RowStrides x, residual, out, residual_out, shift, scale;
    int hidden;
    float eps;
    int flags, unused;
};
static_assert(sizeof(LayerNormParams) == 128, "LayerNormParams: 128 bytes");

// A group of THREADS_PER_ROW threads owns a row: up to 32, several rows in a block of 256
// (warp shuffles only); more, a block per row.
template <typename T, typename R, typename W, typename M, typename O, int VEC, int THREADS_PER_ROW,
          int VECS_PER_THREAD, bool FUSED, bool MODULATE>
__global__ void __launch_bounds__(THREADS_PER_ROW > 32 ? THREADS_PER_ROW : 256)
layer_norm_kernel(const T* x, const R* residual, O* y, R* residual_out, const W* w, const W* b, const M* shift,
                  const M* scale, const LayerNormParams p) {
    using S = typename Select<FUSED, R, T>::type;      // the values normalized
    using Sums = RowSums<THREADS_PER_ROW, VECS_PER_THREAD>;
    constexpr int ROWS_PER_BLOCK = THREADS_PER_ROW > 32 ? 1 : 256 / THREADS_PER_ROW;
    static_assert(VECS_PER_THREAD > 0, "the row is kept in registers");
    __shared__ float warp_sums[1][VECS_PER_THREAD][Sums::WARPS];

    const int tid = threadIdx.x % THREADS_PER_ROW;
    const long long row = linear_block() * ROWS_PER_BLOCK + (ROWS_PER_BLOCK > 1 ? threadIdx.x / THREADS_PER_ROW : 0);
    const bool active = row < p.rows;
    long long outer, inner;
    split_rows(active ? row : 0, p.n_inner, outer, inner);
    const int hidden = p.hidden, n = hidden / VEC, flags = p.flags;
    const bool w_vec = (flags & kHasWeight) && vector_aligned<W, VEC>(w);
    const bool b_vec = (flags & kLnHasBias) && vector_aligned<W, VEC>(b);
    wait_for_previous_kernel();                  // no global memory access before this
    if (flags & kEarlyTrigger) allow_next_kernel();

    Pack<S, VEC> ks[VECS_PER_THREAD];
    float part[1][VECS_PER_THREAD], total[1];
    if (active) {
        const Pack<T, VEC>* xv = reinterpret_cast<const Pack<T, VEC>*>(x + row_offset<false>(outer, inner, p.x));
#pragma unroll
        for (int i = 0; i < VECS_PER_THREAD; ++i) {   // every load before the first use
            const int v = tid + i * THREADS_PER_ROW;
            if (v >= n) continue;
            if constexpr (FUSED) {
                const auto* rv = reinterpret_cast<const Pack<R, VEC>*>(residual + row_offset<false>(outer, inner, p.residual));
                ks[i] = rounded_sum<T, R, VEC>(xv[v], rv[v]);
            } else {
                ks[i] = xv[v];
            }
        }
        if constexpr (FUSED) {
            auto* ro = reinterpret_cast<Pack<R, VEC>*>(residual_out + row_offset<false>(outer, inner, p.residual_out));
#pragma unroll
            for (int i = 0; i < VECS_PER_THREAD; ++i)
                if (tid + i * THREADS_PER_ROW < n) ro[tid + i * THREADS_PER_ROW] = ks[i];
        }
    }
    // zeros past the row's end (and in an inactive group): they add nothing to the tree
#pragma unroll
    for (int i = 0; i < VECS_PER_THREAD; ++i)
        part[0][i] = active && tid + i * THREADS_PER_ROW < n ? vector_sum<S, VEC>(ks[i]) : 0.f;
    Sums::total(part, warp_sums, total);
    const float mean = __fdiv_rn(total[0], (float)hidden);
#pragma unroll
    for (int i = 0; i < VECS_PER_THREAD; ++i)
        part[0][i] = active && tid + i * THREADS_PER_ROW < n ? centered_squares<S, VEC>(ks[i], mean) : 0.f;
    Sums::total(part, warp_sums, total);
    const float rstd = rstd_of(total[0], hidden, p.eps);

    if (active) {
        auto* yv = reinterpret_cast<Pack<O, VEC>*>(y + row_offset<false>(outer, inner, p.out));
        const M* sh = MODULATE ? shift + row_offset<false>(outer, inner, p.shift) : nullptr;
        const M* sc = MODULATE ? scale + row_offset<false>(outer, inner, p.scale) : nullptr;
#pragma unroll
        for (int i = 0; i < VECS_PER_THREAD; ++i) {
            const int v = tid + i * THREADS_PER_ROW;
            if (v >= n) continue;
            float xs[VEC], wv[VEC] = {}, bv[VEC] = {}, shv[VEC] = {}, scv[VEC] = {};
            unpack(ks[i], xs);
            if (flags & kHasWeight) load_param<W, VEC>(w, v, w_vec, wv);
            if (flags & kLnHasBias) load_param<W, VEC>(b, v, b_vec, bv);
            if (MODULATE) {
                load_param<M, VEC>(sh, v, true, shv);
                load_param<M, VEC>(sc, v, true, scv);
            }
            Pack<O, VEC> o;
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                float nrm;
                float a = affine(xs[e], mean, rstd, wv[e], bv[e], flags, nrm);
                if (MODULATE) a = modulate(a, shv[e], scv[e]);
                o.v[e] = from_float<O>(a);
            }
            yv[v] = o;
        }
    }
    if (!(flags & kEarlyTrigger)) allow_next_kernel();
}

}  // namespace rmsnorm
