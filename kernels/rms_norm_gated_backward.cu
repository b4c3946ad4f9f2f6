// Gated RMSNorm, backward (rms_norm_gated.cuh: the forward's formulas and numerics), compiled
// at run time by NVRTC (one program; cupy_rmsnorm/_compile.py). VECS_PER_THREAD > 0 keeps a
// group's dy, x and z in registers; 0 streams long groups (the second pass re-reads them).
//
// Per group, in float32, with r = inv_rms, a = act(z), a' = act'(z), g = dy * w':
//   norm before gate: gx = g * a; dx = r * (gx - xhat * mean(gx * xhat)), xhat = x * r;
//                     dgate = dy * xhat' * w' * a'; dweight += dy * a * xhat'
//   gate before norm: h = x * a; dh = r * (g - hhat * mean(g * hhat)), hhat = h * r;
//                     dx = dh * a; dgate = dh * x * a'; dweight += dy * hhat'
// (xhat', hhat': rounded to T as the forward multiplied them, in llama mode; with
// kRoundProduct the forward's product xhat' * w' too.) Block b takes one group position
// (b % groups) of a contiguous chunk of rows, so each thread adds its columns' dweight terms
// in registers, rows in order; the block's row groups are then added in order, and its sums
// written as a partial row (or, one chunk, dweight itself); rms_norm_backward_reduce_kernel
// adds the partial rows in a fixed order. dy has the forward output's type D.

#include "common.cuh"
#include "reduce.cuh"
#include "row.cuh"
#include "backward.cuh"
#include "rms_norm_gated.cuh"

namespace rmsnorm {

// The backward's (GATED_BACKWARD_PARAMS_DTYPE): rows_per_block counts whole rows of the
// caller's arrays; block b takes group b % groups of the rows [c, c + rows_per_block),
// c = (b / groups) * rows_per_block.
struct GatedBackwardParams {
    long long rows, n_inner, rows_per_block;
    RowStrides dy, x, gate, dx, dgate;
    int hidden, groups;
    float eps, weight_offset;
    int flags, unused;
};
static_assert(sizeof(GatedBackwardParams) == 128, "GatedBackwardParams: 128 bytes, as cupy_rmsnorm/_abi.py packs it");

template <typename T, typename D, int VEC, bool GATE_FIRST, int ACT>
struct GatedElement {
    // pass 1: the vector's share of (sum of squares, sum of g * xhat / r)
    __device__ __forceinline__ static void sums(const Pack<D, VEC>& dyp, const Pack<T, VEC>& xp,
                                                const Pack<T, VEC>& zp, const float (&wv)[VEC], float& ss,
                                                float& sg) {
        float dy[VEC], x[VEC], z[VEC];
        unpack(dyp, dy);
        unpack(xp, x);
        unpack(zp, z);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            const float a = activation<ACT>(z[e]);
            const float h = GATE_FIRST ? x[e] * a : x[e];
            const float g = GATE_FIRST ? dy[e] * wv[e] : dy[e] * wv[e] * a;
            ss += h * h;
            sg += g * h;
        }
    }
    // pass 2: dx, dgate and the dweight terms of one vector
    __device__ __forceinline__ static void grads(const Pack<D, VEC>& dyp, const Pack<T, VEC>& xp,
                                                 const Pack<T, VEC>& zp, const float (&wv)[VEC], float inv_rms,
                                                 float c, int flags, Pack<T, VEC>& dx, Pack<T, VEC>& dz,
                                                 float (&dw)[VEC]) {
        float dy[VEC], x[VEC], z[VEC];
        unpack(dyp, dy);
        unpack(xp, x);
        unpack(zp, z);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            float a, da;
            activation_and_grad<ACT>(z[e], a, da);
            if (GATE_FIRST) {
                const float h = x[e] * a, hhat = h * inv_rms;
                const float dh = inv_rms * (dy[e] * wv[e] - hhat * c);
                dx.v[e] = from_float<T>(dh * a);
                dz.v[e] = from_float<T>(dh * x[e] * da);
                dw[e] = dy[e] * xhat_for_weight<D>(h, inv_rms, flags);
            } else {
                const float xhat = x[e] * inv_rms, g = dy[e] * wv[e] * a;
                dx.v[e] = from_float<T>(inv_rms * (g - xhat * c));
                float prod = normalized<D>(x[e], inv_rms, wv[e], flags);     // what the forward gated
                if (flags & kRoundProduct) prod = to_float(from_float<D>(prod));
                dz.v[e] = from_float<T>(dy[e] * prod * da);
                dw[e] = dy[e] * a * xhat_for_weight<D>(x[e], inv_rms, flags);
            }
        }
    }
};

