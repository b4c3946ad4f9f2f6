"""The quantized forms' reference (cupy_rmsnorm/_reference.py) and the NumPy path: the
conversions bit for bit against ml_dtypes, saturation, NaN and zero rows, each scale rule,
and the public functions on NumPy arrays (layouts, given outputs)."""

import ml_dtypes
import numpy as np
import pytest
from helpers import DTYPES

import cupy_rmsnorm as rn
from cupy_rmsnorm import _reference as R
from cupy_rmsnorm.ops.quant import reference as quant_reference

E4M3 = ml_dtypes.float8_e4m3fn
QUANT = ("float8_e4m3fn", "float8_e5m2", "int8")
MODES = ("fp32", "llama")


def bits(a):
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.itemsize}")


def rand(shape, dtype, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale + 0.1).astype(dtype)


def y_of(x, weight, eps=1e-6, weight_offset=0.0, mode="fp32"):
    """y before the final rounding, written out here in float32 on its own (the sum of squares
    in the contract's canonical order)."""
    xf = x.astype(np.float32)
    inv = np.float32(1) / np.sqrt(R.canonical_sum_of_squares(xf)[..., None] / np.float32(x.shape[-1])
                                  + np.float32(eps))
    n = xf * inv
    if mode == "llama":
        n = n.astype(x.dtype).astype(np.float32)
    return n if weight is None else n * (weight.astype(np.float32) + np.float32(weight_offset))


# -- conversions -----------------------------------------------------------------------------------

@pytest.mark.parametrize("quant_dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_conversion_is_ml_dtypes_rounding_and_saturates(quant_dtype):
    """Every finite FP8 value and every midpoint between neighbours (round to even) converts as
    ml_dtypes converts it; past QMAX (infinities too) it saturates; NaN stays NaN."""
    dtype, qmax = quant_reference.QUANT_DTYPES[quant_dtype]
    values = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)
    finite = np.unique(values[np.isfinite(values)])
    mids = (finite[:-1].astype(np.float64) + finite[1:]) / 2
    probe = np.concatenate([finite, mids.astype(np.float32), np.nextafter(mids.astype(np.float32), np.float32(0))])
    got = quant_reference.quantize(probe, np.float32(1), quant_dtype)
    assert np.array_equal(bits(got), bits(probe.astype(dtype)))
    over = np.array([qmax * 1.01, qmax * 2, 1e30, np.inf, -np.inf, -qmax * 3], np.float32)
    assert np.array_equal(quant_reference.quantize(over, np.float32(1), quant_dtype).astype(np.float32),
                          np.sign(over) * np.float32(qmax))
    assert np.isnan(quant_reference.quantize(np.array([np.nan], np.float32), np.float32(1), quant_dtype).astype(np.float32)).all()


def test_int8_rounds_half_to_even_saturates_and_zeroes_nan():
    v = np.array([0.5, 1.5, 2.5, -0.5, -1.5, 126.5, 127.4, 300, -300, np.inf, -np.inf, np.nan], np.float32)
    assert quant_reference.quantize(v, np.float32(1), "int8").tolist() == [0, 2, 2, 0, -2, 126, 127, 127, -127, 127, -127, 0]


def test_quantize_multiplies_by_the_float32_reciprocal():
    y = np.float32(np.random.default_rng(1).standard_normal(4096) * 3)
    s = np.float32(0.0123)
    want = np.clip(y * (np.float32(1) / s), -448, 448).astype(E4M3)
    assert np.array_equal(bits(quant_reference.quantize(y, s, "float8_e4m3fn")), bits(want))


