"""The public checks of a call's arguments, before anything is launched or written.

Works on ``Meta`` records (pointer, shape, strides in elements, dtype), so CuPy arrays,
torch tensors and NumPy arrays go through the same checks with the same messages.
Row layout and overlap are ``_layout``'s.
"""

import math
from typing import NamedTuple

from ._layout import Arrays, ROWS, WEIGHT, X
from ._reference import CASTING_MODES

DTYPES = ("float32", "float16", "bfloat16")


class Scalars(NamedTuple):
    """A call's checked scalar arguments, as the kernel takes them."""
    eps: float
    weight_offset: float
    llama: bool          # casting_mode == "llama"

    @property
    def casting_mode(self):
        return "llama" if self.llama else "fp32"


def check_scalars(eps, weight_offset, casting_mode, has_weight):
    if casting_mode not in CASTING_MODES:
        raise ValueError(f"casting_mode must be 'fp32' or 'llama', got {casting_mode!r}")
    try:
        eps_f = float(eps)
    except (TypeError, ValueError):
        raise TypeError(f"eps must be a real number, got {type(eps).__name__}") from None
    if not math.isfinite(eps_f) or eps_f < 0:
        raise ValueError(f"eps must be finite and >= 0, got {eps!r}")
    try:
        off = float(weight_offset)
    except (TypeError, ValueError):
        raise TypeError(f"weight_offset must be a real number, got {type(weight_offset).__name__}") from None
    if not math.isfinite(off):
        raise ValueError(f"weight_offset must be finite, got {weight_offset!r}")
    if off != 0.0 and not has_weight:
        raise ValueError("weight_offset needs a weight: with weight=None nothing is scaled")
    return Scalars(eps_f, off, casting_mode == "llama")


def check_arrays(metas):
    """dtype, shape and device checks; ``metas``: an Arrays of Meta records (None where absent)."""
    names = Arrays._fields
    xm = metas[X]
    if xm.dtype not in DTYPES:
        raise TypeError(f"x must be float32, float16 or bfloat16, got {xm.dtype}")
    if len(xm.shape) < 1:
        raise ValueError("x must have at least one dimension, got a 0-d array")
    if xm.shape[-1] == 0:
        raise ValueError("x has hidden size 0 (its last axis is empty); there is nothing to normalize")
    for k in ROWS[1:]:
        m = metas[k]
        if m is None:
            continue
        if m.dtype != xm.dtype:
            raise TypeError(f"{names[k]} must have x's dtype {xm.dtype}, got {m.dtype}")
        if tuple(m.shape) != tuple(xm.shape):
            raise ValueError(f"{names[k]} must have x's shape {tuple(xm.shape)}, got {tuple(m.shape)}")
    wm = metas[WEIGHT]
    if wm is not None:
        if len(wm.shape) != 1 or wm.shape[0] != xm.shape[-1]:
            raise ValueError(f"weight must have shape ({xm.shape[-1]},) (x's last axis), got {tuple(wm.shape)}")
        if wm.dtype not in (xm.dtype, "float32"):
            raise TypeError(f"weight must have x's dtype {xm.dtype} or float32, got {wm.dtype}")
    for name, m in zip(names[1:], metas[1:]):
        if m is not None and m.device != xm.device:
            raise ValueError(f"{name} is on device {m.device} but x is on device {xm.device}; "
                             f"all arrays must be on one device")
