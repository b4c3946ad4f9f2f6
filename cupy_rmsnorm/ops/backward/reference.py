import numpy as np

from ..._reference import _backward_float32


def rms_norm_backward_reference(dy, x, weight=None, eps=1e-6, weight_offset=0.0, casting_mode="fp32"):
    """``(dx, dweight)`` of ``rms_norm`` in NumPy, following the contract above (dweight
    None when weight is None; dx in x's dtype; dy in the forward's output dtype, which llama
    mode's xhat is rounded to); quiet about infinities and NaNs, as the forward."""
    with np.errstate(divide="ignore", over="ignore", invalid="ignore", under="ignore"):
        dx, dweight = _backward_float32(dy, x, weight, eps, weight_offset, casting_mode)
        return dx.astype(x.dtype), dweight


def fused_add_rms_norm_backward_reference(dy, d_residual_out, residual_out, weight=None, eps=1e-6,
                                          weight_offset=0.0, casting_mode="fp32"):
    """``(d_input, dweight)`` of ``fused_add_rms_norm`` in NumPy: ``residual_out`` is the
    forward's s = round(x + residual), ``d_residual_out`` the gradient of that output (None
    for zero); d_input is the gradient of both x and residual, in residual_out's dtype (dy
    may be in another: the forward's y dtype)."""
    with np.errstate(divide="ignore", over="ignore", invalid="ignore", under="ignore"):
        dx, dweight = _backward_float32(dy, residual_out, weight, eps, weight_offset, casting_mode)
        if d_residual_out is not None:
            dx = dx + np.asarray(d_residual_out, dtype=np.float32)
        return dx.astype(residual_out.dtype), dweight
