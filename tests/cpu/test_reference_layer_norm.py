"""The LayerNorm reference (cupy_rmsnorm/ops/layer_norm/reference.py) against float64
computations, torch's layer_norm (16-bit, CPU) and float64 autograd where torch is
importable, and its own promises: the fused op's rounding, modulation's broadcasting,
deterministic bits and batch invariance. torch is imported inside tests only."""

import itertools

import ml_dtypes
import numpy as np
import pytest
from helpers import DTYPES, MANTISSA_BITS, cpu_tensor_to_numpy, numpy_to_cpu_tensor, seed

from cupy_rmsnorm.ops.layer_norm.reference import (canonical_sum, fused_add_layer_norm_backward_reference,
                                                fused_add_layer_norm_reference, layer_norm_backward_reference,
                                                layer_norm_modulate_backward_reference,
                                                layer_norm_modulate_reference, layer_norm_reference)
from cupy_rmsnorm._reference import canonical_sum_of_squares

HIDDEN = (64, 255, 768, 1152, 1280, 4096, 8192)
# weight, bias: present or not, of x's dtype ("x") or float32
PARAMS = [(w, b) for w, b in itertools.product((None, "x", "float32"), repeat=2)
          if w is None or b is None or w == b]
EPS = 1e-5
MIN_EXPONENT = {"float32": -126, "float16": -14, "bfloat16": -126}
# float32 arithmetic's own error, relative to the magnitudes a value is made of (|n * w| +
# |b|: the sums, the centring, rstd, a few roundings): under 1e-6 in practice
FLOAT32_NOISE = 4e-6


def ulp(v, dtype):
    """One unit in the last place of ``dtype`` at the float64 magnitudes ``v``."""
    e = np.floor(np.log2(np.maximum(np.abs(v), 1e-300)))
    return np.exp2(np.maximum(e, MIN_EXPONENT[dtype]) - MANTISSA_BITS[dtype])


def assert_within_one_unit(got, exact, dtype, magnitude):
    """``got`` within one unit of ``dtype`` of the float64 ``exact``, plus float32's noise
    relative to ``magnitude`` (what the value was made of)."""
    got = got.astype(np.float64)
    allowed = ulp(exact, dtype) + FLOAT32_NOISE * magnitude
    bad = np.abs(got - exact) > allowed
    assert not bad.any(), (got[bad][:5], exact[bad][:5], allowed[bad][:5])


def draw(shape, dtype, name, scale=1.0, offset=0.0):
    rng = np.random.default_rng(seed(name, shape, dtype))
    return (offset + scale * rng.standard_normal(shape)).astype(np.float32).astype(DTYPES[dtype])


def params(kind_w, kind_b, hidden, dtype, name):
    def one(kind, which, offset):
        if kind is None:
            return None
        return draw((hidden,), dtype if kind == "x" else "float32", f"{name}-{which}", 0.5, offset)
    return one(kind_w, "w", 1.0), one(kind_b, "b", 0.0)


def f64(a):
    return None if a is None else np.asarray(a).astype(np.float64)


def layer_norm64(x, w, b, eps):
    """(a, m) in float64: the result and the magnitudes it is made of (centring rounds
    relative to |x|, not to |x - mean|: m counts |x| * rstd, times |w|, plus |b|)."""
    x = f64(x)
    rstd = 1 / np.sqrt(x.var(-1, keepdims=True) + eps)
    n = (x - x.mean(-1, keepdims=True)) * rstd
    ww = 1.0 if w is None else f64(w)
    bb = 0.0 if b is None else f64(b)
    return n * ww + bb, (np.abs(n) + np.abs(x) * rstd) * np.abs(ww) + np.abs(bb)


