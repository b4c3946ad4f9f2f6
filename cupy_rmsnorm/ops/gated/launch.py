from typing import NamedTuple, Optional

import numpy as np

from ... import _cache, _driver
from ..._abi import (
    CUDA_TYPES,
    DIRECT_WEIGHT,
    HAS_WEIGHT,
    ITEMSIZES,
    LLAMA,
    WEIGHT_GRAD,
    kernel_weight_offset,
)
from ..._compile import kernel_cache, register_program
from ..._launcher import GradLauncher, SlotLauncher, _apart, _argv
from ..._layout import (
    _MAYBE,
    OUT,
    RESIDUAL,
    Arrays,
    CallLayout,
    X,
    _unit_last,
    _weight_overlap,
    call_layout,
)
from ..._plan import (
    vector_width_from_bits,
)
from ..backward.launch import (
    BackwardArrays,
    BackwardLayout,
    backward_layout,
)
from .plan import gated_backward_plan, gated_plan

# the family's kernel programs (kernels/)
register_program("gated", "rms_norm_gated.cu")
register_program("gated_backward", "rms_norm_gated_backward.cu")


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
                             meta_of, names=("x", "gate", "weight", "out", "residual_out"))
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


# -- gated: enum GatedFlags, enum Activation, struct GatedParams / GatedBackwardParams ------------
# (kernels/rms_norm_gated.cu; the backward's flags also take BACKWARD_FLAGS' kWeightGrad, kDirectWeight)
GATED_FLAGS = {"kRoundProduct": 256}
ROUND_PRODUCT = GATED_FLAGS["kRoundProduct"]
ACTIVATION_IDS = {"silu": 0, "sigmoid": 1}
GATED_PARAMS_BYTES = 88
GATED_PARAMS_DTYPE = np.dtype([
    ("rows", "<i8"), ("n_inner", "<i8"), ("x", "<i8", (2,)), ("gate", "<i8", (2,)), ("out", "<i8", (2,)),
    ("hidden", "<i4"), ("groups", "<i4"), ("eps", "<f4"), ("weight_offset", "<f4"), ("flags", "<i4"), ("unused", "<i4"),
])
assert GATED_PARAMS_DTYPE.itemsize == GATED_PARAMS_BYTES


GATED_BACKWARD_PARAMS_BYTES = 128
GATED_BACKWARD_PARAMS_DTYPE = np.dtype([
    ("rows", "<i8"), ("n_inner", "<i8"), ("rows_per_block", "<i8"),
    ("dy", "<i8", (2,)), ("x", "<i8", (2,)), ("gate", "<i8", (2,)), ("dx", "<i8", (2,)), ("dgate", "<i8", (2,)),
    ("hidden", "<i4"), ("groups", "<i4"), ("eps", "<f4"), ("weight_offset", "<f4"), ("flags", "<i4"), ("unused", "<i4"),
])
assert GATED_BACKWARD_PARAMS_DTYPE.itemsize == GATED_BACKWARD_PARAMS_BYTES


def gated_instantiation_name(dtype, weight_dtype, out_dtype, plan, norm_before_gate, activation):
    """The name expression of the gated forward kernel (program "gated") a LaunchPlan needs."""
    return (f"rmsnorm::rms_norm_gated_kernel<{CUDA_TYPES[dtype]}, {CUDA_TYPES[weight_dtype or dtype]}, "
            f"{CUDA_TYPES[out_dtype]}, {plan.vec}, {plan.threads_per_row}, {plan.vecs_per_thread}, "
            f"{'false' if norm_before_gate else 'true'}, {ACTIVATION_IDS[activation]}>")


def gated_backward_instantiation_name(dtype, dy_dtype, weight_dtype, plan, norm_before_gate, activation):
    """The name expression of the gated backward kernel (program "gated") a GatedBackwardPlan needs."""
    return (f"rmsnorm::rms_norm_gated_backward_kernel<{CUDA_TYPES[dtype]}, {CUDA_TYPES[dy_dtype]}, "
            f"{CUDA_TYPES[weight_dtype or dtype]}, {plan.vec}, {plan.threads_per_row}, {plan.vecs_per_thread}, "
            f"{'false' if norm_before_gate else 'true'}, {ACTIVATION_IDS[activation]}>")


