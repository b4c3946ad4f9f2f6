import ml_dtypes
import numpy as np

from ..._reference import _normalized, _summed

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
    return _quantized(x, weight, eps, weight_offset, casting_mode, x.dtype, scale=scale, group_size=group_size,
                      scale_ub=scale_ub, quant_dtype=quant_dtype)


def _quantized(x, weight, eps, weight_offset, casting_mode, round_dtype, *, scale=None, group_size=None,
               scale_ub=None, quant_dtype="float8_e4m3fn"):
    """``(q, scales)`` of x's normalized values, llama mode rounding to ``round_dtype``."""
    with np.errstate(divide="ignore", over="ignore", invalid="ignore", under="ignore"):
        y = _normalized(x, weight, eps, weight_offset, casting_mode, round_dtype)
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
    """``(q, residual_out, scales)``: ``rms_norm_quant_reference`` of round(x + residual).

    round(x + residual) is to the residual's dtype (a float32 residual stream: float32);
    llama mode rounds x * inv_rms to x's dtype, as the unfused quantized form does."""
    summed = _summed(x, residual)
    q, scales = _quantized(summed, weight, eps, weight_offset, casting_mode, np.asarray(x).dtype, **quant)
    return q, summed, scales
