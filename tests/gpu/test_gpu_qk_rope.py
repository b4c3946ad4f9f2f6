"""qk_norm_rope and its backward on the GPU (CuPy arrays), against the NumPy reference (the
contract, checked against float64 on the CPU by tests/cpu/test_reference_qk_rope.py): every
dtype x head_dim (64, 80, 96, 128, 256, 512) x rotary_dim (full, half) x NeoX / GPT-J x both
conventions of angles, with the layout (views of a packed projection, separate arrays, in
place, rows one element off the vector grid, batched tokens with transformers' broadcast
angles), the positions and the GQA ratio taken by turns; every plan gives the same bits; in
place on the packed projection; positions outside the cache; the backward, its bits run after
run; repeated calls through the signature cache; torch tensors on the direct path."""

import itertools

import ml_dtypes
import numpy as np
import pytest
from helpers import gpu_missing, seed

reason = gpu_missing()
pytestmark = pytest.mark.skipif(reason is not None, reason=f"QK norm + RoPE GPU test: {reason}")
if reason is None:
    import cupy as cp
    from gpu_reference import to_device, to_host

    import cupy_rmsnorm as rn
    from cupy_rmsnorm import _cache, _driver

DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
HEAD_DIMS = (64, 80, 96, 128, 256, 512)
LAYOUTS = ("packed", "separate", "in_place", "offset", "batched")
POSITIONS = ("ascending", "random", "repeated")
GQA = (1, 4, 8)
K_HEADS, TOKENS, MAX_POSITION, EPS = 2, 37, 4096, 1e-6
# against the NumPy reference: the kernels' rsqrtf and the float32 sums' order move a value by
# float32 ulps before its one rounding, so an element is the reference's or one unit away (ULP of
# |want|), plus float32 noise relative to the head's largest magnitude (a rotation may cancel)
ULP = {"float32": 2.0 ** -23, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}
NOISE = {"float32": 1e-5, "float16": 1e-5, "bfloat16": 1e-5}
# the backward's dx and dweight: differences and sums in float32 in another order than NumPy's
BACKWARD_NOISE = 3e-5


def bits(a):
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.itemsize}")


def close(got, want, dtype, noise=None, what=""):
    """None when ``got`` (device) is within one unit of ``want`` (host) plus noise relative to the
    largest magnitude of its head (the last axis)."""
    g = to_host(got).astype(np.float64)
    w = np.asarray(want).astype(np.float64)
    if g.shape != w.shape:
        return f"{what}: shape {g.shape} against {w.shape}"
    head_max = np.max(np.abs(w), axis=-1, keepdims=True) if w.ndim else np.abs(w)
    tol = ULP[dtype] * np.abs(w) + (noise or NOISE[dtype]) * head_max + 2.0 ** -24
    bad = ~(np.abs(g - w) <= tol)
    if not bad.any():
        return None
    i = np.flatnonzero(bad)[0]
    return f"{what}: {int(bad.sum())} of {bad.size} off; first at {i}: got {g.flat[i]}, want {w.flat[i]}"


def frequencies(positions, rotary_dim, base=10000.0):
    inv_freq = 1.0 / base ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    return np.asarray(positions, dtype=np.float64)[..., None] * inv_freq


def per_channel(half, is_neox):
    return np.concatenate([half, half], axis=-1) if is_neox else np.repeat(half, 2, axis=-1)


def heads_view(buf, start, heads, head_dim):
    """(..., heads, head_dim) view of ``buf`` (..., width) from column ``start``: a packed projection's
    per-head view, without a copy."""
    item = buf.itemsize
    view = cp.lib.stride_tricks.as_strided(buf[..., start:], buf.shape[:-1] + (heads, head_dim),
                                           buf.strides[:-1] + (head_dim * item, item))
    assert view.data.ptr == buf[..., start:].data.ptr
    return view