# -- forward ------------------------------------------------------------------------------
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kinds", PARAMS, ids=lambda k: f"w{k[0]}-b{k[1]}")
def test_forward_against_float64(dtype, hidden, kinds):
    # an offset mean: the two-pass variance has to cancel it
    x = draw((4, hidden), dtype, "fwd", 2.0, 3.0)
    w, b = params(*kinds, hidden, dtype, "fwd")
    y = layer_norm_reference(x, w, b, EPS)
    assert y.dtype == x.dtype and y.shape == x.shape
    exact, magnitude = layer_norm64(x, w, b, EPS)
    assert_within_one_unit(y, exact, dtype, magnitude)


@pytest.mark.parametrize("out", ["float32", "bfloat16"])
def test_out_dtype_rounds_once(out):
    x = draw((3, 768), "float16", "out")
    w, b = params("float32", "float32", 768, "float16", "out")
    y = layer_norm_reference(x, w, b, out_dtype=DTYPES[out])
    assert y.dtype == DTYPES[out]
    full = layer_norm_reference(x, w, b, out_dtype=np.float32)
    assert np.array_equal(y.view(np.uint8), full.astype(DTYPES[out]).view(np.uint8))


def test_canonical_sum_is_the_tree_of_the_squares():
    d = draw((5, 1000), "float32", "tree")
    assert np.array_equal(canonical_sum(d * d), canonical_sum_of_squares(d))
    # 13 values: the tree of 16, padded with zeros, neighbours first
    v = draw((3, 13), "float32", "tree13")
    p = np.concatenate([v, np.zeros((3, 3), np.float32)], -1)
    pairs = [p[:, 2 * i] + p[:, 2 * i + 1] for i in range(8)]
    quads = [pairs[2 * i] + pairs[2 * i + 1] for i in range(4)]
    expect = (quads[0] + quads[1]) + (quads[2] + quads[3])
    assert canonical_sum(v).dtype == np.float32 and np.array_equal(canonical_sum(v), expect)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("hidden", [64, 768, 1152, 4096])
@pytest.mark.parametrize("affine", [False, True])
def test_forward_against_torch(dtype, hidden, affine):
    torch = pytest.importorskip("torch")
    x = draw((8, hidden), dtype, "torch", 1.5, 0.5)
    w, b = params("x", "x", hidden, dtype, "torch") if affine else (None, None)
    ours = layer_norm_reference(x, w, b, EPS)
    theirs = cpu_tensor_to_numpy(torch.nn.functional.layer_norm(
        numpy_to_cpu_tensor(x), (hidden,), numpy_to_cpu_tensor(w), numpy_to_cpu_tensor(b), EPS))
    exact, _ = layer_norm64(x, w, b, EPS)
    # both within one unit of the float64 value: at most one unit apart
    diff = np.abs(ours.astype(np.float64) - theirs.astype(np.float64))
    assert (diff <= ulp(exact, dtype)).all()


# -- fused add ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("stream", ["x", "float32"])
def test_fused_add_normalizes_the_rounded_sum(dtype, stream):
    x = draw((6, 1280), dtype, "fx")
    residual = draw((6, 1280), dtype if stream == "x" else "float32", "fr", 10.0)
    w, b = params("x", "x", 1280, dtype, "fused")
    y, s = fused_add_layer_norm_reference(x, residual, w, b, EPS)
    summed = (x.astype(np.float32) + residual.astype(np.float32)).astype(residual.dtype)
    assert s.dtype == residual.dtype and np.array_equal(s, summed)
    assert y.dtype == x.dtype
    assert np.array_equal(y.view(np.uint8), layer_norm_reference(s, w, b, EPS, out_dtype=x.dtype).view(np.uint8))


