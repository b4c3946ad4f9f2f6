"""The launch itself, and the per-signature cache that keeps repeated calls thin.

A ``Launcher`` is built from a call's ``CallLayout``, ``Scalars`` and array kind: it
holds everything about a call that does not depend on the arrays' addresses (kernel
parameters, row strides, memory extents relative to each base pointer). The first call
with a given signature (kinds, shapes, strides, dtypes, device, scalars) goes through
the full validation in ``_api`` and leaves its Launcher in this module's cache
(``lookup`` / ``remember``); later calls with that signature only read the pointers,
check what depends on them (alignment, vector width, overlap of given outputs with
inputs), allocate missing outputs and launch. Whatever those cheap checks cannot
settle returns ``None``, and the caller takes the full path.

Kernels are launched through the driver (``_driver``) on the caller's stream: five
pointer slots and the ``Params`` struct live in one host buffer per Launcher, so a call
writes five integers and launches (CuPy's generic argument packing costs several
times that).
"""

import contextlib
import ctypes
import struct
import threading

import numpy as np

from . import _driver
from ._compile import instantiation_name, kernel_cache
from ._layout import OUT, RESIDUAL, RESIDUAL_OUT, WEIGHT, X
from ._plan import early_trigger, launch_plan, vector_width_from_bits

# kernels/rms_norm.cu: enum Flags and struct Params (eight-byte fields first, no padding;
# the kernel asserts the same size, and a CPU test reads both sides).
FLAGS = {"kLlama": 1, "kHasWeight": 2, "kEarlyTrigger": 4}
LLAMA, HAS_WEIGHT, EARLY_TRIGGER = FLAGS["kLlama"], FLAGS["kHasWeight"], FLAGS["kEarlyTrigger"]
PARAMS_BYTES = 96
PARAMS_DTYPE = np.dtype([
    ("rows", "<i8"), ("n_inner", "<i8"),
    ("x", "<i8", (2,)), ("residual", "<i8", (2,)), ("out", "<i8", (2,)), ("residual_out", "<i8", (2,)),
    ("hidden", "<i4"), ("eps", "<f4"), ("weight_offset", "<f4"), ("flags", "<i4"),
])
assert PARAMS_DTYPE.itemsize == PARAMS_BYTES
_ROW_STRIDE_FIELDS = {X: "x", RESIDUAL: "residual", OUT: "out", RESIDUAL_OUT: "residual_out"}
KERNEL_POINTERS = (X, RESIDUAL, OUT, RESIDUAL_OUT, WEIGHT)   # the kernel's pointer arguments, in order
_SLOT = {k: i for i, k in enumerate(KERNEL_POINTERS)}
_pack_pointers = struct.Struct("<5Q").pack_into

# -- the cache ---------------------------------------------------------------------------
_MAX_LAUNCHERS = 1024
_cache = {}              # call signature -> Launcher
_plan_overrides = {}     # forced_plan(): launch_plan keyword arguments for new plans
_plan_record = None      # forced_plan(record=...): a list each new plan is appended to


def lookup(signature):
    """The Launcher remembered for a call signature, or None (also for an unhashable one)."""
    try:
        return _cache.get(signature)
    except TypeError:     # an odd scalar, say: no fast path for this call
        return None


def remember(signature, launcher):
    try:
        hash(signature)
    except TypeError:
        return
    if len(_cache) >= _MAX_LAUNCHERS:
        _cache.clear()
    _cache[signature] = launcher


def clear_cache():
    """Forget every Launcher (each next call validates and plans anew)."""
    _cache.clear()


