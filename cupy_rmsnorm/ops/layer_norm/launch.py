"""LayerNorm on the GPU: the arrays, the kernels' ABI, the layouts and the launchers of
kernels/layer_norm.cu (plain, fused add, adaLN modulate) and kernels/layer_norm_backward.cu
(dx, then the parameters' and the modulation's gradients added in a fixed order)."""

from typing import NamedTuple, Optional

import numpy as np

from ... import _cache, _driver
from ..._abi import CUDA_TYPES, EARLY_TRIGGER, HAS_WEIGHT, ITEMSIZES
from ..._compile import kernel_cache, register_program
from ..._launcher import GradLauncher, _argv
from ..._layout import Arrays, CallLayout, _unit_last, check_overlap, extent, row_layout
from ..._plan import early_trigger
from .plan import layer_norm_backward_plan, layer_norm_plan

register_program("layer_norm", "layer_norm.cu")
register_program("layer_norm_backward", "layer_norm_backward.cu")


class LayerNormArrays(NamedTuple):
    """A forward call's arrays (None where absent): the three forms share them."""
    x: object
    residual: object = None
    weight: object = None
    bias: object = None
    out: object = None
    residual_out: object = None
    shift: object = None
    scale: object = None


class LayerNormBackwardArrays(NamedTuple):
    """A backward call's inputs: x is the fused op's residual_out."""
    dy: object
    x: object
    d_residual_out: object = None
    weight: object = None
    bias: object = None
    shift: object = None
    scale: object = None


OUTPUTS = (4, 5)     # out, residual_out


# -- the ABI (kernels/layer_norm.cuh, layer_norm.cu, layer_norm_backward.cu) -------------------
LN_HAS_BIAS, LN_ADD_GRAD, LN_PARAM_GRAD, LN_MOD_GRAD, LN_DIRECT_PARAM, LN_DIRECT_MOD = (1024, 2048, 4096, 8192,
                                                                                      16384, 32768)
LAYER_NORM_PARAMS_DTYPE = np.dtype([
    ("rows", "<i8"), ("n_inner", "<i8"),
    ("x", "<i8", (2,)), ("residual", "<i8", (2,)), ("out", "<i8", (2,)), ("residual_out", "<i8", (2,)),
    ("shift", "<i8", (2,)), ("scale", "<i8", (2,)),
    ("hidden", "<i4"), ("eps", "<f4"), ("flags", "<i4"), ("unused", "<i4"),
])
LAYER_NORM_BACKWARD_PARAMS_DTYPE = np.dtype([
    ("rows", "<i8"), ("n_inner", "<i8"), ("group_rows", "<i8"), ("rows_per_block", "<i8"),
    ("blocks_per_group", "<i8"),
    ("dy", "<i8", (2,)), ("x", "<i8", (2,)), ("d_residual_out", "<i8", (2,)), ("dx", "<i8", (2,)),
    ("shift", "<i8", (2,)), ("scale", "<i8", (2,)),
    ("hidden", "<i4"), ("eps", "<f4"), ("flags", "<i4"), ("unused", "<i4"),
])
LAYER_NORM_REDUCE_PARAMS_DTYPE = np.dtype([("per_output", "<i8"), ("hidden", "<i8"), ("plane", "<i8")])
REDUCE_COLUMNS, REDUCE_BLOCK = 32, 256      # kLnReduceColumns, kLnReduceColumns * kLnReduceSlices
assert LAYER_NORM_PARAMS_DTYPE.itemsize == 128 and LAYER_NORM_BACKWARD_PARAMS_DTYPE.itemsize == 152
assert LAYER_NORM_REDUCE_PARAMS_DTYPE.itemsize == 24


def _bool(b):
    return "true" if b else "false"


def forward_name(t, r, w, m, o, plan, fused, modulate):
    """The forward kernel's name expression (dtype names; r, w, m, o default to t's)."""
    types = ", ".join(CUDA_TYPES[d] for d in (t, r or t, w or t, m or t, o or t))
    args = ", ".join(map(str, plan.template_args()))
    return f"rmsnorm::layer_norm_kernel<{types}, {args}, {_bool(fused)}, {_bool(modulate)}>"