class Case:
    """A call's host arrays (for the reference) and device arrays (for the kernels)."""

    def __init__(self, dtype, head_dim, rotary, is_neox, convention, positions, layout, gqa, turn=0, tokens=TOKENS,
                 salt=0):
        rng = np.random.default_rng(seed("qk", dtype, head_dim, rotary, is_neox, convention, positions, layout, gqa,
                                         turn, tokens, salt))
        dt = DTYPES[dtype]
        self.dtype, self.layout, self.is_neox = dtype, layout, is_neox
        d, rd = head_dim, head_dim if rotary == "full" else head_dim // 2
        hq, hk = K_HEADS * gqa, K_HEADS
        lead = (3, tokens) if layout == "batched" else (tokens,)
        width = (hq + 2 * hk) * d
        shift = 1 if layout == "offset" else 0
        host = (rng.standard_normal(lead + (width + shift,)) * 1.5 + 0.2).astype(np.float32).astype(dt)
        self.qkv = to_device(host)
        self.q_host = np.ascontiguousarray(host[..., shift:shift + hq * d]).reshape(lead + (hq, d))
        self.k_host = np.ascontiguousarray(host[..., shift + hq * d:shift + (hq + hk) * d]).reshape(lead + (hk, d))
        if layout == "separate":
            self.q, self.k = to_device(self.q_host), to_device(self.k_host)
        else:
            self.q = heads_view(self.qkv, shift, hq, d)
            self.k = heads_view(self.qkv, shift + hq * d, hk, d)
        wdt = (dt, np.dtype(np.float32), None)[turn % 3]
        self.offset = 1.0 if turn % 2 and wdt is not None else 0.0
        self.qw_host = self.kw_host = None
        if wdt is not None:
            center = 0.0 if self.offset else 1.0
            self.qw_host = (center + 0.3 * rng.standard_normal(d)).astype(np.float32).astype(wdt)
            self.kw_host = (center + 0.3 * rng.standard_normal(d)).astype(np.float32).astype(wdt)
        table_dt = (np.dtype(np.float32), dt)[(turn // 2) % 2]
        if positions == "ascending":
            pos = np.arange(int(np.prod(lead))).reshape(lead) + 5
        elif positions == "random":
            pos = rng.integers(0, MAX_POSITION, size=lead)
        else:
            pos = np.full(lead, 42)
        cache = np.concatenate([np.cos(frequencies(np.arange(MAX_POSITION), rd)),
                                np.sin(frequencies(np.arange(MAX_POSITION), rd))], axis=-1).astype(table_dt)
        if convention == "cache":
            pos = pos.astype((np.int64, np.int32)[turn % 2])
            self.angles_host = dict(positions=pos, cos_sin_cache=cache)
        else:
            if layout == "batched":
                pos = pos[:1]                    # (1, T): transformers' one row of positions for the batch
            rows = cache[pos]
            self.angles_host = dict(cos=per_channel(rows[..., :rd // 2], is_neox),
                                    sin=per_channel(rows[..., rd // 2:], is_neox))
        self.angles = {name: to_device(np.ascontiguousarray(a)) for name, a in self.angles_host.items()}
        self.qw = None if self.qw_host is None else to_device(self.qw_host)
        self.kw = None if self.kw_host is None else to_device(self.kw_host)

    def keywords(self, host=False):
        return dict(self.angles_host if host else self.angles, is_neox=self.is_neox, weight_offset=self.offset)

    def reference(self, mode="fp32"):
        return rn.qk_norm_rope(self.q_host, self.k_host, self.qw_host, self.kw_host, EPS, casting_mode=mode,
                               **self.keywords(host=True))

    def run(self, mode="fp32"):
        out = dict(out_q=self.q, out_k=self.k) if self.layout == "in_place" else {}
        return rn.qk_norm_rope(self.q, self.k, self.qw, self.kw, EPS, casting_mode=mode, **self.keywords(), **out)


def grid():
    cases = []
    for i, (dtype, d, rotary, neox, conv) in enumerate(itertools.product(DTYPES, HEAD_DIMS, ("full", "half"),
                                                                         (True, False), ("cache", "cos_sin"))):
        cases.append((dtype, d, rotary, neox, conv, POSITIONS[i % 3], LAYOUTS[(i // 3) % len(LAYOUTS)],
                      GQA[(i // 2) % 3], i))
    return cases


@pytest.mark.parametrize("dtype,head_dim,rotary,is_neox,convention,positions,layout,gqa,turn", grid())
def test_forward_against_the_reference(dtype, head_dim, rotary, is_neox, convention, positions, layout, gqa, turn,
                                       free_gpu_memory):
    case = Case(dtype, head_dim, rotary, is_neox, convention, positions, layout, gqa, turn)
    mode = ("fp32", "llama")[turn % 2]
    want_q, want_k = case.reference(mode)
    untouched = to_host(case.qkv)
    q_out, k_out = case.run(mode)
    assert q_out.dtype == case.q.dtype and q_out.shape == case.q.shape and k_out.shape == case.k.shape
    if case.layout == "in_place":
        assert q_out is case.q and k_out is case.k
        hq, hk, d = case.q.shape[-2], case.k.shape[-2], head_dim
        assert np.array_equal(bits(to_host(case.qkv)[..., (hq + hk) * d:]), bits(untouched[..., (hq + hk) * d:]))
    # llama: x * inv_rms near a rounding midpoint may round the other way (rsqrtf): one unit of it
    noise = 2 * ULP[dtype] if mode == "llama" else None
    assert close(q_out, want_q, dtype, noise, what="q") is None
    assert close(k_out, want_k, dtype, noise, what="k") is None


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("head_dim,rotary_dim,is_neox", [(128, 128, True), (128, 64, False), (96, 96, True),
                                                          (64, 8, True), (256, 128, True)])
def test_every_plan_gives_the_same_bits(dtype, head_dim, rotary_dim, is_neox, free_gpu_memory):
    """Vector widths (contiguous, one and two elements off the grid), in place, forced geometries:
    the canonical tree and the element-wise rotation make a head's bits independent of the plan."""
    rotary = "full" if rotary_dim == head_dim else "half"
    case = Case(dtype, head_dim, rotary, is_neox, "cache", "random", "separate", 4, turn=1)
    if rotary_dim not in (head_dim, head_dim // 2):           # a rotary_dim of its own: its own cache
        rng = np.random.default_rng(seed("rd", dtype, head_dim, rotary_dim))
        case.angles = dict(positions=case.angles["positions"],
                           cos_sin_cache=cp.asarray(rng.standard_normal((MAX_POSITION, rotary_dim)).astype(np.float32)))
    base_q, base_k = rn.qk_norm_rope(case.q, case.k, case.qw, case.kw, EPS, **case.keywords())
    d, hq, hk = head_dim, case.q.shape[-2], case.k.shape[-2]
    for shift in (1, 2, 8):
        buf = cp.zeros((TOKENS, (hq + hk) * d + shift), case.q.dtype)
        q, k = heads_view(buf, shift, hq, d), heads_view(buf, shift + hq * d, hk, d)
        q[...], k[...] = case.q, case.k
        got = rn.qk_norm_rope(q, k, case.qw, case.kw, EPS, out_q=q, out_k=k, **case.keywords())
        assert np.array_equal(bits(to_host(got[0])), bits(to_host(base_q))), shift
        assert np.array_equal(bits(to_host(got[1])), bits(to_host(base_k))), shift
    for forced in (dict(threads_per_row=32), dict(threads_per_row=16, vecs_per_thread=4)):
        try:
            with _cache.forced_plan(**forced):
                got = rn.qk_norm_rope(case.q, case.k, case.qw, case.kw, EPS, **case.keywords())
        except ValueError as e:                  # a geometry that does not cover this head
            assert "do not cover" in str(e)
            continue
        assert np.array_equal(bits(to_host(got[0])), bits(to_host(base_q))), forced


def test_in_place_on_the_packed_projection_over_calls(free_gpu_memory):
    """vLLM's call: q and k views of one qkv buffer, rotated in place step after step; v is never
    touched; the signature cache's launcher reads each call's pointers (a new buffer each step)."""
    for step in range(3):
        case = Case("bfloat16", 128, "full", True, "cache", "ascending", "in_place", 8, turn=4, salt=step)
        want_q, want_k = case.reference()
        v = to_host(case.qkv)[:, (case.q.shape[-2] + case.k.shape[-2]) * 128:]
        q_out, k_out = case.run()
        assert q_out is case.q and k_out is case.k
        assert close(q_out, want_q, "bfloat16") is None and close(k_out, want_k, "bfloat16") is None
        assert np.array_equal(bits(to_host(case.qkv)[:, (case.q.shape[-2] + case.k.shape[-2]) * 128:]), bits(v))
    # an output overlapping what it must not is still refused after the cached in-place calls
    with pytest.raises(ValueError, match=r"^out_q partially overlaps q"):
        shifted = heads_view(case.qkv, 8, case.q.shape[-2], 128)
        rn.qk_norm_rope(case.q, case.k, case.qw, case.kw, out_q=shifted, out_k=case.k, **case.keywords())


def test_positions_outside_the_cache_give_nan_and_read_nothing_outside(free_gpu_memory):
    case = Case("float16", 128, "half", True, "cache", "ascending", "separate", 4, turn=0)
    pos = case.angles["positions"].copy()
    pos[3], pos[7] = MAX_POSITION, -1
    q_out, k_out = rn.qk_norm_rope(case.q, case.k, case.qw, case.kw, positions=pos,
                                   cos_sin_cache=case.angles["cos_sin_cache"])
    want_q, want_k = rn.qk_norm_rope_reference(case.q_host, case.k_host, case.qw_host, case.kw_host,
                                               positions=to_host(pos), cos_sin_cache=case.angles_host["cos_sin_cache"])
    for got, want in ((q_out, want_q), (k_out, want_k)):
        g = to_host(got).astype(np.float32)
        assert np.isnan(g[[3, 7], :, :64]).all() and not np.isnan(g[[3, 7], :, 64:]).any()
        assert not np.isnan(np.delete(g, [3, 7], axis=0)).any()
        assert close(got[:, :, 64:], want[:, :, 64:], "float16") is None


@pytest.mark.parametrize("heads", [(128, 16), (3, 1), (40, 0)])
def test_many_and_few_heads(heads, free_gpu_memory):
    """More heads than a block takes (chunks along grid.y); a few heads (several tokens a block);
    no k heads at all."""
    hq, hk = heads
    rng = np.random.default_rng(seed("heads", hq, hk))
    q_host = rng.standard_normal((TOKENS, hq, 128)).astype(np.float32).astype(ml_dtypes.bfloat16)
    k_host = rng.standard_normal((TOKENS, hk, 128)).astype(np.float32).astype(ml_dtypes.bfloat16)
    cache = rng.standard_normal((64, 128)).astype(np.float32)
    pos = rng.integers(0, 64, TOKENS)
    want = rn.qk_norm_rope(q_host, k_host, None, None, positions=pos, cos_sin_cache=cache)
    got = rn.qk_norm_rope(to_device(q_host), to_device(k_host), None, None, positions=cp.asarray(pos),
                          cos_sin_cache=cp.asarray(cache))
    assert close(got[0], want[0], "bfloat16") is None and close(got[1], want[1], "bfloat16") is None


def test_empty_calls(free_gpu_memory):
    q, k = cp.zeros((0, 4, 64), cp.float16), cp.zeros((0, 2, 64), cp.float16)
    q_out, k_out = rn.qk_norm_rope(q, k, None, None, positions=cp.zeros(0, cp.int64),
                                   cos_sin_cache=cp.ones((8, 64), cp.float32))
    assert q_out.shape == (0, 4, 64) and k_out.shape == (0, 2, 64)
    w = cp.ones(64, cp.float16)
    dq, dk, dqw, dkw = rn.qk_norm_rope_backward(q, k, q, k, w, w, positions=cp.zeros(0, cp.int64),
                                                cos_sin_cache=cp.ones((8, 64), cp.float32))
    assert dq.shape == (0, 4, 64) and float(cp.abs(dqw).max()) == 0 and float(cp.abs(dkw).max()) == 0


# -- the backward ------------------------------------------------------------------------------------

def backward_grid():
    cases = []
    for i, (dtype, d, rotary, neox, conv) in enumerate(itertools.product(DTYPES, (64, 96, 128, 256, 512),
                                                                         ("full", "half"), (True, False),
                                                                         ("cache", "cos_sin"))):
        cases.append((dtype, d, rotary, neox, conv, POSITIONS[i % 3], ("packed", "offset", "batched")[(i // 3) % 3],
                      GQA[(i // 2) % 3], i))
    return cases


def check_backward(case, mode="fp32", tokens_note=""):
    rng = np.random.default_rng(seed("dy", case.dtype, case.q.shape, case.is_neox, mode))
    dt = DTYPES[case.dtype]
    dq_host = rng.standard_normal(case.q.shape).astype(np.float32).astype(dt)
    dk_host = rng.standard_normal(case.k.shape).astype(np.float32).astype(dt)
    args = dict(case.keywords(), casting_mode=mode)
    got = rn.qk_norm_rope_backward(to_device(dq_host), to_device(dk_host), case.q, case.k, case.qw, case.kw, EPS,
                                   **args)
    want = rn.qk_norm_rope_backward(dq_host, dk_host, case.q_host, case.k_host, case.qw_host, case.kw_host, EPS,
                                    **dict(case.keywords(host=True), casting_mode=mode))
    for name, g, w in zip(("dq", "dk"), got[:2], want[:2]):
        assert g.dtype == case.q.dtype and g.flags.c_contiguous
        assert close(g, w, case.dtype, BACKWARD_NOISE, what=name + tokens_note) is None
    for name, g, w in zip(("dq_weight", "dk_weight"), got[2:], want[2:]):
        if w is None:
            assert g is None
            continue
        assert g.dtype == w.dtype and g.shape == w.shape
        # llama: the rounded xhat of a term near a rounding midpoint may round the other way
        noise = max(BACKWARD_NOISE, 2 * ULP[case.dtype]) if mode == "llama" else BACKWARD_NOISE
        assert close(g, w, w.dtype.name, noise, what=name + tokens_note) is None
    again = rn.qk_norm_rope_backward(to_device(dq_host), to_device(dk_host), case.q, case.k, case.qw, case.kw, EPS,
                                     **args)
    for a, b in zip(got, again):                 # deterministic: no float atomics
        assert (a is None and b is None) or np.array_equal(bits(to_host(a)), bits(to_host(b)))


@pytest.mark.parametrize("dtype,head_dim,rotary,is_neox,convention,positions,layout,gqa,turn", backward_grid())
def test_backward_against_the_reference(dtype, head_dim, rotary, is_neox, convention, positions, layout, gqa, turn,
                                        free_gpu_memory):
    check_backward(Case(dtype, head_dim, rotary, is_neox, convention, positions, layout, gqa, turn),
                   ("fp32", "llama")[turn % 2])


@pytest.mark.parametrize("tokens", [1, 3, 1000, 5000])
def test_backward_row_counts_and_partial_rows(tokens, free_gpu_memory):
    """One block writing dweight itself, a few, many (partial rows reduced in a fixed order); and
    the same on a device of one multiprocessor (every block loops over many items)."""
    case = Case("bfloat16", 128, "full", True, "cache", "random", "packed", 4, turn=3, tokens=tokens)
    check_backward(case, tokens_note=f" ({tokens} tokens)")
    device = _driver.device(cp.cuda.Device().id)
    sm_count, device.sm_count = device.sm_count, 1
    try:
        with _cache.forced_backward_plan():      # fresh launchers, planned for one multiprocessor
            check_backward(case, tokens_note=f" ({tokens} tokens, one SM)")
    finally:
        device.sm_count = sm_count
        _cache.clear()


def test_torch_tensors_on_the_direct_path(free_gpu_memory):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    case = Case("bfloat16", 128, "half", True, "cache", "random", "packed", 4, turn=1)
    want = case.run()
    as_torch = lambda a: None if a is None else torch.from_dlpack(a)  # noqa: E731
    with torch.no_grad():
        got = rn.qk_norm_rope(as_torch(case.q), as_torch(case.k), as_torch(case.qw), as_torch(case.kw), EPS,
                              positions=as_torch(case.angles["positions"]),
                              cos_sin_cache=as_torch(case.angles["cos_sin_cache"]), weight_offset=case.offset)
    for g, w in zip(got, want):
        assert isinstance(g, torch.Tensor)
        assert torch.equal(g, torch.from_dlpack(w))
