// LayerNorm backward, compiled at run time by NVRTC (program "layer_norm_backward";
// cupy_rmsnorm/_compile.py): plain, fused add (kLnAddGrad) and adaLN modulation (MODULATE).
//
// Per row, in float32, each step rounded on its own (layer_norm.cuh), with K = hidden:
//   mean = sum(x) / K;  d = x - mean;  rstd = 1 / sqrt(sum(d^2) / K + eps);  n = d * rstd
//   e = MODULATE ? dy * (1 + scale) : dy;  g = e * w (e without a weight)
//   mean_g = sum(g) / K;  c = (sum(g * d) * rstd) / K          (c = mean(g * n))
//   dx = round_T(rstd * ((g - mean_g) - n * c)  [+ d_residual_out])
// the row's sums in the canonical tree (so dx depends on the row alone), and per column:
//   dweight += e * n;  dbias += e;  dshift += dy;  dscale += dy * (n * w + b)
// cupy_rmsnorm/_layer_norm_reference.py computes the same steps.
//
// Column sums, deterministic without float atomics: rows fall into modulation groups of
// group_rows consecutive rows (the rows that share a shift / scale row; all rows without
// modulation), each cut into chunks of rows_per_block rows; block b takes chunk
// b % blocks_per_group of group b / blocks_per_group. A thread adds its columns' terms in
// registers, its rows in order; a block's row groups (several rows in flight, short rows)
// are added in group order; the block writes one float32 row of partial sums per quantity
// (or, kLnDirectParam / kLnDirectMod, the result itself), and
// layer_norm_backward_reduce_kernel adds the partial rows in a fixed order.
//
// Types: T x's (the fused op: residual_out's, and d_residual_out's and dx's), D dy's, W the
// weight's and bias's, M shift's and scale's (their gradients have those types). VEC as in
// the forward (every row of dy, x, d_residual_out, dx, shift, scale on the vector grid).

#include "common.cuh"
#include "reduce.cuh"
#include "layer_norm.cuh"

namespace rmsnorm {

// Everything but the pointers (LAYER_NORM_BACKWARD_PARAMS_DTYPE in
// tests/cpu/test_compile_layer_norm.py). The grid has (rows / group_rows) * blocks_per_group
// blocks; rows is a multiple of group_rows.
struct LayerNormBackwardParams {
    long long rows, n_inner, group_rows, rows_per_block, blocks_per_group;
    RowStrides dy, x, d_residual_out, dx, shift, scale;
    int hidden;
    float eps;
    int flags, unused;
};
static_assert(sizeof(LayerNormBackwardParams) == 152, "LayerNormBackwardParams: 152 bytes");

// Partial-sum planes, one per quantity present, in this order, each (grid blocks) x hidden
// floats: dweight (kLnParamGrad with a weight), dbias (kLnParamGrad with a bias), dshift
// and dscale (kLnModGrad).
__device__ __forceinline__ int plane_of(int q, int flags) {
    const bool present[4] = {(flags & kLnParamGrad) && (flags & kHasWeight), (flags & kLnParamGrad) && (flags & kLnHasBias),
                             (flags & kLnModGrad) != 0, (flags & kLnModGrad) != 0};
    int k = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) k += i < q && present[i];
    return present[q] ? k : -1;
}

template <typename W, typename M>
struct ColumnOut {
    float* partials;     // this block's partial row of plane 0
    long long plane;     // floats between planes
    W *dweight, *dbias;
    M *dshift, *dscale;  // this group's rows
    int flags;

    __device__ __forceinline__ void put(int q, int j, float s) const {
        const int k = plane_of(q, flags);
        if (k < 0) return;
        if (q < 2 && (flags & kLnDirectParam)) (q == 0 ? dweight : dbias)[j] = from_float<W>(s);
        else if (q >= 2 && (flags & kLnDirectMod)) (q == 2 ? dshift : dscale)[j] = from_float<M>(s);
        else partials[k * plane + j] = s;
    }
};

