from typing import NamedTuple, Optional

import numpy as np

from ... import _cache, _driver
from ..._abi import (
    CUDA_TYPES,
    DIRECT_WEIGHT,
    HAS_WEIGHT,
    LLAMA,
    WEIGHT_GRAD,
    kernel_weight_offset,
)
from ..._compile import kernel_cache, register_program
from ..._launcher import GradLauncher, SlotLauncher, _apart, _argv
from ..._layout import _MAYBE, _TooHardError, _unit_last, row_layout
from ..._plan import (
    vector_width_from_bits,
)
from .plan import qk_rope_backward_plan, qk_rope_plan

# the family's kernel programs (kernels/)
register_program("qk_rope", "qk_norm_rope.cu")
register_program("qk_rope_backward", "qk_norm_rope_backward.cu")


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


# -- QK norm + RoPE: enum QkRopeFlags, struct QkRopeParams / QkRopeBackwardParams -----------------
# (kernels/qk_norm_rope.cu; the backward's flags also take BACKWARD_FLAGS' kWeightGrad, kDirectWeight)
QK_ROPE_FLAGS = {"kInt64Positions": 512}
INT64_POSITIONS = QK_ROPE_FLAGS["kInt64Positions"]
QK_ROPE_PARAMS_BYTES = 208
QK_ROPE_PARAMS_DTYPE = np.dtype([
    ("tokens", "<i8"), ("n_inner", "<i8"),
    ("q", "<i8", (2,)), ("k", "<i8", (2,)), ("out_q", "<i8", (2,)), ("out_k", "<i8", (2,)),
    ("cos", "<i8", (2,)), ("sin", "<i8", (2,)), ("positions", "<i8", (2,)),
    ("q_head", "<i8"), ("k_head", "<i8"), ("out_q_head", "<i8"), ("out_k_head", "<i8"),
    ("cache_row", "<i8"), ("max_position", "<i8"),
    ("q_heads", "<i4"), ("k_heads", "<i4"), ("head_dim", "<i4"), ("rotary_dim", "<i4"),
    ("eps", "<f4"), ("weight_offset", "<f4"), ("flags", "<i4"), ("unused", "<i4"),
])
assert QK_ROPE_PARAMS_DTYPE.itemsize == QK_ROPE_PARAMS_BYTES


QK_ROPE_BACKWARD_PARAMS_BYTES = 264
QK_ROPE_BACKWARD_PARAMS_DTYPE = np.dtype([
    ("tokens", "<i8"), ("n_inner", "<i8"), ("items_per_block", "<i8"),
    ("dq_out", "<i8", (2,)), ("dk_out", "<i8", (2,)), ("q", "<i8", (2,)), ("k", "<i8", (2,)),
    ("dq", "<i8", (2,)), ("dk", "<i8", (2,)), ("cos", "<i8", (2,)), ("sin", "<i8", (2,)),
    ("positions", "<i8", (2,)),
    ("dq_out_head", "<i8"), ("dk_out_head", "<i8"), ("q_head", "<i8"), ("k_head", "<i8"), ("dq_head", "<i8"),
    ("dk_head", "<i8"), ("cache_row", "<i8"), ("max_position", "<i8"),
    ("q_heads", "<i4"), ("k_heads", "<i4"), ("head_dim", "<i4"), ("rotary_dim", "<i4"),
    ("eps", "<f4"), ("weight_offset", "<f4"), ("flags", "<i4"), ("unused", "<i4"),
])
assert QK_ROPE_BACKWARD_PARAMS_DTYPE.itemsize == QK_ROPE_BACKWARD_PARAMS_BYTES


def qk_rope_instantiation_name(dtype, weight_dtype, table_dtype, plan, cache):
    """The name expression of the QK norm + RoPE forward kernel (program "qk_rope") a QkRopePlan
    needs: ``table_dtype`` the cos / sin (or cos_sin_cache) dtype, ``cache`` the positions and
    cos_sin_cache convention."""
    args = ", ".join(str(a) for a in plan.template_args())
    return (f"rmsnorm::qk_norm_rope_kernel<{CUDA_TYPES[dtype]}, {CUDA_TYPES[weight_dtype or dtype]}, "
            f"{CUDA_TYPES[table_dtype]}, {args}, {'true' if cache else 'false'}>")


