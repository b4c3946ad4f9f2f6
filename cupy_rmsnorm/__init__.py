"""cupy_rmsnorm: RMSNorm and fused residual-add + RMSNorm for CuPy, NumPy and PyTorch.

    import cupy_rmsnorm as rn
    y = rn.rms_norm(x, weight)
    y, residual = rn.fused_add_rms_norm(x, residual, weight)
    q, scales = rn.rms_norm_quant(x, weight)                       # FP8 e4m3fn, a scale per token
    dx, dweight = rn.rms_norm_backward(dy, x, weight)
    d_input, dweight = rn.fused_add_rms_norm_backward(dy, d_residual_out, residual_out, weight)
    y = rn.rms_norm_gated(x, gate, weight)                        # rmsnorm(x) * weight * silu(gate)
    q, k = rn.qk_norm_rope(q, k, q_weight, k_weight, positions=positions, cos_sin_cache=cache)  # Qwen3

The public functions are those of the op families registered in ``cupy_rmsnorm.ops`` (each
with its ``*_reference``, the NumPy contract).
"""

import sys

from . import _interop, ops
from ._pipeline import REGISTRY
from ._plan import LaunchPlan, launch_plan
from .ops.backward.plan import BackwardPlan, backward_plan


def _public_names():
    """{name: object} of every registered op's public function and its family's references."""
    names = {}
    for spec in REGISTRY.values():
        names[spec.public.__name__] = spec.public
    for family in vars(ops).values():
        for reference in getattr(family, "REFERENCES", ()):
            names[reference.__name__] = reference
    return names


globals().update(_public_names())
__version__ = "0.2.0"
__all__ = list(_public_names()) + ["LaunchPlan", "launch_plan", "BackwardPlan", "backward_plan", "__version__"]

if sys.modules.get("torch") is not None:   # torch is in use: tracing must find the ops from the start
    _interop.TorchKind.bind()
