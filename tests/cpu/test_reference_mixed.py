"""Mixed precision in the reference (cupy_rmsnorm/_reference.py) on the CPU: ``out_dtype``, a
float32 residual stream with 16-bit x, weights of any float dtype, the quantized fused form
with a float32 residual, and the backward with dy in another dtype than x.

- every x dtype x residual dtype (x's, float32) x out_dtype (None, bfloat16, float16, float32)
  x weight dtype (bfloat16, float16, float32, None), both casting modes, rms_norm and the fused
  op, against a float64 PyTorch model within two ulps of O;
- properties bit for bit: the float32 stream is rms_norm of the float32 sum, out_dtype is one
  rounding of the float32 result, None is x's dtype, llama's rounding is to O (a direct float32
  implementation), the quantized fused form rounds its llama step to x's dtype;
- the backward: dy in O, dweight's llama rounding to dy's dtype, the fused op's d_input in
  residual_out's dtype (float32 for a float32 stream).
"""

import zlib

import ml_dtypes
import numpy as np
import pytest
torch = pytest.importorskip("torch", reason="mixed-precision reference tests: torch is not installed")
from helpers import DTYPES, HOST_ATOL, HOST_RTOL

from cupy_rmsnorm import _reference as R
from cupy_rmsnorm.ops.backward.reference import fused_add_rms_norm_backward_reference, rms_norm_backward_reference
from cupy_rmsnorm.ops.quant.reference import fused_add_rms_norm_quant_reference, rms_norm_quant_reference
from cupy_rmsnorm.ops.forward.reference import fused_add_rms_norm_reference, rms_norm_reference
from cupy_rmsnorm.ops.quant import reference as quant_reference

EPS = 1e-6
F32 = np.dtype(np.float32)
BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
DTYPE_NAMES = ("float32", "float16", "bfloat16")
OUTS = (None, BF16, F16, F32)
WEIGHT_DTYPES = (BF16, F16, F32, None)
MODES = ("fp32", "llama")
TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
NOISE = 2e-5            # float32 arithmetic against float64, relative to the row's largest value


def bits(a):
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.itemsize}")


def seed(*parts):
    return zlib.crc32(" ".join(map(str, parts)).encode())


def rand(rng, shape, dtype, scale=1.0, shift=0.1):
    a = (rng.standard_normal(shape) * scale + shift).astype(dtype)
    assert np.all(a.astype(np.float32) != 0)            # never zeros
    return a


def weight_of(rng, hidden, dtype, offset):
    if dtype is None:
        return None
    return rand(rng, hidden, dtype, 0.5, 0.0 if offset else 1.0)


def to_torch(a, dtype=None):
    """A numpy array (ml_dtypes bfloat16 too) as a torch tensor of the same values."""
    t = torch.from_numpy(np.asarray(a).astype(np.float64))
    return t if dtype is None else t.to(TORCH[np.dtype(dtype).name])


def w_prime64(w, offset):
    if w is None:
        return None
    w32 = w.astype(np.float32)
    return torch.from_numpy((w32 + np.float32(offset) if offset else w32).astype(np.float64))


def torch_rms_norm(x64, w64, eps, mode, out):
    """The float64 model: llama rounds x * inv_rms to O before the weight multiply."""
    n = x64 * torch.rsqrt(x64.square().mean(dim=-1, keepdim=True) + eps)
    if mode == "llama":
        n = n.to(TORCH[np.dtype(out).name]).to(torch.float64)
    return n if w64 is None else n * w64


def check_close(where, got, want, dtype, scale=0.0):
    name = np.dtype(dtype).name
    g = got.astype(np.float64)
    tol = HOST_RTOL[name] * np.abs(want) + HOST_ATOL[name] + NOISE * scale
    bad = ~(np.abs(g - want) <= tol)
    if bad.any():
        i = np.flatnonzero(bad.reshape(-1))[0]
        raise AssertionError(f"{where}: {int(bad.sum())} of {bad.size} off; first at flat {i}: "
                             f"got {g.reshape(-1)[i]!r}, want {want.reshape(-1)[i]!r}")


# -- the forward against float64 torch --------------------------------------------------------------

