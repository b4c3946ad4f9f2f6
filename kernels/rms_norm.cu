// RMSNorm and fused residual-add + RMSNorm, and their quantized forms: the forward kernels,
// compiled at run time by NVRTC (one program; cupy_rmsnorm/_compile.py).
//
//   rms_norm:            y = x * rsqrt(mean(x^2) + eps) * (w + weight_offset)
//   fused_add_rms_norm:  s = round_T(x + residual); residual_out = s; y = rms_norm(s)
//
// Numerics (the contract in cupy_rmsnorm/_reference.py, shared by every path): the sum of
// squares is accumulated in float32 whatever T is, in one canonical tree per hidden size
// (reduce.cuh), so a row's bits depend on the row alone, not on the rows beside it or the
// plan they chose (rows that start off the vector grid aside); the fused op normalizes the
// residual sum *after* it has been rounded to T, so it equals the unfused
// rms_norm(x + residual); kLlama rounds x * inv_rms to T before the weight multiply (HF
// LlamaRMSNorm), otherwise there is one rounding at the end.
//
// Work split (cupy_rmsnorm/_plan.py decides): a group of THREADS_PER_ROW threads owns one row
// (up to 32: several rows per block, reduced with warp shuffles; more: one row per block,
// reduced through shared memory; rms_norm_cluster_kernel: one row per cluster of CLUSTER
// blocks on CLUSTER SMs, the block sums added through distributed shared memory). One block
// per row group, no grid-stride loop: a loop's live state costs registers, hence occupancy.
// Each row is split into an unaligned head (< VEC elements, up to the first 16-byte boundary
// of x's row), a body of VEC-wide vectors and a tail, so every row gets 16-byte accesses
// whatever its offset, provided all arrays share x's alignment pattern (the launcher checks
// that and lowers VEC otherwise); EDGES = false compiles the common case (rows on the vector
// grid, hidden a multiple of VEC) without head and tail. VECS_PER_THREAD > 0 keeps the body
// in registers, VECS_PER_THREAD vectors per thread (each element read from DRAM once);
// VECS_PER_THREAD == 0 streams the row twice (the second pass re-reads x, or residual_out,
// from L2). The quantized forms (quant.cuh) share all of it but the output stage.

#include "common.cuh"
#include "reduce.cuh"
#include "row.cuh"
#include "quant.cuh"

