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
- the quantized forms (``rms_norm_quant`` / ``fused_add_rms_norm_quant``) quantize y as it
  stands in float32 before that final rounding (see "quantized outputs" below).

Known differences from the GPU kernels, all within a float32 ulp or two: the kernels
sum in another order, use the hardware ``rsqrtf`` and, as CuPy compiles them, flush
float32 subnormals to zero.
"""

import ml_dtypes
import numpy as np

CASTING_MODES = ("fp32", "llama")


def rms_norm_reference(x, weight=None, eps=1e-6, weight_offset=0.0, casting_mode="fp32"):
    """``rms_norm`` over the last axis of a NumPy array, following the contract above.

    Infinities and NaNs come out as IEEE arithmetic makes them (an all-zero row with
    eps=0 gives NaN), quietly, as from the GPU kernels: no RuntimeWarning."""
    with np.errstate(divide="ignore", over="ignore", invalid="ignore", under="ignore"):
        return _rms_norm(x, weight, eps, weight_offset, casting_mode)


def _rms_norm(x, weight, eps, weight_offset, casting_mode):
    return _normalized(x, weight, eps, weight_offset, casting_mode).astype(x.dtype)


def _normalized(x, weight, eps, weight_offset, casting_mode):
    """y in float32, before the final rounding (what the quantized forms quantize)."""
    dtype = x.dtype
    xf = np.asarray(x, dtype=np.float32)
    sumsq = np.sum(xf * xf, axis=-1, keepdims=True, dtype=np.float32)
    inv_rms = np.float32(1.0) / np.sqrt(sumsq / np.float32(x.shape[-1]) + np.float32(eps))
    normed = xf * inv_rms
    if casting_mode == "llama":     # (without a weight the final rounding makes this moot)
        normed = normed.astype(dtype).astype(np.float32)
    if weight is None:
        return normed
    w = np.asarray(weight, dtype=np.float32) + np.float32(weight_offset)
    return normed * w


def fused_add_rms_norm_reference(x, residual, weight=None, eps=1e-6, weight_offset=0.0,
                                 casting_mode="fp32"):
    """``(rms_norm(round(x + residual)), round(x + residual))`` in NumPy."""
    with np.errstate(over="ignore", invalid="ignore"):
        summed = (np.asarray(x, dtype=np.float32) + np.asarray(residual, dtype=np.float32)).astype(x.dtype)
    return rms_norm_reference(summed, weight, eps, weight_offset, casting_mode), summed


# -- quantized outputs -----------------------------------------------------------------------------
# y is the float32 value above before its final rounding (llama mode included). Then, in float32:
#   static:    scale given (one float32 in device memory);
#   per token: amax = max |y| over the row (NaN ignored, as fmaxf does), per group: over each
#              run of group_size elements; scale = max(min(amax, scale_ub) / QMAX, MIN_SCALE);
#   inv = 1 / scale (correctly rounded); q = sat(round(y * inv)) to the quant dtype: round to
#   nearest even, saturating at +-QMAX (an infinity too), NaN stays NaN (int8: 0).
# Multiplying by the reciprocal (as FlashInfer and vLLM's static form do) rather than dividing
# per element keeps the kernel off the ALU limit; both sides compute exactly this.
QUANT_DTYPES = {"float8_e4m3fn": (ml_dtypes.float8_e4m3fn, 448.0),
                "float8_e5m2": (ml_dtypes.float8_e5m2, 57344.0),
                "int8": (np.dtype(np.int8), 127.0)}
GROUP_SIZES = (128,)
MIN_SCALE_DIVISOR = 512.0   # MIN_SCALE = 1 / (QMAX * 512) (vLLM's): an all-zero row gives zeros, not NaN


def quant_max(quant_dtype):
    """QMAX: the largest finite value of the quant dtype (the saturation bound)."""
    return QUANT_DTYPES[quant_dtype][1]


def min_scale(quant_dtype):
    return np.float32(1.0) / np.float32(quant_max(quant_dtype) * MIN_SCALE_DIVISOR)


def dynamic_scales(y, quant_dtype, scale_ub=None):
    """float32 scales of y's last axis (keepdims): max(min(amax, scale_ub) / QMAX, MIN_SCALE)."""
    with np.errstate(invalid="ignore"):
        amax = np.max(np.where(np.isnan(y), np.float32(0), np.abs(y)), axis=-1, keepdims=True)
    if scale_ub is not None:
        amax = np.minimum(amax, np.float32(scale_ub))
    return np.maximum(amax / np.float32(quant_max(quant_dtype)), min_scale(quant_dtype))


def quantize(y, scale, quant_dtype):
    """``sat(round(y * (1 / scale)))`` in the quant dtype (ml_dtypes float8, or int8)."""
    dtype, qmax = QUANT_DTYPES[quant_dtype]
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        inv = np.float32(1.0) / np.asarray(scale, dtype=np.float32)
        v = np.clip(y * inv, np.float32(-qmax), np.float32(qmax))   # NaN stays NaN
        if dtype == np.int8:
            return np.where(np.isnan(v), np.float32(0), np.rint(v)).astype(np.int8)
        return v.astype(dtype)


def rms_norm_quant_reference(x, weight=None, eps=1e-6, weight_offset=0.0, casting_mode="fp32", *,
                             scale=None, group_size=None, scale_ub=None, quant_dtype="float8_e4m3fn"):
    """``(q, scales)``: ``rms_norm``'s y before its final rounding, quantized (see above).

    ``scale`` given: the static form (scales is that scale, as float32); else per token
    (scales of shape x.shape[:-1] + (1,)) or, with ``group_size``, per group of that many
    elements (scales of shape x.shape[:-1] + (hidden // group_size,), contiguous here)."""
    with np.errstate(divide="ignore", over="ignore", invalid="ignore", under="ignore"):
        y = _normalized(x, weight, eps, weight_offset, casting_mode)
    if scale is not None:
        scales = np.asarray(scale, dtype=np.float32)
        return quantize(y, scales.reshape(()), quant_dtype), scales
    if group_size is None:
        scales = dynamic_scales(y, quant_dtype, scale_ub)
        return quantize(y, scales, quant_dtype), scales
    groups = y.reshape(y.shape[:-1] + (y.shape[-1] // group_size, group_size))
    scales = dynamic_scales(groups, quant_dtype, scale_ub)
    return quantize(groups, scales, quant_dtype).reshape(y.shape), scales[..., 0]


def fused_add_rms_norm_quant_reference(x, residual, weight=None, eps=1e-6, weight_offset=0.0,
                                       casting_mode="fp32", **quant):
    """``(q, residual_out, scales)``: ``rms_norm_quant_reference`` of round(x + residual)."""
    with np.errstate(over="ignore", invalid="ignore"):
        summed = (np.asarray(x, dtype=np.float32) + np.asarray(residual, dtype=np.float32)).astype(x.dtype)
    q, scales = rms_norm_quant_reference(summed, weight, eps, weight_offset, casting_mode, **quant)
    return q, summed, scales


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
