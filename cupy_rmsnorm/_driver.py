"""The kernel launch: CUDA driver calls, with programmatic dependent launch where it helps,
and the one record of what the library needs to know about a device.

On sm_90 and later a kernel may be launched with the *programmatic stream serialization*
attribute (``cuLaunchKernelEx``): it then starts while the previous kernel in the stream
is still finishing, gets its blocks resident and computes its addresses, and waits in
``griddepcontrol.wait`` (kernels/rms_norm.cu) until that kernel's writes are visible.
Results are the same as with a plain launch; the launch latency overlaps the previous
kernel's tail. Set ``CUPY_RMSNORM_PDL=0`` to launch plainly. Older devices, drivers
without ``cuLaunchKernelEx``, or a driver that refuses the attribute get the plain
``cuLaunchKernel`` (the refusal is remembered for the process).
"""

import ctypes
import functools
import os
import struct
import threading
import warnings

from ._plan import max_cluster_for

PDL_MIN_MAJOR = 9      # programmatic dependent launch: sm_90 and later
BULK_COPY_MIN_MAJOR = 9   # cp.async.bulk and mbarrier transaction counts (the staged backward)
_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
_CUDA_ERROR_INVALID_CONTEXT = 201
# cudaDeviceAttr: cudaDevAttrMaxSharedMemoryPerMultiprocessor, ...PerBlockOptin
_ATTR_SHARED_PER_SM, _ATTR_SHARED_PER_BLOCK_OPTIN = 81, 97
# CUlaunchConfig: grid x/y/z, block x/y/z, shared memory bytes, (pad), stream, attrs, numAttrs
_CONFIG = struct.Struct("<7I4xQQI4x")
# CUlaunchAttribute: id, (pad), value (a 64-byte union; here one int)
_ATTRIBUTE = struct.Struct("<I4xi60x")

_plain = None          # cupy_backends' cuLaunchKernel
_launch_ex = None      # ctypes cuLaunchKernelEx, or False when unusable
_devices = {}
_devices_lock = threading.Lock()


def pdl_wanted():
    """False when the environment turns programmatic dependent launch off."""
    return os.environ.get("CUPY_RMSNORM_PDL", "1") != "0"


class Device:
    """What the launch path needs of one CUDA device, read once (``device(index)``).

    ``pdl``: launches use programmatic dependent launch (sm_90+, the driver has
    ``cuLaunchKernelEx``, not turned off); set to False for good if the driver refuses.
    ``shared_per_sm`` / ``shared_per_block``: shared memory an SM has and a block may opt in
    to, where the kernels' bulk copies into it exist (sm_90+; else 0).
    """
    __slots__ = ("index", "sm_count", "compute_capability", "max_cluster", "pdl", "shared_per_sm",
                 "shared_per_block")

    def __init__(self, index, sm_count, compute_capability, pdl, shared_per_sm=0, shared_per_block=0):
        self.index, self.sm_count, self.compute_capability = index, sm_count, compute_capability
        self.max_cluster = max_cluster_for(compute_capability[0])
        self.pdl = bool(pdl) and compute_capability[0] >= PDL_MIN_MAJOR
        bulk = compute_capability[0] >= BULK_COPY_MIN_MAJOR
        self.shared_per_sm = int(shared_per_sm) if bulk else 0
        self.shared_per_block = int(shared_per_block) if bulk else 0

    def __repr__(self):
        return (f"Device({self.index}, sm_count={self.sm_count}, compute_capability="
                f"{self.compute_capability}, max_cluster={self.max_cluster}, pdl={self.pdl})")


def device(index):
    """The cached ``Device`` record of a CUDA device index."""
    d = _devices.get(index)
    if d is None:
        with _devices_lock:
            d = _devices.get(index)
            if d is None:
                from cupy.cuda import runtime
                props = runtime.getDeviceProperties(index)
                d = _devices[index] = Device(index, props["multiProcessorCount"],
                                             (props["major"], props["minor"]),
                                             pdl_wanted() and bool(_load_launch_ex()),
                                             runtime.deviceGetAttribute(_ATTR_SHARED_PER_SM, index),
                                             runtime.deviceGetAttribute(_ATTR_SHARED_PER_BLOCK_OPTIN, index))
    return d


_device_count = None


def device_count():
    """The number of visible CUDA devices (fixed for the process, so read once)."""
    global _device_count
    if _device_count is None:
        from cupy.cuda import runtime
        _device_count = runtime.getDeviceCount()
    return _device_count


_DRIVER_LIBRARIES = ("libcuda.so.1", "libcuda.so", "nvcuda.dll")