def qk_rope_backward_instantiation_name(dtype, weight_dtype, table_dtype, plan, cache):
    """The name expression of the QK norm + RoPE backward kernel (program "qk_rope") a
    QkRopeBackwardPlan needs."""
    args = ", ".join(str(a) for a in plan.template_args())
    return (f"rmsnorm::qk_norm_rope_backward_kernel<{CUDA_TYPES[dtype]}, {CUDA_TYPES[weight_dtype or dtype]}, "
            f"{CUDA_TYPES[table_dtype]}, {args}, {'true' if cache else 'false'}>")


# -- QK norm + RoPE --------------------------------------------------------------------------------
# The forward kernel's pointer slots, by argument (the cache takes cos's slot in its convention).
QK_ROPE_SLOTS = {"q": 0, "k": 1, "out_q": 2, "out_k": 3, "q_weight": 4, "k_weight": 5, "cos": 6, "cos_sin_cache": 6,
                 "sin": 7, "positions": 8}
_HEAD_MAJOR = ("q", "k", "out_q", "out_k")


def _qk_rope_params(params, layout, scalars, arrays):
    """Fill the fields a forward and a backward Params share: the tokens, each of ``arrays``'
    token strides (and head strides where it has heads), the angles' arrays, the sizes and the
    scalars; the flags but for the weights' and the backward's."""
    params["tokens"], params["n_inner"] = layout.tokens, layout.n_inner
    for name in arrays:
        params[name] = layout.token_strides.get(name, (0, 0))
        if name in layout.head_strides:
            params[name + "_head"] = layout.head_strides[name]
    for name in ("cos", "sin", "positions"):
        params[name] = layout.token_strides.get(name, (0, 0))
    params["cache_row"], params["max_position"] = layout.cache_row, layout.max_position
    params["q_heads"], params["k_heads"] = layout.q_heads, layout.k_heads
    params["head_dim"], params["rotary_dim"] = layout.head_dim, layout.spec.rotary_dim
    params["eps"], params["weight_offset"] = scalars.eps, kernel_weight_offset(scalars)
    return (LLAMA if scalars.llama else 0) | (INT64_POSITIONS if layout.int64_positions else 0)


def _qk_rope_stride_bits(layout, names):
    """The OR of the byte steps between heads of ``names`` (token and head strides) and of
    head_dim: with the arrays' addresses, what decides the vector width (every head of every
    array on its grid, whole vectors)."""
    bits = layout.head_dim * layout.itemsize
    for name in names:
        so, si = layout.token_strides[name]
        bits |= (so | si | layout.head_strides[name]) * layout.itemsize
    return bits


