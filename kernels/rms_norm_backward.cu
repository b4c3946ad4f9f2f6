// Backward of RMSNorm (and of the fused residual-add + RMSNorm), compiled at run time by NVRTC.
//
// Per row, in float32 (the contract in cupy_rmsnorm/_reference.py):
//   r = rsqrt(sum(x^2) / hidden + eps)       recomputed here: the forward saves nothing
//   w' = w + weight_offset, g = dy * w'      (g = dy without a weight)
//   dx = r * (g - x * r * c),  c = r * sum(g * x) / hidden   (= mean(g * xhat))
//   fused op: x is the forward's residual_out s, and dx += d_residual_out before the rounding
//   dweight = sum over rows of dy * xhat     (kLlama: xhat rounded to T first, as the forward)
// One pass over the row gives both sums; the row is kept in registers for the second pass
// (VECS_PER_THREAD > 0) or re-read (VECS_PER_THREAD == 0: rows too long for registers).
//
// Work split (cupy_rmsnorm/_plan.py, backward_plan): a persistent-ish grid; block b owns the
// contiguous rows [b * rows_per_block, (b + 1) * rows_per_block), handled by GROUPS row groups
// of THREADS_PER_ROW threads (group k takes rows begin + k, begin + k + GROUPS, ...). Each group
// adds dy * xhat per column over its rows, in shared memory (or, streamed, in the block's
// partials row), and the block writes one float32 row of partial sums: partials[b][col].
// (rms_norm_backward_row_kernel, no more rows than SMs: a block's one row is its partial row,
// written from registers.) The second kernel adds the partial rows in a fixed order.
// Nothing depends on timing (no float atomics): the same inputs and plan give the same bits
// on every run.
// rms_norm_backward_staged_kernel (below; sm_90, rows on the 16-byte grid, 8+ rows a block):
// the same work split and arithmetic, with each block's next rows brought into shared memory
// by bulk copies ahead of use, so that more bytes are in flight than registers can hold.

#include "common.cuh"
#include "reduce.cuh"
#include "backward.cuh"
#include "staging.cuh"