def _driver_library():
    """The loaded CUDA driver library, or None when this machine has no NVIDIA driver."""
    for name in _DRIVER_LIBRARIES:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def gpu_missing():
    """None when a CUDA GPU is usable through CuPy, else a one-line reason (never raises)."""
    if _driver_library() is None:
        return "no NVIDIA driver or GPU found (the CUDA driver library libcuda cannot be loaded)"
    try:
        import cupy
    except Exception as e:  # noqa: BLE001 - any import failure means no GPU path
        return (f"CuPy is not importable ({type(e).__name__}: {e}); pip install "
                f"'cupy-rmsnorm[cuda12]' or 'cupy-rmsnorm[cuda13]'")
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - no device, CUDA_VISIBLE_DEVICES="", an old driver
        return f"{type(e).__name__}: {e}"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return None if n > 0 else "no CUDA GPU found (device count 0" + (
        f"; CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ")")


def _load_launch_ex():
    global _launch_ex
    if _launch_ex is None:
        _launch_ex = False
        lib = _driver_library()
        if lib is not None:
            try:
                fn = lib.cuLaunchKernelEx
            except AttributeError:    # a driver older than CUDA 12.0
                fn = None
            if fn is not None:
                # no argtypes: every argument is a ready-made c_void_p (or None), which ctypes
                # passes as it is, skipping a conversion per argument and call
                fn.restype = ctypes.c_int
                _launch_ex = fn
    return _launch_ex


class KernelLaunch:
    """One compiled kernel with its (x, y[, z]) grid and block size, and the CUlaunchConfig
    that cuLaunchKernelEx reads (with the PDL attribute): built once per plan, so a call
    writes at most the stream into it; ``shared``: dynamic shared memory bytes. Used under the
    owning Launcher's lock.

    ``ex``: once a launch with the attribute has gone out, cuLaunchKernelEx bound to this
    config and kernel, ``ex(argv, None)`` -> CUDA error code: the hot path's launch (no
    Python frame) while the stream stays ``stream``; ``launch`` handles everything else."""
    __slots__ = ("fn_ptr", "grid", "block", "shared", "stream", "ptr", "ex", "_fn_arg", "_buffer", "_attribute")

    def __init__(self, fn_ptr, grid, block, shared=0):
        self.fn_ptr, self.grid, self.block, self.shared, self.stream = fn_ptr, grid, block, shared, 0
        self.ex = None
        self._attribute = (ctypes.c_char * _ATTRIBUTE.size)()
        _ATTRIBUTE.pack_into(self._attribute, 0, _CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 1)
        self._buffer = (ctypes.c_char * _CONFIG.size)()
        gz = grid[2] if len(grid) > 2 else 1
        _CONFIG.pack_into(self._buffer, 0, grid[0], grid[1], gz, block, 1, 1, shared, 0,
                          ctypes.addressof(self._attribute), 1)
        self.ptr = ctypes.c_void_p(ctypes.addressof(self._buffer))
        self._fn_arg = ctypes.c_void_p(fn_ptr)    # ready-made: ctypes converts no int per call

    def set_stream(self, stream):
        _STREAM.pack_into(self._buffer, _STREAM_OFFSET, stream)
        self.stream = stream


_STREAM = struct.Struct("<Q")
_STREAM_OFFSET = 32          # CUlaunchConfig.hStream


def ensure_context(index):
    """A thread that has not touched CUDA yet gets the device's primary context."""
    from cupy_backends.cuda.api import driver
    if driver.ctxGetCurrent() != 0:
        return False
    from cupy.cuda import runtime
    runtime.setDevice(index)
    return True


def launch(dev, kernel, stream, argv):
    """Launch a ``KernelLaunch`` on the ``Device`` ``dev`` on ``stream``; ``argv``: the
    kernelParams array (its address as a ctypes.c_void_p)."""
    if dev.pdl:
        if stream != kernel.stream:
            kernel.set_stream(stream)
        err = _launch_ex(kernel.ptr, kernel._fn_arg, argv, None)
        if err == _CUDA_ERROR_INVALID_CONTEXT and ensure_context(dev.index):
            err = _launch_ex(kernel.ptr, kernel._fn_arg, argv, None)
        if err == 0:
            if kernel.ex is None:
                kernel.ex = functools.partial(_launch_ex, kernel.ptr, kernel._fn_arg)
            return
        kernel.ex = None
        dev.pdl = False       # refused (an older driver, say): plain from now on
        warnings.warn(f"cupy_rmsnorm: cuLaunchKernelEx failed with CUDA error {err}; launching "
                      "without programmatic dependent launch from now on", RuntimeWarning, stacklevel=2)
    _launch_plain(dev.index, kernel.fn_ptr, kernel.grid, kernel.block, kernel.shared, stream, argv.value)


def _launch_plain(index, fn_ptr, grid, block, shared, stream, argv_ptr):
    global _plain
    if _plain is None:
        from cupy_backends.cuda.api import driver
        _plain = driver.launchKernel
    try:
        _plain(fn_ptr, grid[0], grid[1], grid[2] if len(grid) > 2 else 1, block, 1, 1, shared, stream, argv_ptr, 0)
    except Exception:
        if not ensure_context(index):
            raise
        _plain(fn_ptr, grid[0], grid[1], grid[2] if len(grid) > 2 else 1, block, 1, 1, shared, stream, argv_ptr, 0)
