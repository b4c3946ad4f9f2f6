"""Validation through the public API with NumPy inputs, and the NumPy API's happy paths.

Every error must come before anything is written: outputs are poisoned before a bad
call and compared bit for bit after it.
"""

import ml_dtypes
import numpy as np
import pytest
from helpers import DTYPES

import cupy_rmsnorm as rn

BF16 = np.dtype(ml_dtypes.bfloat16)
as_strided = np.lib.stride_tricks.as_strided


def bits(a):
    return np.ascontiguousarray(a).view(f"u{a.itemsize}").copy()


def rand(shape, dtype=np.float16, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def poisoned(shape, dtype=np.float16):
    return np.full(shape, np.nan, dtype)


def same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(bits(a), bits(b))


# -- dtypes -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.complex64, np.bool_, np.uint16])
def test_x_dtype_rejected(dtype):
    x = np.ones((2, 8), dtype)
    with pytest.raises(TypeError, match=r"\bx must be float32, float16 or bfloat16"):
        rn.rms_norm(x)
    with pytest.raises(TypeError, match=r"\bx must be"):
        rn.fused_add_rms_norm(x, x)


@pytest.mark.parametrize("arg,dtype,message", [
    ("residual", BF16, r"^residual must have dtype float16 \(x's dtype or float32\), got bfloat16"),
    ("out", np.float32, r"^out must have dtype float16 \(out_dtype, or x's dtype\), got float32"),
    ("residual_out", np.float32, r"^residual_out must have dtype float16 \(the residual's dtype\), got float32")])
def test_companion_dtype_rules(arg, dtype, message):
    """The residual may be x's dtype or float32 (a float32 residual stream); residual_out has
    the residual's dtype, out the output dtype (out_dtype, or x's)."""
    x = rand((3, 8))
    kw = {"residual": rand((3, 8)), "out": poisoned((3, 8)), "residual_out": poisoned((3, 8))}
    kw[arg] = kw[arg].astype(dtype)
    with pytest.raises(TypeError, match=message):
        rn.fused_add_rms_norm(x, **kw)
    if arg == "out":
        with pytest.raises(TypeError, match=r"^out must have dtype float16"):
            rn.rms_norm(x, out=kw["out"])
        assert rn.rms_norm(x, out=kw["out"], out_dtype="float32") is kw["out"]


def test_a_float32_residual_stream_is_accepted():
    x = rand((3, 8))
    r = rand((3, 8)).astype(np.float32)
    y, s = rn.fused_add_rms_norm(x, r)
    assert y.dtype == x.dtype and s.dtype == np.float32
    assert np.array_equal(s, x.astype(np.float32) + r)


@pytest.mark.parametrize("x_dtype, w_dtype", [(np.float16, np.float64), (np.float32, np.float64), (np.float16, np.int8)])
def test_weight_dtype_rejected(x_dtype, w_dtype):
    x = rand((3, 8), x_dtype)
    w = np.ones(8, w_dtype)
    with pytest.raises(TypeError, match=r"^weight must be float32, float16 or bfloat16"):
        rn.rms_norm(x, w)
    with pytest.raises(TypeError, match=r"^weight must be"):
        rn.fused_add_rms_norm(x, x.copy(), w)


@pytest.mark.parametrize("x_dtype, w_dtype", [
    (np.float16, np.float16), (np.float16, np.float32), (BF16, BF16), (BF16, np.float32),
    (np.float32, np.float32), (np.float16, BF16), (BF16, np.float16), (np.float32, np.float16)])
def test_weight_dtype_accepted(x_dtype, w_dtype):
    x = rand((3, 8), x_dtype)
    w = np.linspace(0.5, 2, 8).astype(w_dtype)
    y = rn.rms_norm(x, w)
    assert y.dtype == np.dtype(x_dtype)
    assert same_bits(y, rn.rms_norm_reference(x, w))


# -- shapes -----------------------------------------------------------------------------------

@pytest.mark.parametrize("arg, shape", [("residual", (3, 9)), ("residual", (4, 8)), ("residual", (3, 1, 8)),
                                        ("out", (3, 9)), ("out", (8,)), ("residual_out", (2, 8))])
def test_companion_shape_must_match_x(arg, shape):
    x = rand((3, 8))
    kw = {"residual": rand((3, 8)), "out": poisoned((3, 8)), "residual_out": poisoned((3, 8))}
    kw[arg] = rand(shape)
    with pytest.raises(ValueError, match=rf"^{arg} must have x's shape \(3, 8\)"):
        rn.fused_add_rms_norm(x, **kw)


@pytest.mark.parametrize("wshape", [(7,), (9,), (1,), (1, 8), (8, 1), ()])
def test_weight_shape_rejected(wshape):
    x = rand((3, 8))
    w = np.ones(wshape, np.float16)
    with pytest.raises(ValueError, match=r"^weight must have shape \(8,\)"):
        rn.rms_norm(x, w)


@pytest.mark.parametrize("shape", [(3, 0), (0,), (0, 0), (2, 3, 0)])
def test_hidden_size_zero_rejected(shape):
    x = np.ones(shape, np.float16)
    with pytest.raises(ValueError, match=r"hidden size 0"):
        rn.rms_norm(x)
    with pytest.raises(ValueError, match=r"hidden size 0"):
        rn.fused_add_rms_norm(x, x.copy())


def test_zero_dim_x_rejected():
    with pytest.raises(ValueError, match=r"^x must have at least one dimension"):
        rn.rms_norm(np.array(1.0, np.float32))


# -- scalars ----------------------------------------------------------------------------------

@pytest.mark.parametrize("eps", [float("nan"), float("inf"), -float("inf"), -1e-6, np.float32("nan")])
def test_bad_eps(eps):
    x = rand((2, 8))
    with pytest.raises(ValueError, match=r"^eps must be finite and >= 0"):
        rn.rms_norm(x, eps=eps)
    with pytest.raises(ValueError, match=r"^eps must be"):
        rn.fused_add_rms_norm(x, x.copy(), eps=eps)


@pytest.mark.parametrize("eps", [None, "small", [1e-6]])
def test_eps_of_wrong_type(eps):
    with pytest.raises(TypeError, match=r"^eps must be a real number"):
        rn.rms_norm(rand((2, 8)), eps=eps)


def test_eps_zero_and_numpy_scalar_accepted():
    x = rand((2, 8))
    assert same_bits(rn.rms_norm(x, eps=0.0), rn.rms_norm_reference(x, eps=0.0))
    assert same_bits(rn.rms_norm(x, eps=np.float64(1e-5)), rn.rms_norm_reference(x, eps=1e-5))


@pytest.mark.parametrize("offset", [float("nan"), float("inf"), -float("inf")])
def test_bad_weight_offset(offset):
    x = rand((2, 8))
    with pytest.raises(ValueError, match=r"^weight_offset must be finite"):
        rn.rms_norm(x, np.ones(8, np.float16), weight_offset=offset)


def test_weight_offset_without_weight():
    x = rand((2, 8))
    with pytest.raises(ValueError, match=r"^weight_offset needs a weight"):
        rn.rms_norm(x, weight_offset=1.0)
    with pytest.raises(ValueError, match=r"^weight_offset needs a weight"):
        rn.fused_add_rms_norm(x, x.copy(), weight_offset=-0.5)
    assert same_bits(rn.rms_norm(x, weight_offset=0.0), rn.rms_norm_reference(x))


@pytest.mark.parametrize("mode", ["FP32", "bf16", "", None, "torch", 1])
def test_bad_casting_mode(mode):
    x = rand((2, 8))
    with pytest.raises(ValueError, match=r"^casting_mode must be 'fp32' or 'llama'"):
        rn.rms_norm(x, casting_mode=mode)
    with pytest.raises(ValueError, match=r"^casting_mode must be"):
        rn.fused_add_rms_norm(x, x.copy(), casting_mode=mode)


# -- array kinds ------------------------------------------------------------------------------

def test_x_of_unknown_kind():
    with pytest.raises(TypeError, match=r"^x must be a CuPy array, a NumPy array"):
        rn.rms_norm([[1.0, 2.0]])
    with pytest.raises(TypeError, match=r"^x must be"):
        rn.fused_add_rms_norm(3.0, np.ones((1, 2), np.float32))


@pytest.mark.parametrize("arg", ["residual", "weight", "out", "residual_out"])
@pytest.mark.parametrize("other", [lambda a: a.tolist(), lambda a: memoryview(a.view(np.uint16)), lambda a: 1.0],
                         ids=["list", "memoryview", "float"])
def test_mixed_kinds_rejected(arg, other):
    x = rand((2, 8))
    kw = {"residual": rand((2, 8)), "weight": np.ones(8, np.float16),
          "out": poisoned((2, 8)), "residual_out": poisoned((2, 8))}
    before = {k: bits(v) for k, v in kw.items()}
    kw[arg] = other(kw[arg])
    with pytest.raises(TypeError, match=rf"^{arg} must be"):
        rn.fused_add_rms_norm(x, **kw)
    for k in ("out", "residual_out"):
        if k != arg:
            assert np.array_equal(bits(kw[k]), before[k])


# -- layouts of outputs -----------------------------------------------------------------------

def test_out_with_non_unit_last_stride():
    x = rand((4, 8))
    buf = poisoned((4, 16))
    out = buf[:, ::2]
    with pytest.raises(ValueError, match=r"^out must have a unit-stride last axis"):
        rn.rms_norm(x, out=out)
    assert np.all(np.isnan(buf.astype(np.float32)))
    ro = poisoned((4, 8, 2))[..., 0]
    with pytest.raises(ValueError, match=r"^residual_out must have a unit-stride last axis"):
        rn.fused_add_rms_norm(x, x.copy(), residual_out=ro)


def test_out_misaligned_for_its_dtype():
    raw = np.zeros(4 * 8 * 2 + 1, np.uint8)
    out = raw[1:].view(np.float16).reshape(4, 8)   # odd byte address
    assert out.__array_interface__["data"][0] % 2 == 1
    with pytest.raises(ValueError, match=r"^out must have a unit-stride last axis, element-aligned"):
        rn.rms_norm(rand((4, 8)), out=out)
    assert not raw.any()


@pytest.mark.parametrize("row_stride", [0, 4, 7])
def test_out_rows_overlapping_themselves(row_stride):
    x = rand((4, 8))
    buf = poisoned(64)
    out = as_strided(buf, shape=(4, 8), strides=(2 * row_stride, 2))
    with pytest.raises(ValueError, match=r"^out has rows that overlap each other"):
        rn.rms_norm(x, out=out)
    with pytest.raises(ValueError, match=r"^out has rows that overlap each other"):
        rn.fused_add_rms_norm(x, x.copy(), out=out)
    assert np.all(np.isnan(buf.astype(np.float32)))


def test_residual_out_rows_overlapping_themselves():
    x = rand((3, 2, 8))
    buf = poisoned(64)
    ro = as_strided(buf, shape=(3, 2, 8), strides=(2 * 16, 0, 2))   # the inner level is a broadcast
    with pytest.raises(ValueError, match=r"^residual_out has rows that overlap each other"):
        rn.fused_add_rms_norm(x, x.copy(), residual_out=ro)
    assert np.all(np.isnan(buf.astype(np.float32)))


def test_out_leading_axes_not_addressable():
    x = rand((4, 3, 5, 8))
    buf = poisoned((4, 6, 10, 8))
    out = buf[:, :3, :5]   # three strided levels: cannot be written without a copy
    with pytest.raises(ValueError, match=r"^out's leading axes cannot be addressed"):
        rn.rms_norm(x, out=out)
    assert np.all(np.isnan(buf.astype(np.float32)))


# -- overlap ----------------------------------------------------------------------------------

@pytest.mark.parametrize("shift", [(1, 0), (0, 1), (0, 3), (2, 5)])
def test_out_partially_overlapping_x(shift):
    buf = rand((8, 24))
    r0, c0 = shift
    x = buf[:4, :16]
    out = buf[r0:r0 + 4, c0:c0 + 16]
    before = bits(buf)
    with pytest.raises(ValueError, match=r"^out partially overlaps x"):
        rn.rms_norm(x, out=out)
    assert np.array_equal(bits(buf), before)


def test_out_partially_overlapping_x_flat_buffer():
    flat = rand(4 * 32 + 1)
    before = bits(flat)
    x = flat[:-1].reshape(4, 32)
    out = flat[1:].reshape(4, 32)
    with pytest.raises(ValueError, match=r"^out partially overlaps x"):
        rn.rms_norm(x, out=out)
    assert np.array_equal(bits(flat), before)


def test_out_interleaved_with_x_is_not_overlap():
    """Columns [0, 16) and [16, 32) of one buffer share no element: allowed."""
    buf = rand((4, 32))
    x = buf[:, :16]
    expected = rn.rms_norm_reference(x.copy())
    y = rn.rms_norm(x, out=buf[:, 16:])
    assert same_bits(buf[:, 16:], expected) and same_bits(y, expected)


@pytest.mark.parametrize("pair", [("out", "residual"), ("residual_out", "x"), ("residual_out", "residual")])
def test_fused_partial_overlap_rejected(pair):
    dst, src = pair
    buf = rand((9, 16), seed=1)
    x, residual = rand((4, 16), seed=2), rand((4, 16), seed=3)
    arrays = {"x": x, "residual": residual}
    arrays[src] = buf[:4]
    dest = buf[1:5]
    kw = {dst: dest}
    other = "residual_out" if dst == "out" else "out"
    kw[other] = poisoned((4, 16))
    before = bits(buf)
    with pytest.raises(ValueError, match=rf"^{dst} partially overlaps {src}"):
        rn.fused_add_rms_norm(arrays["x"], arrays["residual"], **kw)
    assert np.array_equal(bits(buf), before)
    assert np.all(np.isnan(kw[other].astype(np.float32)))


def test_out_and_residual_out_sharing_memory():
    x, residual = rand((4, 16), seed=1), rand((4, 16), seed=2)
    both = poisoned((4, 16))
    with pytest.raises(ValueError, match=r"^out and residual_out must not share memory"):
        rn.fused_add_rms_norm(x, residual, out=both, residual_out=both)
    buf = poisoned((5, 16))
    with pytest.raises(ValueError, match=r"^out and residual_out must not share memory"):
        rn.fused_add_rms_norm(x, residual, out=buf[:4], residual_out=buf[1:])
    assert np.all(np.isnan(buf.astype(np.float32))) and np.all(np.isnan(both.astype(np.float32)))


@pytest.mark.parametrize("fused", [False, True])
def test_out_overlapping_weight(fused):
    x = rand((4, 16))
    out = poisoned((4, 16))
    w = out[2]               # a row of out is the weight
    with pytest.raises(ValueError, match=r"^out overlaps weight"):
        if fused:
            rn.fused_add_rms_norm(x, x.copy(), w, out=out)
        else:
            rn.rms_norm(x, w, out=out)
    assert np.all(np.isnan(out.astype(np.float32)))


def test_residual_out_overlapping_weight():
    x = rand((4, 16))
    ro = poisoned((4, 16))
    with pytest.raises(ValueError, match=r"^residual_out overlaps weight"):
        rn.fused_add_rms_norm(x, x.copy(), ro.reshape(-1)[20:36], residual_out=ro)
    assert np.all(np.isnan(ro.astype(np.float32)))


# -- in place -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_rms_norm_in_place(dtype):
    x = rand((5, 3, 40), DTYPES[dtype])
    w = np.linspace(0.5, 2, 40).astype(DTYPES[dtype])
    expected = rn.rms_norm_reference(x.copy(), w, 1e-5, 1.0, "llama")
    y = rn.rms_norm(x, w, 1e-5, out=x, weight_offset=1.0, casting_mode="llama")
    assert y is x
    assert same_bits(x, expected)


@pytest.mark.parametrize("swap", [False, True], ids=["vllm-in-place", "swapped"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_fused_in_place(dtype, swap):
    x, residual = rand((6, 64), DTYPES[dtype], 1), rand((6, 64), DTYPES[dtype], 2)
    w = np.linspace(0.5, 2, 64).astype(np.float32)
    exp_y, exp_s = rn.fused_add_rms_norm_reference(x.copy(), residual.copy(), w)
    if swap:   # out=residual, residual_out=x
        y, s = rn.fused_add_rms_norm(x, residual, w, out=residual, residual_out=x)
        assert y is residual and s is x
    else:      # vLLM / FlashInfer: out=x, residual_out=residual
        y, s = rn.fused_add_rms_norm(x, residual, w, out=x, residual_out=residual)
        assert y is x and s is residual
    assert same_bits(y, exp_y) and same_bits(s, exp_s)


def test_in_place_on_strided_view():
    buf = rand((6, 48))
    x = buf[:, 8:40]
    untouched = bits(buf[:, :8]), bits(buf[:, 40:])
    expected = rn.rms_norm_reference(x.copy())
    assert rn.rms_norm(x, out=x) is x
    assert same_bits(buf[:, 8:40], expected)
    assert np.array_equal(bits(buf[:, :8]), untouched[0]) and np.array_equal(bits(buf[:, 40:]), untouched[1])


# -- a failing call writes nothing --------------------------------------------------------------

BAD_CALLS = {
    "eps": dict(eps=float("nan")),
    "casting_mode": dict(casting_mode="fp16"),
    "weight_offset": dict(weight=None, weight_offset=1.0),
    "weight_shape": dict(weight=np.ones(15, np.float16)),
    "weight_dtype": dict(weight=np.ones(16, np.float64)),
    "residual_dtype": dict(residual=np.ones((4, 16), np.float32)),
    "residual_shape": dict(residual=np.ones((4, 17), np.float16)),
    "residual_kind": dict(residual=[[0.0] * 16] * 4),
    "residual_out_vs_x": "partial",
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_failing_fused_call_writes_nothing(case):
    x, residual = rand((4, 16), seed=1), rand((4, 16), seed=2)
    kw = dict(weight=np.ones(16, np.float16))
    out, ro = poisoned((4, 16)), poisoned((4, 16))
    bad = BAD_CALLS[case]
    if bad == "partial":
        buf = rand((5, 16), seed=3)
        x = buf[:4]
        ro = buf[1:]
    else:
        kw.update(bad)
        residual = kw.pop("residual", residual)
    arrays = [a for a in (x, residual, out, ro) if isinstance(a, np.ndarray)]
    snapshot = [bits(a) for a in arrays]
    with pytest.raises((TypeError, ValueError)):
        rn.fused_add_rms_norm(x, residual, out=out, residual_out=ro, **kw)
    assert all(np.array_equal(bits(a), s) for a, s in zip(arrays, snapshot))


# -- happy paths --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_returns_numpy_arrays_of_x_dtype(dtype):
    x = rand((3, 24), DTYPES[dtype])
    y = rn.rms_norm(x, np.ones(24, np.float32))
    assert type(y) is np.ndarray and y.dtype == DTYPES[dtype] and y.shape == x.shape
    y2, s = rn.fused_add_rms_norm(x, x.copy())
    for a in (y2, s):
        assert type(a) is np.ndarray and a.dtype == DTYPES[dtype] and a.shape == x.shape
    assert same_bits(s, x + x)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("mode", ["fp32", "llama"])
def test_out_is_returned_and_written(dtype, mode):
    x, residual = rand((5, 33), DTYPES[dtype], 1), rand((5, 33), DTYPES[dtype], 2)
    w = np.linspace(0.5, 2, 33).astype(DTYPES[dtype])
    out = poisoned((5, 33), DTYPES[dtype])
    assert rn.rms_norm(x, w, 1e-5, out=out, weight_offset=0.5, casting_mode=mode) is out
    assert same_bits(out, rn.rms_norm_reference(x, w, 1e-5, 0.5, mode))
    out, ro = poisoned((5, 33), DTYPES[dtype]), poisoned((5, 33), DTYPES[dtype])
    y, s = rn.fused_add_rms_norm(x, residual, w, 1e-5, out=out, residual_out=ro, casting_mode=mode)
    assert y is out and s is ro
    exp_y, exp_s = rn.fused_add_rms_norm_reference(x, residual, w, 1e-5, 0.0, mode)
    assert same_bits(out, exp_y) and same_bits(ro, exp_s)
    # only one of the two outputs given: the other is allocated
    out = poisoned((5, 33), DTYPES[dtype])
    y, s = rn.fused_add_rms_norm(x, residual, w, 1e-5, out=out, casting_mode=mode)
    assert y is out and s is not residual and same_bits(s, exp_s) and same_bits(y, exp_y)
    ro = poisoned((5, 33), DTYPES[dtype])
    y, s = rn.fused_add_rms_norm(x, residual, w, 1e-5, residual_out=ro, casting_mode=mode)
    assert s is ro and same_bits(s, exp_s) and same_bits(y, exp_y)


def _views():
    """Non-contiguous inputs and where they come from."""
    wide = rand((6, 100), seed=5)
    qkv = rand((7, 3 * 4 * 16), seed=6)
    base3 = rand((5, 3, 24), seed=7)
    flat = rand(6 * 24 + 1, seed=8)
    return {
        "wider-buffer": wide[:, :64],
        "every-other-row": wide[::2, 10:74],
        "reversed-rows": wide[::-1, 1:65],
        "3d": rand((2, 3, 40), seed=9),
        "per-head-qkv": qkv[:, 4 * 16:2 * 4 * 16].reshape(7, 4, 16),
        "transposed-leading": base3.transpose(1, 0, 2),
        "odd-offset-flat": flat[1:].reshape(6, 24),
        "strided-last-axis": wide[:, ::3],
        "three-levels": rand((4, 6, 10, 8), seed=10)[:, :3, :5],
        "one-d": rand(50, seed=11),
        "hidden-1": rand((9, 1), seed=12),
    }


@pytest.mark.parametrize("name", list(_views()))
def test_strided_inputs(name):
    x = _views()[name]
    residual = rand(x.shape, seed=13)
    w = np.linspace(0.5, 2, x.shape[-1]).astype(np.float16)
    xc = np.ascontiguousarray(x)
    assert same_bits(rn.rms_norm(x, w), rn.rms_norm_reference(xc, w))
    y, s = rn.fused_add_rms_norm(x, residual, w)
    exp_y, exp_s = rn.fused_add_rms_norm_reference(xc, residual, w)
    assert same_bits(y, exp_y) and same_bits(s, exp_s)
    # and the view as residual, into a strided out
    out = poisoned(x.shape[:-1] + (x.shape[-1] + 3,))[..., :x.shape[-1]]
    y, s = rn.fused_add_rms_norm(residual, x, w, out=out)
    assert y is out
    assert same_bits(out, rn.fused_add_rms_norm_reference(residual, xc, w)[0])


@pytest.mark.parametrize("shape", [(0, 8), (0, 1), (2, 0, 16), (0, 3, 4)])
def test_zero_rows(shape):
    x = np.empty(shape, BF16)
    y = rn.rms_norm(x, np.ones(shape[-1], BF16))
    assert type(y) is np.ndarray and y.shape == shape and y.dtype == BF16
    y, s = rn.fused_add_rms_norm(x, x.copy(), np.ones(shape[-1], np.float32))
    assert y.shape == shape and s.shape == shape and y.dtype == BF16 and s.dtype == BF16
    out = np.empty(shape, BF16)
    assert rn.rms_norm(x, out=out) is out