// Rows of up to 32 threads: 256 / THREADS_PER_ROW rows in flight a block; more: one.
template <typename T, typename D, typename W, typename M, int VEC, int THREADS_PER_ROW, int VECS_PER_THREAD,
          bool MODULATE>
__global__ void __launch_bounds__(THREADS_PER_ROW > 32 ? THREADS_PER_ROW : 256)
layer_norm_backward_kernel(const D* dy, const T* x, const T* d_res, T* dx, const W* w, const W* b, const M* shift,
                           const M* scale, float* partials, W* dweight, W* dbias, M* dshift, M* dscale,
                           const LayerNormBackwardParams p) {
    using Sums = RowSums<THREADS_PER_ROW, VECS_PER_THREAD>;
    constexpr int ROW_GROUPS = THREADS_PER_ROW > 32 ? 1 : 256 / THREADS_PER_ROW;
    constexpr int Q = MODULATE ? 4 : 2;                        // dweight, dbias[, dshift, dscale]
    constexpr int SPAN = THREADS_PER_ROW * VECS_PER_THREAD * VEC;
    __shared__ float mean_sums[1][VECS_PER_THREAD][Sums::WARPS];
    __shared__ float grad_sums[3][VECS_PER_THREAD][Sums::WARPS];
    __shared__ float group_sums[ROW_GROUPS > 1 ? ROW_GROUPS * SPAN : 1];

    const int hidden = p.hidden, n = hidden / VEC, flags = p.flags;
    const float kf = (float)hidden;
    const int tid = threadIdx.x % THREADS_PER_ROW, rg = threadIdx.x / THREADS_PER_ROW;
    const long long block = linear_block();
    const long long group = block / p.blocks_per_group, chunk = block - group * p.blocks_per_group;
    const long long begin = group * p.group_rows + chunk * p.rows_per_block;
    const long long end = min(begin + p.rows_per_block, (group + 1) * p.group_rows);
    const bool w_vec = (flags & kHasWeight) && vector_aligned<W, VEC>(w);
    const bool b_vec = (flags & kLnHasBias) && vector_aligned<W, VEC>(b);
    wait_for_previous_kernel();

    float acc[Q][VECS_PER_THREAD][VEC];
#pragma unroll
    for (int q = 0; q < Q; ++q)
#pragma unroll
        for (int i = 0; i < VECS_PER_THREAD; ++i)
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[q][i][e] = 0.f;

    // every thread runs the same iterations (the shuffles and barriers need them all)
    for (long long base = begin; base < end; base += ROW_GROUPS) {
        const long long r = base + rg;
        const bool active = r < end;
        long long outer, inner;
        split_rows(active ? r : begin, p.n_inner, outer, inner);
        const auto* dyv = reinterpret_cast<const Pack<D, VEC>*>(dy + row_offset<false>(outer, inner, p.dy));
        const auto* xv = reinterpret_cast<const Pack<T, VEC>*>(x + row_offset<false>(outer, inner, p.x));
        const M* sh = MODULATE ? shift + row_offset<false>(outer, inner, p.shift) : nullptr;
        const M* sc = MODULATE ? scale + row_offset<false>(outer, inner, p.scale) : nullptr;
        // x stays in registers; dy is read again in the last pass (from L1), which keeps the
        // column sums of 16 elements a thread in registers without spills
        Pack<T, VEC> kx[VECS_PER_THREAD];
        if (active) {
#pragma unroll
            for (int i = 0; i < VECS_PER_THREAD; ++i) {
                const int v = tid + i * THREADS_PER_ROW;
                if (v < n) kx[i] = xv[v];
            }
        }
        float part1[1][VECS_PER_THREAD], mean_total[1];
#pragma unroll
        for (int i = 0; i < VECS_PER_THREAD; ++i)
            part1[0][i] = active && tid + i * THREADS_PER_ROW < n ? vector_sum<T, VEC>(kx[i]) : 0.f;
        Sums::total(part1, mean_sums, mean_total);
        const float mean = __fdiv_rn(mean_total[0], kf);

        // e and g of one vector (the weight and the scale re-read from L1 where needed again)
        auto e_and_g = [&](int i, const float (&dys)[VEC], float (&ev)[VEC], float (&gv)[VEC], float (&wv)[VEC]) {
            const int v = tid + i * THREADS_PER_ROW;
#pragma unroll
            for (int e = 0; e < VEC; ++e) ev[e] = dys[e];
            if (MODULATE) {
                float scv[VEC];
                load_param<M, VEC>(sc, v, true, scv);
#pragma unroll
                for (int e = 0; e < VEC; ++e) ev[e] = __fmul_rn(ev[e], __fadd_rn(1.0f, scv[e]));
            }
            if (flags & kHasWeight) load_param<W, VEC>(w, v, w_vec, wv);
#pragma unroll
            for (int e = 0; e < VEC; ++e) gv[e] = (flags & kHasWeight) ? __fmul_rn(ev[e], wv[e]) : ev[e];
        };

        // sum(d^2), sum(g), sum(g * d), each vector's share a pairwise tree
        float part3[3][VECS_PER_THREAD], totals[3];
#pragma unroll
        for (int i = 0; i < VECS_PER_THREAD; ++i) {
            part3[0][i] = part3[1][i] = part3[2][i] = 0.f;
            if (!active || tid + i * THREADS_PER_ROW >= n) continue;
            float xs[VEC], dys[VEC], ev[VEC], gv[VEC], wv[VEC] = {}, sq[VEC], gd[VEC];
            unpack(kx[i], xs);
            unpack(dyv[tid + i * THREADS_PER_ROW], dys);
            e_and_g(i, dys, ev, gv, wv);
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                const float d = __fsub_rn(xs[e], mean);
                sq[e] = square(d);
                gd[e] = __fmul_rn(gv[e], d);
            }
            part3[0][i] = pairwise_sum(sq);
            part3[1][i] = pairwise_sum(gv);
            part3[2][i] = pairwise_sum(gd);
        }
        Sums::total(part3, grad_sums, totals);
        const float rstd = rstd_of(totals[0], hidden, p.eps);
        const float mean_g = __fdiv_rn(totals[1], kf);
        const float c = __fdiv_rn(__fmul_rn(totals[2], rstd), kf);

        if (active) {
            auto* dxv = reinterpret_cast<Pack<T, VEC>*>(dx + row_offset<false>(outer, inner, p.dx));
            const auto* drv = reinterpret_cast<const Pack<T, VEC>*>(d_res + row_offset<false>(outer, inner, p.d_residual_out));
#pragma unroll
            for (int i = 0; i < VECS_PER_THREAD; ++i) {
                const int v = tid + i * THREADS_PER_ROW;
                if (v >= n) continue;
                float xs[VEC], dys[VEC], ev[VEC], gv[VEC], wv[VEC] = {}, bv[VEC] = {}, dr[VEC] = {};
                unpack(kx[i], xs);
                unpack(dyv[v], dys);
                e_and_g(i, dys, ev, gv, wv);
                if (MODULATE && (flags & kLnHasBias)) load_param<W, VEC>(b, v, b_vec, bv);
                if (flags & kLnAddGrad) unpack(drv[v], dr);
                Pack<T, VEC> out;
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    float nrm;
                    const float a = affine(xs[e], mean, rstd, wv[e], bv[e], flags, nrm);
                    float gx = __fmul_rn(rstd, __fsub_rn(__fsub_rn(gv[e], mean_g), __fmul_rn(nrm, c)));
                    if (flags & kLnAddGrad) gx = __fadd_rn(gx, dr[e]);
                    out.v[e] = from_float<T>(gx);
                    acc[0][i][e] = __fadd_rn(acc[0][i][e], __fmul_rn(ev[e], nrm));
                    acc[1][i][e] = __fadd_rn(acc[1][i][e], ev[e]);
                    if (MODULATE) {
                        acc[Q - 2][i][e] = __fadd_rn(acc[Q - 2][i][e], dys[e]);
                        acc[Q - 1][i][e] = __fadd_rn(acc[Q - 1][i][e], __fmul_rn(dys[e], a));
                    }
                }
                dxv[v] = out;
            }
        }
    }

    const long long blocks = (p.rows / p.group_rows) * p.blocks_per_group;
    const ColumnOut<W, M> col{partials + block * hidden, blocks * hidden, dweight, dbias,
                              dshift + group * hidden, dscale + group * hidden, flags};
    const bool wanted[4] = {(flags & kLnParamGrad) != 0, (flags & kLnParamGrad) != 0, (flags & kLnModGrad) != 0,
                            (flags & kLnModGrad) != 0};