class GatedLauncher(SlotLauncher):
    """Launches one signature of rms_norm_gated (rms_norm_gated_kernel): x, the gate and out
    (each group a row; out may have another dtype) and the weight. Rows take the widest
    vector that every group starts on and holds whole (no head or tail). Called with the four
    of GatedArrays."""

    slots = 4

    def __init__(self, layout, scalars, kind, spec):
        call = layout.call
        super().__init__(kind, call.device)
        self.layout, self.spec = layout, spec
        self.rows, self.hidden, self.itemsize = call.rows, call.hidden, call.itemsize
        self.out_dtype, out_itemsize = layout.out_dtype, ITEMSIZES[layout.out_dtype]
        # out's pointer in x's bytes: its element offset from x's must be a multiple of the vector
        self._out_shift = (self.itemsize.bit_length() - 1) - (out_itemsize.bit_length() - 1)
        st = call.row_strides
        xso, xsi = st[X]
        bits = (call.hidden * self.itemsize)           # whole vectors in every group
        for k in (RESIDUAL, OUT):                      # the gate (in the residual's place) and out
            so, si = st[k]
            bits |= ((so - xso) | (si - xsi)) * self.itemsize
        self.stride_bits = bits | (xso * self.itemsize) | ((xsi * self.itemsize) if call.n_inner != 1 else 0)
        params = np.zeros(1, GATED_PARAMS_DTYPE)
        params["rows"], params["n_inner"], params["hidden"] = call.rows, call.n_inner, call.hidden
        params["groups"] = layout.groups
        params["x"], params["gate"], params["out"] = st[X], st[RESIDUAL], st[OUT]
        params["eps"], params["weight_offset"] = scalars.eps, kernel_weight_offset(scalars)
        has_weight = layout.weight_dtype is not None
        round_product = (scalars.llama and has_weight and layout.weight_dtype == layout.out_dtype
                         and scalars.weight_offset == 0)
        params["flags"] = ((LLAMA if scalars.llama else 0) | (HAS_WEIGHT if has_weight else 0)
                           | (ROUND_PRODUCT if round_product else 0))
        self.params = params
        self._item_mask, self._out_mask = self.itemsize - 1, out_itemsize - 1
        self._weight_mask = (layout.weight_itemsize or 1) - 1
        ext, pairs = call.extents, []
        if OUT in call.given_outputs:      # out may be x or the gate itself (in place), nothing else
            for j, slot in ((X, 0), (RESIDUAL, 1)):
                pairs.append(_apart(2, ext[OUT], slot, ext[j], st[OUT] == st[j] and out_itemsize == self.itemsize))
            if has_weight:
                pairs.append(_apart(2, ext[OUT], 3, (0, layout.groups * call.hidden * layout.weight_itemsize), False))
        self._overlap_pairs = tuple(pairs)
        self._new_out = lambda x: kind.empty_of(x, x.shape, self.out_dtype)

    def plan_and_function(self, vec, edges=False):
        entry = self._by_vec.get(vec)
        if entry is None:
            plan = gated_plan(self.rows, self.hidden, self.itemsize, vec, self.device.sm_count, **_cache.plan_overrides)
            _cache.record_plan(plan)
            name = gated_instantiation_name(self.layout.call.dtype, self.layout.weight_dtype, self.out_dtype, plan,
                                            self.spec.norm_before_gate, self.spec.activation)
            entry = self._by_vec[vec] = (plan, kernel_cache.get(self.device.index, name, "gated"))
        return entry

    def edges(self, vec, x_ptr):
        return False                # the vector width covers every group's start and length

    def _run(self, arrays, checked=False):
        x, gate, weight, out = arrays
        ptr = self._ptr
        px, pz = ptr(x), ptr(gate)
        pw = 0 if weight is None else ptr(weight)
        po = 0 if out is None else ptr(out)
        if (px | pz) & self._item_mask or po & self._out_mask or pw & self._weight_mask:
            return None
        if not checked and self._overlap_pairs and self._overlapping((px, pz, po, pw)):
            return None
        if out is None:
            out = self._new_out(x)
            po = ptr(out)
        if self.rows:
            shift = self._out_shift      # out's element offset in x's bytes
            po_x = po << shift if shift >= 0 else po >> -shift
            self._launch(self.stride_bits | px | (pz - px) | (po_x - px), px, (px, pz, po, pw))
        return out


