"""The launchers: everything about a call that does not depend on its arrays' addresses,
kept per call signature (``_cache``), and the launch itself.

A launcher is built from a validated call's layout, scalars and array kind. Calling it
with the arrays reads their pointers, checks what depends on them (alignment, the vector
width they allow, overlap of given outputs with what they must keep apart from),
allocates missing outputs and launches on the caller's stream; whatever those cheap checks
cannot settle returns ``None``, and the caller takes the full path. ``Launcher`` (rms_norm
and the fused op) and ``QuantLauncher`` (their quantized forms) share the launch tail
(``_launch``): the kernel's pointer slots and its Params live in one host buffer per
launcher, so a repeated call writes its pointers and launches through the driver
(``_driver``), with no argument packing of CuPy's. ``BackwardLauncher`` launches the
backward's dx kernel and its dweight reduction. The gated and QK norm + RoPE ops have a launcher
of each kind too.
"""

import ctypes
import struct
import threading

import numpy as np

from . import _cache, _driver
from ._abi import (ADD_GRAD, BACKWARD_PARAMS_DTYPE, DIRECT_WEIGHT, EARLY_TRIGGER, GATED_BACKWARD_PARAMS_DTYPE,
                   GATED_PARAMS_DTYPE, HAS_WEIGHT, INT64_POSITIONS, ITEMSIZES, LLAMA, PARAMS_DTYPE,
                   QK_ROPE_BACKWARD_PARAMS_DTYPE, QK_ROPE_PARAMS_DTYPE, QUANT_PARAMS_DTYPE, REDUCE_BLOCK,
                   REDUCE_COLUMNS, REDUCE_PARAMS_DTYPE, ROUND_PRODUCT, WEIGHT_GRAD, backward_instantiation_name,
                   gated_backward_instantiation_name, gated_instantiation_name, instantiation_name,
                   kernel_weight_offset, qk_rope_backward_instantiation_name, qk_rope_instantiation_name,
                   quant_instantiation_name, reduce_instantiation_name, row_kernel_flags)
from ._compile import kernel_cache
from ._layout import (B_WEIGHT, OUT, RESIDUAL, RESIDUAL_OUT, SCALE, SCALES, WEIGHT, X, BackwardArrays,
                      backward_layout, new_scales)
from ._plan import (backward_plan, backward_refit_keywords, early_trigger, fits_32_bit_offsets, gated_backward_plan,
                    gated_plan, launch_plan, qk_rope_backward_plan, qk_rope_plan, vector_width_from_bits)

_ROW_STRIDE_FIELDS = {X: "x", RESIDUAL: "residual", OUT: "out", RESIDUAL_OUT: "residual_out"}
KERNEL_POINTERS = (X, RESIDUAL, OUT, RESIDUAL_OUT, WEIGHT)   # the forward kernel's pointer arguments, in order
_SLOT = {k: i for i, k in enumerate(KERNEL_POINTERS)}
# the quantized kernel's: x, residual, q, residual_out, weight, scale, scales
_QUANT_SLOT = {**_SLOT, SCALE: 5, SCALES: 6}


def _apart(a, extent_a, b, extent_b, same_ok):
    """A pair of pointer slots that must not overlap, as (a, b, low, high, same_ok): arrays a
    and b span [pa + lo_a, pa + hi_a) and [pb + lo_b, pb + hi_b) (byte extents relative to
    their pointers), which overlap exactly when low < pb - pa < high; ``same_ok``: pa == pb is
    allowed (the very same array)."""
    (lo_a, hi_a), (lo_b, hi_b) = extent_a, extent_b
    return a, b, lo_a - hi_b, hi_a - lo_b, same_ok


