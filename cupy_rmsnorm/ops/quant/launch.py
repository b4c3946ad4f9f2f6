import math
from typing import NamedTuple, Optional

import numpy as np

from ..._abi import CUDA_TYPES, ITEMSIZES
from ..._compile import kernel_cache
from ..._launcher import _SLOT, _apart
from ..._layout import (
    _MAYBE,
    OUT,
    RESIDUAL,
    RESIDUAL_OUT,
    WEIGHT,
    Arrays,
    CallLayout,
    X,
    _fake_numpy,
    _TooHardError,
    call_layout,
    extent,
    row_layout,
    rows_overlap_themselves,
)
from ..._plan import fits_32_bit_offsets
from ..forward.launch import _ROW_STRIDE_FIELDS, Launcher, _in_x_bytes, _shift


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


# -- quantized forms: enum QuantForm, enum QuantType, struct QuantParams (kernels/quant.cuh) -----
QUANT_FORM_IDS = {"static": 1, "per_token": 2, "per_group": 3}
QUANT_TYPES = {"float8_e4m3fn": 0, "float8_e5m2": 1, "int8": 2}
QUANT_PARAMS_BYTES = 24
QUANT_PARAMS_DTYPE = np.dtype([("scales_row", "<i8"), ("scales_group", "<i8"), ("scale_ub", "<f4"),
                               ("pad", "<i4")])
assert QUANT_PARAMS_DTYPE.itemsize == QUANT_PARAMS_BYTES


def quant_instantiation_name(dtype, weight_dtype, fused, plan, form, quant_dtype, residual_dtype=None):
    """The name expression of the quantized kernel (``form`` a QUANT_FORM_IDS key, ``quant_dtype`` a
    QUANT_TYPES key) a LaunchPlan needs; ``residual_dtype`` its R (a float32 residual stream)."""
    args = ", ".join(str(a) for a in plan.template_args())
    kernel = "rms_norm_quant_cluster_kernel" if plan.cluster > 1 else "rms_norm_quant_kernel"
    flat = "" if plan.cluster > 1 else ", true" if plan.flat else ", false"     # FLAT: not with clusters
    mixed = f", {CUDA_TYPES[residual_dtype]}" if (residual_dtype or dtype) != dtype else ""
    return (f"rmsnorm::{kernel}<{CUDA_TYPES[dtype]}, {CUDA_TYPES[weight_dtype or dtype]}, "
            f"{'true' if fused else 'false'}, {args}, {QUANT_FORM_IDS[form]}, {QUANT_TYPES[quant_dtype]}{flat}{mixed}>")


# the quantized kernel's: x, residual, q, residual_out, weight, scale, scales
_QUANT_SLOT = {**_SLOT, SCALE: 5, SCALES: 6}


