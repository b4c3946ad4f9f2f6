// Device code the backward programs share (rms_norm_backward.cu, rms_norm_gated_backward.cu,
// qk_norm_rope_backward.cu): a row's statistics from its two sums (reduce.cuh: row_sums), the
// block's row of dweight partial sums, and the kernel that adds the partial rows in a fixed
// order (no float atomics: the same bits every run).
#pragma once

#include "common.cuh"
#include "reduce.cuh"

namespace rmsnorm {

// BackwardParams.flags: Flags' kLlama and kHasWeight (g = dy * w'), and these
// dx += d_residual_out; write dweight partials; write dweight itself (a grid of one block).
// The row kernel takes its flags as a template argument instead, with two promises more:
// n_inner == 1 (a row's offset without a division) and the weight aligned to its vectors.
enum BackwardFlags { kAddGrad = 8, kWeightGrad = 16, kDirectWeight = 32, kUnitRows = 64, kWeightVectors = 128 };

// xhat as the weight multiply of the forward saw it: rounded to T in llama mode.
template <typename T>
__device__ __forceinline__ float xhat_for_weight(float xf, float inv_rms, int flags) {
    const float n = xf * inv_rms;
    return (flags & kLlama) ? to_float(from_float<T>(n)) : n;
}

// v / hidden. For a power of two the product with its reciprocal 2^-k is the same correctly
// rounded quotient, bit for bit, without the division's instruction sequence: two of those
// follow a row's sums in its chain of latency, which is the whole time of a one-row block.
__device__ __forceinline__ float over_hidden(float v, int hidden) {
    return (hidden & (hidden - 1)) == 0 ? v * __int_as_float((128 - __ffs(hidden)) << 23) : v / (float)hidden;
}

// A row's inv_rms and c = mean(g * xhat) from its sums (sum x^2, sum g * x): the one formula
// every backward kernel uses.
__device__ __forceinline__ float2 row_statistics(float ss, float sgx, int hidden, float eps) {
    const float inv_rms = rsqrtf(over_hidden(ss, hidden) + eps);
    return make_float2(inv_rms, over_hidden(sgx * inv_rms, hidden));
}

// Where a block's dweight sums go: its row of float32 partials, or (direct: the grid's only
// block) dweight itself in the weight's dtype. put_vector: VEC consecutive columns from j,
// in 16-byte stores where the address allows.
template <typename W>
struct DweightRow {
    float* partials;
    W* dweight;
    bool direct;

    __device__ __forceinline__ void put(int j, float v) const {
        if (direct) dweight[j] = from_float<W>(v);
        else partials[j] = v;
    }
    template <int VEC>
    __device__ __forceinline__ void put_vector(int j, const float (&v)[VEC]) const {
        if (direct) {
            W* d = dweight + j;
            if (reinterpret_cast<unsigned long long>(d) % sizeof(Pack<W, VEC>) == 0) {
                Pack<W, VEC> pk;
#pragma unroll
                for (int e = 0; e < VEC; ++e) pk.v[e] = from_float<W>(v[e]);
                *reinterpret_cast<Pack<W, VEC>*>(d) = pk;
                return;
            }
        } else if (VEC % 4 == 0 && reinterpret_cast<unsigned long long>(partials + j) % 16 == 0) {
#pragma unroll
            for (int e = 0; e < VEC; e += 4)
                *reinterpret_cast<float4*>(partials + j + e) = make_float4(v[e], v[e + 1], v[e + 2], v[e + 3]);
            return;
        }
#pragma unroll
        for (int e = 0; e < VEC; ++e) put(j + e, v[e]);
    }
};

// The reduction kernel's sizes (mirrored by REDUCE_PARAMS_DTYPE).
struct ReduceParams {
    long long partials, hidden;
};
static_assert(sizeof(ReduceParams) == 16, "ReduceParams: 16 bytes, as cupy_rmsnorm/_abi.py packs it");

// dweight[j] = sum over the partial rows, in a fixed order. A block takes REDUCE_COLUMNS
// columns: REDUCE_COLUMNS / 4 threads across, four columns each (one 16-byte load when the
// partial rows are 16-byte aligned, hidden % 4 == 0), and REDUCE_SLICES slices down; slice s
// adds the partial rows s, s + REDUCE_SLICES, ..., then the slices are added in order. Many
// slices and 16-byte loads keep enough bytes in flight: with 8 slices of 4-byte loads this
// kernel waited on memory latency and took as long as the whole dx pass at 256 x 4096.
constexpr int REDUCE_COLUMNS = 32, REDUCE_SLICES = 32;   // the block: 8 x 32 = 256 threads
constexpr int REDUCE_ACROSS = REDUCE_COLUMNS / 4;

template <typename W>
__global__ void __launch_bounds__(REDUCE_ACROSS * REDUCE_SLICES)
rms_norm_backward_reduce_kernel(const float* partials, W* dweight, const ReduceParams p) {
    __shared__ float4 slices[REDUCE_SLICES][REDUCE_ACROSS];
    const int lane = threadIdx.x % REDUCE_ACROSS, slice = threadIdx.x / REDUCE_ACROSS;
    const long long j = (long long)blockIdx.x * REDUCE_COLUMNS + 4 * lane;   // this thread's first column
    wait_for_previous_kernel();
    float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
    if (p.hidden % 4 == 0 && j < p.hidden) {
        const float* col = partials + j;
#pragma unroll 8
        for (long long k = slice; k < p.partials; k += REDUCE_SLICES) {
            const float4 v = *reinterpret_cast<const float4*>(col + k * p.hidden);
            s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
        }
    } else if (j < p.hidden) {
        const int n = (int)min(4LL, p.hidden - j);
#pragma unroll 4
        for (long long k = slice; k < p.partials; k += REDUCE_SLICES) {
            const float* row = partials + k * p.hidden + j;
            s.x += row[0];
            if (n > 1) s.y += row[1];
            if (n > 2) s.z += row[2];
            if (n > 3) s.w += row[3];
        }
    }
    slices[slice][lane] = s;
    __syncthreads();
    if (slice == 0 && j < p.hidden) {
        float4 t = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int k = 0; k < REDUCE_SLICES; ++k) {
            const float4 v = slices[k][lane];
            t.x += v.x; t.y += v.y; t.z += v.z; t.w += v.w;
        }
        const int n = (int)min(4LL, p.hidden - j);
        dweight[j] = from_float<W>(t.x);
        if (n > 1) dweight[j + 1] = from_float<W>(t.y);
        if (n > 2) dweight[j + 2] = from_float<W>(t.z);
        if (n > 3) dweight[j + 3] = from_float<W>(t.w);
    }
    allow_next_kernel();
}

}  // namespace rmsnorm