class SlotLauncher:
    """What the forward launchers share: the pointer slots and Params in one host buffer, a
    launch entry per alignment of the arrays (plan, kernel, arguments), the launch tail and the
    switch to the arrays' device. A subclass sets ``params`` and ``itemsize`` and gives
    ``plan_and_function``, ``edges`` and ``_run``."""

    slots = 5              # pointer arguments

    def __init__(self, kind, device_index):
        self.kind = kind
        self.device = _driver.device(device_index)
        self._slots = bytearray(8 * self.slots)     # the pointer arguments, written per call
        self._slots_base = ctypes.addressof(ctypes.c_char.from_buffer(self._slots))
        self._pack = struct.Struct(f"<{self.slots}Q").pack_into
        self._by_vec = {}
        self._by_low_bits = {}      # low 4 bits of x's address and differences -> (KernelLaunch, argv, held)
        self._ptr = kind.ptr
        self._stream = kind.stream
        self._device_index = self.device.index
        self._lock = threading.Lock()   # the slots are shared: one launch at a time per launcher
        from cupy import cuda
        self._get_device, self._device_context = cuda.runtime.getDevice, cuda.Device
        # with one visible device, the current device is the arrays' (no query per call), so
        # the cache keeps _run itself: one frame less per call
        self._one_device = _driver.device_count() == 1
        self.entry = self._run if self._one_device else self.__call__

    def plan_flags(self, plan, fn):
        """Params.flags for a plan: the launcher's, plus when to allow the next kernel."""
        from cupy_backends.cuda.api import driver
        _driver.ensure_context(self.device.index)   # a driver call: this thread may have none yet
        per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.ptr, plan.block, 0)
        trigger = EARLY_TRIGGER if early_trigger(plan.grid, self.device.sm_count, per_sm) else 0
        return int(self.params["flags"][0]) | trigger

    def _launch_entry(self, bits, px):
        """The kernel launch and argument array for the vector width and edges these
        address bits allow: a plan, its kernel, and a Params copy with its flags."""
        vec = vector_width_from_bits(self.itemsize, bits)
        plan, fn = self.plan_and_function(vec, self.edges(vec, px))
        params = self.params.copy()
        params["flags"] = self.plan_flags(plan, fn)
        argv = np.array(self._kernel_args(params), np.uint64)
        kernel = _driver.KernelLaunch(fn.ptr, plan.grid_dims(), plan.block)
        # the arrays live as long as the entry: the driver reads them at each launch
        return kernel, ctypes.c_void_p(argv.ctypes.data), (params, argv)

    def _kernel_args(self, params):
        """The kernelParams addresses: the pointer slots, then Params."""
        return [self._slots_base + 8 * i for i in range(self.slots)] + [params.ctypes.data]

    def _launch(self, bits, px, pointers):
        """The launch tail: the kernel for these address bits (planned and compiled on first
        use), ``pointers`` written into the slots, the launch on the caller's current stream."""
        key = (bits & 15) | ((px & 15) << 4)              # all that decides vector width and edges
        entry = self._by_low_bits.get(key)
        if entry is None:
            entry = self._by_low_bits[key] = self._launch_entry(bits, px)
        kernel, argv, _ = entry
        stream = self._stream(self._device_index)
        lock = self._lock        # acquire and release: cheaper than a with statement's protocol
        lock.acquire()
        try:
            self._pack(self._slots, 0, *pointers)
            if kernel.stream != stream or kernel.ex is None or kernel.ex(argv, None):
                _driver.launch(self.device, kernel, stream, argv)    # a new stream, plain, or an error
        finally:
            lock.release()

    def __call__(self, arrays, checked=False):
        """Launch on ``arrays`` (None where absent).

        Returns the result, or None when the full path must decide (nothing was done).
        ``checked``: the full path has just validated these very arrays. Grad mode and
        inference mode are the signature's business (_interop), not checked here.
        """
        if self._one_device or self._get_device() == self._device_index:
            return self._run(arrays, checked)
        with self._device_context(self._device_index):   # allocate and launch on the arrays' device
            return self._run(arrays, checked)

    def _overlapping(self, pointers):
        """Whether a given output overlaps what it must keep apart from (``pointers``: by
        slot); being the very same array is allowed for an input."""
        for a, b, low, high, same_ok in self._overlap_pairs:
            d = pointers[b] - pointers[a]
            if low < d < high and not (same_ok and d == 0):
                return True
        return False


