from typing import NamedTuple, Optional

import numpy as np

from ..._validate import DTYPES, _check_like_x, dtype_name
from .reference import ACTIVATIONS


class GatedSpec(NamedTuple):
    """A gated call's checked arguments (out_dtype: the output's dtype name, or None for x's)."""
    group_size: Optional[int]
    norm_before_gate: bool
    activation: str
    out_dtype: Optional[str]


def check_gated(group_size, norm_before_gate, activation, out_dtype=None):
    """The GatedSpec of a call's gated arguments, or TypeError / ValueError."""
    if group_size is not None:
        if isinstance(group_size, (bool, np.bool_)) or not hasattr(group_size, "__index__"):
            raise TypeError(f"group_size must be an int or None, got {type(group_size).__name__}")
        group_size = int(group_size)
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1 (or None for the whole row), got {group_size}")
    if not isinstance(norm_before_gate, (bool, np.bool_)):
        raise TypeError(f"norm_before_gate must be a bool, got {type(norm_before_gate).__name__}")
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(map(repr, ACTIVATIONS))}, got {activation!r}")
    return GatedSpec(group_size, bool(norm_before_gate), activation, dtype_name(out_dtype, "out_dtype"))


def check_gated_arrays(metas, spec, names=("x", "gate", "weight", "out")):
    """dtype, shape and device checks of a gated call (``metas``: the GatedArrays' Meta
    records, None where absent). Returns the output's dtype name."""
    xm, gm, wm, om = metas
    anchor = names[0]
    _check_like_x(xm, [(names[1], gm)], None, anchor, list(zip(names[1:], metas[1:])))
    hidden = xm.shape[-1]
    if spec.group_size is not None and hidden % spec.group_size:
        raise ValueError(f"group_size={spec.group_size} needs a hidden size that is a multiple of it; "
                         f"{anchor} has hidden size {hidden}")
    if wm is not None:
        if len(wm.shape) != 1 or wm.shape[0] != hidden:
            raise ValueError(f"weight must have shape ({hidden},) ({anchor}'s last axis), got {tuple(wm.shape)}")
        if wm.dtype not in DTYPES:
            raise TypeError(f"weight must be float32, float16 or bfloat16, got {wm.dtype}")
    out_dtype = spec.out_dtype or xm.dtype
    if om is not None:
        if om.dtype != out_dtype:
            raise TypeError(f"{names[3]} must have dtype {out_dtype} (out_dtype, or x's dtype), got {om.dtype}")
        if tuple(om.shape) != tuple(xm.shape):
            raise ValueError(f"{names[3]} must have {anchor}'s shape {tuple(xm.shape)}, got {tuple(om.shape)}")
        if not om.writeable:
            raise ValueError(f"{names[3]} is read-only (for a torch inference tensor: writeable only "
                             f"inside torch.inference_mode()); pass a writeable {names[3]}")
    return out_dtype


def check_gated_backward_arrays(metas, spec, names=("dy", "x", "gate", "weight")):
    """The gated backward's checks: dy of x's shape (any float dtype: the forward's output),
    the gate and weight as in check_gated_arrays."""
    dym, xm, gm, wm = metas
    check_gated_arrays((xm, gm, wm, None), spec, (names[1], names[2], names[3], "out"))
    if dym.dtype not in DTYPES:
        raise TypeError(f"{names[0]} must be float32, float16 or bfloat16, got {dym.dtype}")
    if tuple(dym.shape) != tuple(xm.shape):
        raise ValueError(f"{names[0]} must have {names[1]}'s shape {tuple(xm.shape)}, got {tuple(dym.shape)}")
    if dym.device != xm.device:
        raise ValueError(f"{names[0]} is on device {dym.device} but {names[1]} is on device {xm.device}; "
                         f"all arrays must be on one device")
