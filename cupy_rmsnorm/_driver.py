"""The kernel launch: CUDA driver calls, with programmatic dependent launch where it helps.

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
import os
import struct
import warnings

_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
_CUDA_ERROR_INVALID_CONTEXT = 201
# CUlaunchConfig: grid x/y/z, block x/y/z, shared memory bytes, (pad), stream, attrs, numAttrs
_CONFIG = struct.Struct("<7I4xQQI4x")
# CUlaunchAttribute: id, (pad), value (a 64-byte union; here one int)
_ATTRIBUTE = struct.Struct("<I4xi60x")

_plain = None          # cupy_backends' cuLaunchKernel
_launch_ex = None      # ctypes cuLaunchKernelEx, or False when unusable
_pdl_devices = {}      # device -> whether to launch it with the attribute


def _load_launch_ex():
    global _launch_ex
    if _launch_ex is None:
        _launch_ex = False
        if os.environ.get("CUPY_RMSNORM_PDL", "1") != "0":
            for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
                try:
                    fn = getattr(ctypes.CDLL(name), "cuLaunchKernelEx")
                except (OSError, AttributeError):
                    continue
                fn.argtypes = [ctypes.c_void_p] * 4
                fn.restype = ctypes.c_int
                _launch_ex = fn
                break
    return _launch_ex


def pdl_enabled(device):
    """Whether launches on ``device`` use programmatic dependent launch (sm_90+, driver support)."""
    on = _pdl_devices.get(device)
    if on is None:
        from cupy.cuda import runtime
        on = _pdl_devices[device] = bool(_load_launch_ex()) and \
            runtime.getDeviceProperties(device)["major"] >= 9
    return on


class LaunchConfig:
    """A reusable CUlaunchConfig with the PDL attribute; one per Launcher, used under its lock."""

    def __init__(self):
        self._attribute = (ctypes.c_char * _ATTRIBUTE.size)()
        _ATTRIBUTE.pack_into(self._attribute, 0, _CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 1)
        self._buffer = (ctypes.c_char * _CONFIG.size)()
        self._attribute_ptr = ctypes.addressof(self._attribute)
        self.ptr = ctypes.addressof(self._buffer)

    def set(self, grid, block, stream):
        _CONFIG.pack_into(self._buffer, 0, grid[0], grid[1], 1, block, 1, 1, 0, stream, self._attribute_ptr, 1)


def ensure_context(device):
    """A thread that has not touched CUDA yet gets the device's primary context."""
    from cupy_backends.cuda.api import driver
    if driver.ctxGetCurrent() != 0:
        return False
    from cupy.cuda import runtime
    runtime.setDevice(device)
    return True


def launch(device, fn_ptr, grid, block, stream, argv_ptr, config):
    """Launch ``fn_ptr`` with (x, y) ``grid`` and ``block`` threads on ``stream``;
    ``argv_ptr``: cuLaunchKernel's kernelParams array; ``config``: the caller's LaunchConfig."""
    if _pdl_devices.get(device):
        config.set(grid, block, stream)
        err = _launch_ex(config.ptr, fn_ptr, argv_ptr, None)
        if err == _CUDA_ERROR_INVALID_CONTEXT and ensure_context(device):
            err = _launch_ex(config.ptr, fn_ptr, argv_ptr, None)
        if err == 0:
            return
        _pdl_devices[device] = False       # refused (an older driver, say): plain from now on
        warnings.warn(f"cupy_rmsnorm: cuLaunchKernelEx failed with CUDA error {err}; launching "
                      "without programmatic dependent launch from now on", RuntimeWarning, stacklevel=2)
    _launch_plain(device, fn_ptr, grid, block, stream, argv_ptr)


def _launch_plain(device, fn_ptr, grid, block, stream, argv_ptr):
    global _plain
    if _plain is None:
        from cupy_backends.cuda.api import driver
        _plain = driver.launchKernel
    try:
        _plain(fn_ptr, grid[0], grid[1], 1, block, 1, 1, 0, stream, argv_ptr, 0)
    except Exception:
        if not ensure_context(device):
            raise
        _plain(fn_ptr, grid[0], grid[1], 1, block, 1, 1, 0, stream, argv_ptr, 0)