class Launcher(SlotLauncher):
    """Launches one signature of rms_norm or fused_add_rms_norm (rms_norm_kernel and its
    cluster form); called with the five of ``Arrays``."""

    quant_form = None      # QuantLauncher: the quantized form its plans are made for
    flat = False           # QuantLauncher: whether its rows fit 32-bit offsets (fits_32_bit_offsets)

    def __init__(self, layout, scalars, kind):
        super().__init__(kind, layout.device)
        self.layout, self.fused = layout, layout.fused
        self.shape, self.itemsize, self.rows, self.hidden = layout.shape, layout.itemsize, layout.rows, layout.hidden
        row_strides = layout.row_strides
        self.given_outputs = layout.given_outputs
        self.others = (RESIDUAL, OUT, RESIDUAL_OUT) if self.fused else (OUT,)  # must follow x's alignment
        # with the pointer differences, the stride differences from x decide the vector width
        xso, xsi = row_strides[X]
        bits = 0
        for k in self.others:
            so, si = row_strides[k]
            bits |= ((so - xso) * self.itemsize) | ((si - xsi) * self.itemsize)
        self.stride_bits = bits
        # x's rows all start on its vector grid when its address and strides do (the
        # strides part is settled here; the address, per call)
        self.x_stride_bytes = (xso * self.itemsize) | ((xsi * self.itemsize) if layout.n_inner != 1 else 0)
        params = np.zeros(1, PARAMS_DTYPE)
        params["rows"], params["n_inner"], params["hidden"] = layout.rows, layout.n_inner, layout.hidden
        for k in (X,) + self.others:
            params[_ROW_STRIDE_FIELDS[k]] = row_strides[k]
        params["eps"], params["weight_offset"] = scalars.eps, kernel_weight_offset(scalars)
        params["flags"] = (LLAMA if scalars.llama else 0) | (HAS_WEIGHT if layout.weight_dtype else 0)
        self.params = params               # each plan gets a copy with its own trigger flag
        self.fresh_residual_out = self.fused and RESIDUAL_OUT not in self.given_outputs
        self._overlap_pairs = self._pairs_to_keep_apart(layout)
        self._item_mask = self.itemsize - 1                      # itemsizes are powers of two
        self._weight_mask = (layout.weight_itemsize or 1) - 1
        self._empty = kind.empty_getter(layout.row_strides[X], layout.n_inner, layout.hidden)

    def _pairs_to_keep_apart(self, layout):
        """``_apart`` of each given output against weight, the inputs and the other output;
        "the same" (same pointer, same strides) is allowed for an input."""
        ext, st = layout.extents, layout.row_strides
        pairs = []
        for o in layout.given_outputs:
            others = [WEIGHT] if layout.weight_dtype else []
            others += [i for i in ((X, RESIDUAL) if self.fused else (X,))]
            if o == RESIDUAL_OUT and OUT in layout.given_outputs:
                others.append(OUT)
            for k in others:
                same_ok = k in (X, RESIDUAL) and st[o] == st[k]
                pairs.append(_apart(_SLOT[o], ext[o], _SLOT[k], ext[k], same_ok))
        return tuple(pairs)

    def plan_and_function(self, vec, edges=True):
        """The plan and compiled kernel for a vector width (cached; compiled on first use).
        ``edges``: whether rows may have a scalar head or tail (see LaunchPlan)."""
        entry = self._by_vec.get((vec, edges))
        if entry is None:
            d = self.device
            plan = launch_plan(self.rows, self.hidden, self.itemsize, vec, d.sm_count, self.fused,
                               edges=edges, max_cluster=d.max_cluster, quant=self.quant_form,
                               **{"flat": self.flat, **_cache.plan_overrides})
            _cache.record_plan(plan)
            entry = self._by_vec[(vec, edges)] = (plan, self.function(plan))
        return entry

    def edges(self, vec, x_ptr):
        """False when every row of x starts on the vector grid and holds whole vectors."""
        return bool(self.hidden % vec or (x_ptr | self.x_stride_bytes) % (vec * self.itemsize))

    def function(self, plan):
        """The compiled kernel for a plan."""
        name = instantiation_name(self.layout.dtype, self.layout.weight_dtype, self.fused, plan)
        return kernel_cache.get(self.device.index, name)

    def _run(self, arrays, checked=False):
        # The hot path of every repeated call: the signature fixes which arrays are present,
        # so absent ones are pointer 0 and each check is one expression over the pointers.
        x, residual, weight, out, residual_out = arrays
        ptr = self._ptr
        px = ptr(x)
        pr = 0 if residual is None else ptr(residual)
        pw = 0 if weight is None else ptr(weight)
        po = 0 if out is None else ptr(out)
        pro = 0 if residual_out is None else ptr(residual_out)
        if (px | pr | po | pro) & self._item_mask or pw & self._weight_mask:
            return None
        if not checked and self._overlap_pairs and self._overlapping((px, pr, po, pro, pw)):
            return None
        if out is None:
            out = self._empty(x)
            po = ptr(out)
        if self.fused:
            if residual_out is None:
                residual_out = self._empty(x)
                pro = ptr(residual_out)
            result = out, residual_out
            bits = self.stride_bits | (pr - px) | (po - px) | (pro - px)
        else:
            result = out
            bits = self.stride_bits | (po - px)
        if self.rows:
            self._launch(bits, px, (px, pr, po, pro, pw))
        return result