def backward_name(t, d, w, m, plan, modulate):
    types = ", ".join(CUDA_TYPES[a] for a in (t, d, w or t, m or t))
    args = ", ".join(map(str, plan.template_args()))
    return f"rmsnorm::layer_norm_backward_kernel<{types}, {args}, {_bool(modulate)}>"


def reduce_name(out):
    return f"rmsnorm::layer_norm_backward_reduce_kernel<{CUDA_TYPES[out]}>"


# -- layouts ----------------------------------------------------------------------------------

def broadcast_strides(m, shape):
    """The leading-axis strides (elements) of ``m`` broadcast to ``shape`` (0 on broadcast axes)."""
    pad = len(shape) - len(m.shape)
    sh, st = (1,) * pad + tuple(m.shape), (0,) * pad + tuple(m.strides)
    return tuple(0 if sh[i] == 1 and shape[i] != 1 else st[i] for i in range(len(shape) - 1))


class RowsLayout(NamedTuple):
    """The rows of a call's arrays of x's row shape, as two strided levels."""
    shape: tuple
    rows: int
    n_inner: int
    strides: dict       # name -> (outer, inner) in elements
    copied: bool


def rows_layout(kind, arrays, metas, names, outputs, fresh=(), copied=False):
    """Two strided levels shared by ``names`` (arrays whose rows run over x's leading axes:
    the broadcast ones too), inputs the kernels cannot read so copied, outputs that cannot be
    written so refused (ValueError); ``fresh`` outputs get contiguous strides. Returns the
    arrays (a dict), their metas and the RowsLayout."""
    arrays, metas = dict(arrays), dict(metas)
    x = metas["x"]
    shape, hidden = tuple(x.shape), x.shape[-1]

    def copy(name):
        nonlocal copied
        copied = True
        a = arrays[name]
        if tuple(metas[name].shape) != shape:           # a broadcast input: its rows made whole
            a = kind.broadcast_to(a, shape)
        arrays[name] = kind.contiguous(a)
        metas[name] = kind.meta(arrays[name])

    present = [n for n in names if metas.get(n) is not None]
    for n in present:
        if not _unit_last(metas[n], hidden):
            if n in outputs:
                m = metas[n]
                raise ValueError(f"{n} must have a unit-stride last axis, element-aligned; got strides "
                                 f"{m.strides} (in elements) at address {m.ptr:#x}")
            copy(n)
    order = [n for n in present if n in outputs] + [n for n in present if n not in outputs]
    for attempt in range(2):
        lay = row_layout(shape, [broadcast_strides(metas[n], shape) for n in order])
        misfits = [n for n, st in zip(order, lay.strides) if st is None]
        if not misfits:
            break
        if any(n in outputs for n in misfits) or attempt:
            raise ValueError(f"{misfits[0]}'s leading axes cannot be addressed as at most two strided levels "
                             f"alongside the other arrays; pass a contiguous one")
        for n in misfits:
            copy(n)
    rows, n_inner = lay.rows, lay.n_inner
    n_outer = rows // n_inner if n_inner else 0
    strides = {n: (so if n_outer > 1 else 0, si if n_inner > 1 else 0) for n, (so, si) in zip(order, lay.strides)}
    for n in fresh:
        strides.setdefault(n, (hidden * n_inner if n_outer > 1 else 0, hidden if n_inner > 1 else 0))
    return arrays, metas, RowsLayout(shape, rows, n_inner, strides, copied)


def _spans_apart(name, m, strides, rows_layout_, other, om, ostrides):
    """ValueError when output ``name`` and input ``other``'s byte ranges meet (a conservative
    test for the inputs that are not x's rows: the weight, bias, shift and scale)."""
    lay = rows_layout_
    hidden = lay.shape[-1]
    lo, hi = extent(m.ptr, strides, lay.rows, lay.n_inner, hidden, m.itemsize)
    if ostrides is None:
        olo, ohi = om.ptr, om.ptr + hidden * om.itemsize
    else:
        olo, ohi = extent(om.ptr, ostrides, lay.rows, lay.n_inner, hidden, om.itemsize)
    if lay.rows and lo < ohi and olo < hi:
        raise ValueError(f"{name} overlaps {other}, which every row reads; pass memory apart from it")


