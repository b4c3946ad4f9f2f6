"""The NumPy reference backward (the numerics contract) against an independent float64
gradient, itself checked against finite differences; and the public backward functions on
NumPy arrays (the CPU path) in every layout.

Grid: dtype x hidden (1, 7, 255, 4096, 4095, 8192, 65536) per item; inside, casting mode x
weight (None; x's dtype or float32, offset 0 or 1) x rows (1, 3, 257, 4096) for both ops (the
fused op with and without a residual_out gradient). Rows are capped at MAX_ELEMENTS per array
(fewer rows at large hidden sizes); past SMALL_ELEMENTS one (mode, weight) pair runs per rows
value, rotating, so every pair meets every hidden size.
"""

import itertools
import zlib

import numpy as np
import pytest
from helpers import DTYPES

import cupy_rmsnorm as rn

HIDDEN = (1, 7, 255, 4096, 4095, 8192, 65536)
ROWS = (1, 3, 257, 4096)
MODES = ("fp32", "llama")
WEIGHTS = ((None, 0.0), ("same", 0.0), ("same", 1.0), ("float32", 0.0), ("float32", 1.0))
PAIRS = [(m, wk, wo) for m in MODES for wk, wo in WEIGHTS]
MAX_ELEMENTS = 2 ** 19
SMALL_ELEMENTS = 2 ** 14
EPS = 1e-6
MANTISSA = {"float32": 23, "float16": 10, "bfloat16": 7}
MIN_SPACING = {"float32": 2.0 ** -149, "float16": 2.0 ** -24, "bfloat16": 2.0 ** -133}
# float32 arithmetic against float64 (sums of up to 65536 terms, products): relative to the
# magnitudes that meet in each result
NOISE = 2e-5


def _seed(*parts):
    return zlib.crc32(" ".join(map(str, parts)).encode())


def _spacing(a, dtype_name):
    """The spacing of dtype's numbers at |a| (float64 array)."""
    _, e = np.frexp(a)
    return np.maximum(np.exp2(e.astype(np.float64) - 1 - MANTISSA[dtype_name]), MIN_SPACING[dtype_name])


def _round_to(a64, dtype):
    return a64.astype(np.float32).astype(dtype).astype(np.float64)


def backward_f64(dy, x, weight, eps, weight_offset, casting_mode, d_residual_out=None):
    """The gradients in float64, independent of the reference: (dx, dweight, dx's error
    scale, dweight's error scale). dx is unrounded; the offset is added to the weight in
    float32, as the contract says."""
    hidden = x.shape[-1]
    x64, dy64 = x.astype(np.float64).reshape(-1, hidden), dy.astype(np.float64).reshape(-1, hidden)
    r = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    xhat = x64 * r
    w = 1.0 if weight is None else (weight.astype(np.float32) + np.float32(weight_offset)).astype(np.float64)
    g = dy64 * w
    m = np.mean(g * xhat, axis=-1, keepdims=True)
    dx = r * (g - xhat * m)
    dx_scale = r * (np.abs(g) + np.abs(xhat) * np.mean(np.abs(g * xhat), axis=-1, keepdims=True))
    if d_residual_out is not None:
        dres = d_residual_out.astype(np.float64).reshape(-1, hidden)
        dx, dx_scale = dx + dres, dx_scale + np.abs(dres)
    if weight is None:
        return dx.reshape(x.shape), None, dx_scale.reshape(x.shape), None
    xw = _round_to(xhat, x.dtype) if casting_mode == "llama" else xhat
    dw = np.sum(dy64 * xw, axis=0)
    dw_scale = np.sum(np.abs(dy64 * xw), axis=0)
    if casting_mode == "llama" and x.dtype != np.float32:   # one xhat per column may round the other way
        dw_scale = dw_scale + np.max(np.abs(dy64) * _spacing(xw, x.dtype.name), axis=0) / NOISE
    return dx.reshape(x.shape), dw, dx_scale.reshape(x.shape), dw_scale


