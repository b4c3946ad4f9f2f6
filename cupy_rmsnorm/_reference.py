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


# -- backward ----------------------------------------------------------------------------------
# Per row, in float32 (kernels/rms_norm_backward.cu computes the same):
#   r = 1 / sqrt(sum(x^2) / hidden + eps), xhat = x * r, w' = weight + weight_offset,
#   g = dy * w' (dy without a weight), dx = r * (g - xhat * mean(g * xhat));
#   dweight = sum over rows of dy * xhat, with xhat rounded to x's dtype first in llama
#   mode (what the forward multiplied the weight by), summed in float32 and returned in
#   the weight's dtype.
# The fused op's gradient at s = round(x + residual) is rms_norm's dx at s plus the gradient
# of residual_out, rounded once; it is the gradient of both x and residual.


def _backward_float32(dy, x, weight, eps, weight_offset, casting_mode, weight_grad=True):
    """(dx in float32, dweight in the weight's dtype or None)."""
    hidden = x.shape[-1]
    xf = np.asarray(x, dtype=np.float32)
    dyf = np.asarray(dy, dtype=np.float32)
    sumsq = np.sum(xf * xf, axis=-1, keepdims=True, dtype=np.float32)
    inv_rms = np.float32(1.0) / np.sqrt(sumsq / np.float32(hidden) + np.float32(eps))
    xhat = xf * inv_rms
    g = dyf if weight is None else dyf * (np.asarray(weight, dtype=np.float32) + np.float32(weight_offset))
    mean_gx = np.sum(g * xhat, axis=-1, keepdims=True, dtype=np.float32) / np.float32(hidden)
    dx = inv_rms * (g - xhat * mean_gx)
    if weight is None or not weight_grad:
        return dx, None
    if casting_mode == "llama":
        xhat = xhat.astype(x.dtype).astype(np.float32)
    dweight = np.sum((dyf * xhat).reshape(-1, hidden), axis=0, dtype=np.float32)
    return dx, dweight.astype(np.asarray(weight).dtype)


def rms_norm_backward_reference(dy, x, weight=None, eps=1e-6, weight_offset=0.0, casting_mode="fp32"):
    """``(dx, dweight)`` of ``rms_norm`` in NumPy, following the contract above (dweight
    None when weight is None); quiet about infinities and NaNs, as the forward."""
    with np.errstate(divide="ignore", over="ignore", invalid="ignore", under="ignore"):
        dx, dweight = _backward_float32(dy, x, weight, eps, weight_offset, casting_mode)
        return dx.astype(x.dtype), dweight


def fused_add_rms_norm_backward_reference(dy, d_residual_out, residual_out, weight=None, eps=1e-6,
                                          weight_offset=0.0, casting_mode="fp32"):
    """``(d_input, dweight)`` of ``fused_add_rms_norm`` in NumPy: ``residual_out`` is the
    forward's s = round(x + residual), ``d_residual_out`` the gradient of that output (None
    for zero); d_input is the gradient of both x and residual."""
    with np.errstate(divide="ignore", over="ignore", invalid="ignore", under="ignore"):
        dx, dweight = _backward_float32(dy, residual_out, weight, eps, weight_offset, casting_mode)
        if d_residual_out is not None:
            dx = dx + np.asarray(d_residual_out, dtype=np.float32)
        return dx.astype(residual_out.dtype), dweight