class LayerNormLayout(NamedTuple):
    """A validated forward call but the addresses."""
    rows: RowsLayout
    fused: bool
    modulate: bool
    dtype: str
    residual_dtype: str
    param_dtype: Optional[str]      # the kernel's W: weight's and bias's (float32 where they differ)
    mod_dtype: Optional[str]        # M: shift's and scale's (float32 where they differ)
    out_dtype: str
    given_outputs: tuple
    device: int


def layer_norm_layout(kind, arrays, metas, fused, modulate, out_dtype, residual_dtype, copied=False):
    """The forward's LayerNormLayout and its arrays (a LayerNormArrays)."""
    names = ("x", "residual", "shift", "scale", "out", "residual_out")
    outputs = ("out", "residual_out")
    a, m, rows = rows_layout(kind, arrays._asdict(), metas._asdict(), names, outputs,
                             fresh=("out", "residual_out") if fused else ("out",), copied=copied)
    for n in ("weight", "bias"):                      # read as (hidden,) vectors
        if m[n] is not None and not _unit_last(m[n], rows.shape[-1]):
            a[n] = kind.contiguous(a[n])
            m[n] = kind.meta(a[n])
    given = tuple(n for n in outputs if metas._asdict()[n] is not None)
    # the shared overlap rules on the forward's five arrays, then the other inputs
    st = rows.strides
    five = Arrays(m["x"], m["residual"], m["weight"], m["out"], m["residual_out"])
    idx = {"out": 3, "residual_out": 4}
    hidden = rows.shape[-1]
    ext = [None if mm is None else tuple(v - mm.ptr for v in (
        (mm.ptr, mm.ptr + hidden * mm.itemsize) if k == 2 else extent(mm.ptr, st[n], rows.rows, rows.n_inner,
                                                                      hidden, mm.itemsize)))
           for k, (n, mm) in enumerate(zip(("x", "residual", "weight", "out", "residual_out"), five))]
    layout5 = CallLayout(fused, rows.shape, rows.rows, rows.n_inner, m["x"].dtype, m["x"].itemsize,
                         m["weight"].dtype if m["weight"] else None, m["weight"].itemsize if m["weight"] else 0,
                         m["x"].device, Arrays(st.get("x"), st.get("residual"), None, st.get("out"),
                                               st.get("residual_out")),
                         Arrays(*ext), tuple(idx[n] for n in given), rows.copied)
    check_overlap(layout5, five)
    for o in given:
        for i in ("bias", "shift", "scale"):
            if m[i] is not None:
                _spans_apart(o, m[o], st[o], rows, i, m[i], st.get(i))
    w, b, sh, sc = m["weight"], m["bias"], m["shift"], m["scale"]
    param = None if w is None and b is None else (w or b).dtype if (w is None or b is None or w.dtype == b.dtype) \
        else "float32"
    mod = None if not modulate else sh.dtype if sh.dtype == sc.dtype else "float32"
    layout = LayerNormLayout(rows, fused, modulate, m["x"].dtype, residual_dtype, param, mod, out_dtype, given,
                             m["x"].device)
    return LayerNormArrays(**{n: a.get(n) for n in LayerNormArrays._fields}), layout


def _vector_width(itemsize, hidden, pointers):
    """The widest vector (elements of x, at most 16 bytes) that ``hidden`` and every row array
    allow: ``pointers`` [(address, (outer, inner) strides, itemsize)]."""
    vec = 16 // itemsize
    while vec > 1:
        if hidden % vec == 0 and all((p | (so * s) | (si * s)) % (vec * s) == 0 for p, (so, si), s in pointers):
            break
        vec //= 2
    return vec


def _widened(kind, a, dtype):
    """``a`` in the kernel's dtype (float32 beside another 16-bit or float32 parameter: exact)."""
    if a is None or kind.meta(a).dtype == dtype:
        return a
    return kind.as_dtype(a, dtype)


