"""The launch configuration handed to cuLaunchKernelEx, checked byte by byte on the CPU."""

import ctypes
import struct

from cupy_rmsnorm import _driver


def test_launch_config_layout():
    """CUlaunchConfig (cuda.h): grid x/y/z, block x/y/z, sharedMemBytes, 4 bytes of padding,
    hStream, attrs, numAttrs; one CUlaunchAttribute: id 6 (programmatic stream
    serialization), padding to 8 bytes, a 64-byte value whose first int is 1."""
    kernel = _driver.KernelLaunch(0x1234, (70000, 3), 256)
    kernel.set_stream(0xDEADBEEF)
    raw = ctypes.string_at(kernel.ptr.value, 56)
    gx, gy, gz, bx, by, bz, smem, pad = struct.unpack_from("<8I", raw, 0)
    stream, attrs, num = struct.unpack_from("<QQI", raw, 32)
    assert (gx, gy, gz, bx, by, bz, smem, pad) == (70000, 3, 1, 256, 1, 1, 0, 0)
    assert (stream, num) == (0xDEADBEEF, 1) and kernel.stream == 0xDEADBEEF
    attr = ctypes.string_at(attrs, 72)
    assert struct.unpack_from("<Ii", attr, 0) == (6, 0) and struct.unpack_from("<i", attr, 8) == (1,)
    assert attr[12:] == bytes(60)
    kernel.set_stream(0)                       # rewritten in place, the rest kept
    raw = ctypes.string_at(kernel.ptr.value, 56)
    assert struct.unpack_from("<7I", raw, 0) == (70000, 3, 1, 256, 1, 1, 0)
    assert struct.unpack_from("<QQI", raw, 32) == (0, attrs, 1)
    assert (kernel.fn_ptr, kernel.grid, kernel.block) == (0x1234, (70000, 3), 256)


def test_pdl_off_by_environment(monkeypatch):
    """CUPY_RMSNORM_PDL=0: every device record says plain launches (decided without CuPy)."""
    monkeypatch.setenv("CUPY_RMSNORM_PDL", "0")
    assert _driver.pdl_wanted() is False
    assert _driver.Device(0, 132, (9, 0), _driver.pdl_wanted()).pdl is False
    monkeypatch.setenv("CUPY_RMSNORM_PDL", "1")
    assert _driver.pdl_wanted() is True


def test_device_record():
    """Clusters and programmatic dependent launch need sm_90: one record says both."""
    hopper = _driver.Device(3, 132, (9, 0), True)
    assert (hopper.index, hopper.sm_count, hopper.max_cluster, hopper.pdl) == (3, 132, 8, True)
    ampere = _driver.Device(0, 108, (8, 0), True)
    assert (ampere.max_cluster, ampere.pdl) == (1, False)
    assert _driver.Device(0, 132, (9, 0), False).pdl is False     # no cuLaunchKernelEx


def test_refused_attribute_falls_back_for_good(monkeypatch):
    """A driver that refuses the launch attribute: the launch goes out plainly, with one
    warning, and the device record launches plainly from then on."""
    import pytest
    plain = []
    monkeypatch.setattr(_driver, "_launch_ex", lambda *a: 1)      # CUDA_ERROR_INVALID_VALUE
    monkeypatch.setattr(_driver, "_launch_plain", lambda *a: plain.append(a))
    dev = _driver.Device(0, 132, (9, 0), True)
    kernel, argv = _driver.KernelLaunch(7, (2, 1), 128), ctypes.c_void_p(99)
    with pytest.warns(RuntimeWarning, match="cuLaunchKernelEx failed"):
        _driver.launch(dev, kernel, 5, argv)
    assert dev.pdl is False and plain == [(0, 7, (2, 1), 128, 0, 5, 99)]   # no dynamic shared memory
    _driver.launch(dev, kernel, 5, argv)            # plain, and no second warning
    assert len(plain) == 2


def test_bound_launch_once_one_went_out(monkeypatch):
    """After a launch with the attribute succeeds, kernel.ex is cuLaunchKernelEx bound to
    the kernel's config and function (the hot path calls it directly); a refusal unbinds it."""
    seen = []

    def launch_ex(config, fn, argv, extra):
        seen.append((config, fn, argv, extra))
        return 0

    monkeypatch.setattr(_driver, "_launch_ex", launch_ex)
    dev = _driver.Device(0, 132, (9, 0), True)
    kernel, argv = _driver.KernelLaunch(7, (2, 1), 128), ctypes.c_void_p(99)
    assert kernel.ex is None
    _driver.launch(dev, kernel, 5, argv)
    assert kernel.stream == 5 and seen == [(kernel.ptr, kernel._fn_arg, argv, None)]
    assert kernel.ex(argv, None) == 0 and seen[-1] == seen[0]
    monkeypatch.setattr(_driver, "_launch_ex", lambda *a: 1)
    monkeypatch.setattr(_driver, "_launch_plain", lambda *a: None)
    import pytest
    with pytest.warns(RuntimeWarning):
        _driver.launch(dev, kernel, 5, argv)
    assert kernel.ex is None and dev.pdl is False
