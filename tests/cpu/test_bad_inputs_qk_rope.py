"""Bad arguments to qk_norm_rope and its backward: TypeError / ValueError naming the argument,
raised before anything is written (checked on NumPy arrays, which take the same validation,
layout and overlap checks as GPU arrays; torch CPU tensors for the torch guards)."""

import ml_dtypes
import numpy as np
import pytest

import cupy_rmsnorm as rn

BF16 = np.dtype(ml_dtypes.bfloat16)
T, HQ, HK, D = 3, 4, 2, 64


def arrays(dtype=BF16):
    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((T, (HQ + 2 * HK) * D)).astype(np.float32).astype(dtype)
    q = qkv[:, :HQ * D].reshape(T, HQ, D)
    k = qkv[:, HQ * D:(HQ + HK) * D].reshape(T, HK, D)
    w = np.ones(D, dtype)
    return qkv, q, k, w


QKV, Q, K, W = arrays()
CACHE = np.ones((16, D), np.float32)
POS = np.arange(T)
COS = np.ones((T, D), np.float32)
ANGLES = dict(positions=POS, cos_sin_cache=CACHE)


def call(**changes):
    args = dict(q=Q, k=K, q_weight=W, k_weight=W, **ANGLES)
    args.update(changes)
    return lambda: rn.qk_norm_rope(**args)


