// Device code the LayerNorm programs share (layer_norm.cu, layer_norm_backward.cu): flags,
// a row's sums in the canonical tree, and the explicitly rounded float32 steps that
// cupy_rmsnorm/_layer_norm_reference.py mirrors operation for operation.
//
// Every step is one float32 operation rounded on its own (__fadd_rn, __fmul_rn, ...): the
// compiler may not fuse a multiply and an add into an FMA, whose single rounding the NumPy
// reference cannot reproduce. So the kernels give the reference's bits, flush to zero aside.
#pragma once

#include "common.cuh"
#include "reduce.cuh"

namespace rmsnorm {

// LayerNormParams.flags and LayerNormBackwardParams.flags: Flags' kHasWeight and
// kEarlyTrigger (common.cuh), and these (above every other program's bits).
enum LayerNormFlags {
    kLnHasBias = 1024,
    kLnAddGrad = 2048,       // backward: dx += d_residual_out (the fused op)
    kLnParamGrad = 4096,     // backward: dweight / dbias of the parameters present
    kLnModGrad = 8192,       // backward: dshift and dscale
    kLnDirectParam = 16384,  // backward, a grid of one block: dweight / dbias written directly
    kLnDirectMod = 32768,    // backward, one block per modulation group: dshift / dscale directly
};

// The sum of a vector's elements, the canonical tree's lowest levels.
template <typename T, int VEC>
__device__ __forceinline__ float vector_sum(const Pack<T, VEC>& a) {
    float q[VEC];
    unpack(a, q);
    return pairwise_sum(q);
}

// The sum of a vector's (x - mean)^2, each difference and square rounded on its own.
template <typename T, int VEC>
__device__ __forceinline__ float centered_squares(const Pack<T, VEC>& a, float mean) {
    float q[VEC];
    unpack(a, q);
#pragma unroll
    for (int e = 0; e < VEC; ++e) q[e] = square(__fsub_rn(q[e], mean));
    return pairwise_sum(q);
}

// N sums of a row held as SLOTS values per thread (slot i: the thread's vector i) over a
// group of THREADS_PER_ROW threads (a power of two): the canonical tree of reduce.cuh
// (vector, lanes, warps, slots), each of the N sums on its own. Every thread of the block
// calls it; with more than a warp a row, `shared` carries the warps' sums (the barrier in
// front keeps a previous call's readers ahead of this call's writers).
template <int THREADS_PER_ROW, int SLOTS>
struct RowSums {
    static constexpr int LANES = THREADS_PER_ROW < 32 ? THREADS_PER_ROW : 32;
    static constexpr int WARPS = THREADS_PER_ROW > 32 ? THREADS_PER_ROW / 32 : 1;
    using Lanes = SlotSums<SLOTS, LANES>;

    template <int N>
    __device__ __forceinline__ static void total(float (&part)[N][SLOTS], float (&shared)[N][SLOTS][WARPS],
                                                 float (&out)[N]) {
#pragma unroll
        for (int q = 0; q < N; ++q) Lanes::over_lanes(part[q]);
        if (THREADS_PER_ROW <= 32) {
#pragma unroll
            for (int q = 0; q < N; ++q) out[q] = Lanes::slot_tree(part[q]);
            return;
        }
        const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
        __syncthreads();
        if (lane < Lanes::HOLDERS) {
#pragma unroll
            for (int q = 0; q < N; ++q)
#pragma unroll
                for (int k = 0; k < Lanes::KEPT; ++k) shared[q][Lanes::held(lane, k)][warp] = part[q][k];
        }
        __syncthreads();
#pragma unroll
        for (int q = 0; q < N; ++q) out[q] = block_total<SLOTS, WARPS, 1>(shared[q], SLOTS, true);
    }
};

// rstd = 1 / sqrt(var + eps), var = sumsq / hidden: correctly rounded steps (not rsqrtf), as
// the reference's np.float32(1) / np.sqrt(...).
__device__ __forceinline__ float rstd_of(float sumsq, int hidden, float eps) {
    return __frcp_rn(__fsqrt_rn(__fadd_rn(__fdiv_rn(sumsq, (float)hidden), eps)));
}

// A parameter vector (weight, bias, shift, scale) as floats: one vector load when `vec`
// (the address is aligned to it), else element by element.
template <typename W, int VEC>
__device__ __forceinline__ void load_param(const W* p, int v, bool vec, float (&f)[VEC]) {
    if (vec) {
        unpack(reinterpret_cast<const Pack<W, VEC>*>(p)[v], f);
    } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) f[e] = to_float(p[v * VEC + e]);
    }
}

template <typename W, int VEC>
__device__ __forceinline__ bool vector_aligned(const W* p) {
    return reinterpret_cast<unsigned long long>(p) % sizeof(Pack<W, VEC>) == 0;
}

// a = ((x - mean) * rstd) * w + b, absent parameters skipped (not multiplied by one or added
// zero: -0 stays -0, as in the reference); n (xhat) returned too.
__device__ __forceinline__ float affine(float x, float mean, float rstd, float w, float b, int flags, float& n) {
    n = __fmul_rn(__fsub_rn(x, mean), rstd);
    float a = (flags & kHasWeight) ? __fmul_rn(n, w) : n;
    return (flags & kLnHasBias) ? __fadd_rn(a, b) : a;
}

// The modulation (adaLN): a * (1 + scale) + shift.
__device__ __forceinline__ float modulate(float a, float shift, float scale) {
    return __fadd_rn(__fmul_rn(a, __fadd_rn(1.0f, scale)), shift);
}

}  // namespace rmsnorm