def check_close(name, got, want, scale, dtype_name):
    """got (rounded to dtype_name once) within half a spacing of want, plus float32 noise."""
    g = got.astype(np.float64)
    tol = 0.5 * _spacing(want, dtype_name) + NOISE * scale
    bad = ~(np.abs(g - want) <= tol)
    if bad.any():
        i = np.flatnonzero(bad.reshape(-1))[0]
        raise AssertionError(f"{name}: {int(bad.sum())} of {bad.size} elements off; first at flat {i}: got "
                             f"{g.reshape(-1)[i]!r}, want {want.reshape(-1)[i]!r} +- {tol.reshape(-1)[i]:.3g}")


def make_inputs(rng, shape, dtype, wkind, weight_offset, fused, with_dres):
    """x (scaled per row by 2..8), dy, the weight and the residual_out gradient."""
    x = rng.standard_normal(shape) * np.exp(rng.uniform(np.log(2), np.log(8), shape[:-1] + (1,)))
    dy = rng.standard_normal(shape)
    w = None
    if wkind is not None:
        w = (rng.standard_normal(shape[-1]) * 0.5 + (0.0 if weight_offset else 1.0)).astype(
            dtype if wkind == "same" else np.float32)
    dres = rng.standard_normal(shape).astype(dtype) if fused and with_dres else None
    return x.astype(dtype), dy.astype(dtype), w, dres