# -- the three forms --------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("quant_dtype", QUANT)
def test_per_token(quant_dtype, dtype, mode):
    x, w = rand((6, 384), DTYPES[dtype]), rand(384, DTYPES[dtype], 1, 0.3) + DTYPES[dtype].type(1)
    q, scales = rn.rms_norm_quant_reference(x, w, casting_mode=mode, quant_dtype=quant_dtype)
    qmax = quant_reference.quant_max(quant_dtype)
    y = y_of(x, w, mode=mode)
    amax = np.abs(y).max(-1, keepdims=True)
    assert scales.shape == (6, 1) and scales.dtype == np.float32
    assert np.array_equal(scales, np.maximum(amax / np.float32(qmax), quant_reference.min_scale(quant_dtype)))
    assert np.array_equal(bits(q), bits(quant_reference.quantize(y, scales, quant_dtype)))
    assert (np.abs(q.astype(np.float32)).max(-1) == qmax).all()       # the row's max maps to QMAX
    # dequantized: within half a step of the quant dtype (relative 2**-4 for e4m3, 2**-3 e5m2; int8 absolute)
    err = np.abs(q.astype(np.float32) * scales - y)
    rel = {"float8_e4m3fn": 2.0 ** -4, "float8_e5m2": 2.0 ** -3}
    bound = scales * 0.5001 if quant_dtype == "int8" else rel[quant_dtype] * np.abs(y) + scales * 2.0 ** -9
    assert (err <= bound).all()


@pytest.mark.parametrize("quant_dtype", QUANT)
def test_static_scale_saturates(quant_dtype):
    x = rand((4, 256), np.float16)
    qmax = quant_reference.quant_max(quant_dtype)
    scale = np.array([1.5 / qmax], np.float32)       # |y| past 1.5 saturates
    q, scales = rn.rms_norm_quant_reference(x, None, scale=scale, quant_dtype=quant_dtype)
    assert scales is not None and np.array_equal(scales, scale)
    y = y_of(x, None)
    assert np.array_equal(bits(q), bits(quant_reference.quantize(y, scale[0], quant_dtype)))
    big = np.abs(y * (np.float32(1) / scale[0])) > qmax
    assert big.any() and (np.abs(q.astype(np.float32))[big] == qmax).all()


def test_scale_ub_bounds_the_row_max():
    x = rand((3, 128), np.float32, scale=4.0)
    y = y_of(x, None)
    amax = np.abs(y).max(-1, keepdims=True)
    ub = float(np.median(amax))
    _, scales = rn.rms_norm_quant_reference(x, scale_ub=ub)
    assert np.array_equal(scales, np.minimum(amax, np.float32(ub)) / np.float32(448))


@pytest.mark.parametrize("quant_dtype", QUANT)
def test_per_group(quant_dtype):
    x = rand((2, 3, 512), ml_dtypes.bfloat16, scale=2.0)
    x[0, 1, 128:256] *= 50                             # one loud group
    w = rand(512, np.float32, 2)
    q, scales = rn.rms_norm_quant_reference(x, w, group_size=128, quant_dtype=quant_dtype)
    y = y_of(x, w).reshape(2, 3, 4, 128)
    want = np.maximum(np.abs(y).max(-1) / np.float32(quant_reference.quant_max(quant_dtype)), quant_reference.min_scale(quant_dtype))
    assert scales.shape == (2, 3, 4) and np.array_equal(scales, want)
    assert np.array_equal(bits(q), bits(quant_reference.quantize(y, want[..., None], quant_dtype).reshape(2, 3, 512)))


def test_zero_rows_give_zeros_and_the_minimum_scale():
    x = rand((3, 256), np.float16)
    x[1] = 0
    for kw in ({}, {"group_size": 128}):
        with np.errstate(all="raise"):
            q, scales = rn.rms_norm_quant_reference(x, **kw)
        assert not bits(q[1]).any() and (scales[1] == quant_reference.min_scale("float8_e4m3fn")).all()


def test_nan_and_inf_stay_in_their_row():
    x = rand((4, 256), np.float32)
    x[1, 7], x[2, 9] = np.nan, np.inf
    for kw in ({}, {"group_size": 128}, {"scale": np.array([0.01], np.float32)}):
        q, scales = rn.rms_norm_quant_reference(x, **kw)
        qf = q.astype(np.float32)
        assert np.isnan(qf[1]).all()                   # inv_rms is NaN: the whole row
        assert np.isnan(qf[2, 9]) and np.isfinite(np.delete(qf[2], 9)).all()   # inf * 0
        assert np.isfinite(qf[[0, 3]]).all()
        if "scale" not in kw:
            assert np.isfinite(scales).all()           # the max ignores NaN