class QuantLauncher(Launcher):
    """Launches one signature of a quantized call (rms_norm_quant_kernel): a Launcher whose out
    is q (one byte an element, of x's row layout), with the static scale and the scales as two
    more pointers and QuantParams after Params. Called with the seven of QuantArrays."""

    slots = 7

    def __init__(self, layout, scalars, kind, spec, residual_dtype=None):
        super().__init__(layout.call, scalars, kind)
        self.quant, self.spec, self.quant_form = layout, spec, spec.form
        self.residual_dtype = residual_dtype or self.layout.dtype
        r_size = ITEMSIZES[self.residual_dtype]
        # q's bytes are checked against x's elements (in _run); the residual's (x's dtype, or
        # float32) element by element: (slot, its itemsize, the shift to x's bytes)
        self.other_slots = tuple((k, _SLOT[k], r_size, _shift(self.itemsize, r_size))
                                 for k in ((RESIDUAL, RESIDUAL_OUT) if self.fused else ()))
        self.aligned_slots = ((WEIGHT, 4, self.layout.weight_itemsize), (SCALE, 5, 4), (SCALES, 6, 4))
        self.group = spec.form == "per_group"
        self.static = spec.form == "static"
        self.fresh_scales = not self.static and layout.scales_extent is None
        qp = np.zeros(1, QUANT_PARAMS_DTYPE)
        (qp["scales_row"], qp["scales_group"]), qp["scale_ub"] = layout.scales_strides, spec.scale_ub
        self.quant_params = qp
        params = self.params[0]
        self.flat = fits_32_bit_offsets(self.rows, self.hidden, int(params["n_inner"]),
                                        [int(params[_ROW_STRIDE_FIELDS[k]][0]) for k in _ROW_STRIDE_FIELDS],
                                        layout.scales_strides, layout.scales_shape[-1])
        shape, q_dtype = layout.call.shape, kind.quant_storage(spec.quant_dtype)
        self._new_q = lambda x: kind.empty_of(x, shape, q_dtype)
        if self.residual_dtype != self.layout.dtype:
            self._empty = lambda x: kind.empty_of(x, shape, self.residual_dtype)
        self._new_scales = lambda x: new_scales(lambda s: kind.empty_of(x, s, "float32"), layout.form,
                                                layout.scales_shape)
        pairs = self._quant_pairs(layout)
        if self.residual_dtype != self.layout.dtype:   # the very same array only at the same itemsize
            sizes = {0: self.itemsize, 1: r_size, 3: r_size}
            pairs = tuple((a, b, lo, hi, same and sizes.get(a) == sizes.get(b)) for a, b, lo, hi, same in pairs)
        self._overlap_pairs = pairs

    @staticmethod
    def _quant_pairs(layout):
        """As _pairs_to_keep_apart, over the seven arrays (slots in _QUANT_SLOT order): each
        given output against the inputs present and the given outputs before it."""
        call = layout.call
        ext = list(call.extents) + [layout.scale_extent, layout.scales_extent]
        st = call.row_strides
        given = list(call.given_outputs) + ([SCALES] if layout.scales_extent is not None else [])
        inputs = [k for k in (X, RESIDUAL, WEIGHT, SCALE) if ext[k] is not None]
        pairs = []
        for n, o in enumerate(given):
            for k in inputs + given[:n]:
                same_ok = o == RESIDUAL_OUT and k in (X, RESIDUAL) and st[o] == st[k]
                pairs.append(_apart(_QUANT_SLOT[o], ext[o], _QUANT_SLOT[k], ext[k], same_ok))
        return tuple(pairs)

    def function(self, plan):
        name = quant_instantiation_name(self.layout.dtype, self.layout.weight_dtype, self.fused, plan,
                                        self.spec.form, self.spec.quant_dtype, self.residual_dtype)
        return kernel_cache.get(self.device.index, name)

    def _kernel_args(self, params):
        return super()._kernel_args(params) + [self.quant_params.ctypes.data]

    def _run(self, arrays, checked=False):
        ptr, itemsize = self._ptr, self.itemsize
        slots = [0] * 7                                   # the kernel's pointers, in _QUANT_SLOT order
        x = arrays[X]
        slots[0] = px = ptr(x)
        bits, misaligned = self.stride_bits, px % itemsize
        for k, i, size, shift in self.other_slots:
            a = arrays[k]
            if a is not None:
                p = slots[i] = ptr(a)
                bits |= _in_x_bytes(p, shift) - px
                misaligned |= p % size
        for k, i, size in self.aligned_slots:
            a = arrays[k]
            if a is not None:
                p = slots[i] = ptr(a)
                misaligned |= p % size
        if misaligned:
            return None
        q = arrays[OUT]
        if q is not None:
            slots[2] = ptr(q)
        if not checked and self._overlapping(slots):
            return None
        residual_out, scales = arrays[RESIDUAL_OUT], arrays[SCALE if self.static else SCALES]
        if q is None:
            q = self._new_q(x)
            slots[2] = ptr(q)
        bits |= slots[2] * itemsize - px                 # q's bytes line up with x's elements
        if self.fresh_residual_out:
            residual_out = self._empty(x)
            slots[3] = p = ptr(residual_out)
            bits |= _in_x_bytes(p, self.other_slots[1][3]) - px
        if self.fresh_scales:
            scales = self._new_scales(x)
            slots[6] = ptr(scales)
        result = (q, residual_out, scales) if self.fused else (q, scales)
        if self.group:                                    # groups need rows on the vector grid: no head
            bits |= px | self.x_stride_bytes
        if self.rows:
            self._launch(bits, px, slots)
        return result