namespace rmsnorm {

// Everything but the pointers, passed by value as one argument (fewer kernel arguments, less
// host work per launch); flags: Flags. Mirrored by cupy_rmsnorm/_abi.py (PARAMS_DTYPE).
struct Params {
    long long rows, n_inner;
    RowStrides x, residual, out, residual_out;
    int hidden;
    float eps, weight_offset;
    int flags;
};
static_assert(sizeof(Params) == 96, "Params: 96 bytes, as cupy_rmsnorm/_abi.py packs it");

// One row (or, with CLUSTER > 1, the share of one row of block `rank` of its cluster).
// EDGES: a row may start off x's 16-byte grid or end in a partial vector (head and tail);
// without it every row is whole vectors, a compile-time fact that saves registers.
// FORM != kPlain: the output is quant.q (QTYPE bytes, at out's row strides), not y.
// R: the residual's (and residual_out's) type, O: y's (row.cuh); both T but for mixed precision.
template <typename T, typename W, bool FUSED, int VEC, int THREADS_PER_ROW, int VECS_PER_THREAD, bool EDGES, int CLUSTER,
          int FORM = kPlain, int QTYPE = kE4M3, bool FLAT = false, typename R = T, typename O = T>
__device__ __forceinline__ void norm_row(const T* x, const R* res, O* y, R* res_out, const W* w,
                                         const Params& p, long long block_id, int rank,
                                         const QuantArgs& quant = QuantArgs()) {
    using S = typename Select<FUSED, R, T>::type;     // the values normalized: the fused op's sum, or x
    using VecT = Pack<T, VEC>;
    using VecR = Pack<R, VEC>;
    using VecS = Pack<S, VEC>;
    constexpr int WARPS = THREADS_PER_ROW > 32 ? THREADS_PER_ROW / 32 : 1;
    constexpr int SLOTS = VECS_PER_THREAD > 0 ? VECS_PER_THREAD : kEpoch;   // partial sums per thread
    static_assert(THREADS_PER_ROW >= VEC, "a group must cover a head of up to VEC - 1 elements");
    static_assert(CLUSTER == 1 || THREADS_PER_ROW > 32, "clusters split rows of a block each");
    static_assert(VECS_PER_THREAD > 0 || THREADS_PER_ROW > 32, "a streamed row has a block of its own");
    static_assert((THREADS_PER_ROW & (THREADS_PER_ROW - 1)) == 0 && (SLOTS & (SLOTS - 1)) == 0 && (CLUSTER & (CLUSTER - 1)) == 0,
                  "the canonical tree needs power-of-two splits");
    __shared__ float warp_sums[SLOTS][WARPS];   // slot s of warp w

    const int hidden = p.hidden, flags = p.flags;
    const float w_offset = p.weight_offset;
    // The block's rows as the plan launches them (rows_per_block): one a block past 32 threads,
    // else groups sharing blocks of 256 threads. Compile-time, so that with one row a block its
    // index and addresses are the block's (uniform registers), not each thread's.
    constexpr int ROWS_PER_BLOCK = THREADS_PER_ROW > 32 ? 1 : 256 / THREADS_PER_ROW;
    const int tid = threadIdx.x % THREADS_PER_ROW;   // lane within the row group
    const long long row = block_id * ROWS_PER_BLOCK + (ROWS_PER_BLOCK > 1 ? threadIdx.x / THREADS_PER_ROW : 0);
    const bool active = row < p.rows;            // false only in the last block of small groups
    const long long r = active ? row : 0;
    long long outer = r, inner = 0;
    if (!FLAT && p.n_inner != 1) { outer = r / p.n_inner; inner = r - outer * p.n_inner; }
    const T* xr = x + row_offset<FLAT>(outer, inner, p.x);
    const R* rr = FUSED ? res + row_offset<FLAT>(outer, inner, p.residual) : nullptr;
    O* yr = y + row_offset<FLAT>(outer, inner, p.out);
    R* ror = FUSED ? res_out + row_offset<FLAT>(outer, inner, p.residual_out) : nullptr;

    // Head: elements before x's row reaches a 16-byte boundary (all arrays share that
    // alignment pattern, the launcher made sure); tail: what is left after the last whole
    // vector. Both are shorter than VEC <= THREADS_PER_ROW. The head's elements go one to a
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
    const int first = rank * THREADS_PER_ROW + tid;  // this thread's first body vector
    constexpr int STEP = THREADS_PER_ROW * CLUSTER;  // and the stride between its vectors
    const bool has_head = EDGES && active && rank == 0 && tid < head;
    const bool has_tail = EDGES && active && tail > 0 && first <= n_body && (n_body - first) % STEP == 0;
    const bool w_vec = (flags & kHasWeight) &&
        ((reinterpret_cast<unsigned long long>(w + head) % sizeof(Pack<W, VEC>)) == 0);

    float total, head_v = 0.f;                   // the row's sum of squares; this thread's head element
    VecS keep[VECS_PER_THREAD > 0 ? VECS_PER_THREAD : 1];   // the row's body, kept for the second pass
    // The weights are fetched with the row, not after the reduction, so their latency is off
    // the critical path: at one vector a thread, and in the plain forms on the vector grid up
    // to 64 bytes of them (4 bf16 vectors). Not past one vector with edges (where the weights
    // are mostly not vector-aligned and the registers cost more than they save) nor in the
    // quantized forms (held to fewer registers: quant_min_blocks_of_256).
    constexpr bool PREFETCH_W = VECS_PER_THREAD == 1 ||
        (FORM == kPlain && !EDGES && VECS_PER_THREAD > 0 && VECS_PER_THREAD * sizeof(Pack<W, VEC>) <= 64);
    Pack<W, VEC> wk[PREFETCH_W ? VECS_PER_THREAD : 1];
    const bool prefetch_w = PREFETCH_W && w_vec;
    // the body's start in each array; the head and tail are addressed from it (fewer live pointers)
    const T* xb = xr + head;
    const R* rb = FUSED ? rr + head : nullptr;
    R* rob = FUSED ? ror + head : nullptr;
    const VecT* xv = reinterpret_cast<const VecT*>(xb);
    const VecR* rv = reinterpret_cast<const VecR*>(rb);
    VecR* rov = reinterpret_cast<VecR*>(rob);
    const int tail_at = n_body * VEC;            // the tail's start, from the body's

    // q (out's row strides) and the row's scales: their addresses here, not at the end of the
    // row, where the compiler recomputed the row's index from the thread's for them
    unsigned char* const qr = FORM != kPlain ? quant.q + row_offset<FLAT>(outer, inner, p.out) : nullptr;
    float* const row_scales = FORM == kPerToken || FORM == kPerGroup
        ? quant.scales + (FLAT ? (int)r * (int)quant.p.scales_row : r * quant.p.scales_row) : nullptr;
    wait_for_previous_kernel();                  // no global memory access before this
    if (flags & kEarlyTrigger) allow_next_kernel();
    const float static_scale = FORM == kStatic ? *quant.scale : 0.f;   // issued early, used at the end
    if constexpr (VECS_PER_THREAD > 0) {
        float part[SLOTS];                       // slot i: the squares of this thread's vector i
#pragma unroll
        for (int i = 0; i < SLOTS; ++i) part[i] = 0.f;
        if (active) {
            VecT xin[FUSED && VECS_PER_THREAD > 0 ? VECS_PER_THREAD : 1];     // the fused op's x
            VecR other[FUSED && VECS_PER_THREAD > 0 ? VECS_PER_THREAD : 1];
#pragma unroll
            for (int i = 0; i < VECS_PER_THREAD; ++i) {   // issue every body load before the first use
                const int v = first + i * STEP;
                if (v < n_body) {
                    if constexpr (FUSED) {
                        xin[i] = xv[v];
                        other[i] = rv[v];
                    } else {
                        keep[i] = xv[v];
                    }
                } else if (EDGES && v == n_body) {       // the tail, in the same registers
                    if constexpr (FUSED) {
                        xin[i] = load_partial<T, VEC>(xb + tail_at, tail);
                        other[i] = load_partial<R, VEC>(rb + tail_at, tail);
                    } else {
                        keep[i] = load_partial<T, VEC>(xb + tail_at, tail);
                    }
                }
            }
            if (prefetch_w) {
#pragma unroll
                for (int i = 0; i < VECS_PER_THREAD; ++i) {
                    const int v = first + i * STEP;
                    if (v < n_body) wk[i] = reinterpret_cast<const Pack<W, VEC>*>(w + head)[v];
                }
            }
            // the head's load goes out while the body loads are in flight
            if (has_head) head_v = load_scalar<T, R, FUSED>(xb, rb, rob, tid - head);
            const float head_ss = square(head_v);
#pragma unroll
            for (int i = 0; i < VECS_PER_THREAD; ++i) {
                const int v = first + i * STEP;
                if (v < n_body || (EDGES && v == n_body)) {
                    if constexpr (FUSED) {
                        keep[i] = rounded_sum(xin[i], other[i]);
                        if (v < n_body) rov[v] = keep[i];
                        else store_partial<R, VEC>(rob + tail_at, keep[i], tail);
                    }
                    part[i] = vector_squares<S, VEC>(keep[i]);
                }
            }
            if (has_head) part[0] += head_ss;
        }
        total = row_total<SLOTS, THREADS_PER_ROW, CLUSTER>(part, warp_sums);
    } else {
        // Streamed: an unbounded number of steps i, BATCH at a time (reduce.cuh: row_total).
        constexpr int BATCH = FUSED ? 2 : 4;   // (FUSED: two arrays' loads in flight)
        const int n_vec = n_body + (tail > 0);   // vectors, the tail's included
        const int steps = n_vec / STEP + (n_vec % STEP != 0);
        const float head_ss = has_head ? square(load_scalar<T, R, FUSED>(xb, rb, rob, tid - head)) : 0.f;
        total = row_total<BATCH, WARPS, CLUSTER>(steps, warp_sums, [&](int step, float (&part)[BATCH]) {
            const unsigned v0 = first + unsigned(step) * STEP;   // (unsigned: no overflow past the row)
            // Issue the batch's loads before the first use; unchecked where the whole batch
            // is in the row (all but the last), so that they can all go out at once.
            const bool whole = active && v0 + (BATCH - 1) * STEP < unsigned(n_body);
            VecT a[BATCH];
            VecR b[FUSED ? BATCH : 1];
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
                        if (FUSED) b[FUSED ? k : 0] = load_partial<R, VEC>(rb + tail_at, tail);
                    }
                }
            }
#pragma unroll
            for (int k = 0; k < BATCH; ++k) {
                const unsigned v = v0 + k * STEP;
                const bool is_tail = EDGES && !whole && has_tail && v == unsigned(n_body);
                part[k] = step + k == 0 ? head_ss : 0.f;
                if (whole || (active && v < unsigned(n_body)) || is_tail) {
                    if constexpr (FUSED) {
                        const VecR s = rounded_sum(a[k], b[k]);
                        if (is_tail) store_partial<R, VEC>(rob + tail_at, s, tail);
                        else rov[v] = s;
                        part[k] += vector_squares<R, VEC>(s);
                    } else {
                        part[k] += vector_squares<T, VEC>(a[k]);
                    }
                }
            }
        });
    }
    if (!active) return;                         // (never with a cluster: it shares one row)
    const float inv_rms = rsqrtf(total / (float)hidden + p.eps);
    // the body's values normalized: residual_out's when FUSED (where this same thread wrote the
    // rounded sum), else x's
    const S* sr = FUSED ? reinterpret_cast<const S*>(ror) : reinterpret_cast<const S*>(xr);
    const S* sb = sr + head;
    if constexpr (FORM != kPlain) {
        // the head element and its weight, as the plain output below takes them
        const float head_x = has_head ? (VECS_PER_THREAD == 0 ? to_float(sb[tid - head]) : head_v) : 0.f;
        const float head_w = has_head ? weight_at(w + head, tid - head, w_offset, flags) : 1.f;
        const RowState<S, T, W, VEC, VECS_PER_THREAD, PREFETCH_W> row{
            keep, wk, sr, w, head, n_body, first, STEP, tail_at, tail, tid, has_head, has_tail, w_vec,
            prefetch_w, head_x, head_w, w_offset, flags, inv_rms};
        store_quantized<VEC, THREADS_PER_ROW, VECS_PER_THREAD, CLUSTER, EDGES, FORM, QTYPE, FLAT>(row, qr, row_scales,
                                                                                          static_scale, quant, rank);
        return;
    }

    // The body comes from registers, or (streaming) is re-read from sb.
    O* yb = yr + head;
    Pack<O, VEC>* yv = reinterpret_cast<Pack<O, VEC>*>(yb);
    const VecS* sv = reinterpret_cast<const VecS*>(sb);
    const W* wb = w + head;
    if (VECS_PER_THREAD > 0) {
#pragma unroll
        for (int i = 0; i < VECS_PER_THREAD; ++i) {
            const int v = first + i * STEP;
            if (EDGES && v == n_body) finish_tail<S, O, W, VEC>(keep[i], yb, wb, tail_at, tail, inv_rms, w_offset, flags);
            if (v >= n_body) continue;
            if (prefetch_w) {
                float wv[VEC];
                weights_of<W, VEC>(wk[PREFETCH_W ? i : 0], w_offset, wv);
                yv[v] = scale_vec<S, O, W, VEC>(keep[i], wv, inv_rms, flags);
            } else {
                yv[v] = finish_vec<S, O, W, VEC>(keep[i], wb, v, w_vec, inv_rms, w_offset, flags);
            }
        }
    } else {
#pragma unroll 4
        for (int v = first; v < n_body; v += STEP) {
            const VecS a = sv[v];                // one vector load, not one per element
            yv[v] = finish_vec<S, O, W, VEC>(a, wb, v, w_vec, inv_rms, w_offset, flags);
        }
    }
    // The head comes last (a streamed row re-reads it, and its tail, as it does the body).
    if (has_head) {
        const int j = tid - head;                // (< 0: before the body)
        if (VECS_PER_THREAD == 0) head_v = to_float(sb[j]);
        yb[j] = normalize<O, W>(head_v, inv_rms, weight_at(wb, j, w_offset, flags), flags);
    }
    if (VECS_PER_THREAD == 0 && has_tail) finish_tail<S, O, W, VEC>(sb, yb, wb, tail_at, tail, inv_rms, w_offset, flags);
}