// In blocks of 512, two vectors a thread (dy, x, the gate and dweight's sums of each), or one
// with float32 weights for 16-bit x, take more than 64 registers: one such block an SM, not
// two that spill (the launcher fits the grid to the occupancy).
template <typename T, typename D, typename W, int VEC, int THREADS_PER_ROW, int VECS_PER_THREAD, bool GATE_FIRST,
          int ACT>
__global__ void __launch_bounds__(THREADS_PER_ROW > 256 ? THREADS_PER_ROW : 256,
                                  THREADS_PER_ROW > 256 ? (VECS_PER_THREAD > 1 || sizeof(W) > sizeof(T) ? 1 : 1024 / THREADS_PER_ROW)
                                                       : 2)
rms_norm_gated_backward_kernel(const D* dy, const T* x, const T* gate, T* dx, T* dgate, const W* w, float* partials,
                               W* dweight, const GatedBackwardParams p) {
    using VecT = Pack<T, VEC>;
    using VecD = Pack<D, VEC>;
    using Element = GatedElement<T, D, VEC, GATE_FIRST, ACT>;
    constexpr int ROW_GROUPS = THREADS_PER_ROW <= 32 ? 256 / THREADS_PER_ROW : 1;   // rows in flight a block
    constexpr int KEPT_VECS = VECS_PER_THREAD > 0 ? VECS_PER_THREAD : 1;
    constexpr int SPAN = THREADS_PER_ROW * KEPT_VECS * VEC;                        // a group's columns
    static_assert(VECS_PER_THREAD > 0 || ROW_GROUPS == 1, "streamed rows get a block each");
    __shared__ float group_sums[ROW_GROUPS > 1 ? ROW_GROUPS * SPAN : 1];

    const int hidden = p.hidden, n = hidden / VEC, flags = p.flags, groups = p.groups;
    const bool weight_grad = flags & kWeightGrad;
    const int tid = threadIdx.x % THREADS_PER_ROW, rg = threadIdx.x / THREADS_PER_ROW;
    const int position = (int)(blockIdx.x % groups);        // the group position this block takes
    const long long chunk = blockIdx.x / groups;
    const long long full_rows = p.rows / groups;
    const long long begin = chunk * p.rows_per_block, end = min(begin + p.rows_per_block, full_rows);
    const W* wr = w + (long long)position * hidden;
    const bool w_vec = (flags & kHasWeight) && reinterpret_cast<unsigned long long>(wr) % sizeof(Pack<W, VEC>) == 0;
    // this block's sums: a partial row of the whole weight (its position's columns), or dweight
    const DweightRow<W> out_row{partials + chunk * ((long long)groups * hidden) + (long long)position * hidden,
                                dweight + (long long)position * hidden, (flags & kDirectWeight) != 0};
    wait_for_previous_kernel();

    float dws[KEPT_VECS][VEC];                   // this thread's columns' dweight terms, rows in order
#pragma unroll
    for (int i = 0; i < KEPT_VECS; ++i)
#pragma unroll
        for (int e = 0; e < VEC; ++e) dws[i][e] = 0.f;
    int parity = 0;
    // every thread of the block runs the same iterations (the shuffles need whole warps)
    for (long long base = begin; base < end; base += ROW_GROUPS, parity ^= 1) {
        const long long full = base + rg;
        const bool active = full < end;
        long long outer, inner;
        split_rows((active ? full : begin) * groups + position, p.n_inner, outer, inner);
        const VecD* dyv = reinterpret_cast<const VecD*>(dy + row_offset<false>(outer, inner, p.dy));
        const VecT* xv = reinterpret_cast<const VecT*>(x + row_offset<false>(outer, inner, p.x));
        const VecT* zv = reinterpret_cast<const VecT*>(gate + row_offset<false>(outer, inner, p.gate));
        VecT* dxv = reinterpret_cast<VecT*>(dx + row_offset<false>(outer, inner, p.dx));
        VecT* dzv = reinterpret_cast<VecT*>(dgate + row_offset<false>(outer, inner, p.dgate));
        float ss = 0.f, sg = 0.f;
        if constexpr (VECS_PER_THREAD > 0) {
            VecD kdy[VECS_PER_THREAD];
            VecT kx[VECS_PER_THREAD], kz[VECS_PER_THREAD];
            float kw[VECS_PER_THREAD][VEC];
            if (active) {
#pragma unroll
                for (int i = 0; i < VECS_PER_THREAD; ++i) {
                    const int v = tid + i * THREADS_PER_ROW;
                    if (v < n) { kdy[i] = dyv[v]; kx[i] = xv[v]; kz[i] = zv[v]; }
                }
#pragma unroll
                for (int i = 0; i < VECS_PER_THREAD; ++i) {
                    const int v = tid + i * THREADS_PER_ROW;
                    if (v >= n) continue;
                    load_weights<W, VEC>(wr, v, w_vec, p.weight_offset, flags, kw[i]);
                    Element::sums(kdy[i], kx[i], kz[i], kw[i], ss, sg);
                }
            }
            row_sums<THREADS_PER_ROW>(ss, sg, parity);
            if (active) {
                const float2 stats = row_statistics(ss, sg, hidden, p.eps);
#pragma unroll
                for (int i = 0; i < VECS_PER_THREAD; ++i) {
                    const int v = tid + i * THREADS_PER_ROW;
                    if (v >= n) continue;
                    VecT gx, gz;
                    float dw[VEC];
                    Element::grads(kdy[i], kx[i], kz[i], kw[i], stats.x, stats.y, flags, gx, gz, dw);
                    dxv[v] = gx;
                    dzv[v] = gz;
#pragma unroll
                    for (int e = 0; e < VEC; ++e) dws[i][e] += dw[e];
                }
            }
        } else {                                 // streamed: re-read the row (mostly from L2)
#pragma unroll 2
            for (int v = tid; v < n; v += THREADS_PER_ROW) {
                float wv[VEC];
                load_weights<W, VEC>(wr, v, w_vec, p.weight_offset, flags, wv);
                Element::sums(dyv[v], xv[v], zv[v], wv, ss, sg);
            }
            row_sums<THREADS_PER_ROW>(ss, sg, parity);
            const float2 stats = row_statistics(ss, sg, hidden, p.eps);
            const bool first_row = full == begin;
#pragma unroll 2
            for (int v = tid; v < n; v += THREADS_PER_ROW) {
                float wv[VEC], dw[VEC];
                load_weights<W, VEC>(wr, v, w_vec, p.weight_offset, flags, wv);
                VecT gx, gz;
                Element::grads(dyv[v], xv[v], zv[v], wv, stats.x, stats.y, flags, gx, gz, dw);
                dxv[v] = gx;
                dzv[v] = gz;
                if (weight_grad) {               // this block's partial row, in global memory
                    float* pv = out_row.partials + v * VEC;
#pragma unroll
                    for (int e = 0; e < VEC; ++e) pv[e] = (first_row ? 0.f : pv[e]) + dw[e];
                }
            }
        }
        if (ROW_GROUPS > 1) __syncwarp();
    }

    if (VECS_PER_THREAD > 0 && weight_grad) {
        if (ROW_GROUPS > 1) {                    // the row groups' sums, added in group order
#pragma unroll
            for (int i = 0; i < KEPT_VECS; ++i)
#pragma unroll
                for (int e = 0; e < VEC; ++e) group_sums[rg * SPAN + (tid + i * THREADS_PER_ROW) * VEC + e] = dws[i][e];
            __syncthreads();
            for (int j = threadIdx.x; j < hidden; j += blockDim.x) {
                float s = 0.f;
#pragma unroll
                for (int k = 0; k < ROW_GROUPS; ++k) s += group_sums[k * SPAN + j];
                out_row.put(j, s);
            }
        } else {
#pragma unroll
            for (int i = 0; i < KEPT_VECS; ++i) {
                const int v = tid + i * THREADS_PER_ROW;
                float s[VEC];
#pragma unroll
                for (int e = 0; e < VEC; ++e) s[e] = 0.f + dws[i][e];
                if (v < n) out_row.put_vector<VEC>(v * VEC, s);
            }
        }
    }
    allow_next_kernel();
}

}  // namespace rmsnorm