@contextlib.contextmanager
def forced_plan(record=None, **overrides):
    """Within the block, every new plan gets ``overrides`` as launch_plan keyword arguments
    (threads_per_row=, vecs_per_thread=, cluster=) and is appended to ``record`` if given.
    The cache is cleared on entry and exit, so calls plan anew. For tests and sweeps."""
    global _plan_record
    saved = dict(_plan_overrides), _plan_record
    _plan_overrides.clear()
    _plan_overrides.update(overrides)
    _plan_record = record
    clear_cache()
    try:
        yield
    finally:
        _plan_overrides.clear()
        _plan_overrides.update(saved[0])
        _plan_record = saved[1]
        clear_cache()


# -- one signature -----------------------------------------------------------------------
class Launcher:
    """Launches one call signature; see the module docstring."""

    def __init__(self, layout, scalars, kind):
        self.kind, self.layout, self.fused = kind, layout, layout.fused
        self.device = _driver.device(layout.device)
        self.shape, self.itemsize, self.rows, self.hidden = layout.shape, layout.itemsize, layout.rows, layout.hidden
        row_strides = layout.row_strides
        self.given_outputs = layout.given_outputs
        self.grad_check = layout.requires_grad      # then the full path decides while grad mode is on
        self.inference_check = layout.inference_outputs   # and outside inference mode
        self.others = (RESIDUAL, OUT, RESIDUAL_OUT) if self.fused else (OUT,)  # must follow x's alignment
        self.extents = layout.extents
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
        self.params = np.zeros(1, PARAMS_DTYPE)
        p = self.params
        p["rows"], p["n_inner"], p["hidden"] = layout.rows, layout.n_inner, layout.hidden
        for k in (X,) + self.others:
            p[_ROW_STRIDE_FIELDS[k]] = row_strides[k]
        p["eps"], p["weight_offset"] = scalars.eps, scalars.weight_offset
        self.flags = (LLAMA if scalars.llama else 0) | (HAS_WEIGHT if layout.weight_dtype else 0)
        p["flags"] = self.flags
        self._flags = p["flags"]                     # a view: the trigger bit is set per plan
        # cuLaunchKernel's argument array: five pointer slots, then the Params struct
        self._slots = bytearray(8 * 5)               # written with struct.pack_into per call
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._slots))
        self._argv = np.array([base + 8 * i for i in range(5)] + [p.ctypes.data], np.uint64)
        self._argv_ptr = self._argv.ctypes.data
        self._config = _driver.LaunchConfig()
        self._by_vec = {}
        self._by_low_bits = {}      # low 4 bits of x's address and differences -> (grid, block, kernel, flags)
        self.other_slots = tuple((k, _SLOT[k]) for k in self.others)
        self.fresh_out = OUT not in self.given_outputs
        self.fresh_residual_out = self.fused and RESIDUAL_OUT not in self.given_outputs
        self._lock = threading.Lock()   # the slots are shared: one launch at a time per Launcher
        from cupy import cuda
        self._get_device, self._device_context = cuda.runtime.getDevice, cuda.Device

    def plan_and_function(self, vec, edges=True):
        """The plan and compiled kernel for a vector width (cached; compiled on first use).
        ``edges``: whether rows may have a scalar head or tail (see LaunchPlan)."""
        entry = self._by_vec.get((vec, edges))
        if entry is None:
            d = self.device
            plan = launch_plan(self.rows, self.hidden, self.itemsize, vec, d.sm_count, self.fused,
                               edges=edges, max_cluster=d.max_cluster, **_plan_overrides)
            if _plan_record is not None:
                _plan_record.append(plan)
            entry = self._by_vec[(vec, edges)] = (plan, self.function(plan))
        return entry

    def plan_flags(self, plan, fn):
        """Params.flags for a plan: the Launcher's, plus when to allow the next kernel."""
        from cupy_backends.cuda.api import driver
        _driver.ensure_context(self.device.index)   # a driver call: this thread may have none yet
        per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.ptr, plan.block, 0)
        return self.flags | (EARLY_TRIGGER if early_trigger(plan.grid, self.device.sm_count, per_sm) else 0)

    def edges(self, vec, x_ptr):
        """False when every row of x starts on the vector grid and holds whole vectors."""
        return bool(self.hidden % vec or (x_ptr | self.x_stride_bytes) % (vec * self.itemsize))

    def function(self, plan):
        """The compiled kernel for a plan."""
        name = instantiation_name(self.layout.dtype, self.layout.weight_dtype, self.fused, plan)
        return kernel_cache.get(self.device.index, name)

    def _overlap_settled(self, arrays, slots):
        """True when the given outputs provably do not overlap what they must not: weight,
        each other, and each input unless they are that very input (same pointer, strides)."""
        ext, st = self.extents, self.layout.row_strides
        ptrs = [slots[_SLOT[k]] if arrays[k] is not None else None for k in range(5)]

        def apart(a, b):
            return ptrs[a] + ext[a][1] <= ptrs[b] + ext[b][0] or ptrs[b] + ext[b][1] <= ptrs[a] + ext[a][0]

        for o in self.given_outputs:
            if ptrs[WEIGHT] is not None and not apart(o, WEIGHT):
                return False
            for i in ((X, RESIDUAL) if self.fused else (X,)):
                if not apart(o, i) and not (ptrs[o] == ptrs[i] and st[o] == st[i]):
                    return False
        return len(self.given_outputs) < 2 or apart(OUT, RESIDUAL_OUT)

    def __call__(self, arrays, checked=False):
        """Launch on ``arrays`` (the five in ``Arrays`` order, None where absent).

        Returns the result, or None when the full path must decide (nothing was done).
        ``checked``: the full path has just validated these very arrays.
        """
        if self.grad_check and self.kind.grad_enabled():
            return None
        if self.inference_check and not self.kind.inference_mode():
            return None
        if self._get_device() == self.device.index:
            return self._run(arrays, checked)
        with self._device_context(self.device.index):   # allocate and launch on the arrays' device
            return self._run(arrays, checked)

    def _run(self, arrays, checked):
        ptr, itemsize = self.kind.ptr, self.itemsize
        slots = [0] * 5                                   # the kernel's pointers, in KERNEL_POINTERS order
        x = arrays[X]
        slots[0] = px = ptr(x)
        bits, misaligned = self.stride_bits, px % itemsize
        for k, i in self.other_slots:
            a = arrays[k]
            if a is not None:
                p = slots[i] = ptr(a)
                bits |= p - px
                misaligned |= p % itemsize
        w = arrays[WEIGHT]
        if w is not None:
            slots[4] = p = ptr(w)
            misaligned |= p % self.layout.weight_itemsize
        if misaligned or (self.given_outputs and not checked and not self._overlap_settled(arrays, slots)):
            return None
        out, residual_out = arrays[OUT], arrays[RESIDUAL_OUT]
        if self.fresh_out:
            out = self.kind.empty(self.shape, x)
            slots[2] = p = ptr(out)
            bits |= p - px
        if self.fresh_residual_out:
            residual_out = self.kind.empty(self.shape, x)
            slots[3] = p = ptr(residual_out)
            bits |= p - px
        result = (out, residual_out) if self.fused else out
        if self.rows == 0:
            return result
        key = (bits & 15) | ((px & 15) << 4)              # all that decides vector width and edges
        entry = self._by_low_bits.get(key)
        if entry is None:
            vec = vector_width_from_bits(itemsize, bits)
            plan, fn = self.plan_and_function(vec, self.edges(vec, px))
            entry = self._by_low_bits[key] = (plan.grid_dims(), plan.block, fn.ptr, self.plan_flags(plan, fn))
        grid, block, fn_ptr, flags = entry
        stream = self.kind.stream(self.device.index)
        with self._lock:
            if self._flags[0] != flags:              # another plan than the last call's
                self._flags[0] = flags
            _pack_pointers(self._slots, 0, *slots)
            _driver.launch(self.device, fn_ptr, grid, block, stream, self._argv_ptr, self._config)
        return result
