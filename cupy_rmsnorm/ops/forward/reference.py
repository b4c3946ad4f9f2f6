import numpy as np

from ..._reference import _out_dtype, _rms_norm, _summed


def rms_norm_reference(x, weight=None, eps=1e-6, weight_offset=0.0, casting_mode="fp32", *, out_dtype=None):
    """``rms_norm`` over the last axis of a NumPy array, following the contract above.

    ``out_dtype``: y's dtype O (None: x's); llama mode rounds x * inv_rms to O before the
    weight multiply. Infinities and NaNs come out as IEEE arithmetic makes them (an all-zero
    row with eps=0 gives NaN), quietly, as from the GPU kernels: no RuntimeWarning."""
    with np.errstate(divide="ignore", over="ignore", invalid="ignore", under="ignore"):
        return _rms_norm(x, weight, eps, weight_offset, casting_mode, out_dtype)


def fused_add_rms_norm_reference(x, residual, weight=None, eps=1e-6, weight_offset=0.0,
                                 casting_mode="fp32", *, out_dtype=None):
    """``(rms_norm(round(x + residual)), round(x + residual))`` in NumPy.

    The sum is ``x + residual`` in float32 rounded to the residual's dtype (x's, or float32
    for a float32 residual stream with 16-bit x): that is residual_out, and y normalizes its
    values, in O = ``out_dtype`` or x's dtype (llama mode rounding to O)."""
    summed = _summed(x, residual)
    return rms_norm_reference(summed, weight, eps, weight_offset, casting_mode,
                              out_dtype=_out_dtype(x, out_dtype)), summed
