"""The gated RMSNorm reference (cupy_rmsnorm/_reference.py: ``rms_norm_gated_reference`` and
``rms_norm_gated_backward_reference``) on the CPU.

- fp32 mode against float64 PyTorch: the forward against a float64 torch formula written here
  on its own (torch's silu / sigmoid, groups by reshape, both gate orders, offsets), and the
  backward (dx, dgate, dweight) against ``torch.autograd.grad`` of that formula, for every
  dtype x activation x gate order x group size (None, 64, 128, a quarter of the row) x hidden
  (64, 128, 255 ungrouped, 1024, 2048) x weight (None, x's dtype, float32, offset 1.0);
- llama mode bit for bit against a direct float32 implementation of the contract's steps
  (the roundings to O / dy's dtype, the rounded product and its rule);
- properties exact in float32: groups are separate calls, a saturated gate reduces to plain
  rms_norm, out_dtype is one rounding of the float32 result, and more.
"""

import zlib

import ml_dtypes
import numpy as np
import pytest
torch = pytest.importorskip("torch", reason="gated reference tests: torch is not installed")
F = torch.nn.functional
from helpers import DTYPES, HOST_ATOL, HOST_RTOL

from cupy_rmsnorm import _reference as R
from cupy_rmsnorm.ops.gated.reference import rms_norm_gated_backward_reference as gated_backward
from cupy_rmsnorm.ops.gated.reference import rms_norm_gated_reference as gated
from cupy_rmsnorm.ops.forward import reference as forward_reference
from cupy_rmsnorm.ops.gated import reference as gated_reference

EPS = 1e-6
F32 = np.dtype(np.float32)
BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
DTYPE_NAMES = ("float32", "float16", "bfloat16")
ACTIVATIONS = ("silu", "sigmoid")
ORDERS = (True, False)                  # norm_before_gate
ORDER_IDS = ("norm-gate", "gate-norm")
MODES = ("fp32", "llama")
# (label, weight dtype: "same" is x's, None: no weight, weight_offset)
WEIGHTS = (("noweight", None, 0.0), ("w-same", "same", 0.0), ("w-f32", "float32", 0.0), ("w-same-off1", "same", 1.0))
# float32 arithmetic against float64, relative to the largest magnitude of the result in its row
# (products and sums of a few thousand terms: ~1e-6; dx and dgate subtract, dweight sums rows)
NOISE = 2e-5


def bits(a):
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.itemsize}")


def seed(*parts):
    return zlib.crc32(" ".join(map(str, parts)).encode())