#pragma unroll
    for (int q = 0; q < Q; ++q) {
        if (!wanted[q]) continue;                // (uniform over the block)
        if (ROW_GROUPS > 1) {                    // the row groups' sums, added in group order
#pragma unroll
            for (int i = 0; i < VECS_PER_THREAD; ++i)
#pragma unroll
                for (int e = 0; e < VEC; ++e) group_sums[rg * SPAN + (tid + i * THREADS_PER_ROW) * VEC + e] = acc[q][i][e];
            __syncthreads();
            for (int j = threadIdx.x; j < hidden; j += blockDim.x) {
                float s = 0.f;
#pragma unroll
                for (int k = 0; k < ROW_GROUPS; ++k) s = __fadd_rn(s, group_sums[k * SPAN + j]);
                col.put(q, j, s);
            }
            __syncthreads();
        } else {
#pragma unroll
            for (int i = 0; i < VECS_PER_THREAD; ++i) {
                const int v = tid + i * THREADS_PER_ROW;
                if (v >= n) continue;
#pragma unroll
                for (int e = 0; e < VEC; ++e) col.put(q, v * VEC + e, acc[q][i][e]);
            }
        }
    }
    allow_next_kernel();
}

// The reduction's sizes (LAYER_NORM_REDUCE_PARAMS_DTYPE): output row o sums the partial rows
// [o * per_output, (o + 1) * per_output) of hidden floats; blockIdx.z picks the plane (z *
// plane floats on) and the output (out0, out1).
struct LayerNormReduceParams {
    long long per_output, hidden, plane;
};
static_assert(sizeof(LayerNormReduceParams) == 24, "LayerNormReduceParams: 24 bytes");