// R, O: the residual's and the output's types (mixed precision; row.cuh).
template <typename T, typename W, bool FUSED, int VEC, int THREADS_PER_ROW, int VECS_PER_THREAD, bool EDGES,
          typename R = T, typename O = T>
__global__ void __launch_bounds__(THREADS_PER_ROW > 256 ? THREADS_PER_ROW : 256,
                                  THREADS_PER_ROW > 256 ? 1024 / THREADS_PER_ROW : 3)
rms_norm_kernel(const T* x, const R* res, O* y, R* res_out, const W* w, const Params p) {
    norm_row<T, W, FUSED, VEC, THREADS_PER_ROW, VECS_PER_THREAD, EDGES, 1, kPlain, kE4M3, false, R, O>(
        x, res, y, res_out, w, p, linear_block(), 0);
    if (!(p.flags & kEarlyTrigger)) allow_next_kernel();
}

// The quantized forms: q (QTYPE bytes) at out's row strides instead of y; QuantForm (quant.cuh)
// says which scales. The launch geometry is the plain kernel's; FLAT: rows at 32-bit offsets
// (row_offset; LaunchPlan.flat says where). The dynamic forms on the vector grid keep their
// row's y in registers (per token: KEEP_Y; per group: SCATTER): in a block of 64-256 threads a
// row they are held to 48 registers (10 blocks of 128 an SM; at 55-63 registers, 8), which
// costs the per-token form a spill of up to 12 bytes and measured faster.
template <int FORM, bool EDGES, int THREADS_PER_ROW>
constexpr int quant_min_blocks_of_256() {
    return (FORM == kPerToken || FORM == kPerGroup) && !EDGES && THREADS_PER_ROW > 32 ? 5 : 3;
}