def group_sizes(hidden):
    """None, 64, 128 and a quarter of the row, those that divide it (255: None only)."""
    if hidden % 4:
        return [None]
    out = [None]
    for g in (64, 128, hidden // 4):
        if g <= hidden and hidden % g == 0 and g not in out:
            out.append(g)
    return out


def hidden_groups():
    return [(h, g) for h in (64, 128, 255, 1024, 2048) for g in group_sizes(h)]


def inputs(rng, shape, dtype, wkind, weight_offset):
    """x, gate, a weight (or None) and dy, random and never zero. dy leans on x, so that the
    mean terms of the backward (c) matter."""
    x = rng.standard_normal(shape) * 1.5 + 0.1
    gate = rng.standard_normal(shape) * 2.0
    dy = rng.standard_normal(shape) + 0.5 * x
    w = None
    if wkind is not None:
        wd = dtype if wkind == "same" else np.dtype(wkind)
        w = (rng.standard_normal(shape[-1]) * 0.5 + (0.0 if weight_offset else 1.0)).astype(wd)
    x, gate = x.astype(dtype), gate.astype(dtype)
    for a in (x, gate, w):
        assert a is None or np.all(a.astype(np.float32) != 0)
    return x, gate, w, dy


def w_prime(w, weight_offset):
    """w' = w + weight_offset, added in float32 (the contract), as float64; None stays None."""
    if w is None:
        return None
    w32 = w.astype(np.float32)
    return (w32 + np.float32(weight_offset) if weight_offset else w32).astype(np.float64)


def t64(a):
    return torch.from_numpy(np.asarray(a).astype(np.float64))


# -- the float64 torch model, independent of the reference -------------------------------------

def torch_gated(x, z, w, eps, g, norm_before_gate, activation):
    """float64 tensors in, y out: rmsnorm(x) * w' * act(z), or rmsnorm(x * act(z)) * w', each
    group of g consecutive elements normalized on its own; w the offset weight w' or None."""
    a = F.silu(z) if activation == "silu" else torch.sigmoid(z)
    grouped = x.shape[:-1] + (x.shape[-1] // g, g)
    v = x.reshape(grouped) if norm_before_gate else (x * a).reshape(grouped)
    n = (v * torch.rsqrt(v.square().mean(dim=-1, keepdim=True) + eps)).reshape(x.shape)
    if w is not None:
        n = n * w
    return n * a if norm_before_gate else n


def torch_forward_and_grads(x, gate, w, dy, weight_offset, g, norm_before_gate, activation):
    """(y, dx, dgate, dweight) in float64 (numpy), dweight None without a weight."""
    xt = t64(x).requires_grad_(True)
    zt = t64(gate).requires_grad_(True)
    wt = None if w is None else torch.from_numpy(w_prime(w, weight_offset)).requires_grad_(True)
    y = torch_gated(xt, zt, wt, EPS, g, norm_before_gate, activation)
    leaves = [xt, zt] + ([wt] if wt is not None else [])
    grads = torch.autograd.grad(y, leaves, grad_outputs=t64(dy))
    out = [y.detach().numpy()] + [t.numpy() for t in grads]
    return out if wt is not None else out + [None]


def check_close(where, got, want, dtype, scale):
    """got (in dtype) within two ulps of want plus dtype's slack near zero, plus float32
    noise relative to ``scale`` (broadcast against want)."""
    name = np.dtype(dtype).name
    g = got.astype(np.float64)
    tol = HOST_RTOL[name] * np.abs(want) + HOST_ATOL[name] + NOISE * scale
    bad = ~(np.abs(g - want) <= tol)
    if bad.any():
        i = np.flatnonzero(bad.reshape(-1))[0]
        raise AssertionError(f"{where}: {int(bad.sum())} of {bad.size} off; first at flat {i}: "
                             f"got {g.reshape(-1)[i]!r}, want {want.reshape(-1)[i]!r}, tol {tol.reshape(-1)[i]!r}")


def row_max(a):
    return np.max(np.abs(a), axis=-1, keepdims=True)


@pytest.mark.parametrize("norm_before_gate", ORDERS, ids=ORDER_IDS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_fp32_mode_matches_float64_torch(dtype_name, activation, norm_before_gate):
    """Forward and backward (dx, dgate, dweight) of every hidden x group size x weight."""
    dtype = DTYPES[dtype_name]
    rng = np.random.default_rng(seed("torch", dtype_name, activation, norm_before_gate))
    cases = 0
    for hidden, g in hidden_groups():
        for label, wkind, offset in WEIGHTS:
            where = f"[hidden={hidden} group={g} {label}]"
            x, gate, w, dy = inputs(rng, (2, 3, hidden), dtype, wkind, offset)
            dy = dy.astype(dtype)                       # dy in the forward's output dtype
            kw = dict(group_size=g, norm_before_gate=norm_before_gate, activation=activation)
            y = gated(x, gate, w, EPS, offset, "fp32", **kw)
            dx, dgate, dw = gated_backward(dy, x, gate, w, EPS, offset, "fp32", **kw)
            want_y, want_dx, want_dgate, want_dw = torch_forward_and_grads(
                x, gate, w, dy, offset, hidden if g is None else g, norm_before_gate, activation)
            assert y.dtype == dtype and y.shape == x.shape, where
            assert dx.dtype == dtype and dgate.dtype == dtype and dx.shape == dgate.shape == x.shape, where
            check_close(f"{where} y", y, want_y, dtype, 0.0)
            check_close(f"{where} dx", dx, want_dx, dtype, row_max(want_dx))
            check_close(f"{where} dgate", dgate, want_dgate, dtype, row_max(want_dgate))
            if w is None:
                assert dw is None, where
            else:
                assert dw.dtype == w.dtype and dw.shape == w.shape, where
                check_close(f"{where} dweight", dw, want_dw, w.dtype, np.max(np.abs(want_dw)))
            cases += 1
    assert cases == 4 * 16


def test_the_float64_check_sees_a_wrong_group_size_or_activation():
    """The comparison above is tight enough to catch a kernel-sized mistake: normalizing the
    whole row for groups of 64, or the other activation."""
    rng = np.random.default_rng(3)
    x, gate, w, dy = inputs(rng, (4, 256), F32, "float32", 0.0)
    want_y, want_dx, _, _ = torch_forward_and_grads(x, gate, w, dy, 0.0, 64, True, "silu")
    with pytest.raises(AssertionError):
        check_close("y", gated(x, gate, w, EPS, group_size=None), want_y, F32, 0.0)
    with pytest.raises(AssertionError):
        check_close("y", gated(x, gate, w, EPS, group_size=64, activation="sigmoid"), want_y, F32, 0.0)
    check_close("y", gated(x, gate, w, EPS, group_size=64), want_y, F32, 0.0)
    with pytest.raises(AssertionError):
        dx = gated_backward(dy.astype(F32), x, gate, w, EPS, group_size=None)[0]
        check_close("dx", dx, want_dx, F32, row_max(want_dx))


# -- llama mode: the roundings, bit for bit -------------------------------------------------------

def direct_forward(x, gate, w, eps, offset, mode, g, norm_before_gate, activation, out):
    """The contract's steps in float32, written out group by group (slices of the row)."""
    out = np.dtype(out)
    hidden = x.shape[-1]
    g = hidden if g is None else g
    one = np.float32(1)
    xf, zf = x.astype(np.float32), gate.astype(np.float32)
    s = one / (one + np.exp(-zf))
    act = zf * s if activation == "silu" else s
    if w is None:
        wp = np.ones(hidden, np.float32)
    else:
        wp = w.astype(np.float32) + np.float32(offset) if offset != 0 else w.astype(np.float32)
    round_product = mode == "llama" and w is not None and w.dtype == out and offset == 0
    y = np.empty(x.shape, np.float32)
    for k in range(hidden // g):
        cols = slice(k * g, (k + 1) * g)
        a = act[..., cols]
        v = xf[..., cols] if norm_before_gate else xf[..., cols] * a
        r = one / np.sqrt(R.canonical_sum_of_squares(v)[..., None] / np.float32(g) + np.float32(eps))
        n = v * r
        if mode == "llama":
            n = n.astype(out).astype(np.float32)
        p = n * wp[cols]
        if norm_before_gate:
            if round_product:
                p = p.astype(out).astype(np.float32)
            p = p * a
        y[..., cols] = p
    return y.astype(out)


def direct_backward(dy, x, gate, w, eps, offset, mode, g, norm_before_gate, activation):
    """The contract's backward steps in float32, group by group; roundings to dy's dtype."""
    hidden = x.shape[-1]
    g = hidden if g is None else g
    D = dy.dtype
    one = np.float32(1)
    xf, zf, dyf = x.astype(np.float32), gate.astype(np.float32), dy.astype(np.float32)
    s = one / (one + np.exp(-zf))
    if activation == "silu":
        act, dact = zf * s, s * (one + zf * (one - s))
    else:
        act, dact = s, s * (one - s)
    wp = None if w is None else (w.astype(np.float32) + np.float32(offset) if offset != 0 else w.astype(np.float32))
    round_product = mode == "llama" and w is not None and w.dtype == D and offset == 0

    def rnd(v):
        return v.astype(D).astype(np.float32) if mode == "llama" else v

    dx, dgate, terms = (np.empty(x.shape, np.float32) for _ in range(3))
    for k in range(hidden // g):
        c_ = slice(k * g, (k + 1) * g)
        a, da, d, xs = act[..., c_], dact[..., c_], dyf[..., c_], xf[..., c_]
        gw = d if wp is None else d * wp[c_]
        if norm_before_gate:
            r = one / np.sqrt(np.sum(xs * xs, axis=-1, keepdims=True, dtype=np.float32) / np.float32(g)
                              + np.float32(eps))
            xhat = xs * r
            gx = gw * a
            c = np.sum(gx * xhat, axis=-1, keepdims=True, dtype=np.float32) / np.float32(g)
            dx[..., c_] = r * (gx - xhat * c)
            p = rnd(xhat) if wp is None else rnd(xhat) * wp[c_]
            if round_product:
                p = p.astype(D).astype(np.float32)
            dgate[..., c_] = d * p * da
            terms[..., c_] = d * a * rnd(xhat)
        else:
            h = xs * a
            r = one / np.sqrt(np.sum(h * h, axis=-1, keepdims=True, dtype=np.float32) / np.float32(g)
                              + np.float32(eps))
            hhat = h * r
            c = np.sum(gw * hhat, axis=-1, keepdims=True, dtype=np.float32) / np.float32(g)
            dh = r * (gw - hhat * c)
            dx[..., c_] = dh * a
            dgate[..., c_] = dh * xs * da
            terms[..., c_] = d * rnd(hhat)
    dw = None if w is None else np.sum(terms.reshape(-1, hidden), axis=0, dtype=np.float32).astype(w.dtype)
    return dx.astype(x.dtype), dgate.astype(gate.dtype), dw


LLAMA_WEIGHTS = (("noweight", None, 0.0), ("w-same", "same", 0.0), ("w-f32", "float32", 0.0),
                 ("w-same-off1", "same", 1.0), ("w-bf16", "bfloat16", 0.0), ("w-f16", "float16", 0.0))


@pytest.mark.parametrize("norm_before_gate", ORDERS, ids=ORDER_IDS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_llama_mode_is_the_direct_float32_steps_bit_for_bit(dtype_name, activation, norm_before_gate):
    """Forward and backward, for out_dtype None / bfloat16 / float16 / float32 (dy in O), with
    weights in every float dtype: the roundings to O (not x's dtype), and the rounded product
    exactly when the weight's dtype is O and the offset 0."""
    dtype = DTYPES[dtype_name]
    rng = np.random.default_rng(seed("llama", dtype_name, activation, norm_before_gate))
    for hidden, g in ((256, None), (256, 64), (255, None)):
        for label, wkind, offset in LLAMA_WEIGHTS:
            for out in (None, BF16, F16, F32):
                where = f"[hidden={hidden} group={g} {label} out={out}]"
                x, gate, w, dy = inputs(rng, (5, hidden), dtype, wkind, offset)
                O = dtype if out is None else out
                dy = dy.astype(O)
                kw = dict(group_size=g, norm_before_gate=norm_before_gate, activation=activation)
                y = gated(x, gate, w, EPS, offset, "llama", out_dtype=out, **kw)
                want = direct_forward(x, gate, w, EPS, offset, "llama", g, norm_before_gate, activation, O)
                assert y.dtype == O, where
                np.testing.assert_array_equal(bits(y), bits(want), err_msg=where)
                got = gated_backward(dy, x, gate, w, EPS, offset, "llama", **kw)
                exp = direct_backward(dy, x, gate, w, EPS, offset, "llama", g, norm_before_gate, activation)
                for name, a, b in zip(("dx", "dgate", "dweight"), got, exp):
                    if b is None:
                        assert a is None, where
                    else:
                        assert a.dtype == b.dtype, (where, name)
                        np.testing.assert_array_equal(bits(a), bits(b), err_msg=f"{where} {name}")


@pytest.mark.parametrize("norm_before_gate", ORDERS, ids=ORDER_IDS)
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_fp32_mode_is_the_direct_float32_steps_bit_for_bit(dtype_name, norm_before_gate):
    dtype = DTYPES[dtype_name]
    rng = np.random.default_rng(seed("fp32 direct", dtype_name, norm_before_gate))
    for activation in ACTIVATIONS:
        for label, wkind, offset in LLAMA_WEIGHTS:
            x, gate, w, dy = inputs(rng, (5, 512), dtype, wkind, offset)
            dy = dy.astype(dtype)
            kw = dict(group_size=128, norm_before_gate=norm_before_gate, activation=activation)
            y = gated(x, gate, w, EPS, offset, "fp32", **kw)
            want = direct_forward(x, gate, w, EPS, offset, "fp32", 128, norm_before_gate, activation, dtype)
            np.testing.assert_array_equal(bits(y), bits(want), err_msg=label)
            got = gated_backward(dy, x, gate, w, EPS, offset, "fp32", **kw)
            exp = direct_backward(dy, x, gate, w, EPS, offset, "fp32", 128, norm_before_gate, activation)
            for a, b in zip(got, exp):
                assert (a is None) == (b is None)
                if b is not None:
                    np.testing.assert_array_equal(bits(a), bits(b), err_msg=label)


# (x dtype, weight dtype, weight_offset, out_dtype, rounds the product?)
PRODUCT_RULE = [
    (BF16, BF16, 0.0, None, True),
    (F16, F16, 0.0, None, True),
    (BF16, BF16, 1.0, None, False),          # an offset weight is a float32 w'
    (BF16, F32, 0.0, None, False),           # a float32 weight: HF's product is float32
    (F16, BF16, 0.0, BF16, True),            # the weight's dtype is O, not x's
    (BF16, BF16, 0.0, F16, False),
]


@pytest.mark.parametrize("xd, wd, offset, out, rounds", PRODUCT_RULE)
def test_the_rounded_product_rule(xd, wd, offset, out, rounds):
    """llama mode, norm before gate: the reference rounds n * w' to O exactly when the rule
    says so, and that rounding shows in the result (it matches the direct steps with that
    choice and not with the other)."""
    rng = np.random.default_rng(seed("product", xd, wd, offset, out))
    x, gate, w, dy = inputs(rng, (64, 256), xd, "same", offset)
    w = w.astype(wd)
    O = xd if out is None else out
    y = gated(x, gate, w, EPS, offset, "llama", out_dtype=out)
    with_rule = direct_forward(x, gate, w, EPS, offset, "llama", None, True, "silu", O)
    # the other choice: the same steps with the weight in a dtype that flips the rule
    other_w = w.astype(F32) if rounds else w
    flipped = _direct_with_product(x, gate, other_w, offset, O, not rounds)
    np.testing.assert_array_equal(bits(y), bits(with_rule))
    assert np.mean(bits(y) != bits(flipped)) > 0.005
    _, dgate, _ = gated_backward(dy.astype(O), x, gate, w, EPS, offset, "llama")
    _, want_dgate, _ = direct_backward(dy.astype(O), x, gate, w, EPS, offset, "llama", None, True, "silu")
    np.testing.assert_array_equal(bits(dgate), bits(want_dgate))


def _direct_with_product(x, gate, w, offset, O, round_product):
    """norm before gate, silu, llama, no groups, with the product's rounding forced."""
    one = np.float32(1)
    xf, zf = x.astype(np.float32), gate.astype(np.float32)
    act = zf * (one / (one + np.exp(-zf)))
    r = one / np.sqrt(R.canonical_sum_of_squares(xf)[..., None] / np.float32(x.shape[-1]) + np.float32(EPS))
    n = (xf * r).astype(O).astype(np.float32)
    p = n * R.offset_weight(w, offset)
    if round_product:
        p = p.astype(O).astype(np.float32)
    return (p * act).astype(O)


@pytest.mark.parametrize("norm_before_gate", ORDERS, ids=ORDER_IDS)
def test_llama_roundings_change_bfloat16_results(norm_before_gate):
    """The llama roundings are visible (an ulp here and there) and bounded (two ulps)."""
    rng = np.random.default_rng(seed("visible", norm_before_gate))
    x, gate, w, dy = inputs(rng, (64, 512), BF16, "same", 0.0)
    kw = dict(norm_before_gate=norm_before_gate)
    ya, yb = gated(x, gate, w, EPS, 0.0, "llama", **kw), gated(x, gate, w, EPS, 0.0, "fp32", **kw)
    assert np.mean(bits(ya) != bits(yb)) > 0.05
    ulps = np.abs(bits(ya).astype(np.int64) - bits(yb).astype(np.int64))
    assert ulps.max() <= 2
    dwa = gated_backward(dy.astype(BF16), x, gate, w, EPS, 0.0, "llama", **kw)[2]
    dwb = gated_backward(dy.astype(BF16), x, gate, w, EPS, 0.0, "fp32", **kw)[2]
    assert np.any(bits(dwa) != bits(dwb))


# -- properties exact in float32 ------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("norm_before_gate", ORDERS, ids=ORDER_IDS)
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_groups_are_separate_calls(dtype_name, norm_before_gate, mode):
    """group_size g is the row split into g-wide pieces, each a call of its own with its slice
    of the weight: forward and backward (dweight too), bit for bit."""
    dtype = DTYPES[dtype_name]
    rng = np.random.default_rng(seed("split", dtype_name, norm_before_gate, mode))
    for activation in ACTIVATIONS:
        for hidden, g in ((512, 128), (1024, 256), (192, 64)):
            x, gate, w, dy = inputs(rng, (3, 4, hidden), dtype, "same", 0.0)
            dy = dy.astype(dtype)
            kw = dict(norm_before_gate=norm_before_gate, activation=activation)
            y = gated(x, gate, w, EPS, 0.0, mode, group_size=g, **kw)
            dx, dgate, dw = gated_backward(dy, x, gate, w, EPS, 0.0, mode, group_size=g, **kw)
            pieces = [slice(k, k + g) for k in range(0, hidden, g)]
            y_parts = [gated(x[..., c], gate[..., c], w[c], EPS, 0.0, mode, **kw) for c in pieces]
            b_parts = [gated_backward(dy[..., c], x[..., c], gate[..., c], w[c], EPS, 0.0, mode, **kw)
                       for c in pieces]
            np.testing.assert_array_equal(bits(y), bits(np.concatenate(y_parts, axis=-1)))
            for i, got in enumerate((dx, dgate, dw)):
                want = np.concatenate([p[i] for p in b_parts], axis=-1)
                np.testing.assert_array_equal(bits(got), bits(want), err_msg=("dx", "dgate", "dweight")[i])
            # and it is not the ungrouped result
            assert np.any(bits(y) != bits(gated(x, gate, w, EPS, 0.0, mode, **kw)))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_saturated_gates_reduce_to_rms_norm(dtype_name, mode):
    """At z = 30, sigmoid(z) is exactly 1 in float32 and silu(z) exactly 30:
    - gate before norm, silu: rms_norm of the float32 x * 30, in x's dtype;
    - sigmoid, either order: rms_norm of x;
    - norm before gate, silu, no weight: rms_norm of x with a weight of 30 (n * 30)."""
    dtype = DTYPES[dtype_name]
    rng = np.random.default_rng(seed("saturated", dtype_name, mode))
    for hidden, g in ((256, None), (1000, None), (512, 128)):
        for label, wkind, offset in LLAMA_WEIGHTS:
            x, _, w, _ = inputs(rng, (6, hidden), dtype, wkind, offset)
            z = np.full(x.shape, 30, dtype)
            assert gated_reference._activation(np.float32(30), "sigmoid")[0] == 1 and gated_reference._activation(np.float32(30), "silu")[0] == 30

            def plain(v, weight):
                """rms_norm per group of v (float32 values), y in x's dtype."""
                if g is None:
                    return forward_reference.rms_norm_reference(v, weight, EPS, offset, mode, out_dtype=dtype)
                parts = [forward_reference.rms_norm_reference(v[..., k:k + g], None if weight is None else weight[k:k + g],
                                              EPS, offset, mode, out_dtype=dtype) for k in range(0, hidden, g)]
                return np.concatenate(parts, axis=-1)

            where = f"[{hidden} {g} {label}]"
            got = gated(x, z, w, EPS, offset, mode, group_size=g, norm_before_gate=False)
            want = plain(x.astype(np.float32) * np.float32(30), w)
            np.testing.assert_array_equal(bits(got), bits(want), err_msg=f"silu gate-norm {where}")
            for order in ORDERS:
                got = gated(x, z, w, EPS, offset, mode, group_size=g, norm_before_gate=order, activation="sigmoid")
                np.testing.assert_array_equal(bits(got), bits(plain(x, w)), err_msg=f"sigmoid {order} {where}")
            if w is None:
                got = gated(x, z, None, EPS, 0.0, mode, group_size=g)
                np.testing.assert_array_equal(bits(got), bits(plain(x, np.full(hidden, 30, np.float32))),
                                              err_msg=f"silu norm-gate {where}")


@pytest.mark.parametrize("norm_before_gate", ORDERS, ids=ORDER_IDS)
def test_closed_gates_give_zeros(norm_before_gate):
    """sigmoid(-200) is 0 in float32 (exp overflows to inf, quietly): y is all zeros."""
    rng = np.random.default_rng(5)
    x, _, w, dy = inputs(rng, (4, 128), BF16, "same", 0.0)
    z = np.full(x.shape, -200, BF16)
    with np.errstate(all="raise"):
        y = gated(x, z, w, EPS, activation="sigmoid", norm_before_gate=norm_before_gate)
        dx, dgate, dw = gated_backward(dy.astype(BF16), x, z, w, EPS, activation="sigmoid",
                                       norm_before_gate=norm_before_gate)
    for a in (y, dx, dgate, dw):
        assert np.all(a.astype(np.float32) == 0)


@pytest.mark.parametrize("norm_before_gate", ORDERS, ids=ORDER_IDS)
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_out_dtype_is_one_rounding_of_the_float32_result(dtype_name, norm_before_gate):
    """fp32 mode: y in O is y in float32 rounded once; llama mode with O = float32 has nothing
    to round (a float32 weight's product included), so it equals fp32 mode; out_dtype None is
    x's dtype."""
    dtype = DTYPES[dtype_name]
    rng = np.random.default_rng(seed("out", dtype_name, norm_before_gate))
    for label, wkind, offset in LLAMA_WEIGHTS:
        x, gate, w, _ = inputs(rng, (8, 384), dtype, wkind, offset)
        kw = dict(norm_before_gate=norm_before_gate, group_size=128)
        y32 = gated(x, gate, w, EPS, offset, "fp32", out_dtype=np.float32, **kw)
        assert y32.dtype == F32
        for out in (BF16, F16, F32):
            np.testing.assert_array_equal(bits(gated(x, gate, w, EPS, offset, "fp32", out_dtype=out, **kw)),
                                          bits(y32.astype(out)), err_msg=f"{label} {out}")
        np.testing.assert_array_equal(bits(gated(x, gate, w, EPS, offset, "llama", out_dtype="float32", **kw)),
                                      bits(y32), err_msg=label)
        np.testing.assert_array_equal(bits(gated(x, gate, w, EPS, offset, "fp32", **kw)),
                                      bits(gated(x, gate, w, EPS, offset, "fp32", out_dtype=dtype, **kw)))
        if dtype != F32:       # the float32 result really is finer than x's dtype
            assert np.any(bits(y32.astype(dtype).astype(F32)) != bits(y32))


@pytest.mark.parametrize("norm_before_gate", ORDERS, ids=ORDER_IDS)
def test_fp32_mode_backward_reads_dy_by_value(norm_before_gate):
    """fp32 mode rounds nothing to dy's dtype: dy in bfloat16 or the same values in float32
    give the same bits; llama mode rounds to dy's dtype, so there they differ."""
    rng = np.random.default_rng(seed("dy", norm_before_gate))
    x, gate, w, dy = inputs(rng, (16, 256), F32, "float32", 0.0)
    dy16 = dy.astype(BF16)
    kw = dict(norm_before_gate=norm_before_gate)
    a = gated_backward(dy16, x, gate, w, EPS, **kw)
    b = gated_backward(dy16.astype(F32), x, gate, w, EPS, **kw)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(bits(u), bits(v))
    la = gated_backward(dy16, x, gate, w, EPS, 0.0, "llama", **kw)
    lb = gated_backward(dy16.astype(F32), x, gate, w, EPS, 0.0, "llama", **kw)
    assert np.any(bits(la[2]) != bits(lb[2]))
    np.testing.assert_array_equal(bits(la[0]), bits(lb[0]))      # dx does not round


def test_dtypes_and_shapes_of_the_results():
    """dx in x's dtype, dgate in the gate's, dweight in the weight's; leading axes kept."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 3, 128)).astype(F16)
    gate = rng.standard_normal((2, 3, 128)).astype(F32)
    w = (rng.standard_normal(128) + 1).astype(BF16)
    y = gated(x, gate, w, EPS, group_size=64)
    assert y.dtype == F16 and y.shape == x.shape
    dx, dgate, dw = gated_backward(y, x, gate, w, EPS, group_size=64)
    assert (dx.dtype, dgate.dtype, dw.dtype) == (F16, F32, BF16)
    assert dx.shape == dgate.shape == x.shape and dw.shape == (128,)
    assert gated_backward(y, x, gate, None, EPS)[2] is None


def test_bad_arguments_are_refused():
    x = np.ones((2, 96), np.float32)
    with pytest.raises(ValueError, match="group_size"):
        gated(x, x, group_size=64)
    with pytest.raises(ValueError, match="group_size"):
        gated_backward(x, x, x, group_size=0)
    with pytest.raises(ValueError, match="activation"):
        gated(x, x, activation="gelu")
    with pytest.raises(ValueError, match="gate"):
        gated(x, x[:, :48])


@pytest.mark.filterwarnings("error")
def test_non_finite_values_stay_quiet_and_in_their_group():
    """inf / NaN in one element: no warning; the other groups and rows are untouched."""
    rng = np.random.default_rng(7)
    x, gate, w, dy = inputs(rng, (3, 256), F32, "float32", 0.0)
    for bad in (np.nan, np.inf):
        xb = x.copy()
        xb[1, 5] = bad
        for order in ORDERS:
            y = gated(xb, gate, w, EPS, group_size=128, norm_before_gate=order)
            ref = gated(x, gate, w, EPS, group_size=128, norm_before_gate=order)
            keep = np.ones(y.shape, bool)
            keep[1, :128] = False
            np.testing.assert_array_equal(bits(y[keep]), bits(ref[keep]))
            assert not np.all(np.isfinite(y[1, :128]))
            dx, dgate, _ = gated_backward(dy.astype(F32), xb, gate, w, EPS, group_size=128, norm_before_gate=order)
            assert np.all(np.isfinite(dx[keep])) and np.all(np.isfinite(dgate[keep]))