@pytest.mark.parametrize("residual_kind", [None, "x", "float32"], ids=["rms_norm", "fused-res-x", "fused-res-f32"])
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_forward_every_dtype_combination_matches_float64_torch(dtype_name, residual_kind):
    dtype = DTYPES[dtype_name]
    rng = np.random.default_rng(seed("mixed", dtype_name, residual_kind))
    cases = 0
    for out in OUTS:
        O = dtype if out is None else out
        for wd in WEIGHT_DTYPES:
            for offset in ((0.0,) if wd is None else (0.0, 1.0)):
                for mode in MODES:
                    where = f"[out={out} weight={wd}+{offset} {mode}]"
                    x = rand(rng, (4, 384), dtype)
                    w = weight_of(rng, 384, wd, offset)
                    if residual_kind is None:
                        y = rms_norm_reference(x, w, EPS, offset, mode, out_dtype=out)
                        base = to_torch(x)
                    else:
                        rd = dtype if residual_kind == "x" else F32
                        r = rand(rng, (4, 384), rd, 2.0)
                        y, s = fused_add_rms_norm_reference(x, r, w, EPS, offset, mode, out_dtype=out)
                        # the sum in the residual's own torch arithmetic (16-bit: float32 then rounded)
                        summed = to_torch(x, rd) + to_torch(r, rd)
                        assert s.dtype == rd and s.shape == x.shape, where
                        np.testing.assert_array_equal(s.astype(np.float64), summed.double().numpy(), err_msg=where)
                        base = summed.double()
                    want = torch_rms_norm(base, w_prime64(w, offset), EPS, mode, O).numpy()
                    assert y.dtype == O and y.shape == x.shape, where
                    check_close(where, y, want, O)
                    cases += 1
    assert cases == 4 * 7 * 2


def test_the_float64_check_sees_the_wrong_rounding_target():
    """llama's rounding to x's dtype instead of O is visible to the check above (x float32,
    O bfloat16: rounding to float32 is no rounding at all, by up to an ulp and more of O)."""
    rng = np.random.default_rng(1)
    x, w = rand(rng, (64, 512), F32), rand(rng, 512, F32, 0.5, 1.0)
    want_llama = torch_rms_norm(to_torch(x), w_prime64(w, 0.0), EPS, "llama", BF16).numpy()
    y = rms_norm_reference(x, w, EPS, 0.0, "llama", out_dtype=BF16)
    check_close("llama to O", y, want_llama, BF16)
    wrong = rms_norm_reference(x, w, EPS, 0.0, "fp32", out_dtype=BF16)     # = rounding to float32
    assert np.mean(bits(wrong) != bits(y)) > 0.05


# -- properties, bit for bit --------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_float32_residual_stream_is_rms_norm_of_the_float32_sum(dtype_name, mode):
    """fused(x, float32 residual) = (rms_norm_reference(x + r in float32, out_dtype=x's),
    x + r in float32): the sum is not rounded to x's dtype."""
    dtype = DTYPES[dtype_name]
    rng = np.random.default_rng(seed("stream", dtype_name, mode))
    for wd in WEIGHT_DTYPES:
        for offset in ((0.0,) if wd is None else (0.0, 1.0)):
            x, r = rand(rng, (16, 1024), dtype), rand(rng, (16, 1024), F32, 3.0)
            w = weight_of(rng, 1024, wd, offset)
            summed = x.astype(np.float32) + r
            for out in OUTS:
                y, s = fused_add_rms_norm_reference(x, r, w, EPS, offset, mode, out_dtype=out)
                assert s.dtype == F32
                np.testing.assert_array_equal(bits(s), bits(summed))
                want = rms_norm_reference(summed, w, EPS, offset, mode, out_dtype=dtype if out is None else out)
                np.testing.assert_array_equal(bits(y), bits(want), err_msg=f"{wd} {offset} {out}")
            # the rounded-to-x sum would give other results
            y_x, _ = fused_add_rms_norm_reference(x, r.astype(dtype), w, EPS, offset, mode)
            assert np.any(bits(y_x) != bits(fused_add_rms_norm_reference(x, r, w, EPS, offset, mode)[0]))


