"""The launch itself, and the per-signature cache that keeps repeated calls thin.

A ``Launcher`` holds everything about a call that does not depend on the arrays'
addresses: row layout, kernel parameters, memory extents relative to each base
pointer. The first call with a given signature (kinds, shapes, strides, dtypes,
device, scalars) goes through the full validation in ``_api`` and leaves a Launcher
behind; later calls with that signature only read the pointers, check what depends
on them (alignment, vector width, overlap of given outputs with inputs), allocate
missing outputs and launch. Whatever those cheap checks cannot settle returns
``None``, and the caller takes the full path.

Kernels are launched through the driver (``_driver``) on the caller's stream: five
pointer slots and the ``Params`` struct live in one host buffer per Launcher, so a call
writes five integers and launches (CuPy's generic argument packing costs several
times that).
"""

import ctypes
import struct
import threading

import numpy as np

from . import _driver
from ._kernels import kernels, name_expression
from ._plan import early_trigger, launch_plan, max_cluster_for, vector_width_from_bits

X, RES, W, OUT, RO = range(5)            # positions in the arrays list
NAMES = ("x", "residual", "weight", "out", "residual_out")
LLAMA, HAS_WEIGHT, EARLY_TRIGGER = 1, 2, 4   # kernels/rms_norm.cu: enum Flags

# kernels/rms_norm.cu: struct Params (eight-byte fields first, so no padding).
PARAMS_DTYPE = np.dtype([
    ("rows", "<i8"), ("n_inner", "<i8"),
    ("x_so", "<i8"), ("x_si", "<i8"), ("r_so", "<i8"), ("r_si", "<i8"),
    ("y_so", "<i8"), ("y_si", "<i8"), ("ro_so", "<i8"), ("ro_si", "<i8"),
    ("hidden", "<i4"), ("eps", "<f4"), ("w_offset", "<f4"), ("flags", "<i4"),
])
_STRIDE_FIELDS = {X: "x", RES: "r", OUT: "y", RO: "ro"}
_KERNEL_POINTERS = (X, RES, OUT, RO, W)  # the kernel's pointer arguments, in order
_SLOT = {k: i for i, k in enumerate(_KERNEL_POINTERS)}
_pack_pointers = struct.Struct("<5Q").pack_into

_devices = {}


def device_limits(device):
    """(multiprocessor count, largest cluster) of a device: clusters need sm_90."""
    limits = _devices.get(device)
    if limits is None:
        from cupy.cuda import runtime
        props = runtime.getDeviceProperties(device)
        limits = _devices[device] = (props["multiProcessorCount"], max_cluster_for(props["major"]))
    return limits