def grid(hidden):
    """(rows, mode, weight kind, weight_offset) of one hidden size's calls (see the docstring)."""
    seen = set()
    for ri, rows in enumerate(ROWS):
        n = max(1, min(rows, MAX_ELEMENTS // hidden))
        if n in seen:                          # the cap made this a row count already run
            continue
        seen.add(n)
        for j, (mode, wk, wo) in enumerate(PAIRS):
            if n * hidden > SMALL_ELEMENTS and j != (3 * ri + hidden) % len(PAIRS):
                continue
            yield n, mode, wk, wo


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_reference_backward_matches_float64(dtype_name, hidden):
    dtype = DTYPES[dtype_name]
    rng = np.random.default_rng(_seed(dtype_name, hidden))
    calls = 0
    for rows, mode, wk, wo in grid(hidden):
        for fused, with_dres in ((False, False), (True, False), (True, True)):
            x, dy, w, dres = make_inputs(rng, (rows, hidden), dtype, wk, wo, fused, with_dres)
            where = f"[rows={rows} {mode} weight={wk}+{wo} {'fused' if fused else 'rms'} dres={with_dres}]"
            if fused:
                dx, dw = rn.fused_add_rms_norm_backward_reference(dy, dres, x, w, EPS, wo, mode)
            else:
                dx, dw = rn.rms_norm_backward_reference(dy, x, w, EPS, wo, mode)
            want_dx, want_dw, dx_scale, dw_scale = backward_f64(dy, x, w, EPS, wo, mode, dres)
            assert dx.dtype == dtype and dx.shape == x.shape, where
            check_close(f"{where} dx", dx, want_dx, dx_scale, dtype_name)
            if w is None:
                assert dw is None, where
            else:
                assert dw.dtype == w.dtype and dw.shape == w.shape, where
                check_close(f"{where} dweight", dw, want_dw, dw_scale, w.dtype.name)
            calls += 1
    assert calls >= 9          # at least three row counts, three op forms


def test_float64_gradient_matches_finite_differences():
    """The float64 formula above is the gradient of sum(dy * rms_norm(x, w)) (fp32 mode, no
    roundings), checked by central differences in float64."""
    rng = np.random.default_rng(11)
    rows, hidden, eps, off = 3, 7, 1e-3, 0.5
    x = rng.standard_normal((rows, hidden))
    dy = rng.standard_normal((rows, hidden))
    w = rng.standard_normal(hidden) * 0.5 + 1.0

    def loss(x, w):
        r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
        return np.sum(dy * x * r * (w + off))

    dx, dw, _, _ = backward_f64(dy, x, w, eps, off, "fp32")
    h = 1e-6
    num_dx = np.zeros_like(x)
    for i, j in itertools.product(range(rows), range(hidden)):
        e = np.zeros_like(x)
        e[i, j] = h
        num_dx[i, j] = (loss(x + e, w) - loss(x - e, w)) / (2 * h)
    num_dw = np.array([(loss(x, w + h * np.eye(hidden)[j]) - loss(x, w - h * np.eye(hidden)[j])) / (2 * h)
                       for j in range(hidden)])
    np.testing.assert_allclose(dx, num_dx, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(dw, num_dw, rtol=1e-6, atol=1e-8)
    # the float32 offset: the weight the float64 model uses is w + offset in float32
    dx0, _, _, _ = backward_f64(dy, x, None, eps, 0.0, "fp32")
    np.testing.assert_allclose(dx0, backward_f64(dy, x, np.zeros(hidden), eps, 1.0, "fp32")[0], rtol=1e-12)


def test_llama_dweight_uses_the_rounded_xhat():
    """In llama mode dweight sums dy * round(xhat): for bfloat16 that differs visibly from fp32
    mode's, and matches the model that rounds."""
    rng = np.random.default_rng(12)
    bf16 = DTYPES["bfloat16"]
    x, dy, w, _ = make_inputs(rng, (64, 256), bf16, "float32", 0.0, False, False)
    _, dw_llama = rn.rms_norm_backward_reference(dy, x, w, EPS, 0.0, "llama")
    _, dw_fp32 = rn.rms_norm_backward_reference(dy, x, w, EPS, 0.0, "fp32")
    assert np.mean(dw_llama != dw_fp32) > 0.5
    _, want, _, scale = backward_f64(dy, x, w, EPS, 0.0, "llama")
    check_close("llama dweight", dw_llama, want, scale, "float32")


def test_no_rows_gives_zero_dweight():
    x = np.zeros((0, 16), np.float16)
    w = np.ones(16, np.float32)
    dx, dw = rn.rms_norm_backward(x, x, w)
    assert dx.shape == (0, 16) and dx.dtype == np.float16
    assert dw.dtype == np.float32 and np.array_equal(dw, np.zeros(16, np.float32))


# -- the public functions on NumPy arrays: every layout gives the contiguous answer ---------------

def _layouts(rng, rows, hidden, dtype):
    """name -> a view of random data (the kernel-facing layouts of the GPU path)."""
    def data(*shape):
        return rng.standard_normal(shape).astype(dtype)
    return {
        "contiguous": data(rows, hidden),
        "strided rows": data(rows, hidden + 3)[:, 3:],
        "per-head view": data(rows, 4, hidden)[:, 1:3],
        "offset by one": data(rows * hidden + 1)[1:].reshape(rows, hidden),
        "3d": data(rows, 2, hidden),
    }


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_public_backward_on_numpy_arrays_in_every_layout(dtype_name):
    dtype = DTYPES[dtype_name]
    rng = np.random.default_rng(_seed("layouts", dtype_name))
    for hidden in (7, 256):
        xs, dys, dres = _layouts(rng, 5, hidden, dtype), _layouts(rng, 5, hidden, dtype), _layouts(rng, 5, hidden, dtype)
        w = (rng.standard_normal(hidden) + 1).astype(np.float32)
        for name in xs:
            x, dy, dr = xs[name], dys[name], dres[name]
            for mode in MODES:
                dx, dw = rn.rms_norm_backward(dy, x, w, EPS, weight_offset=0.5, casting_mode=mode)
                rx, rw = rn.rms_norm_backward_reference(np.ascontiguousarray(dy), np.ascontiguousarray(x), w,
                                                        EPS, 0.5, mode)
                assert dx.shape == x.shape and np.array_equal(dx, rx) and np.array_equal(dw, rw), (name, mode)
                di, dw2 = rn.fused_add_rms_norm_backward(dy, dr, x, w, EPS, weight_offset=0.5, casting_mode=mode)
                ri, rw2 = rn.fused_add_rms_norm_backward_reference(
                    np.ascontiguousarray(dy), np.ascontiguousarray(dr), np.ascontiguousarray(x), w, EPS, 0.5, mode)
                assert np.array_equal(di, ri) and np.array_equal(dw2, rw2), (name, mode)
        dx, dw = rn.rms_norm_backward(dys["contiguous"], xs["contiguous"])
        assert dw is None and dx.dtype == dtype
