"""QK norm + RoPE on the CPU: the NumPy path (``qk_norm_rope`` / ``qk_norm_rope_backward`` on
NumPy arrays, which run ``qk_norm_rope_reference`` and its backward) against an independent
float64 implementation written here with PyTorch (transformers' ``rotate_half`` and GPT-J's
``rotate_every_two``; angles from ``inv_freq`` as the models compute them).

- the forward over dtype x head_dim (64, 96, 128, 256) x rotary_dim (full, half) x NeoX / GPT-J
  x both conventions of angles, with the positions (ascending, random, repeated), the layout
  (views of a packed projection, separate arrays, in place, batched with transformers' (1, T,
  rotary_dim) angles) and the GQA ratio (1, 4, 8) taken by turns, and their full product for
  one case; llama mode bit for bit against a direct float32 implementation of the contract;
- the backward against float64 autograd of the same formula (dq, dk and both weights'
  gradients), llama mode's rounded xhat;
- properties exact in float32: the conventions agree, a zero angle is ``rms_norm``, the
  channels past rotary_dim are ``rms_norm``'s, out-of-range positions.
"""

import itertools
import zlib

import ml_dtypes
import numpy as np
import pytest
torch = pytest.importorskip("torch", reason="QK norm + RoPE reference tests: torch is not installed")

import cupy_rmsnorm as rn
from cupy_rmsnorm import _reference as R
from cupy_rmsnorm.ops.qk_rope import reference as qk_rope_reference

EPS = 1e-6
DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
HEAD_DIMS = (64, 96, 128, 256)
ROTARY = ("full", "half")
CONVENTIONS = ("cos_sin", "cache")
POSITIONS = ("ascending", "random", "repeated")
LAYOUTS = ("packed", "separate", "in_place", "batched")
GQA = (1, 4, 8)
K_HEADS = 2
TOKENS = 5
MAX_POSITION = 64
ULP = {"float32": 2.0 ** -23, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}
SPACING = {"float32": 2.0 ** -149, "float16": 2.0 ** -24, "bfloat16": 2.0 ** -133}   # near zero (subnormals)
# float32 arithmetic against float64, relative to the magnitudes that meet in an element (the
# sum of squares, rsqrt, the products of the rotation; the backward's sums and differences)
NOISE = 2e-5


def seed(*parts):
    return zlib.crc32(" ".join(map(str, parts)).encode())


def bits(a):
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.itemsize}")


# -- the case's arrays -------------------------------------------------------------------------------

def positions_of(kind, rng, shape):
    if kind == "ascending":
        return (np.arange(int(np.prod(shape))) + 3).reshape(shape)
    if kind == "random":
        return rng.integers(0, MAX_POSITION, size=shape)
    return np.full(shape, 11) if len(shape) == 1 else np.broadcast_to(np.arange(shape[-1]) % 2, shape).copy()


def frequencies(positions, rotary_dim, base=10000.0):
    """float64 angles (..., rotary_dim / 2) of the positions, as the models' rotary embeddings."""
    inv_freq = 1.0 / base ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    return np.asarray(positions, dtype=np.float64)[..., None] * inv_freq


def per_channel(half, is_neox):
    """(..., rotary_dim / 2) values of the pairs as (..., rotary_dim) values of the channels:
    transformers' duplicated halves (NeoX) or each repeated twice (GPT-J)."""
    return np.concatenate([half, half], axis=-1) if is_neox else np.repeat(half, 2, axis=-1)