template <typename T, typename W, bool FUSED, int VEC, int THREADS_PER_ROW, int VECS_PER_THREAD, bool EDGES, int FORM,
          int QTYPE, bool FLAT, typename R = T>
__global__ void __launch_bounds__(THREADS_PER_ROW > 256 ? THREADS_PER_ROW : 256,
                                  THREADS_PER_ROW > 256 ? 1024 / THREADS_PER_ROW
                                                    : quant_min_blocks_of_256<FORM, EDGES, THREADS_PER_ROW>())
rms_norm_quant_kernel(const T* x, const R* res, unsigned char* q, R* res_out, const W* w, const float* scale,
                      float* scales, const Params p, const QuantParams qp) {
    static_assert(FORM != kPlain && (FORM != kPerGroup || !EDGES), "a quantized form; groups: whole vectors");
    norm_row<T, W, FUSED, VEC, THREADS_PER_ROW, VECS_PER_THREAD, EDGES, 1, FORM, QTYPE, FLAT, R, T>(
        x, res, static_cast<T*>(nullptr), res_out, w, p, linear_block(), 0, QuantArgs{q, scale, scales, qp});
    if (!(p.flags & kEarlyTrigger)) allow_next_kernel();
}

// A row split over a cluster of CLUSTER blocks (few long rows: more SMs per row). The grid's
// x extent is a multiple of CLUSTER, so a cluster's blocks are CLUSTER consecutive linear blocks.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define RMSNORM_CLUSTER_DIMS(c)
#else
#define RMSNORM_CLUSTER_DIMS(c) __cluster_dims__(c, 1, 1)
#endif

