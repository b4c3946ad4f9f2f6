"""cupy_rmsnorm: RMSNorm and fused residual-add + RMSNorm for CuPy, NumPy and PyTorch.

    import cupy_rmsnorm as rn
    y = rn.rms_norm(x, weight)
    y, residual = rn.fused_add_rms_norm(x, residual, weight)
    q, scales = rn.rms_norm_quant(x, weight)                       # FP8 e4m3fn, a scale per token
    dx, dweight = rn.rms_norm_backward(dy, x, weight)
    d_input, dweight = rn.fused_add_rms_norm_backward(dy, d_residual_out, residual_out, weight)
    y = rn.rms_norm_gated(x, gate, weight)                        # rmsnorm(x) * weight * silu(gate)
    q, k = rn.qk_norm_rope(q, k, q_weight, k_weight, positions=positions, cos_sin_cache=cache)  # Qwen3
"""

import sys

from . import _call
from ._api import (fused_add_rms_norm, fused_add_rms_norm_backward, fused_add_rms_norm_quant, qk_norm_rope,
                   qk_norm_rope_backward, rms_norm, rms_norm_backward, rms_norm_gated, rms_norm_gated_backward,
                   rms_norm_quant)
from ._plan import BackwardPlan, LaunchPlan, backward_plan, launch_plan
from ._reference import (fused_add_rms_norm_backward_reference, fused_add_rms_norm_quant_reference,
                         fused_add_rms_norm_reference, qk_norm_rope_backward_reference, qk_norm_rope_reference,
                         rms_norm_backward_reference, rms_norm_gated_backward_reference, rms_norm_gated_reference,
                         rms_norm_quant_reference, rms_norm_reference)

__version__ = "0.2.0"
__all__ = ["rms_norm", "fused_add_rms_norm", "rms_norm_backward", "fused_add_rms_norm_backward",
           "rms_norm_quant", "fused_add_rms_norm_quant", "rms_norm_gated", "rms_norm_gated_backward",
           "rms_norm_gated_reference", "rms_norm_gated_backward_reference", "rms_norm_quant_reference", "fused_add_rms_norm_quant_reference",
           "qk_norm_rope", "qk_norm_rope_backward", "qk_norm_rope_reference", "qk_norm_rope_backward_reference",
           "LaunchPlan", "launch_plan", "BackwardPlan", "backward_plan",
           "rms_norm_reference", "fused_add_rms_norm_reference",
           "rms_norm_backward_reference", "fused_add_rms_norm_backward_reference", "__version__"]


def _load_torch_ops():
    """Register the torch ops, which routes calls made while torch.compile traces to them
    (the call flow asks for this at the first torch tensor; it never imports torch itself)."""
    from . import _torch_ops  # noqa: F401 - the import registers them and installs the tracing hook


_call.load_torch_ops = _load_torch_ops
if sys.modules.get("torch") is not None:   # torch is in use: tracing must find the ops from the start
    _load_torch_ops()