# -- modulation (adaLN) -------------------------------------------------------------------
MOD_SHAPES = {"B1D": (3, 1, 1152), "BSD": (3, 5, 1152), "D": (1152,)}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mod_shape", list(MOD_SHAPES))
@pytest.mark.parametrize("affine", [False, True])
def test_modulate_against_float64(dtype, mod_shape, affine):
    x = draw((3, 5, 1152), dtype, "mod", 1.0, 0.3)
    shift = draw(MOD_SHAPES[mod_shape], dtype, "shift", 0.5)
    scale = draw(MOD_SHAPES[mod_shape], dtype, "scale", 0.5)
    w, b = params("x", "x", 1152, dtype, "mod") if affine else (None, None)
    y = layer_norm_modulate_reference(x, shift, scale, 1e-6, weight=w, bias=b)
    assert y.dtype == x.dtype and y.shape == x.shape
    a, magnitude = layer_norm64(x, w, b, 1e-6)
    one_plus = 1 + f64(scale)
    exact = a * one_plus + f64(shift)
    assert_within_one_unit(y, exact, dtype, magnitude * np.abs(one_plus) + np.abs(f64(shift)))
    # the same float32 steps as a layer_norm in float32, then the modulation, rounded once
    a32 = layer_norm_reference(x, w, b, 1e-6, out_dtype=np.float32)
    manual = (a32 * (np.float32(1) + scale.astype(np.float32)) + shift.astype(np.float32)).astype(x.dtype)
    assert np.array_equal(y.view(np.uint8), manual.view(np.uint8))


def test_modulate_refuses_shapes_that_do_not_broadcast():
    x = draw((3, 5, 64), "float32", "bad")
    with pytest.raises(ValueError):
        layer_norm_modulate_reference(x, np.zeros((2, 1, 64), np.float32), np.zeros((2, 1, 64), np.float32))


# -- backward -----------------------------------------------------------------------------
def backward64(dy, x, w, b, eps, shift=None, scale=None):
    """(dx, e * n, e, dy, dy * a) in float64, by the textbook formula."""
    x, dy = f64(x), f64(dy)
    mean = x.mean(-1, keepdims=True)
    rstd = 1 / np.sqrt(x.var(-1, keepdims=True) + eps)
    n = (x - mean) * rstd
    a = (n if w is None else n * f64(w)) + (0.0 if b is None else f64(b))
    e = dy if scale is None else dy * (1 + f64(scale))
    g = e if w is None else e * f64(w)
    dx = rstd * (g - g.mean(-1, keepdims=True) - n * (g * n).mean(-1, keepdims=True))
    return dx, e * n, e, dy, dy * a, rstd * np.abs(g).max(-1, keepdims=True)


def assert_column_sums(got, terms, axes, dtype_name, term_magnitudes=None):
    """A float32 sum of the rows' terms: within float32's summation error (relative to the
    sum of |terms|, or of what each term is made of) plus one unit of the result's dtype,
    of the float64 sum."""
    exact = terms.sum(axis=axes)
    magnitude = np.abs(terms if term_magnitudes is None else term_magnitudes).sum(axis=axes)
    allowed = ulp(exact, dtype_name) + FLOAT32_NOISE * magnitude + 1e-30
    diff = np.abs(got.astype(np.float64).reshape(exact.shape) - exact)
    assert (diff <= allowed).all(), (diff.max(), allowed.min())


def name_of(dtype):
    return next(k for k, v in DTYPES.items() if v == np.dtype(dtype))


@pytest.mark.parametrize("hidden", [64, 255, 1152, 4096])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kinds", PARAMS, ids=lambda k: f"w{k[0]}-b{k[1]}")
def test_backward_against_float64(dtype, hidden, kinds):
    x = draw((16, hidden), dtype, "bx", 2.0, 1.0)
    dy = draw((16, hidden), dtype, "bdy")
    w, b = params(*kinds, hidden, dtype, "bwd")
    dx, dw, db = layer_norm_backward_reference(dy, x, w, b, EPS)
    assert dx.dtype == x.dtype
    dx64, wt, bt, _, _, grad_scale = backward64(dy, x, w, b, EPS)
    assert_within_one_unit(dx, dx64, dtype, 4 * grad_scale)
    for got, param, terms in ((dw, w, wt), (db, b, bt)):
        if param is None:
            assert got is None
        else:
            assert got.dtype == param.dtype and got.shape == (hidden,)
            assert_column_sums(got, terms, 0, name_of(param.dtype))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("affine", [False, True])