template <typename T, typename W, bool FUSED, int VEC, int THREADS_PER_ROW, int VECS_PER_THREAD, bool EDGES, int CLUSTER,
          typename R = T, typename O = T>
__global__ void RMSNORM_CLUSTER_DIMS(CLUSTER) __launch_bounds__(THREADS_PER_ROW, 1)
rms_norm_cluster_kernel(const T* x, const R* res, O* y, R* res_out, const W* w, const Params p) {
    const long long b = linear_block();
    norm_row<T, W, FUSED, VEC, THREADS_PER_ROW, VECS_PER_THREAD, EDGES, CLUSTER, kPlain, kE4M3, false, R, O>(
        x, res, y, res_out, w, p, b / CLUSTER, (int)(b % CLUSTER));
    if (!(p.flags & kEarlyTrigger)) allow_next_kernel();
    cluster_done();
}

template <typename T, typename W, bool FUSED, int VEC, int THREADS_PER_ROW, int VECS_PER_THREAD, bool EDGES, int CLUSTER,
          int FORM, int QTYPE, typename R = T>
__global__ void RMSNORM_CLUSTER_DIMS(CLUSTER) __launch_bounds__(THREADS_PER_ROW, 1)
rms_norm_quant_cluster_kernel(const T* x, const R* res, unsigned char* q, R* res_out, const W* w,
                              const float* scale, float* scales, const Params p, const QuantParams qp) {
    static_assert(FORM != kPlain && (FORM != kPerGroup || !EDGES), "a quantized form; groups: whole vectors");
    const long long b = linear_block();
    norm_row<T, W, FUSED, VEC, THREADS_PER_ROW, VECS_PER_THREAD, EDGES, CLUSTER, FORM, QTYPE, false, R, T>(
        x, res, static_cast<T*>(nullptr), res_out, w, p, b / CLUSTER, (int)(b % CLUSTER), QuantArgs{q, scale, scales, qp});
    if (!(p.flags & kEarlyTrigger)) allow_next_kernel();
    cluster_done();
}

}  // namespace rmsnorm