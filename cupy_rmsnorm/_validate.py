"""The public checks of a call's arguments, before anything is launched or written.

Works on ``Meta`` records (pointer, shape, strides in elements, dtype), so CuPy arrays,
torch tensors and NumPy arrays go through the same checks with the same messages.
Row layout and overlap are ``_layout``'s.
"""

import math
from typing import NamedTuple

import numpy as np

from ._reference import CASTING_MODES

DTYPES = ("float32", "float16", "bfloat16")
MAX_HIDDEN = 2 ** 31 - 1                 # the kernels index a row with an int
FLOAT32_MAX = 3.4028234663852886e38     # the kernels take eps and weight_offset as float32


class Scalars(NamedTuple):
    """A call's checked scalar arguments, as the kernel takes them."""
    eps: float
    weight_offset: float
    llama: bool          # casting_mode == "llama"

    @property
    def casting_mode(self):
        return "llama" if self.llama else "fp32"


def _float32_scalar(value, name, what):
    """``value`` (a real number: not a string or a bool) as a Python float that is finite in
    float32, or TypeError / ValueError."""
    if isinstance(value, (str, bytes, bytearray, bool, np.bool_)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    try:
        f = float(value)
    except OverflowError:        # an int past the float range
        f = math.inf
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}") from None
    # comparisons, not math.isfinite: under torch.compile a float option may be symbolic (a
    # module's eps seen with several values), which comparisons take and math.isfinite does not
    if not abs(f) <= FLOAT32_MAX or (what and f < 0):     # (NaN compares false)
        raise ValueError(f"{name} must be finite{what} in float32 (|{name}| <= {FLOAT32_MAX:.4g}), "
                         f"got {value!r}")
    return f


def check_scalars(eps, weight_offset, casting_mode, has_weight):
    # a string check first: `in` on an array would ask for its truth value
    if not isinstance(casting_mode, str) or casting_mode not in CASTING_MODES:
        raise ValueError(f"casting_mode must be 'fp32' or 'llama', got {casting_mode!r}")
    eps_f = _float32_scalar(eps, "eps", " and >= 0")
    off = _float32_scalar(weight_offset, "weight_offset", "")
    if off != 0.0 and not has_weight:
        raise ValueError("weight_offset needs a weight: with weight=None nothing is scaled")
    return Scalars(eps_f, off, casting_mode == "llama")


def _check_like_x(xm, rows, wm, anchor, on_device, weight_dtypes=None):
    """x (called ``anchor``) a float array with a hidden size; ``rows`` (name, Meta) pairs of
    x's shape and dtype; the weight (``weight_dtypes``: the dtypes it may have, default x's
    and float32); every array of ``on_device`` on x's device."""
    if xm.dtype not in DTYPES:
        raise TypeError(f"{anchor} must be float32, float16 or bfloat16, got {xm.dtype}")
    if len(xm.shape) < 1:
        raise ValueError(f"{anchor} must have at least one dimension, got a 0-d array")
    if xm.shape[-1] == 0:
        raise ValueError(f"{anchor} has hidden size 0 (its last axis is empty); there is nothing to normalize")
    if xm.shape[-1] > MAX_HIDDEN:
        raise ValueError(f"{anchor} has hidden size {xm.shape[-1]}; at most {MAX_HIDDEN} (2**31 - 1) is supported")
    for name, m in rows:
        if m is None:
            continue
        if m.dtype != xm.dtype:
            raise TypeError(f"{name} must have {anchor}'s dtype {xm.dtype}, got {m.dtype}")
        if tuple(m.shape) != tuple(xm.shape):
            raise ValueError(f"{name} must have {anchor}'s shape {tuple(xm.shape)}, got {tuple(m.shape)}")
    if wm is not None:
        if len(wm.shape) != 1 or wm.shape[0] != xm.shape[-1]:
            raise ValueError(f"weight must have shape ({xm.shape[-1]},) ({anchor}'s last axis), "
                             f"got {tuple(wm.shape)}")
        if wm.dtype not in (weight_dtypes or (xm.dtype, "float32")):
            if weight_dtypes:
                raise TypeError(f"weight must be float32, float16 or bfloat16, got {wm.dtype}")
            raise TypeError(f"weight must have {anchor}'s dtype {xm.dtype} or float32, got {wm.dtype}")
    for name, m in on_device:
        if m is not None and m.device != xm.device:
            raise ValueError(f"{name} is on device {m.device} but {anchor} is on device {xm.device}; "
                             f"all arrays must be on one device")


# -- quantized forms -----------------------------------------------------------------------------


# -- dtypes given by name ---------------------------------------------------------------------------

def dtype_name(dtype, arg):
    """The name of a float dtype given as a string, a NumPy / ml_dtypes dtype or type, or a
    torch dtype; None for None. TypeError for anything else."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        name = dtype
    elif type(dtype).__module__.startswith("torch"):
        name = str(dtype).replace("torch.", "")
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = None
    if name not in DTYPES:
        raise TypeError(f"{arg} must be float32, float16 or bfloat16 (or None), got {dtype!r}")
    return name


# -- gated ------------------------------------------------------------------------------------------


# -- QK norm + RoPE ---------------------------------------------------------------------------------


