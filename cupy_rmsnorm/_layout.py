"""The layout of one call: how its arrays' rows lie in memory, which inputs need a
contiguous copy, and which overlaps between arrays are allowed.

``Arrays`` is the one shape the five arrays of a call travel in, from the public
functions to the kernel's argument slots; ``call_layout`` turns validated arrays into
a ``CallLayout``: everything about the call that does not depend on the arrays'
addresses, which the launcher keeps per call signature.
"""

import math
from typing import NamedTuple, Optional

import numpy as np

_TooHardError = getattr(np, "exceptions", np).TooHardError   # NumPy < 1.25 has it at the top


class Arrays(NamedTuple):
    """A call's arrays (or their ``Meta`` records, strides, extents), None where absent."""
    x: object
    residual: object = None
    weight: object = None
    out: object = None
    residual_out: object = None


X, RESIDUAL, WEIGHT, OUT, RESIDUAL_OUT = range(5)   # Arrays positions, for the hot path
INPUTS = (X, RESIDUAL)
OUTPUTS = (OUT, RESIDUAL_OUT)
ROWS = (X, RESIDUAL, OUT, RESIDUAL_OUT)             # the arrays of x's shape


class CallLayout(NamedTuple):
    """Everything about a validated call but the addresses.

    row_strides: per array of x's shape, (outer, inner) row strides in elements (rows are
      outer x inner, see ``row_layout``); fresh outputs get contiguous ones; a stride of a
      level of one row is 0. extents: per array, the [lo, hi) bytes its rows cover,
      relative to its pointer. given_outputs: positions of the outputs the caller passed.
    copied: an input was copied to a contiguous temporary (no fast path for such calls).
    """
    fused: bool
    shape: tuple
    rows: int
    n_inner: int
    dtype: str
    itemsize: int
    weight_dtype: Optional[str]
    weight_itemsize: int
    device: int
    row_strides: Arrays
    extents: Arrays
    given_outputs: tuple
    copied: bool

    @property
    def hidden(self):
        return self.shape[-1]


def call_layout(kind, fused, arrays, metas, copied=False, meta_of=None, names=Arrays._fields):
    """The CallLayout of a validated call, and its arrays (inputs the kernel cannot read
    in place replaced by contiguous copies). ValueError for outputs that cannot be
    written as laid out, or that overlap what they must not. ``copied``: the caller has
    already replaced an input by a copy. ``meta_of``: the Meta of a copy (``kind.meta``; the
    gated op sees its groups as rows)."""
    arrays, metas = list(arrays), list(metas)
    meta_of = meta_of or kind.meta

    def copy(k):
        nonlocal copied
        copied = True
        arrays[k] = kind.contiguous(arrays[k])
        metas[k] = meta_of(arrays[k])

    xm = metas[X]
    hidden, itemsize = xm.shape[-1], xm.itemsize
    outputs = [k for k in OUTPUTS if metas[k] is not None]
    inputs = [k for k in INPUTS if metas[k] is not None]
    for k in outputs:
        if not _unit_last(metas[k], hidden):
            m = metas[k]
            raise ValueError(f"{names[k]} must have a unit-stride last axis, element-aligned; "
                             f"got strides {m.strides} (in elements) at address {m.ptr:#x}")
    for k in inputs + ([WEIGHT] if metas[WEIGHT] is not None else []):
        if not _unit_last(metas[k], hidden):
            copy(k)
    order = outputs + inputs      # outputs first: row_layout follows the first array's split
    layout = row_layout(xm.shape, [metas[k].strides[:-1] for k in order])
    for k, st in zip(order, layout.strides):
        if st is None and k in outputs:
            raise ValueError(f"{names[k]}'s leading axes cannot be addressed as at most two "
                             f"strided levels alongside the other arrays; pass a contiguous one")
    if any(st is None for st in layout.strides):
        for k, st in zip(order, layout.strides):
            if st is None:
                copy(k)
        layout = row_layout(xm.shape, [metas[k].strides[:-1] for k in order])
        if any(st is None for st in layout.strides):  # the outputs disagree with each other
            raise ValueError("out and residual_out need leading-axis layouts that agree; "
                             "pass contiguous outputs")
    rows, n_inner = layout.rows, layout.n_inner
    n_outer = rows // n_inner if n_inner else 0
    strides = [None] * 5
    for k, (so, si) in zip(order, layout.strides):   # a level of one row: its stride does not matter
        strides[k] = (so if n_outer > 1 else 0, si if n_inner > 1 else 0)
    for k in (OUT, RESIDUAL_OUT) if fused else (OUT,):
        if strides[k] is None:                           # fresh outputs are contiguous
            strides[k] = (hidden * n_inner if n_outer > 1 else 0, hidden if n_inner > 1 else 0)
    extents = [None] * 5
    for k in range(5):
        m = metas[k]
        if m is None:
            continue
        lo, hi = (m.ptr, m.ptr + hidden * m.itemsize) if k == WEIGHT else \
            extent(m.ptr, strides[k], rows, n_inner, hidden, m.itemsize)
        extents[k] = (lo - m.ptr, hi - m.ptr)
    wm = metas[WEIGHT]
    result = CallLayout(fused, tuple(xm.shape), rows, n_inner, xm.dtype, itemsize,
                        wm.dtype if wm else None, wm.itemsize if wm else 0, xm.device,
                        Arrays(*strides), Arrays(*extents), tuple(outputs), copied)
    check_overlap(result, Arrays(*metas), names)
    return Arrays(*arrays), result