@pytest.mark.parametrize("make, error, match", [
    (call(q=None), TypeError, r"^q must be an array of shape \(\.\.\., heads, head_dim\), got None"),
    (call(k=Q.tolist()), TypeError, r"^k must be a CuPy array, a NumPy array"),
    (call(q=Q.astype(np.float64)), TypeError, r"^q must be float32, float16 or bfloat16, got float64"),
    (call(k=K.astype(np.float16)), TypeError, r"^k must have q's dtype bfloat16, got float16"),
    (call(q=Q[0, 0], k=K[0, 0]), ValueError, r"^q must have shape \(\.\.\., heads, head_dim\), got \(64,\)"),
    (call(k=K[:2]), ValueError, r"^k must have q's leading axes \(3,\) and head_dim 64"),
    (call(k=np.ones((T, HK, 32), BF16)), ValueError, r"^k must have q's leading axes \(3,\) and head_dim 64"),
    (call(q=np.ones((T, HQ, 1024), BF16), k=np.ones((T, HK, 1024), BF16), q_weight=None, k_weight=None),
     ValueError, r"^q and k have head_dim 1024; from 2 to 512"),
    (call(q_weight=W[:32]), ValueError, r"^q_weight must have shape \(64,\) \(head_dim\), got \(32,\)"),
    (call(k_weight=W.astype(np.float16), q_weight=W.astype(np.float16)), TypeError,
     r"^q_weight must have q's dtype bfloat16 or float32, got float16"),
    (call(k_weight=W.astype(np.float32)), TypeError, r"^k_weight must have q_weight's dtype bfloat16, got float32"),
    (call(k_weight=None), ValueError, r"^q_weight and k_weight go together"),
    (call(positions=None, cos_sin_cache=None), ValueError, r"^qk_norm_rope needs the angles: cos and sin"),
    (call(cos=COS, sin=COS), ValueError, r"^pass cos and sin, or positions and cos_sin_cache, not both"),
    (call(positions=None, cos_sin_cache=None, cos=COS), ValueError, r"^cos and sin go together: sin is None"),
    (call(cos_sin_cache=None), ValueError, r"^positions and cos_sin_cache go together: cos_sin_cache is None"),
    (call(positions=POS.astype(np.float32)), TypeError, r"^positions must be int32 or int64, got float32"),
    (call(positions=np.arange(T + 1)), ValueError, r"^positions must have q's leading axes \(3,\)"),
    (call(cos_sin_cache=CACHE[0]), ValueError, r"^cos_sin_cache must have shape \(max_position, rotary_dim\)"),
    (call(cos_sin_cache=CACHE.astype(np.float16)), TypeError,
     r"^cos_sin_cache must have q's dtype bfloat16 or float32, got float16"),
    (call(cos_sin_cache=CACHE[:, :63]), ValueError, r"^cos_sin_cache must be rotary_dim wide, an even width"),
    (call(cos_sin_cache=np.ones((16, 128), np.float32)), ValueError, r"^rotary_dim 128 is more than head_dim 64"),
    (call(rotary_dim=32), ValueError, r"^cos_sin_cache must be rotary_dim wide.*last axis is 64, rotary_dim is 32"),
    (call(rotary_dim=True), TypeError, r"^rotary_dim must be an int or None, got bool"),
    (call(rotary_dim=7), ValueError, r"^rotary_dim must be even and >= 2"),
    (call(is_neox="yes"), TypeError, r"^is_neox must be a bool, got str"),
    (call(positions=None, cos_sin_cache=None, cos=COS, sin=COS[:, :32]), ValueError, r"^sin must have cos's shape"),
    (call(positions=None, cos_sin_cache=None, cos=COS, sin=COS.astype(BF16)), TypeError,
     r"^sin must have cos's dtype float32, got bfloat16"),
    (call(positions=None, cos_sin_cache=None, cos=np.ones((4, D), np.float32), sin=np.ones((4, D), np.float32)),
     ValueError, r"^cos and sin must have shape \(\.\.\., rotary_dim\) whose leading axes broadcast to q's \(3,\)"),
    (call(out_q=np.empty((T, HQ, D), np.float32)), TypeError, r"^out_q must have q's dtype bfloat16, got float32"),
    (call(out_k=np.empty((T, HQ, D), BF16)), ValueError, r"^out_k must have k's shape \(3, 2, 64\)"),
    (call(eps=-1.0), ValueError, r"^eps must be finite and >= 0"),
    (call(q_weight=None, k_weight=None, weight_offset=1.0), ValueError, r"^weight_offset needs a weight"),
    (call(casting_mode="gemma"), ValueError, r"^casting_mode must be 'fp32' or 'llama'"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_errors_name_the_argument(make, error, match):
    with pytest.raises(error, match=match):
        make()


def _read_only(a):
    a = a.copy()
    a.flags.writeable = False
    return a


def test_nothing_is_written_before_an_error():
    out_q = np.full((T, HQ, D), 7, BF16)
    with pytest.raises(ValueError, match=r"^out_k is read-only"):
        rn.qk_norm_rope(Q, K, W, W, out_q=out_q, out_k=_read_only(np.zeros((T, HK, D), BF16)), **ANGLES)
    assert (out_q.astype(np.float32) == 7).all()
    qkv = QKV.copy()
    q, k = qkv[:, :HQ * D].reshape(T, HQ, D), qkv[:, HQ * D:(HQ + HK) * D].reshape(T, HK, D)
    with pytest.raises(ValueError, match=r"^positions must lie in \[0, 16\)"):
        rn.qk_norm_rope(q, k, W, W, positions=POS + 14, cos_sin_cache=CACHE, out_q=q, out_k=k)
    assert np.array_equal(qkv.view(np.uint16), QKV.view(np.uint16))


def test_overlapping_outputs_are_refused():
    qkv = QKV.copy()
    q, k = qkv[:, :HQ * D].reshape(T, HQ, D), qkv[:, HQ * D:(HQ + HK) * D].reshape(T, HK, D)
    v = qkv[:, (HQ + HK) * D:].reshape(T, HK, D)
    with pytest.raises(ValueError, match=r"^out_k overlaps q; pass memory apart from it"):
        rn.qk_norm_rope(q, k, W, W, out_k=q[:, :HK], **ANGLES)
    shifted = qkv[:, 1:HQ * D + 1].reshape(T, HQ, D)          # q's memory, one element on
    with pytest.raises(ValueError, match=r"^out_q partially overlaps q: pass the very same array \(out_q=q\)"):
        rn.qk_norm_rope(q, k, W, W, out_q=shifted, **ANGLES)
    with pytest.raises(ValueError, match=r"^out_q and out_k must not share memory"):
        rn.qk_norm_rope(q[:, :HK], k, W, W, out_q=v, out_k=v, **ANGLES)
    weights = np.ones((T, HQ, D), BF16)
    with pytest.raises(ValueError, match=r"^out_q overlaps q_weight"):
        rn.qk_norm_rope(q, k, weights[0, 0], W, out_q=weights, **ANGLES)
    cache = np.ones((T * HQ, D), np.float32)
    with pytest.raises(ValueError, match=r"^out_q overlaps cos_sin_cache"):
        rn.qk_norm_rope(q.astype(np.float32), k.astype(np.float32), None, None, positions=POS, cos_sin_cache=cache,
                        out_q=cache.reshape(T, HQ, D))
    with pytest.raises(ValueError, match=r"^out_q has heads that overlap each other"):
        rn.qk_norm_rope(q, k, W, W, out_q=np.lib.stride_tricks.as_strided(np.zeros((T, D), BF16), (T, HQ, D),
                                                                           (2 * D, 0, 2)), **ANGLES)
    with pytest.raises(ValueError, match=r"^out_q must have a unit-stride last axis"):
        rn.qk_norm_rope(q, k, W, W, out_q=np.zeros((T, HQ, 2 * D), BF16)[..., ::2], **ANGLES)
    assert np.array_equal(qkv.view(np.uint16), QKV.view(np.uint16))


def test_in_place_on_the_packed_projection_is_allowed():
    qkv = QKV.copy()
    q, k = qkv[:, :HQ * D].reshape(T, HQ, D), qkv[:, HQ * D:(HQ + HK) * D].reshape(T, HK, D)
    want = rn.qk_norm_rope(Q, K, W, W, **ANGLES)
    got = rn.qk_norm_rope(q, k, W, W, out_q=q, out_k=k, **ANGLES)
    assert got[0] is q and got[1] is k
    assert np.array_equal(q.view(np.uint16), want[0].view(np.uint16))
    assert np.array_equal(qkv[:, (HQ + HK) * D:].view(np.uint16), QKV[:, (HQ + HK) * D:].view(np.uint16))


def backward(**changes):
    args = dict(dq_out=Q, dk_out=K, q=Q, k=K, q_weight=W, k_weight=W, **ANGLES)
    args.update(changes)
    return lambda: rn.qk_norm_rope_backward(**args)


@pytest.mark.parametrize("make, error, match", [
    (backward(dq_out=None), TypeError, r"^dq_out must be an array"),
    (backward(dk_out=Q), ValueError, r"^dk_out must have k's shape \(3, 2, 64\)"),
    (backward(dq_out=Q.astype(np.float32)), TypeError, r"^dq_out must have q's dtype bfloat16, got float32"),
    (backward(k=K.astype(np.float32)), TypeError, r"^k must have q's dtype bfloat16"),
    (backward(positions=None), ValueError, r"^positions and cos_sin_cache go together: positions is None"),
    (backward(dq_out=Q.tolist()), TypeError, r"^dq_out must be a CuPy array, a NumPy array"),
    (backward(rotary_dim=3), ValueError, r"^rotary_dim must be even"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_backward_errors_name_the_argument(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_torch_cpu_tensors_run_the_reference_with_and_without_autograd():
    """A call that autograd records goes through the registered op, whose implementation is the
    same direct path: the reference's bits either way; a tensor on another device is refused."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(T, HQ, D, generator=g), torch.randn(T, HK, D, generator=g)
    cache, pos = torch.randn(16, D, generator=g), torch.arange(T)
    want = rn.qk_norm_rope(q.numpy(), k.numpy(), None, None, positions=pos.numpy(), cos_sin_cache=cache.numpy())
    got = rn.qk_norm_rope(q, k, None, None, positions=pos, cos_sin_cache=cache)
    recorded = rn.qk_norm_rope(q.clone().requires_grad_(), k, None, None, positions=pos, cos_sin_cache=cache)
    for a, b, c in zip(want, got, recorded):
        assert torch.equal(torch.from_numpy(a), b) and torch.equal(b, c.detach())
    assert recorded[0].requires_grad
    with pytest.raises(ValueError, match=r"^k is a torch tensor on meta, and q is on the CPU"):
        rn.qk_norm_rope(q, k.to("meta"), None, None, positions=pos, cos_sin_cache=cache)
    with pytest.raises(ValueError, match=r"^cos_sin_cache requires grad, and qk_norm_rope has no gradient"):
        rn.qk_norm_rope(q, k, None, None, positions=pos, cos_sin_cache=cache.requires_grad_())
