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


def call_layout(kind, fused, arrays, metas, copied=False, meta_of=None):
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
            raise ValueError(f"{Arrays._fields[k]} must have a unit-stride last axis, element-aligned; "
                             f"got strides {m.strides} (in elements) at address {m.ptr:#x}")
    for k in inputs + ([WEIGHT] if metas[WEIGHT] is not None else []):
        if not _unit_last(metas[k], hidden):
            copy(k)
    order = outputs + inputs      # outputs first: row_layout follows the first array's split
    layout = row_layout(xm.shape, [metas[k].strides[:-1] for k in order])
    for k, st in zip(order, layout.strides):
        if st is None and k in outputs:
            raise ValueError(f"{Arrays._fields[k]}'s leading axes cannot be addressed as at most two "
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
    check_overlap(result, Arrays(*metas))
    return Arrays(*arrays), result


def _unit_last(m, hidden):
    # NumPy gives arrays with no elements zero strides: with no rows, any layout will do
    return m.strides is not None and (hidden == 1 or m.strides[-1] == 1 or 0 in m.shape) \
        and m.ptr % m.itemsize == 0


def check_overlap(layout, metas):
    """ValueError when a given output overlaps another array in a way the kernel cannot
    honour: rows of one output overlapping each other, out overlapping residual_out or
    weight, or an output that shares memory with an input without being that input."""
    if layout.rows == 0:
        return
    names = Arrays._fields
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

class QuantArrays(NamedTuple):
    """A quantized call's arrays: Arrays' five (out is q, the quantized output), then the static
    scale and the scales (None where absent)."""
    x: object
    residual: object = None
    weight: object = None
    out: object = None
    residual_out: object = None
    scale: object = None
    scales: object = None


SCALE, SCALES = 5, 6                 # QuantArrays positions beyond Arrays'
QUANT_NAMES = Arrays._fields + ("scale", "scales_out")     # the arguments' names, for messages
TMA_ALIGN_ROWS = 4                   # per-group scales: a column of rows padded to 16 bytes


class QuantLayout(NamedTuple):
    """A validated quantized call but the addresses: ``call`` is the CallLayout of its first
    five arrays (out: q). scales_strides: (row, group) strides of the scales in float32
    elements, the row counted linearly over x's leading axes ((0, 0) for the static form);
    scales_padded: the column length of fresh per-group scales (rows rounded up to
    TMA_ALIGN_ROWS), else 0; extents: [lo, hi) bytes of scale and scales relative to their
    pointers (None where absent)."""
    call: CallLayout
    form: str
    scales_shape: tuple
    scales_strides: tuple
    scales_padded: int
    scale_extent: Optional[tuple]
    scales_extent: Optional[tuple]


def quant_layout(kind, fused, arrays, metas, form, scales_shape, copied=False):
    """The QuantLayout of a validated quantized call, and its arrays (QuantArrays), as
    call_layout; scales_out's leading axes must lie at one stride (its rows linear) and no
    given output may share memory with another array."""
    five, call = call_layout(kind, fused, arrays[:5], metas[:5], copied)
    rows, groups = call.rows, scales_shape[-1]
    sm, scm = metas[SCALE], metas[SCALES]
    padded = 0
    if scm is not None:
        row_stride = linear_row_stride(scales_shape[:-1], scm.strides[:-1])
        if row_stride is None:
            raise ValueError(f"scales_out's leading axes must lie at one stride from row to row (strides "
                             f"{scm.strides} in elements); pass a contiguous one or a column-major (rows, groups) one")
        strides = (row_stride, scm.strides[-1] if groups > 1 else 0)
        if rows_overlap_themselves(strides, rows * groups, groups, 1):
            raise ValueError("scales_out has elements that overlap each other in memory; it cannot be written")
    elif form == "static":
        strides = (0, 0)
    elif form == "per_token":
        strides = (1, 0)
    else:                            # column-major, each column padded (DeepGEMM's TMA-aligned layout)
        padded = -(-rows // TMA_ALIGN_ROWS) * TMA_ALIGN_ROWS
        strides = (1, padded)
    scale_extent = (0, 4) if sm is not None else None
    scales_extent = None
    if scm is not None:
        lo, hi = extent(0, strides, rows * groups, groups, 1, 4)
        scales_extent = (lo, hi)
    layout = QuantLayout(call, form, tuple(scales_shape), strides, padded, scale_extent, scales_extent)
    _check_quant_overlap(layout, metas)
    return QuantArrays(*five, arrays[SCALE], arrays[SCALES]), layout


def new_scales(empty, form, shape):
    """Fresh scales of ``shape`` from ``empty(shape)`` (float32): contiguous per token; per group
    column-major, each column padded to a multiple of TMA_ALIGN_ROWS rows (the returned array is a
    view of the first rows), so the scale of (row r, group g) lies at g * padded + r."""
    if form != "per_group":
        return empty(shape)
    rows = math.prod(shape[:-1])
    padded = -(-rows // TMA_ALIGN_ROWS) * TMA_ALIGN_ROWS
    return empty((shape[-1], padded))[:, :rows].T.reshape(shape)


def linear_row_stride(lead_shape, lead_strides):
    """The stride from row to row of leading axes that merge into one level, else None."""
    lay = row_layout(tuple(lead_shape) + (1,), [tuple(lead_strides)])
    if lay.strides[0] is None or lay.n_inner != 1:
        return None
    return lay.strides[0][0]


def _check_quant_overlap(layout, metas):
    """ValueError when scales_out shares memory with any other array, or q, residual_out or
    scales_out with the static scale (call_layout has checked the other pairs)."""
    call = layout.call
    if call.rows == 0:
        return
    names = QUANT_NAMES
    groups = layout.scales_shape[-1]

    def view(k):
        """(extent, fake NumPy view) of array k."""
        m = metas[k]
        if k == SCALE:
            return (m.ptr, m.ptr + 4), _fake_numpy(m.ptr, (0, 0), 1, 1, 1, 4)
        if k == SCALES:
            lo, hi = layout.scales_extent
            return ((m.ptr + lo, m.ptr + hi),
                    _fake_numpy(m.ptr, layout.scales_strides, call.rows * groups, groups, 1, 4))
        if k == WEIGHT:
            return (m.ptr, m.ptr + call.hidden * m.itemsize), _fake_numpy(m.ptr, (0, 0), 1, 1, call.hidden, m.itemsize)
        lo, hi = call.extents[k]
        return ((m.ptr + lo, m.ptr + hi),
                _fake_numpy(m.ptr, call.row_strides[k], call.rows, call.n_inner, call.hidden, m.itemsize))

    pairs = [(SCALES, k) for k in range(5) if metas[SCALES] is not None and metas[k] is not None]
    if metas[SCALE] is not None:     # (the static form has no scales_out)
        pairs += [(k, SCALE) for k in call.given_outputs]
    for a, b in pairs:
        (alo, ahi), fa = view(a)
        (blo, bhi), fb = view(b)
        if ahi <= blo or bhi <= alo:
            continue
        try:
            found = "partial" if np.shares_memory(fa, fb, max_work=10**6) else None
        except _TooHardError:
            found = "maybe"
        if found:
            raise ValueError(f"{names[a]} overlaps {names[b]}; pass memory apart from it" + _MAYBE.get(found, ""))


# -- backward ----------------------------------------------------------------------------------

class BackwardArrays(NamedTuple):
    """A backward call's inputs: the gradient of the output, the forward's normalized input
    (x, or the fused op's residual_out), the gradient of residual_out (fused op; None for
    none or rms_norm) and the weight."""
    dy: object
    x: object
    d_residual_out: object = None
    weight: object = None


B_DY, B_X, B_D_RESIDUAL_OUT, B_WEIGHT = range(4)   # BackwardArrays positions
BACKWARD_ROWS = (B_DY, B_X, B_D_RESIDUAL_OUT)       # the arrays of x's shape


class BackwardLayout(NamedTuple):
    """Everything about a validated backward call but the addresses (as CallLayout).

    row_strides: a BackwardArrays of (outer, inner) row strides in elements (None for the
      weight and absent arrays); dx_strides: the fresh, contiguous dx's.
    """
    shape: tuple
    rows: int
    n_inner: int
    dtype: str
    itemsize: int
    weight_dtype: Optional[str]
    weight_itemsize: int
    device: int
    row_strides: BackwardArrays
    dx_strides: tuple
    copied: bool

    @property
    def hidden(self):
        return self.shape[-1]


def backward_layout(kind, arrays, metas, copied=False, meta_of=None):
    """The BackwardLayout of a validated backward call and its arrays, inputs the kernel
    cannot read in place (a strided last axis, leading axes past two strided levels)
    replaced by contiguous copies. Nothing is written, so no overlap matters. ``copied`` and
    ``meta_of`` as in call_layout."""
    arrays, metas = list(arrays), list(metas)
    meta_of = meta_of or kind.meta

    def copy(k):
        nonlocal copied
        copied = True
        arrays[k] = kind.contiguous(arrays[k])
        metas[k] = meta_of(arrays[k])

    xm = metas[B_X]
    hidden = xm.shape[-1]
    for k in BACKWARD_ROWS + (B_WEIGHT,):
        if metas[k] is not None and not _unit_last(metas[k], hidden):
            copy(k)
    order = [B_X] + [k for k in (B_DY, B_D_RESIDUAL_OUT) if metas[k] is not None]   # x sets the split
    layout = row_layout(xm.shape, [metas[k].strides[:-1] for k in order])
    if any(st is None for st in layout.strides):
        for k, st in zip(order, layout.strides):
            if st is None:
                copy(k)
        layout = row_layout(xm.shape, [metas[k].strides[:-1] for k in order])
    rows, n_inner = layout.rows, layout.n_inner
    n_outer = rows // n_inner if n_inner else 0
    strides = [None] * 4
    for k, (so, si) in zip(order, layout.strides):
        strides[k] = (so if n_outer > 1 else 0, si if n_inner > 1 else 0)
    dx_strides = (hidden * n_inner if n_outer > 1 else 0, hidden if n_inner > 1 else 0)
    wm = metas[B_WEIGHT]
    result = BackwardLayout(tuple(xm.shape), rows, n_inner, xm.dtype, xm.itemsize,
                            wm.dtype if wm else None, wm.itemsize if wm else 0, xm.device,
                            BackwardArrays(*strides), dx_strides, copied)
    return BackwardArrays(*arrays), result


# -- gated ---------------------------------------------------------------------------------------

class GatedArrays(NamedTuple):
    """A gated call's arrays (None where absent)."""
    x: object
    gate: object = None
    weight: object = None
    out: object = None


class GatedBackwardArrays(NamedTuple):
    """A gated backward call's inputs."""
    dy: object
    x: object
    gate: object = None
    weight: object = None


def grouped(meta, group_size):
    """``meta`` (an array of x's shape) with its last axis split into (hidden // group_size,
    group_size): the gated kernels see each group as a row. Unchanged for group_size None."""
    if meta is None or group_size is None:
        return meta
    shape = tuple(meta.shape[:-1]) + (meta.shape[-1] // group_size, group_size)
    strides = None if meta.strides is None else \
        tuple(meta.strides[:-1]) + (meta.strides[-1] * group_size, meta.strides[-1])
    return meta._replace(shape=shape, strides=strides)


class GatedLayout(NamedTuple):
    """A validated gated call but the addresses: ``call`` is the CallLayout of x, the gate (in
    the residual's place) and out, with each group a row (``groups`` groups a row of the
    caller's arrays); the weight runs over the whole row."""
    call: CallLayout
    groups: int
    out_dtype: str
    weight_dtype: Optional[str]
    weight_itemsize: int


def gated_layout(kind, arrays, metas, group_size, out_dtype, copied=False):
    """The GatedLayout of a validated gated call and its arrays (GatedArrays; inputs the kernel
    cannot read in place replaced by contiguous copies), as call_layout; out must not share
    memory with the weight."""
    x, gate, weight, out = arrays
    mx, mg, mw, mo = metas
    hidden = mx.shape[-1]
    g = group_size or hidden

    def meta_of(a):
        return grouped(kind.meta(a), group_size)

    inputs = [x, gate]
    for k, m in enumerate((mx, mg)):          # a strided last axis cannot be grouped in place
        if not _unit_last(m, hidden):
            inputs[k] = kind.contiguous(inputs[k])
            copied = True
    rows_metas = Arrays(meta_of(inputs[0]), meta_of(inputs[1]), None, grouped(mo, group_size), None)
    five, call = call_layout(kind, False, Arrays(inputs[0], inputs[1], None, out, None), rows_metas, copied,
                             meta_of)
    if mw is not None and call.rows and OUT in call.given_outputs:
        lo, hi = call.extents[OUT]
        span = (mo.ptr, call.row_strides[OUT], (mo.ptr + lo, mo.ptr + hi), mo.itemsize)
        if hidden == g:
            found = _weight_overlap(span, mw, call)
        else:       # the weight runs over several groups' rows: its extent against out's
            found = "maybe" if mo.ptr + lo < mw.ptr + hidden * mw.itemsize and mw.ptr < mo.ptr + hi else None
        if found:
            raise ValueError("out overlaps weight; weight is read by every row" + _MAYBE.get(found, ""))
    layout = GatedLayout(call, hidden // g, out_dtype, mw.dtype if mw else None, mw.itemsize if mw else 0)
    return GatedArrays(five.x, five.residual, weight, five.out), layout


class GatedBackwardLayout(NamedTuple):
    """A validated gated backward call but the addresses: ``call`` the BackwardLayout of dy, x
    and the gate (in d_residual_out's place), each group a row; dx and the gate's gradient
    are fresh and contiguous (``call.dx_strides``)."""
    call: BackwardLayout
    groups: int
    dy_dtype: str
    weight_dtype: Optional[str]
    weight_itemsize: int


def gated_backward_layout(kind, arrays, metas, group_size):
    """The GatedBackwardLayout of a validated gated backward call and its arrays
    (GatedBackwardArrays), inputs the kernel cannot read in place replaced by copies."""
    dy, x, gate, weight = arrays
    mdy, mx, mg, mw = metas
    hidden = mx.shape[-1]
    copied = False
    inputs = [dy, x, gate]
    for k, m in enumerate((mdy, mx, mg)):     # a strided last axis cannot be grouped in place
        if not _unit_last(m, hidden):
            inputs[k] = kind.contiguous(inputs[k])
            copied = True

    def meta_of(a):
        return grouped(kind.meta(a), group_size)

    four, call = backward_layout(kind, BackwardArrays(*inputs, None), [meta_of(a) for a in inputs] + [None], copied,
                                 meta_of)
    layout = GatedBackwardLayout(call, hidden // (group_size or hidden), mdy.dtype, mw.dtype if mw else None,
                                 mw.itemsize if mw else 0)
    return GatedBackwardArrays(four.dy, four.x, four.d_residual_out, weight), layout


# -- QK norm + RoPE --------------------------------------------------------------------------------

class QkRopeArrays(NamedTuple):
    """A QK norm + RoPE call's arrays (None where absent): the inputs, then the outputs."""
    q: object
    k: object
    q_weight: object = None
    k_weight: object = None
    cos: object = None
    sin: object = None
    positions: object = None
    cos_sin_cache: object = None
    out_q: object = None
    out_k: object = None


class QkRopeBackwardArrays(NamedTuple):
    """A QK norm + RoPE backward call's inputs: the gradients of the outputs, then the forward's
    arguments."""
    dq_out: object
    dk_out: object
    q: object
    k: object
    q_weight: object = None
    k_weight: object = None
    cos: object = None
    sin: object = None
    positions: object = None
    cos_sin_cache: object = None


QK_ROPE_OUTPUTS = (8, 9)                            # QkRopeArrays positions of out_q, out_k
QK_ROPE_FRESH = {"out_q": "q", "out_k": "k", "dq": "q", "dk": "k"}   # an output and the input it is shaped like


class QkRopeLayout(NamedTuple):
    """Everything about a validated QK norm + RoPE call (forward or backward) but the addresses.

    The tokens (q's leading axes) are two strided levels, tokens = outer x inner (n_inner);
    per array by argument name (fresh outputs too: out_q / out_k, or the backward's dq / dk):
    token_strides: a token's (outer, inner) step in elements (0 for a level of one token);
    head_strides: q-shaped and k-shaped arrays' step from head to head (0 with one head);
    extents: [lo, hi) bytes its elements cover, relative to its pointer (the given arrays).
    cos, sin and positions that broadcast over tokens have steps of 0 there.
    """
    spec: tuple                  # the QkRopeSpec: rotary_dim, is_neox, cache
    tokens_shape: tuple
    tokens: int
    n_inner: int
    q_heads: int
    k_heads: int
    head_dim: int
    dtype: str
    itemsize: int
    weight_dtype: Optional[str]
    weight_itemsize: int
    table_dtype: str
    table_itemsize: int
    int64_positions: bool
    cache_row: int
    max_position: int
    device: int
    token_strides: dict
    head_strides: dict
    extents: dict
    given_outputs: tuple
    copied: bool


def _element_aligned(m):
    return m.strides is not None and m.ptr % m.itemsize == 0


def _span_levels(levels, span, itemsize):
    """[lo, hi) bytes, relative to the pointer, of ``span`` consecutive elements repeated over
    ``levels`` ((count, stride in elements) pairs)."""
    lo = hi = 0
    for count, stride in levels:
        if count > 1:
            lo, hi = (lo + (count - 1) * stride, hi) if stride < 0 else (lo, hi + (count - 1) * stride)
    return lo * itemsize, (hi + span) * itemsize


def _fake_levels(ptr, levels, span, itemsize):
    """A NumPy view at a device address over ``levels`` and ``span``, never dereferenced: for
    np.shares_memory."""
    shape = tuple(n for n, _ in levels) + (span,)
    strides = tuple(s * itemsize for _, s in levels) + (itemsize,)

    class _I:
        __array_interface__ = {"shape": shape, "typestr": f"|V{itemsize}", "data": (ptr, True), "strides": strides,
                               "version": 3}
    return np.asarray(_I())


def _overlaps_itself(levels, span):
    """Whether two of the elements an output's ``levels`` and ``span`` address may be one
    (a level whose step does not pass everything the finer levels cover)."""
    covered = span
    for stride, count in sorted((abs(s), n) for n, s in levels if n > 1):
        if stride < covered:
            return True
        covered = stride * (count - 1) + covered
    return False


def qk_rope_layout(kind, arrays, metas, spec, copied=False):
    """The QkRopeLayout of a validated call and its arrays (a QkRopeArrays or a
    QkRopeBackwardArrays, with its Meta records): cos, sin and positions broadcast to the tokens
    (zero-copy views), inputs the kernel cannot read in place (a strided last axis, leading axes
    past two strided levels) replaced by contiguous copies. ValueError for outputs that cannot
    be written as laid out, or that overlap what they must not: an output may be its own input
    (out_q=q, out_k=k: in place) and share memory with nothing else."""
    make, names = type(arrays), type(arrays)._fields
    arrays, metas = dict(zip(names, arrays)), dict(zip(names, metas))
    outputs = [name for name in ("out_q", "out_k") if metas.get(name) is not None]
    qm = metas["q"]
    tokens_shape, head_dim = tuple(qm.shape[:-2]), qm.shape[-1]
    rd = spec.rotary_dim

    def copy(name):
        nonlocal copied
        copied = True
        arrays[name] = kind.contiguous(arrays[name])
        metas[name] = kind.meta(arrays[name])

    for name, shape in (("cos", tokens_shape + (rd,)), ("sin", tokens_shape + (rd,)), ("positions", tokens_shape)):
        if metas[name] is not None and tuple(metas[name].shape) != shape:
            arrays[name] = kind.broadcast_to(arrays[name], shape)
            metas[name] = kind.meta(arrays[name])
    for name in outputs:
        m = metas[name]
        if not _unit_last(m, head_dim):
            raise ValueError(f"{name} must have a unit-stride last axis, element-aligned; got strides {m.strides} "
                             f"(in elements) at address {m.ptr:#x}")
    for name, m in list(metas.items()):
        if m is None or name in outputs:
            continue
        if not (_element_aligned(m) if name == "positions" else _unit_last(m, m.shape[-1])):
            copy(name)
    heads = {name: m.shape[-2] for name, m in metas.items() if m is not None and name in ("q", "k", "dq_out", "dk_out",
                                                                                           "out_q", "out_k")}
    token_axes = {name: len(tokens_shape) for name in heads}
    token_axes.update({name: len(tokens_shape) for name in ("cos", "sin", "positions") if metas[name] is not None})
    order = outputs + [name for name in token_axes if name not in outputs]  # outputs first: they set the split
    lead = tokens_shape + (1,)
    layout = row_layout(lead, [metas[name].strides[:token_axes[name]] for name in order])
    for name, st in zip(order, layout.strides):
        if st is None and name in outputs:
            raise ValueError(f"{name}'s leading axes cannot be addressed as at most two strided levels alongside "
                             f"the other arrays; pass a contiguous one")
    if any(st is None for st in layout.strides):
        for name, st in zip(order, layout.strides):
            if st is None:
                copy(name)
        layout = row_layout(lead, [metas[name].strides[:token_axes[name]] for name in order])
        if any(st is None for st in layout.strides):
            raise ValueError("out_q and out_k need leading-axis layouts that agree; pass contiguous outputs")
    tokens, n_inner = layout.rows, layout.n_inner
    n_outer = tokens // n_inner if n_inner else 0
    token_strides = {name: (so if n_outer > 1 else 0, si if n_inner > 1 else 0)
                     for name, (so, si) in zip(order, layout.strides)}
    head_strides = {name: (metas[name].strides[-2] if heads[name] > 1 else 0) for name in heads}
    fresh = ("dq", "dk") if "dq_out" in names else tuple(n for n in ("out_q", "out_k") if n not in outputs)
    for name in fresh:                           # contiguous
        h = metas[QK_ROPE_FRESH[name]].shape[-2]
        token_strides[name] = (h * head_dim * n_inner if n_outer > 1 else 0, h * head_dim if n_inner > 1 else 0)
        head_strides[name] = head_dim if h > 1 else 0
    token_levels = lambda name: [(n_outer, token_strides[name][0]), (n_inner, token_strides[name][1])]  # noqa: E731
    levels, spans = {}, {}
    for name in heads:
        levels[name], spans[name] = token_levels(name) + [(heads[name], head_strides[name])], head_dim
    for name in ("cos", "sin", "positions"):
        if metas[name] is not None:
            levels[name], spans[name] = token_levels(name), (rd if name != "positions" else 1)
    for name in ("q_weight", "k_weight"):
        if metas[name] is not None:
            levels[name], spans[name] = [], head_dim
    cm = metas["cos_sin_cache"]
    if cm is not None:
        levels["cos_sin_cache"], spans["cos_sin_cache"] = [(cm.shape[0], cm.strides[0])], rd
    extents = {name: _span_levels(levels[name], spans[name], metas[name].itemsize) for name in levels}
    if tokens and outputs:
        _check_qk_rope_overlap(outputs, metas, levels, spans, extents)
    wm, tm = metas["q_weight"], metas["cos_sin_cache"] if spec.cache else metas["cos"]
    pm = metas["positions"]
    result = QkRopeLayout(spec, tokens_shape, tokens, n_inner, metas["q"].shape[-2], metas["k"].shape[-2], head_dim,
                          qm.dtype, qm.itemsize, wm.dtype if wm else None, wm.itemsize if wm else 0, tm.dtype,
                          tm.itemsize, pm is not None and pm.dtype == "int64",
                          cm.strides[0] if cm is not None else 0, cm.shape[0] if cm is not None else 0, qm.device,
                          token_strides, head_strides, extents, tuple(outputs), copied)
    return make(**{name: arrays[name] for name in names}), result


def _check_qk_rope_overlap(outputs, metas, levels, spans, extents):
    """ValueError when a given output's heads overlap each other, or the output shares memory
    with an array other than its own input (out_q with q, out_k with k: the very same array)."""
    own = {"out_q": "q", "out_k": "k"}
    for name in outputs:
        if _overlaps_itself(levels[name], spans[name]):
            raise ValueError(f"{name} has heads that overlap each other in memory (a broadcast or too-small stride), "
                             f"or may: its strides were refused as possibly overlapping; it cannot be written")
    for n, name in enumerate(outputs):
        m = metas[name]
        others = [o for o in levels if o not in outputs] + outputs[:n]
        for other in others:
            om = metas[other]
            lo, hi = extents[name]
            olo, ohi = extents[other]
            if m.ptr + hi <= om.ptr + olo or om.ptr + ohi <= m.ptr + lo:
                continue
            if other == own[name] and m.ptr == om.ptr and levels[name] == levels[other] and m.itemsize == om.itemsize:
                continue                         # the very same array: in place
            try:
                found = np.shares_memory(_fake_levels(m.ptr, levels[name], spans[name], m.itemsize),
                                         _fake_levels(om.ptr, levels[other], spans[other], om.itemsize),
                                         max_work=10**6)
                found = "partial" if found else None
            except _TooHardError:
                found = "maybe"
            if not found:
                continue
            if other in outputs:
                raise ValueError("out_q and out_k must not share memory" + _MAYBE.get(found, ""))
            if other == own[name]:
                raise ValueError(f"{name} partially overlaps {other}: pass the very same array ({name}={other}) to "
                                 f"work in place, or memory apart from it" + _MAYBE.get(found, ""))
            raise ValueError(f"{name} overlaps {other}; pass memory apart from it" + _MAYBE.get(found, ""))
