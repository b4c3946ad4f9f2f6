"""The launch configuration handed to cuLaunchKernelEx, checked byte by byte on the CPU."""

import ctypes
import struct

from cupy_rmsnorm import _driver


def test_launch_config_layout():
    """CUlaunchConfig (cuda.h): grid x/y/z, block x/y/z, sharedMemBytes, 4 bytes of padding,
    hStream, attrs, numAttrs; one CUlaunchAttribute: id 6 (programmatic stream
    serialization), padding to 8 bytes, a 64-byte value whose first int is 1."""
    config = _driver.LaunchConfig()
    config.set((70000, 3), 256, 0xDEADBEEF)
    raw = ctypes.string_at(config.ptr, 56)
    gx, gy, gz, bx, by, bz, smem, pad = struct.unpack_from("<8I", raw, 0)
    stream, attrs, num = struct.unpack_from("<QQI", raw, 32)
    assert (gx, gy, gz, bx, by, bz, smem, pad) == (70000, 3, 1, 256, 1, 1, 0, 0)
    assert (stream, num) == (0xDEADBEEF, 1)
    attr = ctypes.string_at(attrs, 72)
    assert struct.unpack_from("<Ii", attr, 0) == (6, 0) and struct.unpack_from("<i", attr, 8) == (1,)
    assert attr[12:] == bytes(60)
    config.set((1, 1), 1024, 0)                # rewritten in place, the attribute kept
    raw = ctypes.string_at(config.ptr, 56)
    assert struct.unpack_from("<7I", raw, 0) == (1, 1, 1, 1024, 1, 1, 0)
    assert struct.unpack_from("<QQI", raw, 32) == (0, attrs, 1)


def test_pdl_off_by_environment(monkeypatch):
    """CUPY_RMSNORM_PDL=0: no cuLaunchKernelEx, so every device launches plainly."""
    monkeypatch.setenv("CUPY_RMSNORM_PDL", "0")
    monkeypatch.setattr(_driver, "_launch_ex", None)
    monkeypatch.setattr(_driver, "_pdl_devices", {})
    assert _driver._load_launch_ex() is False
    assert _driver.pdl_enabled(0) is False      # decided without asking the device
