"""Bad or unusual inputs: each is refused with an error that names the argument, before
anything is written, or computed exactly as the contract says. The CPU ones; those that
need a GPU are in tests/gpu/test_bad_inputs_gpu.py."""

import importlib
import subprocess
import sys
import warnings

import numpy as np
import pytest
from helpers import DTYPES, child_env

import cupy_rmsnorm as rn
from cupy_rmsnorm import _driver, _interop, _validate
from cupy_rmsnorm.ops.forward import checks as forward_checks


def rand(shape, dtype=np.float32, seed=0):
    return (np.random.default_rng(seed).standard_normal(shape) + 0.5).astype(dtype)


# -- read-only outputs (NumPy): refused before anything is written ------------------------------

def _read_only(a):
    a.flags.writeable = False
    return a


def test_read_only_residual_out_leaves_out_untouched():
    x, r = rand((3, 16)), rand((3, 16), seed=1)
    out = np.full_like(x, 7.0)
    ro = _read_only(np.zeros_like(x))
    with pytest.raises(ValueError, match=r"^residual_out is read-only"):
        rn.fused_add_rms_norm(x, r, out=out, residual_out=ro)
    assert np.all(out == 7.0)      # nothing was written


@pytest.mark.parametrize("make_out", ["plain", "memmap", "x itself"])
def test_read_only_out_is_refused_before_computing(make_out, tmp_path):
    x = rand((3, 16))
    if make_out == "plain":
        out = _read_only(np.zeros_like(x))
    elif make_out == "memmap":
        path = tmp_path / "out.bin"
        np.zeros_like(x).tofile(path)
        out = np.memmap(path, dtype=x.dtype, mode="r", shape=x.shape)
    else:
        out = x = _read_only(x)
    with pytest.raises(ValueError, match=r"^out is read-only"):
        rn.rms_norm(x, out=out)


# -- hidden size, missing residual, scalars -----------------------------------------------------

def test_hidden_size_past_int32_is_a_value_error():
    """Params.hidden is an int: a row of 2**31 elements is refused, naming x (a zero-stride
    view, so nothing is allocated)."""
    x = np.lib.stride_tricks.as_strided(np.zeros(1, np.float16), (1, 2 ** 31), (0, 0))
    with pytest.raises(ValueError, match=r"^x has hidden size 2147483648; at most 2147483647"):
        rn.rms_norm(x)
    meta = _interop.Meta(0, (2, 2 ** 31), (2 ** 31, 1), "bfloat16", 2, 0)
    with pytest.raises(ValueError, match=r"^x has hidden size"):
        forward_checks.check_arrays(rn._layout.Arrays(meta))


def test_fused_without_residual_names_it():
    x = rand((2, 8))
    with pytest.raises(TypeError, match=r"^residual must be an array"):
        rn.fused_add_rms_norm(x, None)


@pytest.mark.parametrize("name", ["eps", "weight_offset"])
@pytest.mark.parametrize("value", [10 ** 400, -10 ** 400, 1e39, -1e39, 3.5e38],
                         ids=["1e400-int", "-1e400-int", "1e39", "-1e39", "3.5e38"])
def test_scalars_must_be_finite_in_float32(name, value):
    x, w = rand((2, 8)), rand(8, seed=2)
    with pytest.raises(ValueError, match=rf"^{name} must be finite"):
        rn.rms_norm(x, w, **{name: value})


def test_largest_float32_scalars_are_accepted():
    x, w = rand((2, 8)), rand(8, seed=2)
    big = float(np.finfo(np.float32).max)
    assert np.all(np.isfinite(rn.rms_norm(x, w, weight_offset=1e30)))
    y = rn.rms_norm(x, w, eps=big)      # inv_rms ~ 5.4e-20: small, not zero
    assert np.all(y != 0) and np.all(np.isfinite(y))


def test_casting_mode_array_is_a_clear_error():
    with pytest.raises(ValueError, match=r"^casting_mode must be 'fp32' or 'llama'"):
        rn.rms_norm(rand((2, 8)), casting_mode=np.array(["fp32", "llama"]))


# -- the NumPy path is as quiet as the GPU path -------------------------------------------------

def test_reference_raises_no_runtime_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = rn.rms_norm(np.zeros((2, 8), np.float16), eps=0.0)            # 0 / 0
        assert np.all(np.isnan(y))
        big = np.full((2, 8), 60000, np.float16)
        y, s = rn.fused_add_rms_norm(big, big)                           # overflow in the cast
        assert np.all(np.isinf(s))
        rn.rms_norm(np.full((1, 4), 3e38, np.float32))                   # overflow in the square