def _in_x_bytes(pointer, shift):
    """An address of an array of another itemsize as the address of x's element at the same
    index (``shift``: log2 of x's itemsize less the array's): their difference from x's address
    is then a multiple of x's vector exactly when the two line up element for element."""
    return pointer << shift if shift >= 0 else pointer >> -shift


def _shift(itemsize, other_itemsize):
    return (itemsize.bit_length() - 1) - (other_itemsize.bit_length() - 1)


class MixedLauncher(Launcher):
    """A Launcher for mixed precision: a float32 residual stream (residual and residual_out
    float32 with x of another dtype) or an output of another dtype (out_dtype); rms_norm_kernel's
    R and O. Pointers of another itemsize are lined up with x's element by element."""

    def __init__(self, layout, scalars, kind, residual_dtype, out_dtype):
        self.residual_dtype, self.out_dtype = residual_dtype, out_dtype
        super().__init__(layout, scalars, kind)
        r_size, o_size = ITEMSIZES[residual_dtype], ITEMSIZES[out_dtype]
        self._r_shift, self._o_shift = _shift(self.itemsize, r_size), _shift(self.itemsize, o_size)
        self._r_mask, self._o_mask = r_size - 1, o_size - 1
        shape = layout.shape
        self._new_out = lambda x: kind.empty_of(x, shape, out_dtype)
        self._new_residual_out = lambda x: kind.empty_of(x, shape, residual_dtype)
        sizes = {X: self.itemsize, RESIDUAL: r_size, RESIDUAL_OUT: r_size, OUT: o_size}
        slot_size = {_SLOT[k]: s for k, s in sizes.items()}
        # the very same array only if it is also of the same itemsize
        self._overlap_pairs = tuple((a, b, lo, hi, same and slot_size[a] == slot_size.get(b))
                                    for a, b, lo, hi, same in self._overlap_pairs)

    def function(self, plan):
        name = instantiation_name(self.layout.dtype, self.layout.weight_dtype, self.fused, plan, self.residual_dtype,
                                  self.out_dtype)
        return kernel_cache.get(self.device.index, name)

    def _run(self, arrays, checked=False):
        x, residual, weight, out, residual_out = arrays
        ptr = self._ptr
        px = ptr(x)
        pr = 0 if residual is None else ptr(residual)
        pw = 0 if weight is None else ptr(weight)
        po = 0 if out is None else ptr(out)
        pro = 0 if residual_out is None else ptr(residual_out)
        if px & self._item_mask or (pr | pro) & self._r_mask or po & self._o_mask or pw & self._weight_mask:
            return None
        if not checked and self._overlap_pairs and self._overlapping((px, pr, po, pro, pw)):
            return None
        if out is None:
            out = self._new_out(x)
            po = ptr(out)
        bits = self.stride_bits | (_in_x_bytes(po, self._o_shift) - px)
        if self.fused:
            if residual_out is None:
                residual_out = self._new_residual_out(x)
                pro = ptr(residual_out)
            bits |= (_in_x_bytes(pr, self._r_shift) - px) | (_in_x_bytes(pro, self._r_shift) - px)
            result = out, residual_out
        else:
            result = out
        if self.rows:
            self._launch(bits, px, (px, pr, po, pro, pw))
        return result


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