def _unit_last(m, hidden):
    # NumPy gives arrays with no elements zero strides: with no rows, any layout will do
    return m.strides is not None and (hidden == 1 or m.strides[-1] == 1 or 0 in m.shape) \
        and m.ptr % m.itemsize == 0


def check_overlap(layout, metas, names=Arrays._fields):
    """ValueError when a given output overlaps another array in a way the kernel cannot
    honour: rows of one output overlapping each other, out overlapping residual_out or
    weight, or an output that shares memory with an input without being that input."""
    if layout.rows == 0:
        return
    args = (layout.rows, layout.n_inner, layout.hidden, layout.itemsize)

    def span(k):     # an output of another dtype (a quantized out) carries its own itemsize
        lo, hi = layout.extents[k]
        return (metas[k].ptr, layout.row_strides[k] or (0, 0), (metas[k].ptr + lo, metas[k].ptr + hi),
                metas[k].itemsize)

    for k in layout.given_outputs:
        if rows_overlap_themselves(layout.row_strides[k], layout.rows, layout.n_inner, layout.hidden):
            raise ValueError(f"{names[k]} has rows that overlap each other in memory (a broadcast or "
                             f"too-small stride), or may: its strides were refused as possibly "
                             f"overlapping; it cannot be written")
    if len(layout.given_outputs) == 2:
        found = overlap(span(OUT), span(RESIDUAL_OUT), *args)
        if found:
            raise ValueError("out and residual_out must not share memory" + _MAYBE.get(found, ""))
    for k in layout.given_outputs:
        if metas[WEIGHT] is not None:
            found = _weight_overlap(span(k), metas[WEIGHT], layout)
            if found:
                raise ValueError(f"{names[k]} overlaps weight; weight is read by every row" + _MAYBE.get(found, ""))
        for i in INPUTS:
            found = overlap(span(k), span(i), *args) if metas[i] is not None else None
            if found in ("partial", "maybe") and metas[k].dtype != metas[i].dtype:
                raise ValueError(f"{names[k]} overlaps {names[i]}; pass memory apart from it" + _MAYBE.get(found, ""))
            if found in ("partial", "maybe"):
                raise ValueError(f"{names[k]} partially overlaps {names[i]}: pass the very same array "
                                 f"({names[k]}={names[i]}) to work in place, or memory apart from it"
                                 + _MAYBE.get(found, ""))


_MAYBE = {"maybe": " (the layouts were refused as possibly overlapping: proving them apart took "
                   "too long)"}


def _weight_overlap(out_span, wm, layout):
    """Whether an output's rows share memory with the weight vector (None, 'partial', 'maybe')."""
    (po, so, (lo, hi), itemsize), (wlo, whi) = out_span, (wm.ptr, wm.ptr + layout.hidden * wm.itemsize)
    if whi <= lo or hi <= wlo:
        return None
    fo = _fake_numpy(po, so, layout.rows, layout.n_inner, layout.hidden, itemsize)
    fw = _fake_numpy(wm.ptr, (0, 0), 1, 1, layout.hidden, wm.itemsize)
    try:
        return "partial" if np.shares_memory(fo, fw, max_work=10**6) else None
    except _TooHardError:
        return "maybe"


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
    """'same' if a and b are the very same rows, 'partial' if they share memory otherwise,
    'maybe' if that could not be settled in bounded work, else None.

    a and b are (ptr, (outer stride, inner stride), extent) triples, or quadruples whose last
    element is the array's own itemsize (``itemsize`` otherwise); arrays of two itemsizes are
    never "the same".
    """
    (pa, sa, ea, *ia), (pb, sb, eb, *ib) = a, b
    ia, ib = (ia or [itemsize])[0], (ib or [itemsize])[0]
    if ea[1] <= eb[0] or eb[1] <= ea[0]:
        return None
    n_outer = rows // n_inner if n_inner else 0
    norm = lambda s: (s[0] if n_outer > 1 else 0, s[1] if n_inner > 1 else 0)  # noqa: E731
    if pa == pb and norm(sa) == norm(sb) and ia == ib:
        return "same"
    fa = _fake_numpy(pa, sa, rows, n_inner, hidden, ia)
    fb = _fake_numpy(pb, sb, rows, n_inner, hidden, ib)
    try:
        return "partial" if np.shares_memory(fa, fb, max_work=10**6) else None
    except _TooHardError:
        return "maybe"


# -- quantized forms -------------------------------------------------------------------------------


# -- backward ----------------------------------------------------------------------------------


# -- gated ---------------------------------------------------------------------------------------


# -- QK norm + RoPE --------------------------------------------------------------------------------