class LayerNormLauncher:
    """Launches one forward signature: planned and compiled per vector width; a call reads the
    pointers, allocates missing outputs and launches on the caller's stream."""

    def __init__(self, layout, scalars, kind):
        self.kind, self.layout, self.device = kind, layout, _driver.device(layout.device)
        rows = layout.rows
        params = np.zeros(1, LAYER_NORM_PARAMS_DTYPE)
        params["rows"], params["n_inner"], params["hidden"] = rows.rows, rows.n_inner, rows.shape[-1]
        for n in ("x", "residual", "out", "residual_out", "shift", "scale"):
            if n in rows.strides:
                params[n] = rows.strides[n]
        params["eps"] = scalars.eps
        self.params = params
        self._by_vec = {}
        self._empty = kind.empty_getter(rows.strides["x"], rows.n_inner, rows.shape[-1])

    def function(self, vec):
        entry = self._by_vec.get(vec)
        if entry is None:
            lay = self.layout
            plan = layer_norm_plan(lay.rows.rows, lay.rows.shape[-1], vec)
            _cache.record_plan(plan)
            name = forward_name(lay.dtype, lay.residual_dtype if lay.fused else None, lay.param_dtype, lay.mod_dtype,
                                lay.out_dtype, plan, lay.fused, lay.modulate)
            fn = kernel_cache.get(self.device.index, name, "layer_norm")
            from cupy_backends.cuda.api import driver
            _driver.ensure_context(self.device.index)
            per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.ptr, plan.block, 0)
            trigger = EARLY_TRIGGER if early_trigger(plan.grid, self.device.sm_count, per_sm) else 0
            entry = self._by_vec[vec] = (plan, _driver.KernelLaunch(fn.ptr, (plan.grid, 1), plan.block), trigger)
        return entry

    def __call__(self, arrays):
        from cupy import cuda
        if cuda.runtime.getDevice() == self.device.index:
            return self._run(arrays)
        with cuda.Device(self.device.index):
            return self._run(arrays)

    def _run(self, arrays):
        kind, ptr, lay = self.kind, self.kind.ptr, self.layout
        x, residual, weight, bias, out, residual_out, shift, scale = arrays
        if out is None:
            out = kind.empty_of(x, lay.rows.shape, lay.out_dtype) if lay.out_dtype != lay.dtype else self._empty(x)
        if lay.fused and residual_out is None:
            residual_out = kind.empty_of(x, lay.rows.shape, lay.residual_dtype)
        result = (out, residual_out) if lay.fused else out
        if lay.rows.rows == 0:
            return result
        weight, bias = _widened(kind, weight, lay.param_dtype), _widened(kind, bias, lay.param_dtype)
        shift, scale = _widened(kind, shift, lay.mod_dtype), _widened(kind, scale, lay.mod_dtype)
        named = dict(x=x, residual=residual, out=out, residual_out=residual_out, shift=shift, scale=scale)
        pointers = [(ptr(a), self.layout.rows.strides[n], ITEMSIZES[kind.meta(a).dtype])
                    for n, a in named.items() if a is not None]
        plan, kernel, trigger = self.function(_vector_width(ITEMSIZES[lay.dtype], lay.rows.shape[-1], pointers))
        params = self.params.copy()
        params["flags"] = (HAS_WEIGHT if weight is not None else 0) | (LN_HAS_BIAS if bias is not None else 0) | trigger
        argv, held = _argv([ptr(a) if a is not None else 0
                            for a in (x, residual, out, residual_out, weight, bias, shift, scale)] + [params])
        _driver.launch(self.device, kernel, kind.stream(self.device.index), argv)
        return result


# -- the backward ------------------------------------------------------------------------------

class LayerNormBackwardLayout(NamedTuple):
    rows: RowsLayout
    modulate: bool
    group_rows: int
    dtype: str
    dy_dtype: str
    param_dtype: Optional[str]
    mod_dtype: Optional[str]
    mod_shape: Optional[tuple]
    device: int


