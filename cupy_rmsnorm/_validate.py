"""Validation and row layout: everything checked before anything is launched or written.

Works on ``Meta`` records (pointer, shape, strides in elements, dtype), so CuPy arrays,
torch tensors and NumPy arrays go through the same checks with the same messages.
"""

import math
from typing import NamedTuple

import numpy as np

from ._reference import CASTING_MODES

DTYPES = ("float32", "float16", "bfloat16")


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
    return eps_f, off


def check_arrays(x, residual, weight, out, residual_out):
    """dtype and shape checks; arguments are (name, Meta) pairs or None."""
    xname, xm = x
    if xm.dtype not in DTYPES:
        raise TypeError(f"{xname} must be float32, float16 or bfloat16, got {xm.dtype}")
    if len(xm.shape) < 1:
        raise ValueError(f"{xname} must have at least one dimension, got a 0-d array")
    if xm.shape[-1] == 0:
        raise ValueError(f"{xname} has hidden size 0 (its last axis is empty); there is nothing to normalize")
    for item in (residual, out, residual_out):
        if item is None:
            continue
        name, m = item
        if m.dtype != xm.dtype:
            raise TypeError(f"{name} must have x's dtype {xm.dtype}, got {m.dtype}")
        if tuple(m.shape) != tuple(xm.shape):
            raise ValueError(f"{name} must have x's shape {tuple(xm.shape)}, got {tuple(m.shape)}")
    if weight is not None:
        name, wm = weight
        if len(wm.shape) != 1 or wm.shape[0] != xm.shape[-1]:
            raise ValueError(f"{name} must have shape ({xm.shape[-1]},) (x's last axis), got {tuple(wm.shape)}")
        if wm.dtype not in (xm.dtype, "float32"):
            raise TypeError(f"{name} must have x's dtype {xm.dtype} or float32, got {wm.dtype}")
    for item in (residual, weight, out, residual_out):
        if item is not None and item[1].device != xm.device:
            raise ValueError(f"{item[0]} is on device {item[1].device} but x is on device {xm.device}; "
                             f"all arrays must be on one device")


class RowLayout(NamedTuple):
    """Rows of an (..., hidden) array as outer x inner, each with its own stride (elements)."""
    rows: int
    n_inner: int
    strides: tuple      # per array: (outer stride, inner stride), or None if it does not fit


def row_layout(shape, strides_list):
    """Split the leading axes into at most two strided levels shared by every array.

    Leading axes of size 1 are dropped; two neighbouring axes merge for an array when
    its strides allow it. If the arrays' remaining breaks fall at more than one place,
    no common two-level split exists: the first array (in the order given) with a
    single break sets the split and arrays that do not fit it get None (the caller
    copies such inputs and rejects such outputs, so it lists the outputs first).
    """
    lead = [(i, n) for i, n in enumerate(shape[:-1]) if n != 1]
    rows = math.prod(n for _, n in lead)
    idx = [i for i, _ in lead]
    sizes = [n for _, n in lead]

    def breaks(st):
        return {k for k in range(len(idx) - 1) if st[idx[k]] != st[idx[k + 1]] * sizes[k + 1]}

    all_breaks = [breaks(st) if st is not None else None for st in strides_list]
    union = set().union(*(b for b in all_breaks if b is not None))
    split = min(union) if union else None
    if len(union) > 1:  # no common split: follow the first array (in the caller's order) that has one
        split = next((min(b) for b in all_breaks if b and len(b) == 1), None)
    n_inner = math.prod(sizes[split + 1:]) if split is not None else 1
    out = []
    for st, b in zip(strides_list, all_breaks):
        if st is None or (b - ({split} if split is not None else set())):
            out.append(None)
            continue
        if not idx:
            out.append((0, 0))
        elif split is None:
            out.append((st[idx[-1]], 0))
        else:
            out.append((st[idx[split]], st[idx[-1]]))
    return RowLayout(rows, n_inner, tuple(out))


def extent(ptr, layout_strides, rows, n_inner, hidden, itemsize):
    """[lo, hi) byte range an array's rows cover."""
    so, si = layout_strides
    n_outer = rows // n_inner if n_inner else 0
    lo = hi = 0
    for n, s in ((n_outer, so), (n_inner, si)):
        if n > 1:
            if s < 0:
                lo += (n - 1) * s
            else:
                hi += (n - 1) * s
    return ptr + lo * itemsize, ptr + (hi + hidden) * itemsize


def rows_overlap_themselves(layout_strides, rows, n_inner, hidden):
    """True when two rows of an output would share memory (zero or too-small strides)."""
    so, si = (abs(s) for s in layout_strides)
    n_outer = rows // n_inner if n_inner else 0
    levels = sorted(((s, n) for s, n in ((so, n_outer), (si, n_inner)) if n > 1))
    span = hidden
    for s, n in levels:   # each level must step past everything the finer level covers
        if s < span:
            return True
        span = s * (n - 1) + span
    return False


def _fake_numpy(ptr, layout_strides, rows, n_inner, hidden, itemsize):
    """A NumPy view at a device address, never dereferenced: for np.shares_memory."""
    so, si = layout_strides
    n_outer = rows // n_inner if n_inner else 0

    class _I:
        __array_interface__ = {
            "shape": (n_outer, n_inner, hidden),
            "typestr": f"|V{itemsize}",
            "data": (ptr, True),
            "strides": (so * itemsize, si * itemsize, itemsize),
            "version": 3,
        }
    return np.asarray(_I())


def overlap(a, b, rows, n_inner, hidden, itemsize):
    """'same' if a and b are the very same rows, 'partial' if they share memory otherwise, else None.

    a and b are (ptr, (outer stride, inner stride), extent) triples.
    """
    (pa, sa, ea), (pb, sb, eb) = a, b
    if ea[1] <= eb[0] or eb[1] <= ea[0]:
        return None
    n_outer = rows // n_inner if n_inner else 0
    norm = lambda s: (s[0] if n_outer > 1 else 0, s[1] if n_inner > 1 else 0)  # noqa: E731
    if pa == pb and norm(sa) == norm(sb):
        return "same"
    fa = _fake_numpy(pa, sa, rows, n_inner, hidden, itemsize)
    fb = _fake_numpy(pb, sb, rows, n_inner, hidden, itemsize)
    try:
        return "partial" if np.shares_memory(fa, fb, max_work=10**6) else None
    except np.exceptions.TooHardError:
        return "partial"