class GatedBackwardLauncher(GradLauncher):
    """Launches the backward of one rms_norm_gated signature: rms_norm_gated_backward_kernel,
    then (more than one chunk of rows) the dweight reduction."""

    program = "gated_backward"

    def __init__(self, layout, scalars, kind, spec):
        call = layout.call
        super().__init__(kind, call.device, layout.weight_dtype, layout.groups * call.hidden)
        self.layout, self.spec = layout, spec
        self.rows, self.hidden, self.itemsize = call.rows, call.hidden, call.itemsize
        st = call.row_strides
        xso, xsi = st.x
        dy_itemsize = ITEMSIZES[layout.dy_dtype]
        self._dy_shift = (self.itemsize.bit_length() - 1) - (dy_itemsize.bit_length() - 1)
        bits = call.hidden * self.itemsize | xso * self.itemsize | (xsi * self.itemsize if call.n_inner != 1 else 0)
        for s in (st.dy, st.d_residual_out, call.dx_strides):
            bits |= ((s[0] - xso) | (s[1] - xsi)) * self.itemsize
        self.stride_bits = bits
        params = np.zeros(1, GATED_BACKWARD_PARAMS_DTYPE)
        params["rows"], params["n_inner"], params["hidden"] = call.rows, call.n_inner, call.hidden
        params["groups"] = layout.groups
        params["dy"], params["x"], params["gate"] = st.dy, st.x, st.d_residual_out
        params["dx"] = params["dgate"] = call.dx_strides
        params["eps"], params["weight_offset"] = scalars.eps, kernel_weight_offset(scalars)
        round_product = (scalars.llama and layout.weight_dtype is not None and layout.weight_dtype == layout.dy_dtype
                         and scalars.weight_offset == 0)
        self.flags = (LLAMA if scalars.llama else 0) | (ROUND_PRODUCT if round_product else 0)
        self.params = params
        self._empty = kind.empty_getter(st.x, call.n_inner, call.hidden)
        self._by_vec = {}

    def plan_and_function(self, vec):
        """The plan (its grid fitted to the kernel's occupancy) and kernel for a vector width."""
        entry = self._by_vec.get(vec)
        if entry is None:
            d, layout = self.device, self.layout
            forced = dict(_cache.backward_overrides)
            cap = forced.pop("max_blocks_per_sm", None)
            plan = gated_backward_plan(self.rows, layout.groups, self.hidden, self.itemsize, vec, d.sm_count,
                                       max_blocks_per_sm=cap, **forced)
            name = gated_backward_instantiation_name(layout.call.dtype, layout.dy_dtype, layout.weight_dtype, plan,
                                                     self.spec.norm_before_gate, self.spec.activation)
            fn = kernel_cache.get(d.index, name, "gated_backward")
            per_sm = self.occupancy(fn, plan.block)
            plan = gated_backward_plan(self.rows, layout.groups, self.hidden, self.itemsize, vec, d.sm_count,
                                       max_blocks_per_sm=min(per_sm, cap or per_sm),
                                       threads_per_row=plan.threads_per_row, vecs_per_thread=plan.vecs_per_thread)
            _cache.record_plan(plan)
            entry = self._by_vec[vec] = (plan, _driver.KernelLaunch(fn.ptr, (plan.grid, 1), plan.block))
        return entry

    def _run(self, arrays, weight_grad):
        """(dx, dgate, dweight) for ``arrays`` (GatedBackwardArrays)."""
        kind, ptr = self.kind, self.kind.ptr
        dy, x, gate, w = arrays
        want_dw = w is not None and weight_grad
        dx, dgate = self._empty(x), self._empty(x)
        if self.rows == 0:
            return dx, dgate, (kind.zeros_like(w) if want_dw else None)
        px, pdy, pz, pdx, pdz = ptr(x), ptr(dy), ptr(gate), ptr(dx), ptr(dgate)
        shift = self._dy_shift
        pdy_x = pdy << shift if shift >= 0 else pdy >> -shift
        bits = self.stride_bits | px | (pdy_x - px) | (pz - px) | (pdx - px) | (pdz - px)
        plan, kernel = self.plan_and_function(vector_width_from_bits(self.itemsize, bits))
        partials = dweight = None
        direct = want_dw and plan.chunks == 1 and plan.vecs_per_thread > 0   # one chunk: no reduction
        if want_dw:
            dweight = kind.empty_of(w, tuple(w.shape), None)
            if not direct:
                partials = kind.empty_of(x, (plan.chunks, self.layout.groups * self.hidden), "float32")
        params = self.params.copy()
        params["rows_per_block"] = plan.rows_per_block
        params["flags"] = (self.flags | (HAS_WEIGHT if w is not None else 0) | (WEIGHT_GRAD if want_dw else 0)
                           | (DIRECT_WEIGHT if direct else 0))
        argv, held = _argv([pdy, px, pz, pdx, pdz, ptr(w) if w is not None else 0,
                            ptr(partials) if partials is not None else 0, ptr(dweight) if dweight is not None else 0,
                            params])
        self.launch(kernel, argv, partials, dweight, plan.chunks)
        return dx, dgate, dweight