class QkRopeLauncher(SlotLauncher):
    """Launches one signature of qk_norm_rope (qk_norm_rope_kernel): called with the ten of
    QkRopeArrays. Every head of q, k and the outputs starts on the vector grid and holds whole
    vectors (the vector width is the widest their addresses and strides allow). A given output
    may be its own input (in place); an overlap the pointer windows cannot rule out goes to the
    full path, unless the full path has proved these very pointer differences apart before (the
    views of one packed projection, call after call)."""

    slots = 9

    def __init__(self, layout, scalars, kind):
        super().__init__(kind, layout.device)
        self.layout, self.itemsize = layout, layout.itemsize
        self.items = layout.tokens * (layout.q_heads + layout.k_heads)
        self.cache = layout.spec.cache
        params = np.zeros(1, QK_ROPE_PARAMS_DTYPE)
        flags = _qk_rope_params(params, layout, scalars, _HEAD_MAJOR)
        params["flags"] = flags | (HAS_WEIGHT if layout.weight_dtype else 0)
        self.params = params
        self.stride_bits = _qk_rope_stride_bits(layout, _HEAD_MAJOR)
        self._item_mask = self.itemsize - 1
        self._weight_mask = (layout.weight_itemsize or 1) - 1
        self._table_mask = layout.table_itemsize - 1
        self._position_mask = 7 if layout.int64_positions else 3
        ext = layout.extents
        pairs = []
        for n, out in enumerate(layout.given_outputs):     # each given output against the rest
            own = "q" if out == "out_q" else "k"
            for other in [a for a in ext if a not in ("out_q", "out_k")] + list(layout.given_outputs[:n]):
                same_ok = other == own and layout.token_strides[out] == layout.token_strides[own] \
                    and layout.head_strides[out] == layout.head_strides[own]
                pairs.append(_apart(QK_ROPE_SLOTS[out], ext[out], QK_ROPE_SLOTS[other], ext[other], same_ok))
        self._overlap_pairs = tuple(pairs)
        self._proven = (None,) * len(pairs)   # pointer differences the full path proved apart
        shape_q, shape_k = layout.tokens_shape + (layout.q_heads, layout.head_dim), \
            layout.tokens_shape + (layout.k_heads, layout.head_dim)
        self._new_q = lambda q: kind.empty_of(q, shape_q)
        self._new_k = lambda q: kind.empty_of(q, shape_k)

    def plan_and_function(self, vec, edges=False):
        entry = self._by_vec.get(vec)
        if entry is None:
            layout, forced = self.layout, _cache.plan_overrides
            plan = qk_rope_plan(layout.tokens, layout.q_heads + layout.k_heads, layout.head_dim,
                                layout.spec.rotary_dim, layout.spec.is_neox, vec,
                                threads_per_head=forced.get("threads_per_row"),
                                vecs_per_thread=forced.get("vecs_per_thread"))
            _cache.record_plan(plan)
            name = qk_rope_instantiation_name(layout.dtype, layout.weight_dtype, layout.table_dtype, plan, self.cache)
            entry = self._by_vec[vec] = (plan, kernel_cache.get(self.device.index, name, "qk_rope"))
        return entry

    def edges(self, vec, x_ptr):
        return False                # every head on the vector grid, whole vectors

    def _overlapping(self, pointers):
        proven = self._proven
        for n, (a, b, low, high, same_ok) in enumerate(self._overlap_pairs):
            d = pointers[b] - pointers[a]
            if low < d < high and not (same_ok and d == 0) and d != proven[n]:
                return True
        return False

    def _run(self, arrays, checked=False):
        q, k, q_weight, k_weight, cos, sin, positions, cache, out_q, out_k = arrays
        ptr = self._ptr
        pq, pk = ptr(q), ptr(k)
        pqw = 0 if q_weight is None else ptr(q_weight)
        pkw = 0 if k_weight is None else ptr(k_weight)
        if self.cache:
            pcos, psin, ppos = ptr(cache), 0, ptr(positions)
        else:
            pcos, psin, ppos = ptr(cos), ptr(sin), 0
        poq = 0 if out_q is None else ptr(out_q)
        pok = 0 if out_k is None else ptr(out_k)
        if ((pq | pk | poq | pok) & self._item_mask or (pqw | pkw) & self._weight_mask
                or (pcos | psin) & self._table_mask or ppos & self._position_mask):
            return None
        pointers = (pq, pk, poq, pok, pqw, pkw, pcos, psin, ppos)
        if self._overlap_pairs:
            if checked:                 # validated just now, exactly: these differences are apart
                self._proven = tuple(pointers[b] - pointers[a] for a, b, _, _, _ in self._overlap_pairs)
            elif self._overlapping(pointers):
                return None
        if out_q is None:
            out_q = self._new_q(q)
            poq = ptr(out_q)
        if out_k is None:
            out_k = self._new_k(q)
            pok = ptr(out_k)
        if self.items:
            self._launch(self.stride_bits | pq | pk | poq | pok, pq, (pq, pk, poq, pok, pqw, pkw, pcos, psin, ppos))
        return out_q, out_k