def layer_norm_backward_layout(kind, arrays, metas, modulate):
    """The backward's layout and arrays: rows of dy, x, d_residual_out (and the broadcast shift
    and scale) as two levels, dx fresh and contiguous. ValueError for a shift / scale whose
    rows are shared by rows that are not consecutive (the kernel sums a group of consecutive
    rows into each of their rows)."""
    names = ("dy", "x", "d_residual_out", "shift", "scale")
    a, m, rows = rows_layout(kind, arrays._asdict(), metas._asdict(), names, (), fresh=("dx",))
    for n in ("weight", "bias"):
        if m[n] is not None and not _unit_last(m[n], rows.shape[-1]):
            a[n] = kind.contiguous(a[n])
            m[n] = kind.meta(a[n])
    group_rows = rows.rows
    if modulate:
        so, si = rows.strides["shift"]
        if rows.strides["scale"] != (so, si) or tuple(m["shift"].shape) != tuple(m["scale"].shape):
            raise ValueError("shift and scale must have one shape and layout for the backward, got "
                             f"{tuple(m['shift'].shape)} and {tuple(m['scale'].shape)}")
        n_outer = rows.rows // rows.n_inner if rows.n_inner else 0
        if so == 0 and si == 0:
            group_rows = rows.rows
        elif si == 0 and (so != 0 or n_outer <= 1):
            group_rows = rows.n_inner
        elif so != 0 or n_outer <= 1:
            group_rows = 1
        else:
            raise ValueError(f"shift of shape {tuple(m['shift'].shape)} is shared by rows that are not "
                             f"consecutive; the backward takes shapes like (B, 1, D), (B, S, D) or (D,)")
    w, b, sh = m["weight"], m["bias"], m["shift"]
    param = None if w is None and b is None else (w or b).dtype if (w is None or b is None or w.dtype == b.dtype) \
        else "float32"
    mod = None if not modulate else sh.dtype if sh.dtype == m["scale"].dtype else "float32"
    layout = LayerNormBackwardLayout(rows, modulate, max(1, group_rows), m["x"].dtype, m["dy"].dtype, param, mod,
                                     tuple(metas.shift.shape) if modulate else None, m["x"].device)
    return LayerNormBackwardArrays(**{n: a.get(n) for n in LayerNormBackwardArrays._fields}), layout


