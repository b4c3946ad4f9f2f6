"""cupy_rmsnorm: RMSNorm and fused residual-add + RMSNorm for CuPy, NumPy and PyTorch.

    import cupy_rmsnorm as rn
    y = rn.rms_norm(x, weight)
    y, residual = rn.fused_add_rms_norm(x, residual, weight)
"""

from ._api import fused_add_rms_norm, rms_norm
from ._plan import LaunchPlan, launch_plan
from ._reference import fused_add_rms_norm_reference, rms_norm_reference

__version__ = "0.1.0"
__all__ = ["rms_norm", "fused_add_rms_norm", "LaunchPlan", "launch_plan",
           "rms_norm_reference", "fused_add_rms_norm_reference", "__version__"]