@pytest.mark.parametrize("fused", [False, True], ids=["rms_norm", "fused"])
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_out_dtype_is_one_rounding_of_the_float32_result(dtype_name, fused):
    """fp32 mode: y in O is y at float32 rounded once; llama with O = float32 rounds nothing
    (equals fp32 mode); out_dtype None is x's dtype, and positional calls are as before."""
    dtype = DTYPES[dtype_name]
    rng = np.random.default_rng(seed("once", dtype_name, fused))
    for wd in WEIGHT_DTYPES:
        x, r = rand(rng, (8, 640), dtype), rand(rng, (8, 640), dtype)
        w = weight_of(rng, 640, wd, 0.0)

        def run(mode, **kw):
            if fused:
                return fused_add_rms_norm_reference(x, r, w, EPS, 0.0, mode, **kw)[0]
            return rms_norm_reference(x, w, EPS, 0.0, mode, **kw)

        y32 = run("fp32", out_dtype=F32)
        assert y32.dtype == F32
        for out in (BF16, F16, F32):
            np.testing.assert_array_equal(bits(run("fp32", out_dtype=out)), bits(y32.astype(out)),
                                          err_msg=f"{wd} {out}")
        np.testing.assert_array_equal(bits(run("llama", out_dtype=F32)), bits(y32), err_msg=str(wd))
        for mode in MODES:
            np.testing.assert_array_equal(bits(run(mode)), bits(run(mode, out_dtype=dtype)))
        if dtype != F32:
            assert np.any(bits(y32.astype(dtype).astype(F32)) != bits(y32))


def direct_rms_norm(x, w, offset, mode, round_dtype, out):
    """The float32 steps written out: llama rounds x * inv_rms to ``round_dtype``."""
    one = np.float32(1)
    xf = x.astype(np.float32)
    r = one / np.sqrt(R.canonical_sum_of_squares(xf)[..., None] / np.float32(x.shape[-1]) + np.float32(EPS))
    n = xf * r
    if mode == "llama":
        n = n.astype(round_dtype).astype(np.float32)
    if w is not None:
        n = n * (w.astype(np.float32) + np.float32(offset) if offset else w.astype(np.float32))
    return n if out is None else n.astype(out)


@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_llama_rounds_to_the_output_dtype(dtype_name):
    """llama mode rounds x * inv_rms to O, not to x's dtype: the direct float32 steps bit for
    bit, and (for O coarser than x) visibly not the rounding to x's dtype."""
    dtype = DTYPES[dtype_name]
    rng = np.random.default_rng(seed("to O", dtype_name))
    for wd in (BF16, F16, F32):
        for out in (BF16, F16, F32):
            x, w = rand(rng, (32, 512), dtype), weight_of(rng, 512, wd, 0.0)
            y = rms_norm_reference(x, w, EPS, 0.0, "llama", out_dtype=out)
            np.testing.assert_array_equal(bits(y), bits(direct_rms_norm(x, w, 0.0, "llama", out, out)))
            if out != dtype and out != F32 and not (dtype == F16 and out == BF16):
                wrong = direct_rms_norm(x, w, 0.0, "llama", dtype, out)
                assert np.mean(bits(y) != bits(wrong)) > 0.01, (wd, out)


# -- the quantized fused form with a float32 residual ---------------------------------------------