class Case:
    """One call's arrays (NumPy) and keywords, and what the float64 implementation needs."""

    def __init__(self, dtype, head_dim, rotary, is_neox, convention, positions, layout, gqa, weight=0, mode="fp32"):
        rng = np.random.default_rng(seed(dtype, head_dim, rotary, is_neox, convention, positions, layout, gqa,
                                         weight, mode))
        dt = DTYPES[dtype]
        self.dtype, self.is_neox, self.mode, self.layout = dtype, is_neox, mode, layout
        d, rd = head_dim, head_dim if rotary == "full" else head_dim // 2
        hk, hq = K_HEADS, K_HEADS * gqa
        tokens = (2, TOKENS) if layout == "batched" else (TOKENS,)
        width = (hq + 2 * hk) * d
        self.qkv = (rng.standard_normal(tokens + (width,)) * 1.5 + 0.2).astype(np.float32).astype(dt)
        self.qkv_in = self.qkv.copy()
        if layout == "separate":
            q = np.ascontiguousarray(self.qkv[..., :hq * d]).reshape(tokens + (hq, d))
            k = np.ascontiguousarray(self.qkv[..., hq * d:(hq + hk) * d]).reshape(tokens + (hk, d))
        else:                                   # per-head views of the packed projection
            q = self.qkv[..., :hq * d].reshape(tokens + (hq, d))
            k = self.qkv[..., hq * d:(hq + hk) * d].reshape(tokens + (hk, d))
            assert np.shares_memory(q, self.qkv) and np.shares_memory(k, self.qkv)
        self.q, self.k = q, k
        self.q_in, self.k_in = q.copy(), k.copy()
        wdt = (dt, np.dtype(np.float32), None)[weight % 3]
        self.offset = 1.0 if weight % 2 and wdt is not None else 0.0
        self.qw = self.kw = None
        if wdt is not None:
            center = 0.0 if self.offset else 1.0
            self.qw = (center + 0.3 * rng.standard_normal(d)).astype(np.float32).astype(wdt)
            self.kw = (center + 0.3 * rng.standard_normal(d)).astype(np.float32).astype(wdt)
        table_dt = (np.dtype(np.float32), dt)[weight % 2]
        pos = positions_of(positions, rng, tokens)
        cache = np.concatenate([np.cos(frequencies(np.arange(MAX_POSITION), rd)),
                                np.sin(frequencies(np.arange(MAX_POSITION), rd))], axis=-1).astype(table_dt)
        self.cache_f64 = cache.astype(np.float64)
        self.pos = pos
        if convention == "cache":
            self.angles = dict(positions=pos.astype((np.int64, np.int32)[weight % 2]), cos_sin_cache=cache)
        else:                                   # transformers': per token, from the same rows
            rows = cache[pos]
            cos, sin = per_channel(rows[..., :rd // 2], is_neox), per_channel(rows[..., rd // 2:], is_neox)
            if layout == "batched" and positions != "random":
                cos, sin = cos[:1], sin[:1]     # (1, T, rotary_dim): the batch's one row of positions
                self.pos = np.broadcast_to(pos[:1], pos.shape)
                self.angles = dict(cos=cos, sin=sin)
            else:
                self.angles = dict(cos=cos, sin=sin)
        self.rotary_dim = rd

    def kwargs(self):
        kw = dict(self.angles, is_neox=self.is_neox, weight_offset=self.offset, casting_mode=self.mode)
        if self.layout == "in_place":
            kw.update(out_q=self.q, out_k=self.k)
        return kw

    def angles64(self):
        """float64 (cos, sin) per token and channel (tokens + (rotary_dim,))."""
        rows = self.cache_f64[self.pos]
        rd = self.rotary_dim
        return per_channel(rows[..., :rd // 2], self.is_neox), per_channel(rows[..., rd // 2:], self.is_neox)


# -- the float64 implementation ------------------------------------------------------------------

def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_every_two(x):
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def forward64(x, weight, offset, cos, sin, is_neox, eps=EPS, llama_dtype=None):
    """float64 torch: rmsnorm over head_dim (llama: x * inv_rms rounded to ``llama_dtype``), times
    the weight, then transformers' rotation of the first cos.shape[-1] channels."""
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if llama_dtype is not None:
        n = torch.from_numpy(n.detach().numpy().astype(np.float32).astype(llama_dtype).astype(np.float64))
    if weight is not None:
        n = n * (weight + offset)
    rd = cos.shape[-1]
    c, s = cos[..., None, :], sin[..., None, :]
    y = n[..., :rd]
    turned = rotate_half(y) if is_neox else rotate_every_two(y)
    return torch.cat((y * c + turned * s, n[..., rd:]), dim=-1)


def t64(a):
    return None if a is None else torch.from_numpy(np.asarray(a).astype(np.float64))


def paired(case, a, cos, sin):
    """Per element of ``a`` (..., heads, head_dim): |a[j] cos[j]| + |a[p] sin[j]|, the
    magnitudes that meet in a rotated element (|a| past rotary_dim)."""
    rd = case.rotary_dim
    partner, _ = qk_rope_reference._rope_pairs(rd, case.is_neox)
    scale = np.abs(a).copy()
    scale[..., :rd] = np.abs(a[..., :rd] * cos[..., None, :]) + np.abs(a[..., partner] * sin[..., None, :])
    return scale


def scale_of(case, x, weight):
    """The magnitudes that meet in each output element (see ``paired``) of the normalized head."""
    xf = x.astype(np.float64)
    y = xf / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + EPS)
    if weight is not None:
        y = y * np.abs(weight.astype(np.float64) + case.offset)
    return paired(case, y, *case.angles64())


def assert_close(got, want, scale, dtype, ulps=1.0, what=""):
    got, want = np.asarray(got).astype(np.float64), np.asarray(want, dtype=np.float64)
    tol = ulps * ULP[dtype] * scale + NOISE * scale + SPACING[dtype]
    bad = ~(np.abs(got - want) <= tol)
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.size} off, worst {np.max(np.abs(got - want) / tol):.3g} "
                           f"tolerances")


def check_forward(case):
    q_out, k_out = rn.qk_norm_rope(case.q, case.k, case.qw, case.kw, EPS, **case.kwargs())
    if case.layout == "in_place":
        assert q_out is case.q and k_out is case.k
        hq, hk, d = case.q.shape[-2], case.k.shape[-2], case.q.shape[-1]
        assert np.array_equal(bits(case.qkv[..., (hq + hk) * d:]), bits(case.qkv_in[..., (hq + hk) * d:]))  # v
    for got, x, w in ((q_out, case.q_in, case.qw), (k_out, case.k_in, case.kw)):
        assert got.dtype == x.dtype and got.shape == x.shape
        cos, sin = case.angles64()
        llama = DTYPES[case.dtype] if case.mode == "llama" else None
        want = forward64(t64(x), t64(w), case.offset, t64(cos), t64(sin), case.is_neox, llama_dtype=llama).numpy()
        # llama: x * inv_rms near a rounding midpoint may round the other way in float64
        assert_close(got, want, scale_of(case, x, w), case.dtype, ulps=1.0 if case.mode == "fp32" else 2.0,
                     what=f"{'q' if x is case.q_in else 'k'} forward")


# -- the forward -------------------------------------------------------------------------------------

def forward_grid():
    cases = []
    for i, (dtype, d, rotary, neox, conv) in enumerate(itertools.product(DTYPES, HEAD_DIMS, ROTARY, (True, False),
                                                                         CONVENTIONS)):
        cases.append((dtype, d, rotary, neox, conv, POSITIONS[i % 3], LAYOUTS[(i // 3) % 4], GQA[(i // 2) % 3], i))
    return cases


@pytest.mark.parametrize("dtype,head_dim,rotary,is_neox,convention,positions,layout,gqa,turn", forward_grid())
def test_forward_against_float64(dtype, head_dim, rotary, is_neox, convention, positions, layout, gqa, turn):
    check_forward(Case(dtype, head_dim, rotary, is_neox, convention, positions, layout, gqa, weight=turn))


@pytest.mark.parametrize("positions,layout,gqa", list(itertools.product(POSITIONS, LAYOUTS, GQA)))
@pytest.mark.parametrize("convention", CONVENTIONS)
def test_every_layout_positions_and_gqa(positions, layout, gqa, convention):
    check_forward(Case("bfloat16", 128, "full", True, convention, positions, layout, gqa, weight=4))


@pytest.mark.parametrize("dtype,head_dim,rotary,is_neox,convention", [
    ("bfloat16", 128, "full", True, "cache"), ("float16", 96, "half", True, "cos_sin"),
    ("bfloat16", 64, "half", False, "cache"), ("float32", 256, "full", False, "cos_sin")])
def test_llama_mode_against_float64(dtype, head_dim, rotary, is_neox, convention):
    check_forward(Case(dtype, head_dim, rotary, is_neox, convention, "random", "packed", 4, weight=0, mode="llama"))


def direct_float32(case, x, w):
    """The contract's steps in float32, written out (llama mode): n = round_T(x * inv_rms),
    y = n * w', then y[j] * c - y[p] * s (each product rounded), rounded once to T."""
    dt = DTYPES[case.dtype]
    xf = x.astype(np.float32)
    sumsq = R.canonical_sum_of_squares(xf)[..., None]
    inv_rms = np.float32(1) / np.sqrt(sumsq / np.float32(x.shape[-1]) + np.float32(EPS))
    n = (xf * inv_rms).astype(dt).astype(np.float32)
    wf = None if w is None else w.astype(np.float32)
    y = n if w is None else n * (wf + np.float32(case.offset) if case.offset else wf)
    cos, sin = qk_rope_reference.rope_angles(x.shape[:-2], case.rotary_dim, case.is_neox, **case.angles)
    out = y.copy()
    rd, half = case.rotary_dim, case.rotary_dim // 2
    for j in range(rd):
        if case.is_neox:
            p, first = (j + half, True) if j < half else (j - half, False)
        else:
            p, first = j ^ 1, j % 2 == 0
        a, b = y[..., j] * cos[..., None, j], y[..., p] * sin[..., None, j]
        out[..., j] = a - b if first else a + b
    return out.astype(dt)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("is_neox,convention", [(True, "cache"), (False, "cos_sin"), (True, "cos_sin")])
def test_llama_mode_bit_for_bit(dtype, is_neox, convention):
    case = Case(dtype, 96, "half", is_neox, convention, "random", "separate", 4, weight=3, mode="llama")
    q_out, k_out = rn.qk_norm_rope(case.q, case.k, case.qw, case.kw, EPS, **case.kwargs())
    assert np.array_equal(bits(q_out), bits(direct_float32(case, case.q, case.qw)))
    assert np.array_equal(bits(k_out), bits(direct_float32(case, case.k, case.kw)))


# -- the backward ------------------------------------------------------------------------------------

def backward_grid():
    cases = []
    for i, (dtype, d, rotary, neox, conv) in enumerate(itertools.product(DTYPES, (64, 96, 128), ROTARY, (True, False),
                                                                         CONVENTIONS)):
        cases.append((dtype, d, rotary, neox, conv, POSITIONS[i % 3], ("packed", "batched")[(i // 3) % 2],
                      GQA[(i // 2) % 3], i))
    return cases


@pytest.mark.parametrize("dtype,head_dim,rotary,is_neox,convention,positions,layout,gqa,turn", backward_grid())
def test_backward_against_float64_autograd(dtype, head_dim, rotary, is_neox, convention, positions, layout, gqa, turn):
    case = Case(dtype, head_dim, rotary, is_neox, convention, positions, layout, gqa, weight=turn)
    rng = np.random.default_rng(seed("dy", dtype, head_dim, turn))
    dt = DTYPES[dtype]
    dq_out = rng.standard_normal(case.q.shape).astype(np.float32).astype(dt)
    dk_out = rng.standard_normal(case.k.shape).astype(np.float32).astype(dt)
    kw = {k: v for k, v in case.kwargs().items() if not k.startswith("out_")}
    dq, dk, dqw, dkw = rn.qk_norm_rope_backward(dq_out, dk_out, case.q, case.k, case.qw, case.kw, EPS, **kw)
    cos, sin = (t64(a) for a in case.angles64())
    for x, w, do, dx, dw in ((case.q, case.qw, dq_out, dq, dqw), (case.k, case.kw, dk_out, dk, dkw)):
        xt = t64(x).requires_grad_()
        wt = None if w is None else t64(w).requires_grad_()
        out = forward64(xt, wt, case.offset, cos, sin, is_neox)
        grads = torch.autograd.grad(out, [t for t in (xt, wt) if t is not None], t64(do))
        assert dx.dtype == x.dtype and dx.shape == x.shape
        # magnitudes: the rotated gradient times the weight and r, and the mean term's
        xf = t64(x).numpy()
        r = 1 / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + EPS)
        wv = 1.0 if w is None else np.abs(w.astype(np.float64) + case.offset)
        dy = paired(case, do.astype(np.float64), np.abs(cos.numpy()), np.abs(sin.numpy()))   # |dy| at most
        g = dy * wv
        dx_scale = r * (g + np.mean(g * np.abs(xf) * r, axis=-1, keepdims=True) * np.abs(xf) * r)
        assert_close(dx, grads[0].numpy(), dx_scale, dtype, what="dx")
        if w is None:
            assert dw is None
        else:
            assert dw.dtype == w.dtype and dw.shape == w.shape
            dw_scale = np.sum((dy * np.abs(xf) * r).reshape(-1, x.shape[-1]), axis=0)
            assert_close(dw, grads[1].numpy(), dw_scale, w.dtype.name, what="dweight")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_backward_llama_mode(dtype):
    """llama mode changes only the weights' gradients: xhat rounded to q's dtype, as the forward
    multiplied it; dq and dk are fp32 mode's, bit for bit."""
    case = Case(dtype, 128, "half", True, "cache", "random", "packed", 4, weight=0)
    rng = np.random.default_rng(seed("llama dy", dtype))
    dt = DTYPES[dtype]
    dq_out = rng.standard_normal(case.q.shape).astype(np.float32).astype(dt)
    dk_out = rng.standard_normal(case.k.shape).astype(np.float32).astype(dt)
    args = (dq_out, dk_out, case.q, case.k, case.qw, case.kw, EPS)
    fp32 = rn.qk_norm_rope_backward(*args, **case.angles)
    llama = rn.qk_norm_rope_backward(*args, casting_mode="llama", **case.angles)
    assert np.array_equal(bits(fp32[0]), bits(llama[0])) and np.array_equal(bits(fp32[1]), bits(llama[1]))
    cos, sin = case.angles64()
    for x, do, dw in ((case.q, dq_out, llama[2]), (case.k, dk_out, llama[3])):
        xf = x.astype(np.float64)
        r = 1 / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + EPS)
        xhat = (xf * r).astype(np.float32).astype(dt).astype(np.float64)
        dy = rotate_back(do.astype(np.float64), cos, sin, case.rotary_dim)
        want = np.sum((dy * xhat).reshape(-1, x.shape[-1]), axis=0)
        scale = np.sum(np.abs(dy * xhat).reshape(-1, x.shape[-1]), axis=0)
        # xhat near a rounding midpoint may round the other way in float64: one step of it
        assert_close(dw, want, scale, dtype, ulps=2.0, what="llama dweight")


def rotate_back(do, cos, sin, rotary_dim):
    """float64 NeoX rotation by -theta of the first rotary_dim channels: (y1 c + y2 s, y2 c - y1 s)."""
    half = rotary_dim // 2
    c, s = cos[..., None, :half], sin[..., None, :half]
    a, b = do[..., :half], do[..., half:rotary_dim]
    return np.concatenate([a * c + b * s, b * c - a * s, do[..., rotary_dim:]], axis=-1)


# -- properties, exact in float32 --------------------------------------------------------------------

@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("is_neox", [True, False])
def test_the_conventions_agree(dtype, is_neox):
    """A cos_sin_cache and the per-token cos / sin made of its rows give the same bits."""
    case = Case(dtype, 128, "half", is_neox, "cache", "random", "packed", 4, weight=1)
    rd = case.rotary_dim
    rows = case.angles["cos_sin_cache"][case.angles["positions"]]
    cos, sin = per_channel(rows[..., :rd // 2], is_neox), per_channel(rows[..., rd // 2:], is_neox)
    a = rn.qk_norm_rope(case.q, case.k, case.qw, case.kw, is_neox=is_neox, weight_offset=case.offset, **case.angles)
    b = rn.qk_norm_rope(case.q, case.k, case.qw, case.kw, is_neox=is_neox, weight_offset=case.offset, cos=cos, sin=sin)
    for x, y in zip(a, b):
        assert np.array_equal(bits(x), bits(y))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mode", ["fp32", "llama"])
def test_zero_angle_and_unrotated_channels_are_rms_norm(dtype, mode):
    """cos = 1, sin = 0 leaves every head as rms_norm makes it (one rounding, the same tree);
    the channels past rotary_dim are rms_norm's whatever the angles."""
    case = Case(dtype, 128, "half", True, "cos_sin", "random", "separate", 4, weight=0)
    ones, zeros = np.ones((TOKENS, 64), np.float32), np.zeros((TOKENS, 64), np.float32)
    q_out, k_out = rn.qk_norm_rope(case.q, case.k, case.qw, case.kw, cos=ones, sin=zeros, casting_mode=mode)
    want_q, want_k = rn.rms_norm(case.q, case.qw, casting_mode=mode), rn.rms_norm(case.k, case.kw, casting_mode=mode)
    assert np.array_equal(bits(q_out), bits(want_q)) and np.array_equal(bits(k_out), bits(want_k))
    q_out, _ = rn.qk_norm_rope(case.q, case.k, case.qw, case.kw, casting_mode=mode, **case.angles)
    assert np.array_equal(bits(q_out[..., 64:]), bits(want_q[..., 64:]))
    assert not np.array_equal(bits(q_out[..., :64]), bits(want_q[..., :64]))


def test_rotation_preserves_the_norm():
    """A rotation in float64 terms: each pair keeps its length (float32 fp32 mode, 1e-6)."""
    case = Case("float32", 128, "full", False, "cache", "random", "separate", 1, weight=2)
    q_out, _ = rn.qk_norm_rope(case.q, case.k, None, None, is_neox=False, **case.angles)
    normed = rn.rms_norm(case.q)
    pair = lambda a: np.hypot(a[..., 0::2].astype(np.float64), a[..., 1::2].astype(np.float64))  # noqa: E731
    np.testing.assert_allclose(pair(q_out), pair(normed), rtol=1e-6, atol=1e-7)


def test_positions_outside_the_cache():
    """The NumPy path refuses them; the reference (what the kernels compute) gives NaN in the
    rotated channels of that token's heads only."""
    case = Case("bfloat16", 64, "half", True, "cache", "ascending", "separate", 1, weight=0)
    bad = case.angles["positions"].copy()
    bad[2] = MAX_POSITION
    with pytest.raises(ValueError, match=r"^positions must lie in \[0, 64\)"):
        rn.qk_norm_rope(case.q, case.k, case.qw, case.kw, positions=bad, cos_sin_cache=case.angles["cos_sin_cache"])
    bad[3] = -1
    with pytest.raises(ValueError, match=r"^positions must lie in \[0, 64\)"):
        rn.qk_norm_rope_backward(case.q, case.k, case.q, case.k, None, None, positions=bad,
                                 cos_sin_cache=case.angles["cos_sin_cache"])
    q_out, k_out = rn.qk_norm_rope_reference(case.q, case.k, case.qw, case.kw, positions=bad,
                                             cos_sin_cache=case.angles["cos_sin_cache"])
    good, _ = rn.qk_norm_rope(case.q, case.k, case.qw, case.kw, **case.angles)
    for t in range(TOKENS):
        rotated, rest = q_out[t, :, :32].astype(np.float32), q_out[t, :, 32:]
        if t in (2, 3):
            assert np.isnan(rotated).all() and np.isnan(k_out[t, :, :32].astype(np.float32)).all()
        else:
            assert np.array_equal(bits(q_out[t]), bits(good[t]))
        assert np.array_equal(bits(rest), bits(good[t, :, 32:]))


def test_int32_and_int64_positions_and_table_dtypes():
    """The positions' dtype changes nothing; a bfloat16 table is its float32 values."""
    case = Case("bfloat16", 64, "full", True, "cache", "random", "separate", 4, weight=0)
    pos, cache = case.angles["positions"], case.angles["cos_sin_cache"]
    a = rn.qk_norm_rope(case.q, case.k, case.qw, case.kw, positions=pos.astype(np.int32), cos_sin_cache=cache)
    b = rn.qk_norm_rope(case.q, case.k, case.qw, case.kw, positions=pos.astype(np.int64), cos_sin_cache=cache)
    c = rn.qk_norm_rope(case.q, case.k, case.qw, case.kw, positions=pos,
                        cos_sin_cache=cache.astype(ml_dtypes.bfloat16))
    d = rn.qk_norm_rope(case.q, case.k, case.qw, case.kw, positions=pos,
                        cos_sin_cache=cache.astype(ml_dtypes.bfloat16).astype(np.float32))
    assert all(np.array_equal(bits(x), bits(y)) for x, y in zip(a, b))
    assert all(np.array_equal(bits(x), bits(y)) for x, y in zip(c, d))


def test_empty_and_single_token_calls():
    q, k = np.zeros((0, 4, 64), np.float16), np.zeros((0, 2, 64), np.float16)
    cache = np.ones((8, 64), np.float32)
    q_out, k_out = rn.qk_norm_rope(q, k, None, None, positions=np.zeros(0, np.int64), cos_sin_cache=cache)
    assert q_out.shape == (0, 4, 64) and k_out.shape == (0, 2, 64)
    q1 = np.ones((4, 64), np.float16)                  # (heads, head_dim): one token, no leading axis
    q_out, _ = rn.qk_norm_rope(q1, q1[:2], None, None, positions=np.array(3), cos_sin_cache=cache)
    assert q_out.shape == (4, 64)