namespace rmsnorm {

// Everything but the pointers, by value (mirrored by cupy_rmsnorm/_abi.py's
// BACKWARD_PARAMS_DTYPE; a CPU test reads both sides). Row r of an array starts at
// (r / n_inner) * outer + (r % n_inner) * inner elements.
struct BackwardParams {
    long long rows, n_inner, rows_per_block;
    RowStrides dy, x, d_residual_out, dx;
    int hidden;
    float eps, weight_offset;
    int flags;
    int stages, unused;   // rms_norm_backward_staged_kernel: the ring's stages (>= 2)
};
static_assert(sizeof(BackwardParams) == 112, "BackwardParams: 112 bytes, as cupy_rmsnorm/_abi.py packs it");

// Row r's indices on its two leading axes: (r / n_inner, r % n_inner); no division for
// `unit_rows` (n_inner known to be 1) or n_inner == 1.
__device__ __forceinline__ void split_row(const BackwardParams& p, long long r, bool unit_rows, long long& outer,
                                          long long& inner) {
    outer = r, inner = 0;
    if (!unit_rows && p.n_inner != 1) { outer = r / p.n_inner; inner = r - outer * p.n_inner; }
}

// One element of dx (float32 until the one rounding at the end).
template <typename T>
__device__ __forceinline__ T dx_of(float dyf, float xf, float wf, float inv_rms, float c, float add) {
    return from_float<T>(inv_rms * (dyf * wf - xf * inv_rms * c) + add);
}

// Compile-time flags for generic lambdas (NVRTC has no <type_traits>).
template <bool B>
struct Constant { static constexpr bool value = B; };
using True = Constant<true>;
using False = Constant<false>;
struct Flag { bool value; };     // the same, known at run time only

// f(add_grad, weight_grad, llama) with the flags as Constant values, chosen once a row: tested
// per element, the flags cost more instructions than the arithmetic (the staged kernel at
// 4096 x 4096: 337 warp instructions a row, ncu), and the backward is bound by
// instruction issue. Llama matters only to dweight.
template <typename F>
__device__ __forceinline__ void with_backward_flags(int flags, const F& f) {
    const bool weight_grad = flags & kWeightGrad, llama = flags & kLlama;
    if (flags & kAddGrad) {
        if (!weight_grad) f(True{}, False{}, False{});
        else if (llama) f(True{}, True{}, True{});
        else f(True{}, True{}, False{});
    } else {
        if (!weight_grad) f(False{}, False{}, False{});
        else if (llama) f(False{}, True{}, True{});
        else f(False{}, True{}, False{});
    }
}

// A block-wide row's inv_rms and c = mean(g * xhat) from its sums (a, b) = (sum x^2, sum g * x):
// the warps' sums meet in shared memory and warp 0 alone adds them and computes the two
// statistics, which the block then reads back. row_sums has every warp do that last part,
// about 45 instructions a warp and row (two butterflies, two divisions, a square root). The
// same operations in the same order as row_sums and the lines after it: the same bits. Two
// barriers a row, no double buffers: warp 0 reads warp_sums before the second barrier, and
// every thread reads stats before the next row's first. `between` runs in the other warps
// while warp 0 works.
// Measured in the staged kernel against row_sums: blocks of 128 and 256 threads 0.96-0.99 of the time,
// blocks of 512 up to 1.06 (the second barrier, with two blocks an SM, costs more than the
// instructions it saves), hence STATS_IN_ONE_WARP_MAX_THREADS.
constexpr int STATS_IN_ONE_WARP_MAX_THREADS = 256;
// ROWS rows at once: out[j] the statistics of row j.
template <int THREADS_PER_ROW, int ROWS, class Between>
__device__ __forceinline__ void row_stats(float (&a)[ROWS], float (&b)[ROWS], int hidden, float eps,
                                          Between&& between, float2 (&out)[ROWS]) {
    static_assert(THREADS_PER_ROW > 32, "a block-wide row");
    constexpr int WARPS = THREADS_PER_ROW / 32;
    __shared__ float2 warp_sums[ROWS][WARPS];
    __shared__ float2 stats[ROWS];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    row_sums<THREADS_PER_ROW, ROWS, WARPS>(a, b, warp_sums, warp == 0);
    if (warp == 0) {
#pragma unroll
        for (int j = 0; j < ROWS; ++j)
            if (lane == 0) stats[j] = row_statistics(a[j], b[j], hidden, eps);
    } else {
        between();
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < ROWS; ++j) out[j] = stats[j];
}

// Where row r's arrays start and how x's row splits into head / body / tail.
struct RowView {
    long long outer, inner;
    int head, n_body, tail_start;
};

template <typename T, int VEC, bool EDGES>
__device__ __forceinline__ RowView row_view(const T* x, const BackwardParams& p, long long r, int flags) {
    RowView v{r, 0, 0, p.hidden / VEC, p.hidden};
    split_row(p, r, flags & kUnitRows, v.outer, v.inner);
    if (EDGES) {   // head: up to x's row's first 16-byte boundary (every array shares x's pattern)
        const T* xr = x + row_offset<false>(v.outer, v.inner, p.x);
        const int mis = (int)((reinterpret_cast<unsigned long long>(xr) / sizeof(T)) & (VEC - 1));
        v.head = min((VEC - mis) & (VEC - 1), p.hidden);
        v.n_body = (p.hidden - v.head) / VEC;
        v.tail_start = v.head + v.n_body * VEC;
    }
    return v;
}

// A row's body vectors of dy and x that this thread keeps (register plans); every load is
// issued before any is used.
template <typename T, int VEC, int THREADS_PER_ROW, int KEPT_VECS>
__device__ __forceinline__ void load_body(const T* dy, const T* x, const BackwardParams& p, const RowView& v,
                                          int tid, Pack<T, VEC> (&kdy)[KEPT_VECS], Pack<T, VEC> (&kx)[KEPT_VECS]) {
    const Pack<T, VEC>* dyv = reinterpret_cast<const Pack<T, VEC>*>(dy + row_offset<false>(v.outer, v.inner, p.dy) + v.head);
    const Pack<T, VEC>* xv = reinterpret_cast<const Pack<T, VEC>*>(x + row_offset<false>(v.outer, v.inner, p.x) + v.head);
#pragma unroll
    for (int i = 0; i < KEPT_VECS; ++i) {
        const int k = tid + i * THREADS_PER_ROW;
        if (k < v.n_body) { kdy[i] = dyv[k]; kx[i] = xv[k]; }
    }
}

// dx for a block's rows, and its row of dweight partial sums (with kWeightGrad; or, when
// the grid is one block, dweight itself: kDirectWeight).
// Launch bounds: 1024 resident threads per SM (cupy_rmsnorm/_plan.py BACKWARD_THREADS_PER_SM),
// i.e. at most 64 registers a thread; warp groups (the most registers) get 85, three blocks of
// 256; rows off the 16-byte grid (EDGES) take what they need rather than spill, except blocks
// of 256+ threads with one vector each, which fit 64 (unbounded, ptxas gave bf16 79: one
// 512-thread block an SM, and 4096 x 4095 bf16 took 1.4x fp16's time).
template <int THREADS_PER_ROW, int VECS_PER_THREAD, bool EDGES>
struct BackwardMinBlocks {
    static constexpr int value = EDGES && (VECS_PER_THREAD != 1 || THREADS_PER_ROW < 256) ? 1
                                 : THREADS_PER_ROW > 256 ? 1024 / THREADS_PER_ROW : THREADS_PER_ROW == 256 ? 4 : 3;
};

// ONE_ROW (rms_norm_backward_row_kernel; rows_per_block == 1, one group a block): the block's
// dweight sums are its row's dy * xhat: they go from registers straight to its partials row,
// or to dweight, without the shared-memory round trip and its barriers (as 0 + v, what the
// sums would hold). FLAGS: the flags when known at compile time (the row kernel), else -1.
template <typename T, typename W, int VEC, int THREADS_PER_ROW, int VECS_PER_THREAD, bool EDGES, bool ONE_ROW, int FLAGS,
          typename N>
__device__ __forceinline__ void backward_rows(const T* dy, const T* x, const T* d_residual_out, T* dx, const W* w,
                                              float* partials, W* dweight, const BackwardParams& p) {
    using VecT = Pack<T, VEC>;
    constexpr int GROUPS = THREADS_PER_ROW <= 32 ? 256 / THREADS_PER_ROW : 1;   // rows in flight per block
    constexpr int KEPT_VECS = VECS_PER_THREAD > 0 ? VECS_PER_THREAD : 1;
    // a group's dweight sums, one float per column, and (VEC > 1) one of padding after every
    // VEC columns: the threads of a warp add to columns VEC apart, which would otherwise
    // meet in a few shared-memory banks; padded, they stride VEC + 1 (odd): 32 banks
    constexpr int PAD = VECS_PER_THREAD > 0 && VEC > 1 ? 1 : 0;
    constexpr int SPAN = VECS_PER_THREAD > 0 ? (THREADS_PER_ROW * VECS_PER_THREAD + 2) * (VEC + PAD) : 1;
    const auto slot = [](int j) { return PAD ? j + j / VEC : j; };
    // block plans with one vector per thread load the next row's body while this row's sums
    // go round the block (the barrier would otherwise leave the SM with no loads in flight);
    // not for rows off the 16-byte grid, whose head and tail leave no registers for it. The
    // one-row kernel has no next row: without the code for it, 1 x 4096 took 0-8% less
    constexpr bool PREFETCH = VECS_PER_THREAD == 1 && THREADS_PER_ROW > 32 && !EDGES;
    constexpr bool NEXT_ROW = PREFETCH && !ONE_ROW;
    // The looping block plans on the 16-byte grid keep their dweight sums in registers: with
    // no head, a thread has the same columns in every row. The sums in shared memory cost a
    // load, an add and a store per element and row, and the kernel is bound by instruction
    // issue at 1024 x 4096 (ncu: 9.4 M warp instructions with dweight, 6.1 M without);
    // in registers 1024 x 4096 took 0.87-0.91 of the time.
    constexpr bool SUMS_IN_REGISTERS = NEXT_ROW;
    static_assert(THREADS_PER_ROW >= VEC, "a group must cover a head or tail of up to VEC - 1 elements");
    static_assert(VECS_PER_THREAD > 0 || GROUPS == 1, "streamed rows get a block each");
    __shared__ float dw_sums[SUMS_IN_REGISTERS ? 1 : GROUPS * SPAN];
    float dw_acc[SUMS_IN_REGISTERS ? VEC : 1];   // SUMS_IN_REGISTERS: this thread's columns' sums
#pragma unroll
    for (int e = 0; e < (SUMS_IN_REGISTERS ? VEC : 1); ++e) dw_acc[e] = 0.f;

    const int hidden = p.hidden, flags = FLAGS >= 0 ? FLAGS : p.flags;
    const float w_offset = p.weight_offset;
    const bool has_weight = flags & kHasWeight, weight_grad = flags & kWeightGrad, add_grad = flags & kAddGrad;
    const int tid = threadIdx.x % THREADS_PER_ROW, group = threadIdx.x / THREADS_PER_ROW;
    // (one row a block: its grid is the rows)
    const long long begin = ONE_ROW ? (long long)blockIdx.x : (long long)blockIdx.x * p.rows_per_block;
    const long long end = ONE_ROW ? begin + 1 : min(begin + p.rows_per_block, p.rows);
    // Where this block's dweight sums build up: its threads' registers (SUMS_IN_REGISTERS),
    // shared memory (one row per group), or for streamed rows its own row of partials in
    // global memory. Each way each column gets one addition per row, rows in order; outside
    // registers the thread that makes it may change from row to row (the head's length
    // follows each row's alignment), so rows are separated by a barrier: the block's in
    // row_sums, or a __syncwarp for warp groups.
    float* sums = VECS_PER_THREAD > 0 ? dw_sums + group * SPAN : partials + (long long)blockIdx.x * hidden;
    const DweightRow<W> out_row{partials + (long long)blockIdx.x * hidden, dweight, (flags & kDirectWeight) != 0};
    if (VECS_PER_THREAD > 0 && weight_grad && !ONE_ROW && !SUMS_IN_REGISTERS) {
        for (int j = threadIdx.x; j < GROUPS * SPAN; j += blockDim.x) dw_sums[j] = 0.f;
        __syncthreads();
    }

    wait_for_previous_kernel();                  // no global memory access before this
    VecT kdy[KEPT_VECS], kx[KEPT_VECS];                        // the row's body, kept for the second pass
    if (PREFETCH && begin + group < end)
        load_body<T, VEC, THREADS_PER_ROW, KEPT_VECS>(dy, x, p, row_view<T, VEC, EDGES>(x, p, begin + group, flags), tid, kdy, kx);
    int parity = 0;
    // every thread of the block runs the same iterations (the shuffles need whole warps)
    for (long long base = begin; base < end; base += GROUPS, parity ^= 1) {
        const long long row = base + group;
        const bool active = row < end;
        const RowView rv = row_view<T, VEC, EDGES>(x, p, active ? row : begin, flags);
        const T* dyr = dy + row_offset<false>(rv.outer, rv.inner, p.dy);
        const T* xr = x + row_offset<false>(rv.outer, rv.inner, p.x);
        T* dxr = dx + row_offset<false>(rv.outer, rv.inner, p.dx);
        const T* dres = add_grad ? d_residual_out + row_offset<false>(rv.outer, rv.inner, p.d_residual_out) : nullptr;
        const int head = rv.head, n_body = rv.n_body, tail_start = rv.tail_start;

        const bool has_head = EDGES && active && tid < head;
        const bool has_tail = EDGES && active && tid < hidden - tail_start;
        const W* wb = w + head;
        const bool w_vec = has_weight && ((flags & kWeightVectors)
                                          || (reinterpret_cast<unsigned long long>(wb) % sizeof(Pack<W, VEC>)) == 0);
        const VecT* dyv = reinterpret_cast<const VecT*>(dyr + head);
        const VecT* xv = reinterpret_cast<const VecT*>(xr + head);

        float ss = 0.f, sgx = 0.f;               // sum x^2, sum g * x
        float head_dy = 0.f, head_x = 0.f, tail_dy = 0.f, tail_x = 0.f, head_w = 1.f, tail_w = 1.f;
        VecT ndy[KEPT_VECS], nx[KEPT_VECS];                    // NEXT_ROW: the next row's body
        if (NEXT_ROW && row + GROUPS < end)
            load_body<T, VEC, THREADS_PER_ROW, KEPT_VECS>(dy, x, p, row_view<T, VEC, EDGES>(x, p, row + GROUPS, flags), tid, ndy, nx);
        if (active) {
            if (VECS_PER_THREAD > 0 && !PREFETCH) load_body<T, VEC, THREADS_PER_ROW, KEPT_VECS>(dy, x, p, rv, tid, kdy, kx);
            if (has_head) {
                head_dy = to_float(dyr[tid]);
                head_x = to_float(xr[tid]);
                head_w = weight_at(w, tid, w_offset, flags);
            }
            if (has_tail) {
                tail_dy = to_float(dyr[tail_start + tid]);
                tail_x = to_float(xr[tail_start + tid]);
                tail_w = weight_at(w, tail_start + tid, w_offset, flags);
            }
            if (VECS_PER_THREAD > 0) {
#pragma unroll
                for (int i = 0; i < KEPT_VECS; ++i) {
                    const int v = tid + i * THREADS_PER_ROW;
                    if (v >= n_body) continue;
                    float wv[VEC];
                    load_weights<W, VEC>(wb, v, w_vec, w_offset, flags, wv);
#pragma unroll
                    for (int e = 0; e < VEC; ++e) {
                        const float xf = to_float(kx[i].v[e]);
                        ss += xf * xf;
                        sgx += to_float(kdy[i].v[e]) * wv[e] * xf;
                    }
                }
            } else {
#pragma unroll 2
                for (int v = tid; v < n_body; v += THREADS_PER_ROW) {
                    const VecT a = dyv[v], b = xv[v];
                    float wv[VEC];
                    load_weights<W, VEC>(wb, v, w_vec, w_offset, flags, wv);
#pragma unroll
                    for (int e = 0; e < VEC; ++e) {
                        const float xf = to_float(b.v[e]);
                        ss += xf * xf;
                        sgx += to_float(a.v[e]) * wv[e] * xf;
                    }
                }
            }
            if (EDGES) {
                ss += head_x * head_x + tail_x * tail_x;
                sgx += head_dy * head_w * head_x + tail_dy * tail_w * tail_x;
            }
        }
        row_sums<THREADS_PER_ROW>(ss, sgx, parity);
        if (active) {
            const float2 stats = row_statistics(ss, sgx, hidden, p.eps);
            const float inv_rms = stats.x, c = stats.y;        // c = mean(g * xhat)
            // streamed rows: the first row of the block writes its partials, later ones add
            const bool first_row = VECS_PER_THREAD == 0 && row == begin;
            if (has_head) {
                dxr[tid] = dx_of<T>(head_dy, head_x, head_w, inv_rms, c, add_grad ? to_float(dres[tid]) : 0.f);
                if (weight_grad && ONE_ROW)
                    out_row.put(tid, 0.f + head_dy * xhat_for_weight<N>(head_x, inv_rms, flags));
                else if (weight_grad)
                    sums[slot(tid)] = (first_row ? 0.f : sums[slot(tid)]) + head_dy * xhat_for_weight<N>(head_x, inv_rms, flags);
            }
            if (has_tail) {
                const int j = tail_start + tid;
                dxr[j] = dx_of<T>(tail_dy, tail_x, tail_w, inv_rms, c, add_grad ? to_float(dres[j]) : 0.f);
                if (weight_grad && ONE_ROW)
                    out_row.put(j, 0.f + tail_dy * xhat_for_weight<N>(tail_x, inv_rms, flags));
                else if (weight_grad)
                    sums[slot(j)] = (first_row ? 0.f : sums[slot(j)]) + tail_dy * xhat_for_weight<N>(tail_x, inv_rms, flags);
            }
            VecT* dxv = reinterpret_cast<VecT*>(dxr + head);
            const VecT* dresv = reinterpret_cast<const VecT*>(dres + head);
            if (VECS_PER_THREAD > 0) {
                const auto second_pass = [&](auto add_c, auto dw_c, auto llama_c) {
                    const bool ADD = add_c.value, DW = dw_c.value;
                    const int LLAMA = llama_c.value ? kLlama : 0;
#pragma unroll
                    for (int i = 0; i < KEPT_VECS; ++i) {
                        const int v = tid + i * THREADS_PER_ROW;
                        if (v >= n_body) continue;
                        float wv[VEC];
                        load_weights<W, VEC>(wb, v, w_vec, w_offset, flags, wv);
                        VecT add, o;
                        if (ADD) add = dresv[v];
#pragma unroll
                        for (int e = 0; e < VEC; ++e) {
                            const float dyf = to_float(kdy[i].v[e]), xf = to_float(kx[i].v[e]);
                            o.v[e] = dx_of<T>(dyf, xf, wv[e], inv_rms, c, ADD ? to_float(add.v[e]) : 0.f);
                            if (DW && SUMS_IN_REGISTERS)
                                dw_acc[SUMS_IN_REGISTERS ? e : 0] += dyf * xhat_for_weight<N>(xf, inv_rms, LLAMA);
                            else if (DW && !ONE_ROW)
                                sums[slot(head + v * VEC + e)] += dyf * xhat_for_weight<N>(xf, inv_rms, LLAMA);
                        }
                        dxv[v] = o;
                        if (DW && ONE_ROW) {
                            float dw_row[VEC];
#pragma unroll
                            for (int e = 0; e < VEC; ++e)
                                dw_row[e] = 0.f + to_float(kdy[i].v[e]) * xhat_for_weight<N>(to_float(kx[i].v[e]), inv_rms, LLAMA);
                            out_row.put_vector<VEC>(head + v * VEC, dw_row);
                        }
                    }
                };
                // one row a block: a chain of dependent instructions, not issue, is its time, and
                // the six copies of this loop took 1 x 4096 from 2.14 to 2.19 us
                if constexpr (ONE_ROW)
                    second_pass(Flag{add_grad}, Flag{weight_grad}, Flag{(flags & kLlama) != 0});
                else
                    with_backward_flags(flags, second_pass);
            } else {                             // streamed: re-read the row (mostly from L2)
#pragma unroll 2
                for (int v = tid; v < n_body; v += THREADS_PER_ROW) {
                    const VecT a = dyv[v], b = xv[v];
                    float wv[VEC];
                    load_weights<W, VEC>(wb, v, w_vec, w_offset, flags, wv);
                    VecT add, o;
                    if (add_grad) add = dresv[v];
                    float* pv = sums + head + v * VEC;
#pragma unroll
                    for (int e = 0; e < VEC; ++e) {
                        const float dyf = to_float(a.v[e]), xf = to_float(b.v[e]);
                        o.v[e] = dx_of<T>(dyf, xf, wv[e], inv_rms, c, add_grad ? to_float(add.v[e]) : 0.f);
                        if (weight_grad) pv[e] = (first_row ? 0.f : pv[e]) + dyf * xhat_for_weight<N>(xf, inv_rms, flags);
                    }
                    dxv[v] = o;
                }
            }
        }
        if (NEXT_ROW) {
#pragma unroll
            for (int i = 0; i < KEPT_VECS; ++i) { kdy[i] = ndy[i]; kx[i] = nx[i]; }
        }
        if (GROUPS > 1) __syncwarp();            // this row's sums before the next row's
    }

    if (SUMS_IN_REGISTERS && weight_grad) {     // (0 + v: the bits the shared-memory sums give)
        if (tid < hidden / VEC) {
            float v[VEC];
#pragma unroll
            for (int e = 0; e < VEC; ++e) v[e] = 0.f + dw_acc[SUMS_IN_REGISTERS ? e : 0];
            out_row.put_vector<VEC>(tid * VEC, v);
        }
    } else if (VECS_PER_THREAD > 0 && weight_grad && !ONE_ROW) {   // the groups' sums, added in group order
        __syncthreads();
        const bool direct = flags & kDirectWeight;
        float* block_partials = partials + (long long)blockIdx.x * hidden;
        for (int j = threadIdx.x; j < hidden; j += blockDim.x) {
            float s = 0.f;
#pragma unroll
            for (int k = 0; k < GROUPS; ++k) s += dw_sums[k * SPAN + slot(j)];
            if (direct) dweight[j] = from_float<W>(s);
            else block_partials[j] = s;
        }
    }
}

// N: the type the llama mode rounds xhat to for dweight (the forward's output type; T but for
// mixed precision, where the launcher runs the float32 kernel on upcast inputs).
template <typename T, typename W, int VEC, int THREADS_PER_ROW, int VECS_PER_THREAD, bool EDGES, typename N = T>
__global__ void __launch_bounds__(THREADS_PER_ROW > 256 ? THREADS_PER_ROW : 256, BackwardMinBlocks<THREADS_PER_ROW, VECS_PER_THREAD, EDGES>::value)
rms_norm_backward_kernel(const T* dy, const T* x, const T* d_residual_out, T* dx, const W* w, float* partials,
                         W* dweight, const BackwardParams p) {
    backward_rows<T, W, VEC, THREADS_PER_ROW, VECS_PER_THREAD, EDGES, false, -1, N>(dy, x, d_residual_out, dx, w, partials, dweight, p);
    allow_next_kernel();
}

// Few rows (no more than the SMs, cupy_rmsnorm/_plan.py's "row" variant): a block-wide group
// per row and one row a block, whatever the occupancy. A kernel of its own: in the one
// above, the one-row path cost the looping blocks 3% at 1024 x 4096. Its FLAGS are
// compiled in (BackwardFlags, with kUnitRows and kWeightVectors where they hold): a block of one
// row is a chain of dependent instructions, and the flags' tests and the general row
// arithmetic were a quarter of them (1 x 4096 bf16: 6,240 warp instructions, 4,656 compiled in,
// ncu; 0.76-0.99 of the time at 1-128 rows).
template <typename T, typename W, int VEC, int THREADS_PER_ROW, int VECS_PER_THREAD, bool EDGES, int FLAGS, typename N = T>
__global__ void __launch_bounds__(THREADS_PER_ROW > 256 ? THREADS_PER_ROW : 256, BackwardMinBlocks<THREADS_PER_ROW, VECS_PER_THREAD, EDGES>::value)
rms_norm_backward_row_kernel(const T* dy, const T* x, const T* d_residual_out, T* dx, const W* w, float* partials,
                             W* dweight, const BackwardParams p) {
    static_assert(THREADS_PER_ROW > 32 && VECS_PER_THREAD > 0, "a block-wide group with the row in registers");
    backward_rows<T, W, VEC, THREADS_PER_ROW, VECS_PER_THREAD, EDGES, true, FLAGS, N>(dy, x, d_residual_out, dx, w, partials, dweight, p);
    allow_next_kernel();
}

// ---- Rows staged in shared memory by bulk copies (sm_90) -----------------------------------
// The kernel above keeps the rows it works on in registers: at most two rows in flight per
// block, two blocks per SM for rows of 512 vectors, too few bytes in flight to cover DRAM
// latency (at 16384 x 4096 bf16 it moved half of what a copy does). Here, for rows on the
// 16-byte grid (every array: EDGES false, 16-byte vectors), each block keeps a ring of
// p.stages rows in shared memory: one thread issues a bulk copy (staging.cuh) per array of
// the next rows, an mbarrier per stage counts the bytes in, and the block computes on the
// oldest stage. Bytes in flight then cost shared memory, not registers. The math, the
// per-row sums and their order are the register kernel's with one vector per thread and step
// (VECS_PER_THREAD steps of THREADS_PER_ROW threads); each thread keeps its columns' weights
// and dweight sums in registers (its columns never change).
// Stage s holds dy, x and (kAddGrad) d_residual_out of one row, row_bytes each; the
// mbarriers follow the last stage. Stage s is refilled after the barrier of the row that
// follows its row (every thread has then finished with it).

// Launch bounds: 1024 resident threads per SM (at most 64 registers a thread), if shared
// memory lets that many blocks in; half that for rows of more than two steps (their
// weights and sums take 16 registers a step, and their stages leave room for few blocks).
// A block of ROWS rows a step counts as ROWS blocks.
template <int THREADS_PER_ROW, int VECS_PER_THREAD, int ROWS>
struct StagedMinBlocks {
    static constexpr int blocks = VECS_PER_THREAD > 2 ? (THREADS_PER_ROW >= 512 ? 1 : 512 / THREADS_PER_ROW) : 1024 / THREADS_PER_ROW;
    static constexpr int value = blocks / ROWS > 1 ? blocks / ROWS : 1;
};

// ROWS rows a step (1 or 2): with 2 a block takes its rows in pairs, both rows' sums going
// round the block at one barrier (and both rows' refills issued after it), which halves the
// barriers a row and gives each thread two independent rows of work between them
// (cupy_rmsnorm/_plan.py BACKWARD_PAIRED_GEOMETRY: where that pays). Each row's arithmetic
// and each column's order of dweight additions (rows in order) are those of ROWS = 1: the
// same geometry and blocks give the same bits.
template <typename T, typename W, int THREADS_PER_ROW, int VECS_PER_THREAD, int ROWS, typename N = T>
__global__ void __launch_bounds__(THREADS_PER_ROW, StagedMinBlocks<THREADS_PER_ROW, VECS_PER_THREAD, ROWS>::value)
rms_norm_backward_staged_kernel(const T* dy, const T* x, const T* d_residual_out, T* dx, const W* w,
                                float* partials, W* dweight, const BackwardParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    constexpr int VEC = 16 / (int)sizeof(T);
    using VecT = Pack<T, VEC>;
    static_assert(THREADS_PER_ROW > 32, "a staged row takes a block");
    static_assert(ROWS == 1 || ROWS == 2, "one or two rows a step");
    extern __shared__ __align__(128) unsigned char staged[];

    const int hidden = p.hidden, flags = p.flags, stages = p.stages, n = p.hidden / VEC;
    const float w_offset = p.weight_offset;
    const bool add_grad = flags & kAddGrad, weight_grad = flags & kWeightGrad;
    const unsigned row_bytes = (unsigned)hidden * sizeof(T);
    const unsigned stage_bytes = (add_grad ? 3u : 2u) * row_bytes;
    const unsigned bars = shared_address(staged) + stages * stage_bytes;   // 8 bytes each
    const int tid = threadIdx.x;
    const long long begin = (long long)blockIdx.x * p.rows_per_block;
    const int count = (int)(min(begin + p.rows_per_block, p.rows) - begin);   // < 2^31 (the plan checks)

    if (tid == 0) {
        for (int s = 0; s < stages; ++s) stage_init(bars + 8 * s);
        stage_init_fence();
    }
    __syncthreads();
    wait_for_previous_kernel();                  // no global memory access before this

    float wv[VECS_PER_THREAD][VEC], dws[VECS_PER_THREAD][VEC];
    const bool w_vec = (flags & kHasWeight) && (reinterpret_cast<unsigned long long>(w) % sizeof(Pack<W, VEC>)) == 0;
#pragma unroll
    for (int i = 0; i < VECS_PER_THREAD; ++i) {
        const int v = tid + i * THREADS_PER_ROW;
#pragma unroll
        for (int e = 0; e < VEC; ++e) { wv[i][e] = 1.f; dws[i][e] = 0.f; }
        if (v < n) load_weights<W, VEC>(w, v, w_vec, w_offset, flags, wv[i]);
    }

    // the producer: bring row `begin + k` into stage k % stages
    const auto issue = [&](int k) {
        long long outer, inner;
        split_row(p, begin + k, false, outer, inner);
        const int s = k % stages;
        const unsigned bar = bars + 8 * s, dst = shared_address(staged) + s * stage_bytes;
        stage_expect(bar, stage_bytes);
        stage_copy(dst, dy + row_offset<false>(outer, inner, p.dy), row_bytes, bar);
        stage_copy(dst + row_bytes, x + row_offset<false>(outer, inner, p.x), row_bytes, bar);
        if (add_grad) stage_copy(dst + 2 * row_bytes, d_residual_out + row_offset<false>(outer, inner, p.d_residual_out), row_bytes, bar);
    };
    if (tid == THREADS_PER_ROW - 32)                 // the producer: the last warp's first lane
        for (int k = 0; k < min(stages, count); ++k) issue(k);

    for (int k = 0; k < count; k += ROWS) {      // rows k .. k + m - 1 (stages >= 2 ROWS: the plan)
        const int m = min(ROWS, count - k);
        const VecT* sdy[ROWS];
        float ss[ROWS], sgx[ROWS];               // sum x^2, sum g * x
#pragma unroll
        for (int j = 0; j < ROWS; ++j) {
            const int s = (k + j) % stages;
            sdy[j] = reinterpret_cast<const VecT*>(staged + s * stage_bytes);
            ss[j] = 0.f, sgx[j] = 0.f;
            if (j >= m) continue;
            stage_wait(bars + 8 * s, (unsigned)(((k + j) / stages) & 1));
            const VecT* sx = sdy[j] + n;
#pragma unroll
            for (int i = 0; i < VECS_PER_THREAD; ++i) {
                const int v = tid + i * THREADS_PER_ROW;
                if (v >= n) continue;
                const VecT a = sdy[j][v], b = sx[v];   // one 16-byte load each (unpack(sdy[j][v]) splits it)
                float fdy[VEC], fx[VEC];
                unpack(a, fdy);
                unpack(b, fx);
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    ss[j] += fx[e] * fx[e];
                    sgx[j] += fdy[e] * wv[i][e] * fx[e];
                }
            }
        }
        // past the (first) barrier every thread is done with the last step's rows: their
        // stages take rows k - ROWS + stages .. k - 1 + stages (with row_stats, issued while
        // warp 0 finishes the statistics)
        const auto refill = [&] {
            if (tid == THREADS_PER_ROW - 32 && k >= ROWS)
#pragma unroll
                for (int j = 0; j < ROWS; ++j)
                    if (k - ROWS + j + stages < count) issue(k - ROWS + j + stages);
        };
        float2 stats[ROWS];                      // (inv_rms, c = mean(g * xhat)) of each row
        if constexpr (THREADS_PER_ROW <= STATS_IN_ONE_WARP_MAX_THREADS) {
            row_stats<THREADS_PER_ROW, ROWS>(ss, sgx, hidden, p.eps, refill, stats);
        } else {
            row_sums<THREADS_PER_ROW, ROWS>(ss, sgx, (k / ROWS) & 1);
            refill();
#pragma unroll
            for (int j = 0; j < ROWS; ++j) stats[j] = row_statistics(ss[j], sgx[j], hidden, p.eps);
        }
        VecT* dxv[ROWS];
#pragma unroll
        for (int j = 0; j < ROWS; ++j) {
            long long outer, inner;
            split_row(p, begin + k + j, false, outer, inner);
            dxv[j] = reinterpret_cast<VecT*>(dx + row_offset<false>(outer, inner, p.dx));
        }
        const auto second_pass = [&](auto add_c, auto dw_c, auto llama_c) {
            const bool ADD = add_c.value, DW = dw_c.value;
            const int LLAMA = llama_c.value ? kLlama : 0;
#pragma unroll
            for (int i = 0; i < VECS_PER_THREAD; ++i) {
                const int v = tid + i * THREADS_PER_ROW;
                if (v >= n) continue;
#pragma unroll
                for (int j = 0; j < ROWS; ++j) {     // rows in order: each column's dweight order
                    if (j >= m) continue;
                    const float inv_rms = stats[j].x, c = stats[j].y;
                    const VecT* sx = sdy[j] + n;
                    const VecT a = sdy[j][v], b = sx[v], r = ADD ? sx[n + v] : a;
                    float fdy[VEC], fx[VEC], fadd[VEC];
                    unpack(a, fdy);
                    unpack(b, fx);
                    unpack(r, fadd);
                    VecT o;
#pragma unroll
                    for (int e = 0; e < VEC; ++e) {
                        o.v[e] = dx_of<T>(fdy[e], fx[e], wv[i][e], inv_rms, c, ADD ? fadd[e] : 0.f);
                        if (DW) dws[i][e] += fdy[e] * xhat_for_weight<N>(fx[e], inv_rms, LLAMA);
                    }
                    dxv[j][v] = o;
                }
            }
        };
        with_backward_flags(flags, second_pass);
    }

    if (weight_grad) {                           // this block's sums: its row of partials, or dweight
        // in 16-byte stores: one float at a time, a warp's store touched 32 sectors for 128
        // bytes, and the stores' drain at the end showed in ncu's stalls
        const DweightRow<W> out_row{partials + (long long)blockIdx.x * hidden, dweight, (flags & kDirectWeight) != 0};
#pragma unroll
        for (int i = 0; i < VECS_PER_THREAD; ++i) {
            const int v = tid + i * THREADS_PER_ROW;
            if (v < n) out_row.put_vector<VEC>(v * VEC, dws[i]);
        }
    }
    allow_next_kernel();
#endif
}

}  // namespace rmsnorm