class QkRopeBackwardLauncher(GradLauncher):
    """Launches the backward of one qk_norm_rope signature: qk_norm_rope_backward_kernel, then
    (more than one block) the dweight reduction over [q's head_dim | k's] columns; dq and dk
    are fresh and contiguous."""

    program = "qk_rope_backward"
    _ARRAYS = ("dq_out", "dk_out", "q", "k", "dq", "dk")

    def __init__(self, layout, scalars, kind):
        super().__init__(kind, layout.device, layout.weight_dtype, 2 * layout.head_dim)
        self.layout = layout
        self.itemsize, self.head_dim = layout.itemsize, layout.head_dim
        self.items = layout.tokens * (layout.q_heads + layout.k_heads)
        params = np.zeros(1, QK_ROPE_BACKWARD_PARAMS_DTYPE)
        self.flags = _qk_rope_params(params, layout, scalars, self._ARRAYS)
        self.params = params
        self.stride_bits = _qk_rope_stride_bits(layout, self._ARRAYS)
        shape_q, shape_k = layout.tokens_shape + (layout.q_heads, layout.head_dim), \
            layout.tokens_shape + (layout.k_heads, layout.head_dim)
        self._new = lambda q: (kind.empty_of(q, shape_q), kind.empty_of(q, shape_k))
        self._by_vec = {}

    def plan_and_function(self, vec):
        """The plan (its grid fitted to the kernel's occupancy) and kernel for a vector width."""
        entry = self._by_vec.get(vec)
        if entry is None:
            d, layout = self.device, self.layout
            forced = dict(_cache.backward_overrides)
            cap = forced.pop("max_blocks_per_sm", None)
            geometry = dict(threads_per_head=forced.get("threads_per_row"),
                            vecs_per_thread=forced.get("vecs_per_thread"))
            args = (layout.tokens, layout.q_heads + layout.k_heads, layout.head_dim, layout.spec.rotary_dim,
                    layout.spec.is_neox, vec, d.sm_count)
            plan = qk_rope_backward_plan(*args, max_blocks_per_sm=cap, **geometry)
            name = qk_rope_backward_instantiation_name(layout.dtype, layout.weight_dtype, layout.table_dtype, plan,
                                                       layout.spec.cache)
            fn = kernel_cache.get(d.index, name, "qk_rope_backward")
            per_sm = self.occupancy(fn, plan.block)
            plan = qk_rope_backward_plan(*args, max_blocks_per_sm=min(per_sm, cap or per_sm),
                                         threads_per_head=plan.threads_per_head, vecs_per_thread=plan.vecs_per_thread)
            _cache.record_plan(plan)
            entry = self._by_vec[vec] = (plan, _driver.KernelLaunch(fn.ptr, (plan.grid, 1), plan.block))
        return entry

    def _run(self, arrays, weight_grad):
        """(dq, dk, dq_weight, dk_weight) for ``arrays`` (QkRopeBackwardArrays)."""
        kind, ptr, d = self.kind, self.kind.ptr, self.head_dim
        dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, positions, cache = arrays
        want_dw = q_weight is not None and weight_grad
        dq, dk = self._new(q)
        if self.items == 0:
            return dq, dk, *((kind.zeros_like(q_weight), kind.zeros_like(k_weight)) if want_dw else (None, None))
        pointers = [ptr(a) for a in (dq_out, dk_out, q, k, dq, dk)]
        bits = self.stride_bits
        for p in pointers:
            bits |= p
        plan, kernel = self.plan_and_function(vector_width_from_bits(self.itemsize, bits))
        partials = dweight = None
        direct = want_dw and plan.grid == 1                 # one block: no reduction
        if want_dw:
            dweight = kind.empty_of(q_weight, (2 * d,))
            if not direct:
                partials = kind.empty_of(q, (plan.partials, 2 * d), "float32")
        params = self.params.copy()
        params["items_per_block"] = plan.items_per_block
        params["flags"] = (self.flags | (HAS_WEIGHT if q_weight is not None else 0) | (WEIGHT_GRAD if want_dw else 0)
                           | (DIRECT_WEIGHT if direct else 0))
        tables = (ptr(cache), 0, ptr(positions)) if self.layout.spec.cache else (ptr(cos), ptr(sin), 0)
        weights = (0, 0) if q_weight is None else (ptr(q_weight), ptr(k_weight))
        argv, held = _argv(pointers + [*weights, *tables, ptr(partials) if partials is not None else 0,
                                       ptr(dweight) if dweight is not None else 0, params])
        self.launch(kernel, argv, partials, dweight, plan.partials)
        if dweight is None:
            return dq, dk, None, None
        return dq, dk, dweight[:d], dweight[d:]