def test_fused_quantizes_the_rounded_sum():
    x, r = rand((5, 256), ml_dtypes.bfloat16), rand((5, 256), ml_dtypes.bfloat16, 3)
    w = rand(256, ml_dtypes.bfloat16, 4)
    q, s, scales = rn.fused_add_rms_norm_quant_reference(x, r, w, casting_mode="llama", group_size=128)
    summed = (x.astype(np.float32) + r.astype(np.float32)).astype(ml_dtypes.bfloat16)
    assert np.array_equal(bits(s), bits(summed))
    q2, scales2 = rn.rms_norm_quant_reference(summed, w, casting_mode="llama", group_size=128)
    assert np.array_equal(bits(q), bits(q2)) and np.array_equal(scales, scales2)


def test_unquantized_y_is_the_plain_ops_value_before_rounding():
    """The plain op is y rounded to x's dtype: the quantized forms start from the same value."""
    x, w = rand((4, 200), ml_dtypes.bfloat16), rand(200, ml_dtypes.bfloat16, 5)
    for mode in MODES:
        for weight in (None, w):
            y = R._normalized(x, weight, 1e-6, 0.0, mode)
            assert np.array_equal(bits(y.astype(x.dtype)), bits(rn.rms_norm_reference(x, weight, casting_mode=mode)))
            assert np.array_equal(y, y_of(x, weight, mode=mode))


# -- the NumPy path --------------------------------------------------------------------------------

def test_numpy_path_returns_ml_dtypes_and_fills_given_outputs():
    x, w = rand((2, 3, 256), np.float16), rand(256, np.float16, 1)
    q, scales = rn.rms_norm_quant(x, w)
    want_q, want_s = rn.rms_norm_quant_reference(x, w)
    assert q.dtype == E4M3 and np.array_equal(bits(q), bits(want_q)) and np.array_equal(scales, want_s)
    out = np.zeros((2, 3, 256), np.uint8)            # the bits, into a uint8 out
    scales_out = np.zeros((2, 3, 1), np.float32)
    q2, s2 = rn.rms_norm_quant(x, w, out=out, scales_out=scales_out)
    assert q2 is out and s2 is scales_out and np.array_equal(out, bits(want_q)) and np.array_equal(s2, want_s)


def test_numpy_path_group_scales_are_column_major_padded():
    x = rand((6, 384), np.float32)
    q, scales = rn.rms_norm_quant(x, group_size=128)
    assert scales.shape == (6, 3) and scales.strides == (4, 8 * 4)       # columns of round_up(6, 4) = 8 rows
    assert np.array_equal(scales, rn.rms_norm_quant_reference(x, group_size=128)[1])


def test_numpy_path_fused_in_place_and_static():
    x, r = rand((4, 128), np.float16), rand((4, 128), np.float16, 2)
    want = rn.fused_add_rms_norm_quant_reference(x, r, scale=np.array([0.02], np.float32), quant_dtype="int8")
    scale = np.array([0.02], np.float32)
    q, s, scales = rn.fused_add_rms_norm_quant(x, r, scale=scale, residual_out=r, quant_dtype="int8")
    assert s is r and scales is scale and np.array_equal(q, want[0]) and np.array_equal(bits(r), bits(want[1]))


def test_numpy_path_strided_rows():
    buf = rand((5, 300), np.float32)
    x = buf[:, 10:266]                                # strided rows
    q, scales = rn.rms_norm_quant(x, group_size=128)
    want_q, want_s = rn.rms_norm_quant_reference(np.ascontiguousarray(x), group_size=128)
    assert np.array_equal(bits(q), bits(want_q)) and np.array_equal(scales, want_s)
