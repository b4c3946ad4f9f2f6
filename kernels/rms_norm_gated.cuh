// Gated RMSNorm (Gated DeltaNet, Mamba2, Nemotron-H, flash-linear-attention): what the forward
// (rms_norm_gated.cu) and the backward (rms_norm_gated_backward.cu) share.
//
//   norm before gate (GATE_FIRST false): y = rmsnorm(x) * w' * act(z)
//   gate before norm (GATE_FIRST true):  y = rmsnorm(x * act(z)) * w'
//
// w' = w + weight_offset, z the gate, act silu (z * sigmoid(z)) or sigmoid. A row of the
// caller's arrays is `groups` groups of `hidden` elements, each normalized on its own (the
// weight runs over the whole row): the kernels see the groups as rows. Numerics (the contract
// in cupy_rmsnorm/_reference.py): float32 throughout, the sum of squares in the canonical tree
// (reduce.cuh, so a group's bits depend on the group alone); kLlama rounds like the Hugging
// Face modules: x * inv_rms to the output type O (and with kRoundProduct, its product with the
// weight, as `weight * hidden.to(dtype)` in the weight's dtype), then the gate in float32, one
// rounding to O at the end. The backward rounds as the forward did, to dy's type D (= O).
//
// Rows are on the vector grid (the launcher lowers VEC until every group starts on it and
// holds whole vectors: no scalar head or tail).
#pragma once

#include "common.cuh"

namespace rmsnorm {

// GatedParams.flags: Flags' kLlama, kHasWeight, kEarlyTrigger and this; the backward's also
// BackwardFlags' kWeightGrad and kDirectWeight (backward.cuh).
enum GatedFlags { kRoundProduct = 256 };
enum Activation { kSilu = 0, kSigmoid = 1 };

// act(z) and its derivative, in float32: sigmoid(z) = 1 / (1 + exp(-z)) with the hardware
// exponential and the hardware's fast division, as Triton's sigmoid (z -> -inf: 0; z -> +inf:
// 1); a correctly rounded reciprocal costs a slower instruction sequence per element.
template <int ACT>
__device__ __forceinline__ float activation(float z) {
    const float s = __fdividef(1.0f, 1.0f + __expf(-z));
    return ACT == kSilu ? z * s : s;
}

template <int ACT>
__device__ __forceinline__ void activation_and_grad(float z, float& a, float& da) {
    const float s = __fdividef(1.0f, 1.0f + __expf(-z));
    a = ACT == kSilu ? z * s : s;
    da = ACT == kSilu ? s * (1.0f + z * (1.0f - s)) : s * (1.0f - s);
}

}  // namespace rmsnorm