@pytest.mark.parametrize("quant", [dict(), dict(group_size=128), dict(quant_dtype="int8"),
                                   dict(scale=np.array([0.02], np.float32))], ids=["token", "group", "int8", "static"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_quantized_fused_with_a_float32_residual(dtype_name, mode, quant):
    """residual_out is the float32 sum; q, scales quantize its normalized values, llama mode
    rounding x * inv_rms to x's dtype (as the unfused quantized form): the direct float32
    steps bit for bit, within the quant dtype's step of float64 torch, and in llama mode not
    the unfused form's call on the float32 sum (that would round to float32)."""
    dtype = DTYPES[dtype_name]
    rng = np.random.default_rng(seed("quant", dtype_name, mode, sorted(quant)))
    x, r = rand(rng, (6, 512), dtype), rand(rng, (6, 512), F32, 2.0)
    w = weight_of(rng, 512, BF16, 0.0)
    q, s, scales = fused_add_rms_norm_quant_reference(x, r, w, EPS, 0.0, mode, **quant)
    summed = x.astype(np.float32) + r
    assert s.dtype == F32
    np.testing.assert_array_equal(bits(s), bits(summed))
    y = direct_rms_norm(summed, w, 0.0, mode, dtype, None)
    qd = quant.get("quant_dtype", "float8_e4m3fn")
    g = quant.get("group_size")
    if "scale" in quant:
        want_scales = quant["scale"]
        want_q = quant_reference.quantize(y, want_scales.reshape(()), qd)
    elif g is None:
        want_scales = quant_reference.dynamic_scales(y, qd)
        want_q = quant_reference.quantize(y, want_scales, qd)
    else:
        grouped = y.reshape(6, 512 // g, g)
        want_scales = quant_reference.dynamic_scales(grouped, qd)
        want_q = quant_reference.quantize(grouped, want_scales, qd).reshape(y.shape)
        want_scales = want_scales[..., 0]
    np.testing.assert_array_equal(bits(q), bits(want_q))
    np.testing.assert_array_equal(scales, want_scales)
    # dequantized, against the float64 model: within a step of the quant dtype
    y64 = torch_rms_norm(to_torch(summed), w_prime64(w, 0.0), EPS, mode, dtype).numpy()
    sc = want_scales if g is None else np.repeat(want_scales, g, axis=-1)
    step = {"float8_e4m3fn": 2.0 ** -3, "int8": None}[qd]
    deq = q.astype(np.float32) * sc
    bound = sc * 0.51 + 1e-3 * np.abs(y64) if step is None else step * np.abs(y64) + sc * 2.0 ** -8
    if "scale" in quant:
        bound = np.where(np.abs(y64) > 448 * 0.02 * 0.99, np.inf, bound)   # saturated
    assert np.all(np.abs(deq - y64) <= bound)
    q_unfused, _ = rms_norm_quant_reference(summed, w, EPS, 0.0, mode, **quant)
    if mode == "fp32":
        np.testing.assert_array_equal(bits(q), bits(q_unfused))
    else:
        assert np.any(bits(q) != bits(q_unfused))


# -- the backward with dy in another dtype ------------------------------------------------------

def torch_grads(dy, x, w, offset):
    """(dx, dweight) of fp32-mode rms_norm by float64 autograd, and dx's row scale."""
    xt = to_torch(x).requires_grad_(True)
    wt = None if w is None else w_prime64(w, offset).requires_grad_(True)
    y = torch_rms_norm(xt, wt, EPS, "fp32", F32)
    leaves = [xt] + ([wt] if wt is not None else [])
    grads = [t.numpy() for t in torch.autograd.grad(y, leaves, grad_outputs=to_torch(dy))]
    return grads[0], (grads[1] if wt is not None else None)


def direct_dweight(dy, x, w, mode, round_dtype=None):
    """dweight's float32 steps: sum over rows of dy * xhat, xhat rounded in llama mode to
    ``round_dtype`` (None: dy's dtype, the contract's)."""
    xf, dyf = x.astype(np.float32), dy.astype(np.float32)
    r = np.float32(1) / np.sqrt(np.sum(xf * xf, axis=-1, keepdims=True, dtype=np.float32) / np.float32(x.shape[-1])
                                + np.float32(EPS))
    xhat = xf * r
    if mode == "llama":
        xhat = xhat.astype(dy.dtype if round_dtype is None else round_dtype).astype(np.float32)
    return np.sum((dyf * xhat).reshape(-1, x.shape[-1]), axis=0, dtype=np.float32).astype(w.dtype)


# (x dtype, dy dtype): dy in the forward's output dtype O, O != x's
DY_PAIRS = [(F32, BF16), (F32, F16), (BF16, F32), (F16, BF16), (BF16, F16)]


@pytest.mark.parametrize("xd, dyd", DY_PAIRS, ids=[f"x-{a.name}-dy-{b.name}" for a, b in DY_PAIRS])
def test_backward_with_dy_in_the_output_dtype(xd, dyd):
    """dx in x's dtype, against float64 autograd; dweight in the weight's dtype, its llama
    rounding of xhat to dy's dtype (bit for bit the direct steps, and visibly not x's)."""
    rng = np.random.default_rng(seed("dy", xd, dyd))
    for wd in WEIGHT_DTYPES:
        for offset in ((0.0,) if wd is None else (0.0, 1.0)):
            x = rand(rng, (48, 256), xd)
            dy = (rng.standard_normal((48, 256)) + 0.5 * x.astype(np.float64)).astype(dyd)
            w = weight_of(rng, 256, wd, offset)
            want_dx, want_dw = torch_grads(dy, x, w, offset)
            for mode in MODES:
                where = f"[w={wd}+{offset} {mode}]"
                dx, dw = rms_norm_backward_reference(dy, x, w, EPS, offset, mode)
                assert dx.dtype == xd and dx.shape == x.shape, where
                check_close(f"{where} dx", dx, want_dx, xd, np.max(np.abs(want_dx), axis=-1, keepdims=True))
                if w is None:
                    assert dw is None
                    continue
                assert dw.dtype == wd, where
                np.testing.assert_array_equal(bits(dw), bits(direct_dweight(dy, x, w, mode)), err_msg=where)
                if mode == "fp32":
                    check_close(f"{where} dweight", dw, want_dw, wd, np.max(np.abs(want_dw)))
                elif wd == F32:         # rounding xhat to x's dtype instead would show
                    assert np.any(bits(dw) != bits(direct_dweight(dy, x, w, mode, xd))), where


@pytest.mark.parametrize("dyd", [BF16, F16])
@pytest.mark.parametrize("with_dres", [False, True])
def test_fused_backward_on_a_float32_residual_stream(dyd, with_dres):
    """residual_out float32, dy 16-bit (y's dtype), d_residual_out float32: d_input is float32,
    rms_norm's dx at s plus d_residual_out in float32, rounded once; within float32 noise of
    float64 autograd (through s, plus d_residual_out)."""
    rng = np.random.default_rng(seed("fused dy", dyd, with_dres))
    for wd in WEIGHT_DTYPES:
        s = rand(rng, (32, 512), F32, 2.0)
        dy = rand(rng, (32, 512), dyd)
        dres = rand(rng, (32, 512), F32) if with_dres else None
        w = weight_of(rng, 512, wd, 0.0)
        for mode in MODES:
            d_input, dw = fused_add_rms_norm_backward_reference(dy, dres, s, w, EPS, 0.0, mode)
            assert d_input.dtype == F32 and d_input.shape == s.shape
            dx32, dw2 = rms_norm_backward_reference(dy, s, w, EPS, 0.0, mode)
            want_bits = dx32 if dres is None else dx32 + dres
            np.testing.assert_array_equal(bits(d_input), bits(want_bits))
            assert (dw is None) == (w is None)
            if w is not None:
                np.testing.assert_array_equal(bits(dw), bits(dw2))
                np.testing.assert_array_equal(bits(dw), bits(direct_dweight(dy, s, w, mode)))
            want_dx, _ = torch_grads(dy, s, w, 0.0)
            if dres is not None:
                want_dx = want_dx + dres.astype(np.float64)
            check_close(f"[{wd} {mode}] d_input", d_input, want_dx, F32,
                        np.max(np.abs(want_dx), axis=-1, keepdims=True))


def test_mixed_weight_dtypes_use_the_weight_as_float32():
    """A bfloat16 weight with float16 x (and the other pairs): the weight's values exactly, as
    a float32 weight of the same values would give."""
    rng = np.random.default_rng(9)
    for xd, wd in ((F16, BF16), (BF16, F16), (F32, BF16), (F16, F32)):
        x, w = rand(rng, (8, 256), xd), rand(rng, 256, wd, 0.5, 1.0)
        for mode in MODES:
            for offset in (0.0, 1.0):
                a = rms_norm_reference(x, w, EPS, offset, mode)
                b = rms_norm_reference(x, w.astype(F32), EPS, offset, mode)
                np.testing.assert_array_equal(bits(a), bits(b))
        assert a.dtype == xd
