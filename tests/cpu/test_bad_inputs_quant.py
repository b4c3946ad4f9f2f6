"""The quantized forms refuse bad arguments with a TypeError / ValueError naming the argument,
before anything is written (NumPy arrays here: the checks are the GPU path's too)."""

import numpy as np
import pytest

import cupy_rmsnorm as rn


def rand(shape, dtype=np.float16, seed=0):
    return (np.random.default_rng(seed).standard_normal(shape) + 0.5).astype(dtype)


X = rand((3, 256))


def _read_only(a):
    a.flags.writeable = False
    return a


@pytest.mark.parametrize("kwargs, error, match", [
    ({"quant_dtype": "float8"}, ValueError, r"^quant_dtype must be one of 'float8_e4m3fn', 'float8_e5m2', 'int8'"),
    ({"quant_dtype": np.float16}, ValueError, r"^quant_dtype must be one of"),
    ({"group_size": 64}, ValueError, r"^group_size must be None \(one scale per row\) or one of \(128,\)"),
    ({"group_size": 128.0}, TypeError, r"^group_size must be an int or None, got float"),
    ({"group_size": True}, TypeError, r"^group_size must be an int"),
    ({"scale_ub": -1.0}, ValueError, r"^scale_ub must be > 0"),
    ({"scale_ub": float("nan")}, ValueError, r"^scale_ub must be finite"),
    ({"scale_ub": "big"}, TypeError, r"^scale_ub must be a real number"),
    ({"scale": np.ones(1, np.float32), "group_size": 128}, ValueError, r"^a static scale leaves no scale"),
    ({"scale": np.ones(1, np.float32), "scale_ub": 2.0}, ValueError, r"^a static scale leaves no scale"),
    ({"scale": np.ones(2, np.float32)}, ValueError, r"^scale must hold one element"),
    ({"scale": np.ones(1, np.float64)}, TypeError, r"^scale must be a float32 array"),
    ({"scale": 0.5}, TypeError, r"^scale must be a CuPy array, a NumPy array"),
    ({"out": np.zeros((3, 256), np.float16)}, TypeError, r"^out must have dtype float8_e4m3fn or uint8"),
    ({"out": np.zeros((3, 256), np.uint8), "quant_dtype": "int8"}, TypeError, r"^out must have dtype int8"),
    ({"out": np.zeros((3, 255), np.uint8)}, ValueError, r"^out must have x's shape \(3, 256\)"),
    ({"out": np.zeros((3, 512), np.uint8)[:, ::2]}, ValueError, r"^out must have a unit-stride last axis"),
    ({"scales_out": np.zeros(3, np.float32)}, ValueError, r"^scales_out must have shape \(3, 1\)"),
    ({"scales_out": np.zeros((3, 1), np.float32), "group_size": 128}, ValueError,
     r"^scales_out must have shape \(3, 2\)"),
    ({"scales_out": np.zeros((3, 1), np.float64)}, TypeError, r"^scales_out must be float32"),
    ({"scales_out": np.zeros((3, 1), np.float32), "scale": np.ones(1, np.float32)}, ValueError,
     r"^scales_out is for the dynamic forms"),
    ({"scales_out": np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), (3, 1), (0, 4))}, ValueError,
     r"^scales_out has elements that overlap each other"),
])
def test_bad_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        rn.rms_norm_quant(X, **kwargs)


def test_hidden_not_a_multiple_of_the_group():
    with pytest.raises(ValueError, match=r"^group_size=128 needs a hidden size that is a multiple of it; x has "
                                         r"hidden size 200"):
        rn.rms_norm_quant(rand((2, 200)), group_size=128)


def test_scales_out_leading_axes_must_lie_at_one_stride():
    x = rand((2, 3, 256))
    s = np.zeros((2, 4, 1), np.float32)[:, :3]                # rows 0..2 then a gap
    with pytest.raises(ValueError, match=r"^scales_out's leading axes must lie at one stride"):
        rn.rms_norm_quant(x, scales_out=s)
    with pytest.raises(ValueError, match=r"^scales_out's leading axes must lie at one stride"):
        rn.rms_norm_quant(x, scales_out=np.zeros((3, 2, 1), np.float32).transpose(1, 0, 2))
    for ok in (np.zeros((2, 3, 1), np.float32), np.zeros((1, 6), np.float32).T.reshape(2, 3, 1)):
        assert rn.rms_norm_quant(x, scales_out=ok)[1] is ok


@pytest.mark.parametrize("name", ["out", "scales_out"])
def test_read_only_outputs(name):
    kw = {"out": np.zeros((3, 256), np.uint8), "scales_out": np.zeros((3, 1), np.float32)}
    _read_only(kw[name])
    with pytest.raises(ValueError, match=rf"^{name} is read-only"):
        rn.rms_norm_quant(X, **kw)


def test_fused_read_only_residual_out_writes_nothing():
    out = np.full((3, 256), 7, np.uint8)
    with pytest.raises(ValueError, match=r"^residual_out is read-only"):
        rn.fused_add_rms_norm_quant(X, X.copy(), out=out, residual_out=_read_only(np.zeros_like(X)))
    assert (out == 7).all()


def test_fused_needs_a_residual():
    with pytest.raises(TypeError, match=r"^residual must be an array"):
        rn.fused_add_rms_norm_quant(X, None)


def test_overlapping_outputs():
    buf = np.zeros(3 * 256 + 16, np.uint8)
    out = buf[:768].reshape(3, 256)
    with pytest.raises(ValueError, match=r"^scales_out overlaps out; pass memory apart from it"):
        rn.rms_norm_quant(X, out=out, scales_out=buf[760:772].view(np.float32).reshape(3, 1))
    with pytest.raises(ValueError, match=r"^out overlaps x; pass memory apart from it"):
        rn.rms_norm_quant(X, out=X.view(np.uint8)[:, :256])
    x = X.copy()
    with pytest.raises(ValueError, match=r"^scales_out overlaps x"):
        rn.rms_norm_quant(x, scales_out=x[:, :2].view(np.float32))
    buf = np.zeros(3 * 256 // 2 + 2, np.float32)        # residual_out's memory holds the scale
    scale, residual_out = buf[:1], buf.view(np.float16)[:768].reshape(3, 256)
    with pytest.raises(ValueError, match=r"^residual_out overlaps scale"):
        rn.fused_add_rms_norm_quant(X, X.copy(), scale=scale, residual_out=residual_out)


def test_kinds_must_match():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"^scale must be the same kind of array as x \(numpy\)"):
        rn.rms_norm_quant(X, scale=torch.ones(1))


def test_nothing_is_written_on_error():
    out, scales = np.full((3, 256), 5, np.uint8), np.full((3, 1), 5.0, np.float32)
    with pytest.raises(ValueError):
        rn.rms_norm_quant(X, out=out, scales_out=scales, scale_ub=-1.0)
    assert (out == 5).all() and (scales == 5.0).all()
