from typing import NamedTuple, Optional

import numpy as np

from ... import _cache, _driver
from ..._abi import (
    ADD_GRAD,
    CUDA_TYPES,
    DIRECT_WEIGHT,
    HAS_WEIGHT,
    LLAMA,
    WEIGHT_GRAD,
    kernel_weight_offset,
    row_kernel_flags,
)
from ..._compile import kernel_cache, register_program
from ..._launcher import GradLauncher, _argv
from ..._layout import _unit_last, row_layout
from ..._plan import (
    vector_width_from_bits,
)
from .plan import backward_plan, backward_refit_keywords

# the family's kernel programs (kernels/)
register_program("backward", "rms_norm_backward.cu")


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


BACKWARD_PARAMS_BYTES = 112
BACKWARD_PARAMS_DTYPE = np.dtype([
    ("rows", "<i8"), ("n_inner", "<i8"), ("rows_per_block", "<i8"),
    ("dy", "<i8", (2,)), ("x", "<i8", (2,)), ("d_residual_out", "<i8", (2,)), ("dx", "<i8", (2,)),
    ("hidden", "<i4"), ("eps", "<f4"), ("weight_offset", "<f4"), ("flags", "<i4"),
    ("stages", "<i4"), ("unused", "<i4"),
])
assert BACKWARD_PARAMS_DTYPE.itemsize == BACKWARD_PARAMS_BYTES


def backward_instantiation_name(dtype, weight_dtype, plan, flags=None, llama_dtype=None):
    """The name expression of the backward kernel a BackwardPlan needs (program "backward");
    the row kernel's also has its ``flags`` (``row_kernel_flags``) compiled in. ``llama_dtype``:
    the kernel's N, the dtype the llama mode rounds xhat to (x's when None)."""
    args = ", ".join(str(a) for a in plan.template_args())
    if plan.variant == "row":
        if flags is None:
            raise ValueError("the row kernel's instantiation needs its flags")
        args += f", {flags}"
    if (llama_dtype or dtype) != dtype:
        args += f", {CUDA_TYPES[llama_dtype]}"
    kernel = {"staged": "rms_norm_backward_staged_kernel", "row": "rms_norm_backward_row_kernel"}.get(
        plan.variant, "rms_norm_backward_kernel")
    return f"rmsnorm::{kernel}<{CUDA_TYPES[dtype]}, {CUDA_TYPES[weight_dtype or dtype]}, {args}>"


