"""What the families' launchers share (each family's own are in ``ops/<family>/launch.py``).

A launcher is built from a validated call's layout, scalars and array kind, and kept per call
signature (``_cache``). Calling it with the arrays reads their pointers, checks what depends on
them (alignment, the vector width they allow, overlap of given outputs with what they must keep
apart from), allocates missing outputs and launches on the caller's stream; whatever those cheap
checks cannot settle returns ``None``, and the pipeline takes the full path. ``SlotLauncher``:
the forward launchers' pointer slots and Params in one host buffer, so a repeated call writes its
pointers and launches through the driver (``_driver``) with no argument packing of CuPy's.
``GradLauncher``: the backward launchers' device switch, occupancy, and the launch followed by
the fixed-order reduction of the weights' partial gradients.
"""

import ctypes
import struct
import threading

import numpy as np

from . import _driver
from ._abi import EARLY_TRIGGER, REDUCE_BLOCK, REDUCE_COLUMNS, REDUCE_PARAMS_DTYPE, reduce_instantiation_name
from ._compile import kernel_cache
from ._layout import OUT, RESIDUAL, RESIDUAL_OUT, WEIGHT, X
from ._plan import early_trigger, vector_width_from_bits

KERNEL_POINTERS = (X, RESIDUAL, OUT, RESIDUAL_OUT, WEIGHT)   # the forward kernel's pointer arguments, in order
_SLOT = {k: i for i, k in enumerate(KERNEL_POINTERS)}


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


# -- gated -------------------------------------------------------------------------------------


# -- backward ----------------------------------------------------------------------------------

def _argv(values):
    """A kernelParams array for ``values`` (pointers as ints, or NumPy records): the array
    and what must stay alive until the launch returns."""
    held = [v if isinstance(v, np.ndarray) else np.array([v], np.uint64) for v in values]
    argv = np.array([h.ctypes.data for h in held], np.uint64)
    return ctypes.c_void_p(argv.ctypes.data), (held, argv)


# CUfunction_attribute: CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, ..._SHARED_SIZE_BYTES
_MAX_DYNAMIC_SHARED, _STATIC_SHARED = 8, 1


class GradLauncher:
    """What the backward launchers share: the switch to the arrays' device, a kernel's
    occupancy, and the launch of a backward kernel followed by the fixed-order reduction of its
    float32 partial rows of the weights' gradient. A subclass sets ``program`` (its backward
    program, which holds the reduction kernel too) and gives ``_run(arrays, weight_grad)``; a
    call builds its arguments afresh (it allocates its outputs and partial rows anyway)."""

    program = None

    def __init__(self, kind, device_index, weight_dtype, columns):
        self.kind, self.device = kind, _driver.device(device_index)
        self._weight_dtype, self._columns = weight_dtype, columns   # the reduction's: dweight's columns
        self._reduce = None
        self._lock = threading.Lock()       # the KernelLaunch records hold the stream

    def __call__(self, arrays, weight_grad=True):
        """The gradients of ``arrays`` (the family's backward arrays); the weights' are None
        without weights or when ``weight_grad`` is False."""
        from cupy import cuda
        if cuda.runtime.getDevice() == self.device.index:
            return self._run(arrays, weight_grad)
        with cuda.Device(self.device.index):
            return self._run(arrays, weight_grad)

    def occupancy(self, fn, block, shared_bytes=0):
        """Blocks of ``fn`` an SM can hold (its dynamic shared memory allowed up to the device's
        limit first: the function's limit, shared by every launcher)."""
        from cupy_backends.cuda.api import driver
        _driver.ensure_context(self.device.index)   # a driver call: this thread may have none yet
        if shared_bytes:
            driver.funcSetAttribute(fn.ptr, _MAX_DYNAMIC_SHARED,
                                    self.device.shared_per_block - driver.funcGetAttribute(_STATIC_SHARED, fn.ptr))
        return driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.ptr, block, shared_bytes)

    def reduce_kernel(self):
        if self._reduce is None:
            fn = kernel_cache.get(self.device.index, reduce_instantiation_name(self._weight_dtype), self.program)
            self._reduce = _driver.KernelLaunch(fn.ptr, (-(-self._columns // REDUCE_COLUMNS), 1), REDUCE_BLOCK)
        return self._reduce

    def launch(self, kernel, argv, partials=None, dweight=None, partial_rows=0):
        """``kernel`` with ``argv`` on the caller's stream, then, given ``partials``, their
        ``partial_rows`` rows added in a fixed order into ``dweight``."""
        ptr = self.kind.ptr
        with self._lock:
            stream = self.kind.stream(self.device.index)
            _driver.launch(self.device, kernel, stream, argv)
            if partials is not None:
                rp = np.zeros(1, REDUCE_PARAMS_DTYPE)
                rp["partials"], rp["hidden"] = partial_rows, self._columns
                rargv, held = _argv([ptr(partials), ptr(dweight), rp])
                _driver.launch(self.device, self.reduce_kernel(), stream, rargv)
