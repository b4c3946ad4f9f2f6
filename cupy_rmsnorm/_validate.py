"""The public checks of a call's arguments, before anything is launched or written.

Works on ``Meta`` records (pointer, shape, strides in elements, dtype), so CuPy arrays,
torch tensors and NumPy arrays go through the same checks with the same messages.
Row layout and overlap are ``_layout``'s.
"""

import math
from typing import NamedTuple

from ._layout import OUTPUTS, ROWS, WEIGHT, X, Arrays
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
    """``value`` as a Python float that is finite in float32, or TypeError / ValueError."""
    try:
        f = float(value)
    except OverflowError:        # an int past the float range
        f = math.inf
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}") from None
    if not math.isfinite(f) or abs(f) > FLOAT32_MAX or (what and f < 0):
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


def check_arrays(metas):
    """dtype, shape and device checks; ``metas``: an Arrays of Meta records (None where absent)."""
    names = Arrays._fields
    _check_like_x(metas[X], [(names[k], metas[k]) for k in ROWS[1:]], metas[WEIGHT], "x",
                  list(zip(names[1:], metas[1:])))
    for k in OUTPUTS:
        if metas[k] is not None and not metas[k].writeable:
            raise ValueError(f"{names[k]} is read-only (for a torch inference tensor: writeable only "
                             f"inside torch.inference_mode()); pass a writeable {names[k]}")


def check_backward_arrays(metas, names):
    """The same checks for a backward call: ``metas`` a BackwardArrays of Meta records,
    ``names`` its arguments' names (the second, x's place, is the array the others follow)."""
    dy, x, d_residual_out, weight = metas
    anchor = names[1]
    _check_like_x(x, [(names[0], dy), (names[2], d_residual_out)], weight, anchor,
                  [(names[0], dy), (names[2], d_residual_out), (names[3], weight)])


def _check_like_x(xm, rows, wm, anchor, on_device):
    """x (called ``anchor``) a float array with a hidden size; ``rows`` (name, Meta) pairs of
    x's shape and dtype; the weight; every array of ``on_device`` on x's device."""
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
        if wm.dtype not in (xm.dtype, "float32"):
            raise TypeError(f"weight must have {anchor}'s dtype {xm.dtype} or float32, got {wm.dtype}")
    for name, m in on_device:
        if m is not None and m.device != xm.device:
            raise ValueError(f"{name} is on device {m.device} but {anchor} is on device {xm.device}; "
                             f"all arrays must be on one device")