# -- gated -------------------------------------------------------------------------------------

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


# -- backward ----------------------------------------------------------------------------------

def _argv(values):
    """A kernelParams array for ``values`` (pointers as ints, or NumPy records): the array
    and what must stay alive until the launch returns."""
    held = [v if isinstance(v, np.ndarray) else np.array([v], np.uint64) for v in values]
    argv = np.array([h.ctypes.data for h in held], np.uint64)
    return ctypes.c_void_p(argv.ctypes.data), (held, argv)


# CUfunction_attribute: CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, ..._SHARED_SIZE_BYTES
_MAX_DYNAMIC_SHARED, _STATIC_SHARED = 8, 1


class BackwardLauncher:
    """Launches the backward of one signature: the dx kernel, then the dweight reduction.

    Kept per signature (as the forward's launchers) are the planning, compiling and
    occupancy work, per vector width and edges; a call builds its arguments afresh (it
    allocates dx, dweight and the partial rows anyway). ``llama_dtype``: the dtype the llama
    mode rounds xhat to for dweight (the forward output's; x's when None)."""

    def __init__(self, layout, scalars, kind, llama_dtype=None):
        self.kind, self.layout, self.llama_dtype = kind, layout, llama_dtype
        self.device = _driver.device(layout.device)
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
        self._reduce = None
        self._lock = threading.Lock()

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
            from cupy_backends.cuda.api import driver
            _driver.ensure_context(d.index)
            if plan.shared_bytes:   # the function's limit, shared by every launcher: the device's
                driver.funcSetAttribute(fn.ptr, _MAX_DYNAMIC_SHARED,
                                        d.shared_per_block - driver.funcGetAttribute(_STATIC_SHARED, fn.ptr))
            per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.ptr, plan.block, plan.shared_bytes)
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

    def reduce_kernel(self):
        if self._reduce is None:
            fn = kernel_cache.get(self.device.index, reduce_instantiation_name(self.layout.weight_dtype), "backward")
            grid = -(-self.hidden // REDUCE_COLUMNS)
            self._reduce = _driver.KernelLaunch(fn.ptr, (grid, 1), REDUCE_BLOCK)
        return self._reduce

    def __call__(self, arrays, weight_grad=True):
        """(dx, dweight) for ``arrays`` (a BackwardArrays); dweight is None without a weight
        or when ``weight_grad`` is False."""
        from cupy import cuda
        if cuda.runtime.getDevice() == self.device.index:
            return self._run(arrays, weight_grad)
        with cuda.Device(self.device.index):
            return self._run(arrays, weight_grad)

    def _run(self, arrays, weight_grad):
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
        with self._lock:      # the KernelLaunch records hold the stream
            stream = kind.stream(self.device.index)
            _driver.launch(self.device, kernel, stream, argv)
            if want_dw and not direct:
                rp = np.zeros(1, REDUCE_PARAMS_DTYPE)
                rp["partials"], rp["hidden"] = plan.partials, self.hidden
                rargv, rheld = _argv([ptr(partials), ptr(dweight), rp])
                _driver.launch(self.device, self.reduce_kernel(), stream, rargv)
        return dx, dweight


class GatedBackwardLauncher:
    """Launches the backward of one rms_norm_gated signature: rms_norm_gated_backward_kernel,
    then (more than one chunk of rows) the dweight reduction. As BackwardLauncher, a call
    builds its arguments afresh."""

    def __init__(self, layout, scalars, kind, spec):
        call = layout.call
        self.kind, self.layout, self.spec = kind, layout, spec
        self.device = _driver.device(call.device)
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
        self._reduce = None
        self._lock = threading.Lock()

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
            from cupy_backends.cuda.api import driver
            _driver.ensure_context(d.index)
            per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.ptr, plan.block, 0)
            plan = gated_backward_plan(self.rows, layout.groups, self.hidden, self.itemsize, vec, d.sm_count,
                                       max_blocks_per_sm=min(per_sm, cap or per_sm),
                                       threads_per_row=plan.threads_per_row, vecs_per_thread=plan.vecs_per_thread)
            _cache.record_plan(plan)
            entry = self._by_vec[vec] = (plan, _driver.KernelLaunch(fn.ptr, (plan.grid, 1), plan.block))
        return entry

    def reduce_kernel(self):
        if self._reduce is None:
            fn = kernel_cache.get(self.device.index, reduce_instantiation_name(self.layout.weight_dtype), "gated_backward")
            grid = -(-self.layout.groups * self.hidden // REDUCE_COLUMNS)
            self._reduce = _driver.KernelLaunch(fn.ptr, (grid, 1), REDUCE_BLOCK)
        return self._reduce

    def __call__(self, arrays, weight_grad=True):
        """(dx, dgate, dweight) for ``arrays`` (GatedBackwardArrays); dweight is None without a
        weight or when ``weight_grad`` is False."""
        from cupy import cuda
        if cuda.runtime.getDevice() == self.device.index:
            return self._run(arrays, weight_grad)
        with cuda.Device(self.device.index):
            return self._run(arrays, weight_grad)

    def _run(self, arrays, weight_grad):
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
        with self._lock:
            stream = kind.stream(self.device.index)
            _driver.launch(self.device, kernel, stream, argv)
            if want_dw and not direct:
                rp = np.zeros(1, REDUCE_PARAMS_DTYPE)
                rp["partials"], rp["hidden"] = plan.chunks, self.layout.groups * self.hidden
                rargv, rheld = _argv([ptr(partials), ptr(dweight), rp])
                _driver.launch(self.device, self.reduce_kernel(), stream, rargv)
        return dx, dgate, dweight


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


class QkRopeBackwardLauncher:
    """Launches the backward of one qk_norm_rope signature: qk_norm_rope_backward_kernel, then
    (more than one block) the dweight reduction over [q's head_dim | k's] columns. As
    BackwardLauncher, a call builds its arguments afresh; dq and dk are fresh and contiguous."""

    _ARRAYS = ("dq_out", "dk_out", "q", "k", "dq", "dk")

    def __init__(self, layout, scalars, kind):
        self.kind, self.layout = kind, layout
        self.device = _driver.device(layout.device)
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
        self._reduce = None
        self._lock = threading.Lock()

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
            from cupy_backends.cuda.api import driver
            _driver.ensure_context(d.index)
            per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.ptr, plan.block, 0)
            plan = qk_rope_backward_plan(*args, max_blocks_per_sm=min(per_sm, cap or per_sm),
                                         threads_per_head=plan.threads_per_head, vecs_per_thread=plan.vecs_per_thread)
            _cache.record_plan(plan)
            entry = self._by_vec[vec] = (plan, _driver.KernelLaunch(fn.ptr, (plan.grid, 1), plan.block))
        return entry

    def reduce_kernel(self):
        if self._reduce is None:
            fn = kernel_cache.get(self.device.index, reduce_instantiation_name(self.layout.weight_dtype), "qk_rope_backward")
            grid = -(-2 * self.head_dim // REDUCE_COLUMNS)
            self._reduce = _driver.KernelLaunch(fn.ptr, (grid, 1), REDUCE_BLOCK)
        return self._reduce

    def __call__(self, arrays, weight_grad=True):
        """(dq, dk, dq_weight, dk_weight) for ``arrays`` (QkRopeBackwardArrays); the weights'
        gradients are None without weights or when ``weight_grad`` is False."""
        from cupy import cuda
        if cuda.runtime.getDevice() == self.device.index:
            return self._run(arrays, weight_grad)
        with cuda.Device(self.device.index):
            return self._run(arrays, weight_grad)

    def _run(self, arrays, weight_grad):
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
        with self._lock:
            stream = kind.stream(self.device.index)
            _driver.launch(self.device, kernel, stream, argv)
            if want_dw and not direct:
                rp = np.zeros(1, REDUCE_PARAMS_DTYPE)
                rp["partials"], rp["hidden"] = plan.partials, 2 * d
                rargv, rheld = _argv([ptr(partials), ptr(dweight), rp])
                _driver.launch(self.device, self.reduce_kernel(), stream, rargv)
        if dweight is None:
            return dq, dk, None, None
        return dq, dk, dweight[:d], dweight[d:]