constexpr int kLnReduceColumns = 32, kLnReduceSlices = 8;   // a block of 256 threads

// Column j of output row o: slice s (of kLnReduceSlices) adds the partial rows s, s +
// kLnReduceSlices, ... in order, then the slices are added in order, from zero.
template <typename OUT>
__global__ void __launch_bounds__(kLnReduceColumns * kLnReduceSlices)
layer_norm_backward_reduce_kernel(const float* partials, OUT* out0, OUT* out1, const LayerNormReduceParams p) {
    __shared__ float slices[kLnReduceSlices][kLnReduceColumns];
    const int column = threadIdx.x % kLnReduceColumns, slice = threadIdx.x / kLnReduceColumns;
    const long long j = (long long)blockIdx.x * kLnReduceColumns + column, o = blockIdx.y;
    const float* src = partials + blockIdx.z * p.plane + o * p.per_output * p.hidden + j;
    wait_for_previous_kernel();
    float s = 0.f;
    if (j < p.hidden)
        for (long long k = slice; k < p.per_output; k += kLnReduceSlices) s = __fadd_rn(s, src[k * p.hidden]);
    slices[slice][column] = s;
    __syncthreads();
    if (slice == 0 && j < p.hidden) {
        float t = 0.f;
#pragma unroll
        for (int k = 0; k < kLnReduceSlices; ++k) t = __fadd_rn(t, slices[k][column]);
        (blockIdx.z == 0 ? out0 : out1)[o * p.hidden + j] = from_float<OUT>(t);
    }
    allow_next_kernel();
}

}  // namespace rmsnorm
