"""The numerics contract, written once in NumPy.

This is the CPU path for NumPy arrays and the reference the GPU tests compare with.
Every step mirrors ``kernels/rms_norm.cu``:

- the sum of squares is accumulated in float32 whatever the storage dtype;
  ``inv_rms = 1 / sqrt(sum / hidden + eps)``;
- fused: ``residual_out = round(x + residual)`` to the storage dtype first, and that
  rounded value is what gets squared and normalized;
- ``casting_mode="fp32"``: ``y = round(x * inv_rms * (weight + weight_offset))``,
  one rounding at the end (torch.nn.functional.rms_norm, Gemma);
  ``casting_mode="llama"``: ``y = round(round(x * inv_rms) * (weight + weight_offset))``
  (HF LlamaRMSNorm, vLLM).

Known differences from the GPU kernels, all within a float32 ulp or two: the kernels
sum in another order, use the hardware ``rsqrtf`` and, as CuPy compiles them, flush
float32 subnormals to zero.
"""

import numpy as np

CASTING_MODES = ("fp32", "llama")


def rms_norm_reference(x, weight=None, eps=1e-6, weight_offset=0.0, casting_mode="fp32"):
    """``rms_norm`` over the last axis of a NumPy array, following the contract above.

    Infinities and NaNs come out as IEEE arithmetic makes them (an all-zero row with
    eps=0 gives NaN), quietly, as from the GPU kernels: no RuntimeWarning."""
    with np.errstate(divide="ignore", over="ignore", invalid="ignore", under="ignore"):
        return _rms_norm(x, weight, eps, weight_offset, casting_mode)


def _rms_norm(x, weight, eps, weight_offset, casting_mode):
    dtype = x.dtype
    xf = np.asarray(x, dtype=np.float32)
    sumsq = np.sum(xf * xf, axis=-1, keepdims=True, dtype=np.float32)
    inv_rms = np.float32(1.0) / np.sqrt(sumsq / np.float32(x.shape[-1]) + np.float32(eps))
    normed = xf * inv_rms
    if weight is None:
        return normed.astype(dtype)
    if casting_mode == "llama":
        normed = normed.astype(dtype).astype(np.float32)
    w = np.asarray(weight, dtype=np.float32) + np.float32(weight_offset)
    return (normed * w).astype(dtype)


def fused_add_rms_norm_reference(x, residual, weight=None, eps=1e-6, weight_offset=0.0,
                                 casting_mode="fp32"):
    """``(rms_norm(round(x + residual)), round(x + residual))`` in NumPy."""
    with np.errstate(over="ignore", invalid="ignore"):
        summed = (np.asarray(x, dtype=np.float32) + np.asarray(residual, dtype=np.float32)).astype(x.dtype)
    return rms_norm_reference(summed, weight, eps, weight_offset, casting_mode), summed