class Launcher:
    """Launches one call signature; see the module docstring.

    row_strides / extents: per array position, (outer, inner) strides in elements and
    the [lo, hi) byte range relative to the array's pointer. given_outputs: the output
    positions the caller passed (fresh outputs are allocated contiguous).
    """

    def __init__(self, kind, fused, device, shape, dtype, itemsize, weight_dtype, weight_itemsize,
                 rows, n_inner, row_strides, extents, given_outputs, eps, weight_offset, llama,
                 grad_check):
        self.kind, self.fused, self.device, self.shape = kind, fused, device, shape
        self.dtype, self.itemsize = dtype, itemsize
        self.weight_dtype, self.weight_itemsize = weight_dtype, weight_itemsize
        self.rows, self.hidden = rows, shape[-1]
        self.row_strides, self.extents = row_strides, extents
        self.given_outputs, self.grad_check = given_outputs, grad_check
        self.others = (RES, OUT, RO) if fused else (OUT,)      # arrays that must follow x's alignment
        self.missing_outputs = tuple(k for k in ((OUT, RO) if fused else (OUT,)) if k not in given_outputs)
        # with the pointer differences, the stride differences from x decide the vector width
        xso, xsi = row_strides[X]
        bits = 0
        for k in self.others:
            so, si = row_strides[k]
            bits |= ((so - xso) * itemsize) | ((si - xsi) * itemsize)
        self.stride_bits = bits
        # x's rows all start on its vector grid when its address and strides do (the
        # strides part is settled here; the address, per call)
        self.x_stride_bytes = (xso * itemsize) | ((xsi * itemsize) if n_inner != 1 else 0)
        self.params = np.zeros(1, PARAMS_DTYPE)
        p = self.params
        p["rows"], p["n_inner"], p["hidden"] = rows, n_inner, self.hidden
        for k in (X,) + self.others:
            p[_STRIDE_FIELDS[k] + "_so"], p[_STRIDE_FIELDS[k] + "_si"] = row_strides[k]
        p["eps"], p["w_offset"] = eps, weight_offset
        self.flags = (LLAMA if llama else 0) | (HAS_WEIGHT if weight_dtype else 0)
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
        self.missing_slots = tuple((k, _SLOT[k]) for k in self.missing_outputs)
        self._lock = threading.Lock()   # the slots are shared: one launch at a time per Launcher
        from cupy import cuda
        self._get_device, self._device_context = cuda.runtime.getDevice, cuda.Device

    def plan_and_function(self, vec, edges=True):
        """The plan and compiled kernel for a vector width (cached; compiled on first use).
        ``edges``: whether rows may have a scalar head or tail (see LaunchPlan)."""
        entry = self._by_vec.get((vec, edges))
        if entry is None:
            sms, max_cluster = device_limits(self.device)
            plan = launch_plan(self.rows, self.hidden, self.itemsize, vec, sms, self.fused,
                               edges=edges, max_cluster=max_cluster)
            entry = self._by_vec[(vec, edges)] = (plan, self.function(plan))
        return entry

    def plan_flags(self, plan, fn):
        """Params.flags for a plan: the Launcher's, plus when to allow the next kernel."""
        from cupy_backends.cuda.api import driver
        sms = device_limits(self.device)[0]
        _driver.ensure_context(self.device)        # a driver call: this thread may have none yet
        per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.ptr, plan.block, 0)
        return self.flags | (EARLY_TRIGGER if early_trigger(plan.grid, sms, per_sm) else 0)

    def edges(self, vec, x_ptr):
        """False when every row of x starts on the vector grid and holds whole vectors."""
        return bool(self.hidden % vec or (x_ptr | self.x_stride_bytes) % (vec * self.itemsize))

    def function(self, plan):
        """The compiled kernel for a plan."""
        return kernels.get(self.device, name_expression(self.dtype, self.weight_dtype, self.fused, plan))

    def _overlap_settled(self, arrays, slots):
        """True when the given outputs provably do not overlap what they must not: weight,
        each other, and each input unless they are that very input (same pointer, strides)."""
        ext, st = self.extents, self.row_strides
        ptrs = [slots[_SLOT[k]] if arrays[k] is not None else None for k in range(5)]

        def apart(a, b):
            return ptrs[a] + ext[a][1] <= ptrs[b] + ext[b][0] or ptrs[b] + ext[b][1] <= ptrs[a] + ext[a][0]

        for o in self.given_outputs:
            if ptrs[W] is not None and not apart(o, W):
                return False
            for i in ((X, RES) if self.fused else (X,)):
                if not apart(o, i) and not (ptrs[o] == ptrs[i] and st[o] == st[i]):
                    return False
        return len(self.given_outputs) < 2 or apart(OUT, RO)

    def __call__(self, arrays, checked=False):
        """Launch on ``arrays`` ([x, residual, weight, out, residual_out], None where absent).

        Returns the result, or None when the full path must decide (nothing was done).
        ``checked``: the full path has just validated these very arrays.
        """
        if self.grad_check and self.kind.grad_enabled():
            return None
        if self._get_device() == self.device:
            return self._run(arrays, checked)
        with self._device_context(self.device):   # allocate and launch on the arrays' device
            return self._run(arrays, checked)

    def _run(self, arrays, checked):
        ptr, itemsize = self.kind.ptr, self.itemsize
        slots = [0] * 5                                   # the kernel's pointers, in _KERNEL_POINTERS order
        slots[0] = px = ptr(arrays[X])
        bits, misaligned = self.stride_bits, px % itemsize
        for k, i in self.other_slots:
            a = arrays[k]
            if a is not None:
                p = slots[i] = ptr(a)
                bits |= p - px
                misaligned |= p % itemsize
        w = arrays[W]
        if w is not None:
            slots[4] = p = ptr(w)
            misaligned |= p % self.weight_itemsize
        if misaligned or (self.given_outputs and not checked and not self._overlap_settled(arrays, slots)):
            return None
        for k, i in self.missing_slots:
            a = arrays[k] = self.kind.empty(self.shape, arrays[X])
            p = slots[i] = ptr(a)
            bits |= p - px
        result = (arrays[OUT], arrays[RO]) if self.fused else arrays[OUT]
        if self.rows == 0:
            return result
        key = (bits & 15) | ((px & 15) << 4)              # all that decides vector width and edges
        entry = self._by_low_bits.get(key)
        if entry is None:
            vec = vector_width_from_bits(itemsize, bits)
            plan, fn = self.plan_and_function(vec, self.edges(vec, px))
            _driver.pdl_enabled(self.device)
            entry = self._by_low_bits[key] = (plan.grid_dims(), plan.block, fn.ptr, self.plan_flags(plan, fn))
        grid, block, fn_ptr, flags = entry
        stream = self.kind.stream(self.device)
        with self._lock:
            if self._flags[0] != flags:              # another plan than the last call's
                self._flags[0] = flags
            _pack_pointers(self._slots, 0, *slots)
            _driver.launch(self.device, fn_ptr, grid, block, stream, self._argv_ptr, self._config)
        return result