# -- odd array objects --------------------------------------------------------------------------

class _NoDevice:
    def __dlpack__(self, stream=None):
        raise AssertionError("must not be reached")

    def __dlpack_device__(self):
        return None


def test_dlpack_device_that_is_not_a_pair():
    with pytest.raises(TypeError, match=r"^x.__dlpack_device__\(\) must return \(device type, device id\)"):
        _interop.DlpackKind.to_cupy(_NoDevice(), "x")


class _Producer:
    """A DLPack producer on the given DLPack device type (2: CUDA, 1: CPU)."""
    def __init__(self, device_type):
        self.device_type = device_type

    def __dlpack__(self, stream=None):
        raise AssertionError("not read: the device decides first")

    def __dlpack_device__(self):
        return (self.device_type, 0)


def test_dlpack_producer_without_cupy_names_the_package(monkeypatch):
    """A GPU array with no CuPy installed: an ImportError that says what to install."""
    monkeypatch.setitem(sys.modules, "cupy", None)     # makes `import cupy` fail
    with pytest.raises(ImportError, match=r"pip install 'cupy-rmsnorm\[cuda12\]'"):
        rn.rms_norm(_Producer(2))


def test_cpu_dlpack_producer_without_cupy_gets_the_device_error(monkeypatch):
    """A CPU producer on a CPU-only install: the device is what is wrong, not the install."""
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(ValueError, match=r"^x lives on a non-CUDA device \(DLPack device type 1\)"):
        rn.rms_norm(_Producer(1))


def test_no_driver_says_so(monkeypatch):
    monkeypatch.setattr(_driver, "_driver_library", lambda: None)
    assert _driver.gpu_missing().startswith("no NVIDIA driver or GPU found")


def test_cupy_missing_is_reported_with_the_package(monkeypatch):
    monkeypatch.setattr(_driver, "_driver_library", lambda: object())
    monkeypatch.setitem(sys.modules, "cupy", None)
    assert "pip install 'cupy-rmsnorm[cuda12]'" in _driver.gpu_missing()


def test_import_needs_neither_cupy_nor_torch(tmp_path):
    """`import cupy_rmsnorm` and the NumPy path run where neither is installed."""
    code = ("import sys; sys.modules['cupy'] = None; sys.modules['torch'] = None\n"
            "import numpy as np, cupy_rmsnorm as rn\n"
            "print(rn.rms_norm(np.ones((1, 4), np.float32))[0, 0])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=child_env(), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert abs(float(done.stdout) - 1.0) < 1e-5


def test_weight_inside_out_range_without_sharing_is_allowed():
    """A weight lying between out's rows (inside its address range, no element shared) is
    not an overlap: the exact check lets it through."""
    buf = np.zeros((4, 32), np.float32)
    out = buf[:, :16]                  # rows of 16, stride 32
    w = buf[1, 16:]                    # the gap after row 1
    w[:] = 2.0
    x = rand((4, 16))
    y = rn.rms_norm(x, w, out=out)
    assert y is out
    np.testing.assert_array_equal(out, rn.rms_norm_reference(x, np.full(16, 2.0, np.float32)))


def test_weight_sharing_out_is_still_refused():
    buf = np.zeros((4, 32), np.float32)
    with pytest.raises(ValueError, match=r"^out overlaps weight"):
        rn.rms_norm(rand((4, 16)), buf[1, 8:24], out=buf[:, :16])   # shares row 1's elements 8..15


def test_requires_python_matches_cupy():
    """The CUDA extras need CuPy 14, which needs Python 3.10: the package says so."""
    try:
        import tomllib
    except ImportError:        # Python 3.10
        pytest.skip("tomllib is Python 3.11+")
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[2]
    meta = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert meta["requires-python"] == ">=3.10"
    assert all("cupy-cuda1" in extra[0] and ">=14" in extra[0]
               for extra in (meta["optional-dependencies"]["cuda12"], meta["optional-dependencies"]["cuda13"]))


def test_bf16_dtype_table_is_shared():
    """(guards the helpers this file uses)"""
    assert set(DTYPES) == {"float32", "float16", "bfloat16"}
    assert importlib.util.find_spec("cupy_rmsnorm") is not None


def test_gated_overlap_names_the_gate():
    """The gated op's overlap errors name its own arguments (the gate sits where the fused op's
    residual does in the shared layout)."""
    buf = np.zeros((4, 256), np.float32)
    with pytest.raises(ValueError, match=r"^out partially overlaps gate"):
        rn.rms_norm_gated(buf[:, :64], buf[:, 128:192], out=buf[:, 150:214])