class BackwardLauncher(GradLauncher):
    """Launches the backward of one signature: the dx kernel, then the dweight reduction.

    Kept per signature (as the forward's launchers) are the planning, compiling and
    occupancy work, per vector width and edges. ``llama_dtype``: the dtype the llama mode
    rounds xhat to for dweight (the forward output's; x's when None)."""

    program = "backward"

    def __init__(self, layout, scalars, kind, llama_dtype=None):
        super().__init__(kind, layout.device, layout.weight_dtype, layout.hidden)
        self.layout, self.llama_dtype = layout, llama_dtype
        self.rows, self.hidden, self.itemsize = layout.rows, layout.hidden, layout.itemsize
        strides = layout.row_strides
        xso, xsi = strides.x
        # the other arrays must follow x's alignment pattern, row by row (as in the forward)
        bits = 0
        for st in (strides.dy, strides.d_residual_out, layout.dx_strides):
            if st is not None:
                bits |= ((st[0] - xso) | (st[1] - xsi)) * self.itemsize
        self.stride_bits = bits
        self.x_stride_bytes = (xso * self.itemsize) | ((xsi * self.itemsize) if layout.n_inner != 1 else 0)
        params = np.zeros(1, BACKWARD_PARAMS_DTYPE)
        params["rows"], params["n_inner"], params["hidden"] = layout.rows, layout.n_inner, layout.hidden
        for name in ("dy", "x", "d_residual_out"):
            st = getattr(strides, name)
            if st is not None:
                params[name] = st
        params["dx"] = layout.dx_strides
        params["eps"], params["weight_offset"] = scalars.eps, kernel_weight_offset(scalars)
        self.flags = (LLAMA if scalars.llama else 0) | (ADD_GRAD if strides.d_residual_out is not None else 0)
        self.params = params
        # a fresh contiguous dx (x's row strides decide whether torch's empty_like gives one)
        self._empty_dx = kind.empty_getter(strides.x, layout.n_inner, layout.hidden)
        self._by_vec = {}
        self._row_kernels = {}     # (vec, edges, row_kernel_flags) -> the row kernel's KernelLaunch

    def plan_and_function(self, vec, edges):
        """The plan (its grid fitted to the kernel's occupancy) and compiled kernel for a
        vector width and edges (cached; compiled on first use). The row kernel, whose flags are
        compiled in, comes from ``row_kernel`` (None here)."""
        entry = self._by_vec.get((vec, edges))
        if entry is None:
            d = self.device
            fixed = dict(edges=edges, arrays=3 if self.layout.row_strides.d_residual_out is not None else 2,
                         shared_per_sm=d.shared_per_sm, shared_per_block=d.shared_per_block,
                         **_cache.backward_overrides)
            cap = fixed.pop("max_blocks_per_sm", None)      # forced: at most this many blocks an SM
            plan = backward_plan(self.rows, self.hidden, self.itemsize, vec, d.sm_count, max_blocks_per_sm=cap,
                                 **fixed)
            if plan.variant == "row":       # one row a block at any occupancy: nothing to refit
                _cache.record_plan(plan)
                entry = self._by_vec[(vec, edges)] = (plan, None)
                return entry
            name = backward_instantiation_name(self.layout.dtype, self.layout.weight_dtype, plan,
                                               llama_dtype=self.llama_dtype)
            fn = kernel_cache.get(d.index, name, "backward")
            per_sm = self.occupancy(fn, plan.block, plan.shared_bytes)
            per_sm = min(per_sm, cap or per_sm)
            for key, value in backward_refit_keywords(plan).items():     # the occupancy is this kernel's
                fixed.setdefault(key, value)
            plan = backward_plan(self.rows, self.hidden, self.itemsize, vec, d.sm_count, max_blocks_per_sm=per_sm,
                                 **fixed)
            _cache.record_plan(plan)
            kernel = _driver.KernelLaunch(fn.ptr, (plan.grid, 1), plan.block, plan.shared_bytes)
            entry = self._by_vec[(vec, edges)] = (plan, kernel)
        return entry

    def row_kernel(self, plan, flags):
        """The row kernel for ``plan`` with ``flags`` (row_kernel_flags) compiled in (cached)."""
        key = (plan.vec, plan.edges, flags)
        kernel = self._row_kernels.get(key)
        if kernel is None:
            name = backward_instantiation_name(self.layout.dtype, self.layout.weight_dtype, plan, flags,
                                               self.llama_dtype)
            fn = kernel_cache.get(self.device.index, name, "backward")
            kernel = self._row_kernels[key] = _driver.KernelLaunch(fn.ptr, (plan.grid, 1), plan.block,
                                                                   plan.shared_bytes)
        return kernel

    def _run(self, arrays, weight_grad):
        """(dx, dweight) for ``arrays`` (a BackwardArrays)."""
        kind, ptr = self.kind, self.kind.ptr
        dy, x, dres, w = arrays
        want_dw = w is not None and weight_grad
        dx = self._empty_dx(x)
        if self.rows == 0:
            return dx, (kind.zeros_like(w) if want_dw else None)
        px = ptr(x)
        pointers = [ptr(dy), px, ptr(dres) if dres is not None else 0, ptr(dx), ptr(w) if w is not None else 0]
        bits = self.stride_bits
        for p in (pointers[0], pointers[2], pointers[3]):
            if p:
                bits |= p - px
        vec = vector_width_from_bits(self.itemsize, bits)
        edges = bool(self.hidden % vec or (px | self.x_stride_bytes) % (vec * self.itemsize))
        plan, kernel = self.plan_and_function(vec, edges)
        partials = dweight = None
        # one block that keeps its sums in shared memory writes dweight itself: no reduction
        direct = want_dw and plan.grid == 1 and plan.vecs_per_thread > 0
        if want_dw:
            dweight = kind.empty_of(w, (self.hidden,), None)
            if not direct:
                partials = kind.empty_of(x, (plan.partials, self.hidden), "float32")
        flags = (self.flags | (HAS_WEIGHT if w is not None else 0) | (WEIGHT_GRAD if want_dw else 0)
                 | (DIRECT_WEIGHT if direct else 0))
        if kernel is None:
            w_aligned = w is not None and not edges and pointers[4] % (plan.vec * self.layout.weight_itemsize) == 0
            kernel = self.row_kernel(plan, row_kernel_flags(flags, self.layout.n_inner == 1, w_aligned))
        params = self.params.copy()
        params["rows_per_block"], params["stages"], params["flags"] = plan.rows_per_block, plan.stages, flags
        argv, held = _argv(pointers + [ptr(partials) if partials is not None else 0,
                                       ptr(dweight) if dweight is not None else 0, params])
        self.launch(kernel, argv, partials, dweight, plan.partials)
        return dx, dweight


class MixedBackward:
    """The backward of a mixed-precision signature (dy of another dtype than x: an out_dtype,
    or a float32 residual stream): the float32 kernels on float32 copies of dy, x and
    d_residual_out (exact), dx rounded once to x's dtype, and the llama mode rounding xhat to
    dy's dtype for dweight, as the forward rounded it. A call costs the copies; the
    arithmetic and its roundings are a native kernel's."""

    def __init__(self, scalars, kind, dy_dtype, x_dtype):
        self.scalars, self.kind, self.dy_dtype, self.x_dtype = scalars, kind, dy_dtype, x_dtype
        self._launcher = None

    def __call__(self, arrays, weight_grad=True):
        kind = self.kind
        up = BackwardArrays(*(a if a is None or k == B_WEIGHT else kind.as_dtype(a, "float32")
                              for k, a in enumerate(arrays)))
        if self._launcher is None:      # the copies' layout is the same every call
            up, layout = backward_layout(kind, up, BackwardArrays(*(None if a is None else kind.meta(a) for a in up)))
            self._launcher = BackwardLauncher(layout, self.scalars, kind, self.dy_dtype)
        dx, dweight = self._launcher(up, weight_grad)
        return (dx if self.x_dtype == "float32" else kind.as_dtype(dx, self.x_dtype)), dweight