class LayerNormBackwardLauncher(GradLauncher):
    """Launches one backward signature: layer_norm_backward_kernel, then the reductions of its
    partial rows (the parameters' over every block, the modulation's over each group's)."""

    program = "layer_norm_backward"

    def __init__(self, layout, scalars, kind):
        super().__init__(kind, layout.device, layout.param_dtype or layout.dtype, layout.rows.shape[-1])
        self.layout, self.rows, self.hidden = layout, layout.rows, layout.rows.shape[-1]
        params = np.zeros(1, LAYER_NORM_BACKWARD_PARAMS_DTYPE)
        params["rows"], params["n_inner"], params["hidden"] = self.rows.rows, self.rows.n_inner, self.hidden
        for n in ("dy", "x", "d_residual_out", "dx", "shift", "scale"):
            if n in self.rows.strides:
                params[n] = self.rows.strides[n]
        params["eps"] = scalars.eps
        self.params = params
        self._by_vec = {}
        self._reduces = {}
        self._empty = kind.empty_getter(self.rows.strides["x"], self.rows.n_inner, self.hidden)

    def function(self, vec):
        entry = self._by_vec.get(vec)
        if entry is None:
            lay = self.layout
            plan = layer_norm_backward_plan(self.rows.rows, self.hidden, vec, lay.group_rows, self.device.sm_count)
            _cache.record_plan(plan)
            name = backward_name(lay.dtype, lay.dy_dtype, lay.param_dtype, lay.mod_dtype, plan, lay.modulate)
            fn = kernel_cache.get(self.device.index, name, self.program)
            entry = self._by_vec[vec] = (plan, _driver.KernelLaunch(fn.ptr, (plan.grid, 1), plan.block))
        return entry

    def reduction(self, dtype, outputs, planes):
        key = (dtype, outputs, planes)
        if key not in self._reduces:
            fn = kernel_cache.get(self.device.index, reduce_name(dtype), self.program)
            self._reduces[key] = _driver.KernelLaunch(fn.ptr, (-(-self.hidden // REDUCE_COLUMNS), outputs, planes),
                                                      REDUCE_BLOCK)
        return self._reduces[key]

    def _run(self, arrays, weight_grad):
        """(dx, dweight, dbias, dshift, dscale): None for an absent parameter or modulation."""
        kind, ptr, lay = self.kind, self.kind.ptr, self.layout
        dy, x, d_res, weight, bias, shift, scale = arrays
        want = weight_grad and (weight is not None or bias is not None)
        dx = self._empty(x)
        grads = [kind.empty_of(p, tuple(p.shape)) if want and p is not None else None for p in (weight, bias)]
        mods = [kind.empty_of(p, lay.mod_shape) if p is not None else None for p in (shift, scale)]
        if self.rows.rows == 0:
            return (dx, *[None if g is None else kind.zeros_like(g) for g in grads + mods])
        weight_k, bias_k = _widened(kind, weight, lay.param_dtype), _widened(kind, bias, lay.param_dtype)
        shift_k, scale_k = _widened(kind, shift, lay.mod_dtype), _widened(kind, scale, lay.mod_dtype)
        named = dict(dy=dy, x=x, d_residual_out=d_res, dx=dx, shift=shift_k, scale=scale_k)
        pointers = [(ptr(a), self.rows.strides[n], ITEMSIZES[kind.meta(a).dtype])
                    for n, a in named.items() if a is not None]
        plan, kernel = self.function(_vector_width(ITEMSIZES[lay.dtype], self.hidden, pointers))
        flags = ((HAS_WEIGHT if weight is not None else 0) | (LN_HAS_BIAS if bias is not None else 0)
                 | (LN_ADD_GRAD if d_res is not None else 0) | (LN_PARAM_GRAD if want else 0)
                 | (LN_MOD_GRAD if lay.modulate else 0))
        direct_param, direct_mod = want and plan.grid == 1, lay.modulate and plan.blocks_per_group == 1
        flags |= (LN_DIRECT_PARAM if direct_param else 0) | (LN_DIRECT_MOD if direct_mod else 0)
        # kernel-dtype buffers where a parameter was widened: the gradients come back in its dtype
        kgrads = [g if g is None or kind.meta(g).dtype == lay.param_dtype
                  else kind.empty_of(g, tuple(g.shape), lay.param_dtype) for g in grads]
        kmods = [g if g is None or kind.meta(g).dtype == lay.mod_dtype
                 else kind.empty_of(g, lay.mod_shape, lay.mod_dtype) for g in mods]
        planes = [g for g in kgrads if g is not None] + [g for g in kmods if g is not None]
        partials = None
        if planes and not (direct_param and (direct_mod or not lay.modulate)):
            partials = kind.empty_of(x, (len(planes), plan.grid, self.hidden), "float32")
        params = self.params.copy()
        params["group_rows"], params["rows_per_block"] = plan.group_rows, plan.rows_per_block
        params["blocks_per_group"], params["flags"] = plan.blocks_per_group, flags
        out_ptrs = [ptr(g) if g is not None else 0 for g in kgrads + kmods]
        argv, held = _argv([ptr(a) if a is not None else 0 for a in (dy, x, d_res, dx, weight_k, bias_k, shift_k,
                                                                     scale_k)]
                           + [ptr(partials) if partials is not None else 0] + out_ptrs + [params])
        plane = plan.grid * self.hidden
        with self._lock:
            stream = kind.stream(self.device.index)
            _driver.launch(self.device, kernel, stream, argv)
            base = 0
            for outs, direct, per_output, outputs, dtype in (
                    (kgrads, direct_param, plan.grid, 1, lay.param_dtype),
                    (kmods, direct_mod, plan.blocks_per_group, plan.grid // plan.blocks_per_group, lay.mod_dtype)):
                present = [g for g in outs if g is not None]
                if present and not direct:
                    rp = np.zeros(1, LAYER_NORM_REDUCE_PARAMS_DTYPE)
                    rp["per_output"], rp["hidden"], rp["plane"] = per_output, self.hidden, plane
                    rargv, rheld = _argv([ptr(partials) + 4 * base * plane, ptr(present[0]),
                                          ptr(present[-1]), rp])
                    _driver.launch(self.device, self.reduction(dtype, outputs, len(present)), stream, rargv)
                base += len(present)
        grads = [g if g is None or k is g else _into(kind, k, g) for g, k in zip(grads, kgrads)]
        mods = [g if g is None or k is g else _into(kind, k, g) for g, k in zip(mods, kmods)]
        return (dx, *grads, *mods)


def _into(kind, src, dest):
    """``src`` (a float32 gradient of a widened parameter) rounded into ``dest``."""
    return kind.as_dtype(src, kind.meta(dest).dtype).reshape(dest.shape)