def test_backward_against_torch_autograd(dtype, affine):
    torch = pytest.importorskip("torch")
    hidden = 768
    x = draw((2, 4, hidden), dtype, "ax", 1.5, -0.5)
    dy = draw((2, 4, hidden), dtype, "ady")
    w, b = params("float32", "float32", hidden, dtype, "autograd") if affine else (None, None)
    dx, dw, db = layer_norm_backward_reference(dy, x, w, b, EPS)
    leaves = [torch.tensor(f64(a), requires_grad=True) if a is not None else None for a in (x, w, b)]
    out = torch.nn.functional.layer_norm(leaves[0], (hidden,), leaves[1], leaves[2], EPS)
    out.backward(torch.tensor(f64(dy)))
    _, wt, bt, _, _, grad_scale = backward64(dy, x, w, b, EPS)
    assert_within_one_unit(dx, leaves[0].grad.numpy(), dtype, 4 * grad_scale)
    if affine:
        assert_column_sums(dw, wt, (0, 1), "float32")
        np.testing.assert_allclose(wt.sum((0, 1)), leaves[1].grad.numpy(), rtol=1e-9, atol=1e-9)
        assert_column_sums(db, bt, (0, 1), "float32")
        np.testing.assert_allclose(bt.sum((0, 1)), leaves[2].grad.numpy(), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fused_add_backward(dtype):
    s = draw((8, 1280), dtype, "fs", 3.0)
    dy = draw((8, 1280), dtype, "fdy")
    d_res = draw((8, 1280), dtype, "fdr")
    w, b = params("x", "x", 1280, dtype, "fb")
    d_input, dw, db = fused_add_layer_norm_backward_reference(dy, d_res, s, w, b, EPS)
    plain = layer_norm_backward_reference(dy, s, w, b, EPS)
    assert d_input.dtype == s.dtype
    assert np.array_equal(dw.view(np.uint8), plain[1].view(np.uint8))
    assert np.array_equal(db.view(np.uint8), plain[2].view(np.uint8))
    # dx in float32 plus d_residual_out, rounded once
    dx32 = layer_norm_backward_reference(dy, s.astype(np.float32), w, b, EPS)[0]
    expect = (dx32 + d_res.astype(np.float32)).astype(s.dtype)
    assert np.array_equal(d_input.view(np.uint8), expect.view(np.uint8))
    none = fused_add_layer_norm_backward_reference(dy, None, s, w, b, EPS)[0]
    assert np.array_equal(none.view(np.uint8), plain[0].view(np.uint8))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mod_shape", list(MOD_SHAPES))
def test_modulate_backward_against_float64(dtype, mod_shape):
    x = draw((3, 5, 1152), dtype, "mbx", 1.0, 0.5)
    dy = draw((3, 5, 1152), dtype, "mbdy")
    shift = draw(MOD_SHAPES[mod_shape], dtype, "mbsh", 0.5)
    scale = draw(MOD_SHAPES[mod_shape], "float32", "mbsc", 0.5)
    w, b = params("x", "x", 1152, dtype, "mb")
    dx, dshift, dscale, dw, db = layer_norm_modulate_backward_reference(dy, x, shift, scale, 1e-6, weight=w, bias=b)
    assert dshift.shape == shift.shape and dshift.dtype == shift.dtype
    assert dscale.shape == scale.shape and dscale.dtype == scale.dtype
    sh = np.broadcast_to(f64(shift), x.shape)
    sc = np.broadcast_to(f64(scale), x.shape)
    dx64, wt, bt, sht, sct, grad_scale = backward64(dy, x, w, b, 1e-6, sh, sc)
    assert_within_one_unit(dx, dx64, dtype, 4 * grad_scale)
    axes = {"B1D": (1,), "BSD": (), "D": (0, 1)}[mod_shape]
    assert_column_sums(dshift, sht, axes, dtype)
    _, made_of = layer_norm64(x, w, b, 1e-6)
    assert_column_sums(dscale, sct, axes, "float32", np.abs(f64(dy)) * made_of)
    assert_column_sums(dw, wt, (0, 1), dtype)
    assert_column_sums(db, bt, (0, 1), dtype)


def test_modulate_backward_against_torch_autograd():
    torch = pytest.importorskip("torch")
    x = draw((2, 3, 256), "float32", "tmx")
    dy = draw((2, 3, 256), "float32", "tmdy")
    shift, scale = draw((2, 1, 256), "float32", "tmsh"), draw((2, 1, 256), "float32", "tmsc")
    w, b = params("float32", "float32", 256, "float32", "tm")
    ours = layer_norm_modulate_backward_reference(dy, x, shift, scale, 1e-6, weight=w, bias=b)
    leaves = [torch.tensor(f64(a), requires_grad=True) for a in (x, shift, scale, w, b)]
    tx, tsh, tsc, tw, tb = leaves
    out = torch.nn.functional.layer_norm(tx, (256,), tw, tb, 1e-6) * (1 + tsc) + tsh
    out.backward(torch.tensor(f64(dy)))
    for got, leaf in zip(ours, leaves):
        np.testing.assert_allclose(got, leaf.grad.numpy(), rtol=1e-4, atol=1e-4)


# -- determinism and batch invariance -----------------------------------------------------
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_same_bits_every_run(dtype):
    x = draw((7, 1280), dtype, "det")
    dy = draw((7, 1280), dtype, "detdy")
    w, b = params("x", "float32", 1280, dtype, "det")[0], None
    shift, scale = draw((1280,), dtype, "dsh"), draw((1280,), dtype, "dsc")

    def run():
        return [layer_norm_reference(x, w, b), *layer_norm_backward_reference(dy, x, w, b)[:2],
                layer_norm_modulate_reference(x, shift, scale, weight=w),
                *layer_norm_modulate_backward_reference(dy, x, shift, scale, weight=w)[:4]]

    for a, c in zip(run(), run()):
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(c).view(np.uint8))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("hidden", [255, 4096])
def test_batch_invariance(dtype, hidden):
    """A row's outputs (y, residual_out, the modulated y, dx) are the same bits alone as
    among other rows."""
    x = draw((9, hidden), dtype, "bi")
    res = draw((9, hidden), dtype, "bires")
    dy = draw((9, hidden), dtype, "bidy")
    shift, scale = draw((9, hidden), dtype, "bish"), draw((9, hidden), dtype, "bisc")
    w, b = params("x", "x", hidden, dtype, "bi")

    def outputs(sl):
        return [layer_norm_reference(x[sl], w, b), *fused_add_layer_norm_reference(x[sl], res[sl], w, b),
                layer_norm_modulate_reference(x[sl], shift[sl], scale[sl], weight=w, bias=b),
                layer_norm_backward_reference(dy[sl], x[sl], w, b)[0]]

    batch = outputs(slice(None))
    for i in (0, 4, 8):
        for whole, alone in zip(batch, outputs(slice(i, i + 1))):
            assert np.array_equal(whole[i:i + 1].view(np.uint8), alone.view(np.uint8))


def test_nan_and_constant_rows():
    x = np.array([[1.0, 2.0, np.nan, 4.0], [3.0, 3.0, 3.0, 3.0]], np.float32)
    y = layer_norm_reference(x, eps=1e-5)
    assert np.isnan(y[0]).all()
    assert (y[1] == 0).all()                   # var 0: (x - mean) is exactly 0
    assert np.isnan(layer_norm_reference(x[1:], eps=0.0)).all()   # 0 * inf
    assert layer_norm_reference(x.astype(ml_dtypes.bfloat16)).dtype == ml_dtypes.bfloat16
