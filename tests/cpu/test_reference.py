"""The NumPy reference (the numerics contract) against an independent float64 computation."""

import zlib

import ml_dtypes
import numpy as np
import pytest
from helpers import DTYPES

from cupy_rmsnorm import fused_add_rms_norm_reference, rms_norm_reference

# (dtype, atol, rtol), Liger-style. The float64 model below rounds at the same points as
# the contract, so only the float32 arithmetic of the reference differs: a few float32 ulps
# for float32; for float16 (ulp <= 2**-10 relative) and bfloat16 (ulp <= 2**-7 relative)
# a rounding flipped at a near-tie, which llama mode can compound to two ulps (the
# intermediate rounding, then the final one after the weight multiply).
TOLERANCES = [
    ("float32", 1e-6, 1e-5),
    ("float16", 1e-6, 2e-3),
    ("bfloat16", 1e-6, 1.6e-2),
]
TOL = {name: (atol, rtol) for name, atol, rtol in TOLERANCES}
CASTING_MODES = ("fp32", "llama")
SHAPES = [(5, 1), (7, 257), (3, 4096), (2, 3, 40)]
EPS = 1e-6


def bits(a):
    """The raw bits, so comparisons are exact (NaN, -0.0 and all)."""
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.itemsize}")


def make(shape, dtype, rng, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def make_weight(hidden, dtype, rng):
    # away from 0 and 1, so that the weight (and weight_offset) visibly matter
    return rng.uniform(0.25, 2.5, hidden).astype(dtype)


def rms_norm_f64(x, weight, eps, weight_offset, casting_mode, dtype):
    """The contract in float64, independent of the reference: unrounded result.

    llama mode rounds the normalized value to the storage dtype before the weight
    multiply; the weight offset is added in float32 (as the contract says), which only
    matters for float32 weights.
    """
    x64 = np.asarray(x).astype(np.float64)
    inv_rms = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    normed = x64 * inv_rms
    if weight is None:
        return normed
    if casting_mode == "llama":
        normed = normed.astype(dtype).astype(np.float64)
    w = (np.asarray(weight).astype(np.float32) + np.float32(weight_offset)).astype(np.float64)
    return normed * w


def dtype_add(x, residual):
    """x + residual in the storage dtype's own arithmetic (correctly rounded for all three)."""
    return x + residual


def weight_cases():
    """(label, weight dtype or None, weight_offset): offset 1.0 needs a weight."""
    return [("noweight", None, 0.0),
            ("w-same", "same", 0.0), ("w-same-off1", "same", 1.0),
            ("w-f32", "float32", 0.0), ("w-f32-off1", "float32", 1.0)]


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("label, wdtype, offset", weight_cases(), ids=[c[0] for c in weight_cases()])
@pytest.mark.parametrize("mode", CASTING_MODES)
@pytest.mark.parametrize("dtype_name, atol, rtol", TOLERANCES, ids=[t[0] for t in TOLERANCES])
def test_reference_matches_float64(dtype_name, atol, rtol, mode, label, wdtype, offset, fused):
    dtype = DTYPES[dtype_name]
    rng = np.random.default_rng(zlib.crc32(f"{dtype_name} {mode} {label} {fused}".encode()))
    for shape in SHAPES:
        x = make(shape, dtype, rng)
        weight = None
        if wdtype is not None:
            weight = make_weight(shape[-1], dtype if wdtype == "same" else np.float32, rng)
        if fused:
            residual = make(shape, dtype, rng)
            y, residual_out = fused_add_rms_norm_reference(x, residual, weight, EPS, offset, mode)
            summed = dtype_add(x, residual)
            assert residual_out.dtype == dtype and residual_out.shape == shape
            np.testing.assert_array_equal(bits(residual_out), bits(summed))
            expected = rms_norm_f64(summed, weight, EPS, offset, mode, dtype)
        else:
            y = rms_norm_reference(x, weight, EPS, offset, mode)
            expected = rms_norm_f64(x, weight, EPS, offset, mode, dtype)
        assert y.dtype == dtype and y.shape == shape
        np.testing.assert_allclose(y.astype(np.float64), expected, atol=atol, rtol=rtol,
                                   err_msg=f"shape {shape}")


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("mode", CASTING_MODES)
def test_reference_rounds_once_per_contract(dtype_name, mode):
    """Half types: the reference is the float64 model rounded to the dtype, bit for bit,
    except at rare near-ties (float32 vs float64 arithmetic), never by more than an ulp."""
    dtype = DTYPES[dtype_name]
    rng = np.random.default_rng(21)
    x = make((64, 1024), dtype, rng)
    w = make_weight(1024, dtype, rng)
    y = rms_norm_reference(x, w, EPS, 0.0, mode)
    expected = rms_norm_f64(x, w, EPS, 0.0, mode, dtype).astype(dtype)
    mismatch = np.mean(bits(y) != bits(expected))
    assert mismatch < 1e-3
    ulps = np.abs(bits(y).astype(np.int64) - bits(expected).astype(np.int64))
    assert ulps.max() <= 1


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("wdtype", ["same", "float32"])
def test_llama_rounds_before_the_weight(dtype_name, wdtype):
    """llama rounds x * inv_rms to the dtype before the weight multiply, fp32 does not:
    each mode matches its own float64 model and not the other's."""
    dtype = DTYPES[dtype_name]
    rng = np.random.default_rng(8)
    x = make((64, 1024), dtype, rng)
    w = make_weight(1024, dtype if wdtype == "same" else np.float32, rng)
    ref = {m: rms_norm_reference(x, w, EPS, 0.0, m) for m in CASTING_MODES}
    model = {m: rms_norm_f64(x, w, EPS, 0.0, m, dtype).astype(dtype) for m in CASTING_MODES}

    def mismatch(a, b):
        return np.mean(bits(a) != bits(b))

    for m in CASTING_MODES:
        assert mismatch(ref[m], model[m]) < 1e-3, m
    # the double rounding changes a good share of the outputs (by an ulp)
    assert mismatch(ref["llama"], ref["fp32"]) > 0.05
    assert mismatch(ref["llama"], model["fp32"]) > 0.05
    assert mismatch(ref["fp32"], model["llama"]) > 0.05
    ulps = np.abs(bits(ref["llama"]).astype(np.int64) - bits(ref["fp32"]).astype(np.int64))
    assert ulps.max() <= 2


@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
def test_modes_agree_without_weight(dtype_name):
    dtype = DTYPES[dtype_name]
    x = make((8, 300), dtype, np.random.default_rng(2))
    np.testing.assert_array_equal(bits(rms_norm_reference(x, None, EPS, 0.0, "llama")),
                                  bits(rms_norm_reference(x, None, EPS, 0.0, "fp32")))


@pytest.mark.parametrize("mode", CASTING_MODES)
@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("wdtype", [None, "same", "float32"])
def test_fused_equals_unfused_on_rounded_sum(dtype_name, mode, wdtype):
    """The fused op normalizes the rounded sum: exactly rms_norm(round(x + residual))."""
    dtype = DTYPES[dtype_name]
    rng = np.random.default_rng(4)
    x, residual = make((33, 513), dtype, rng), make((33, 513), dtype, rng, scale=3.0)
    w = None if wdtype is None else make_weight(513, dtype if wdtype == "same" else np.float32, rng)
    offset = 0.0 if w is None else 1.0
    y, residual_out = fused_add_rms_norm_reference(x, residual, w, EPS, offset, mode)
    summed = dtype_add(x, residual)
    np.testing.assert_array_equal(bits(residual_out), bits(summed))
    np.testing.assert_array_equal(bits(y), bits(rms_norm_reference(summed, w, EPS, offset, mode)))
    if dtype_name != "float32":
        # and it is not the normalization of the unrounded float32 sum (peers' drift)
        unrounded = x.astype(np.float32) + residual.astype(np.float32)
        drift = rms_norm_f64(unrounded, w, EPS, offset, mode, dtype).astype(dtype)
        assert np.any(bits(drift) != bits(y))


def test_bfloat16_dtype_is_ml_dtypes():
    x = make((2, 16), ml_dtypes.bfloat16, np.random.default_rng(0))
    y, s = fused_add_rms_norm_reference(x, x, None)
    assert y.dtype == np.dtype(ml_dtypes.bfloat16) and s.dtype == np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("mode", CASTING_MODES)
def test_float16_scaled_by_100_stays_finite(fused, mode):
    """Squares of x100 activations overflow float16 (max 65504); float32 accumulation does not."""
    dtype = DTYPES["float16"]
    rng = np.random.default_rng(6)
    x = make((16, 4096), dtype, rng, scale=100.0)
    assert np.max(np.abs(x.astype(np.float32))) ** 2 > 65504      # the case really is hard
    w = make_weight(4096, dtype, rng)
    if fused:
        residual = make((16, 4096), dtype, rng, scale=100.0)
        y, s = fused_add_rms_norm_reference(x, residual, w, EPS, 0.0, mode)
        assert np.all(np.isfinite(s.astype(np.float32)))
        base = s
    else:
        y = rms_norm_reference(x, w, EPS, 0.0, mode)
        base = x
    assert np.all(np.isfinite(y.astype(np.float32)))
    atol, rtol = TOL["float16"]
    np.testing.assert_allclose(y.astype(np.float64), rms_norm_f64(base, w, EPS, 0.0, mode, dtype),
                               atol=atol, rtol=rtol)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")   # inf * 0 in the bad row
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
def test_non_finite_stays_in_its_row(dtype_name, bad, fused):
    dtype = DTYPES[dtype_name]
    rng = np.random.default_rng(9)
    x = make((6, 100), dtype, rng)
    w = make_weight(100, dtype, rng)
    x[2, 17] = bad
    if fused:
        residual = make((6, 100), dtype, rng)
        y, s = fused_add_rms_norm_reference(x, residual, w, EPS, 0.0, "fp32")
        clean_y, clean_s = fused_add_rms_norm_reference(np.delete(x, 2, 0), np.delete(residual, 2, 0),
                                                        w, EPS, 0.0, "fp32")
        # residual_out: only the one element is non-finite
        bad_s = ~np.isfinite(s.astype(np.float32))
        assert bad_s.sum() == 1 and bad_s[2, 17]
        np.testing.assert_array_equal(bits(np.delete(s, 2, 0)), bits(clean_s))
    else:
        y = rms_norm_reference(x, w, EPS, 0.0, "fp32")
        clean_y = rms_norm_reference(np.delete(x, 2, 0), w, EPS, 0.0, "fp32")
    y32 = y.astype(np.float32)
    other_rows = np.delete(y32, 2, 0)
    assert np.all(np.isfinite(other_rows))
    np.testing.assert_array_equal(bits(np.delete(y, 2, 0)), bits(clean_y))
    assert not np.isfinite(y32[2, 17])    # the bad element itself is not made finite
    if np.isnan(bad):
        assert np.all(np.isnan(y32[2]))   # its row's mean square is NaN


@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
def test_zero_offset_leaves_the_weight_as_is(dtype_name):
    """weight_offset=0 multiplies by the weight itself: a -0 weight gives zeros of the sign
    x * -0 has (HF's weight * x), where adding +0 first would give +0 for positive x."""
    dtype = DTYPES[dtype_name]
    x = np.array([[1.0, -2.0, 3.0, 4.0]], dtype)
    w = np.array([-0.0, -0.0, 1.0, 1.0], dtype)
    y = rms_norm_reference(x, w, EPS, 0.0, "fp32")
    assert np.signbit(y[0, :2]).tolist() == [True, False]
    y1 = rms_norm_reference(x, w - np.array(1, dtype), EPS, 1.0, "fp32")   # w' = -1 + 1 = +0
    assert np.signbit(y1[0, :2]).tolist() == [False, True]
