import numpy as np

from ..._reference import _backward_float32, _normalized


def _rope_pairs(rotary_dim, is_neox):
    """(partner index, whether each channel is its pair's first) of channels 0 .. rotary_dim - 1."""
    j = np.arange(rotary_dim)
    if is_neox:
        half = rotary_dim // 2
        return np.where(j < half, j + half, j - half), j < half
    return j ^ 1, j % 2 == 0


def rope_angles(tokens_shape, rotary_dim, is_neox, *, cos=None, sin=None, positions=None, cos_sin_cache=None):
    """(cos, sin) of every token and rotated channel, float32 of shape tokens_shape +
    (rotary_dim,), from either convention (see above); NaN for a position outside the cache."""
    shape = tuple(tokens_shape) + (rotary_dim,)
    if cos is not None:
        return (np.broadcast_to(np.asarray(cos, dtype=np.float32), shape),
                np.broadcast_to(np.asarray(sin, dtype=np.float32), shape))
    cache = np.asarray(cos_sin_cache, dtype=np.float32)
    pos = np.broadcast_to(np.asarray(positions), tuple(tokens_shape)).astype(np.int64)
    outside = (pos < 0) | (pos >= cache.shape[0])
    rows = cache[np.where(outside, 0, pos)] if cache.shape[0] else np.zeros(shape, np.float32)
    half = rotary_dim // 2
    c, s = rows[..., :half], rows[..., half:]
    if is_neox:
        c, s = np.concatenate([c, c], axis=-1), np.concatenate([s, s], axis=-1)
    else:
        c, s = np.repeat(c, 2, axis=-1), np.repeat(s, 2, axis=-1)
    nan = np.float32(np.nan)
    return np.where(outside[..., None], nan, c), np.where(outside[..., None], nan, s)


def _rotated(v, cos, sin, rotary_dim, is_neox, inverse=False):
    """v (float32, (..., heads, D)) with its first rotary_dim channels rotated by the angles
    (cos, sin: (..., rotary_dim), the same for every head) by +theta, or by -theta (``inverse``:
    the transpose, which takes the partner's sin)."""
    partner, first = _rope_pairs(rotary_dim, is_neox)
    c, s = cos[..., None, :], sin[..., None, :]
    if inverse:
        s = s[..., partner]
        first = ~first
    turned = v[..., :rotary_dim]
    b = turned[..., partner] * s
    out = turned * c + np.where(first, -b, b)
    return np.concatenate([out, v[..., rotary_dim:]], axis=-1)


def _rope_inputs(q, k, rotary_dim, is_neox, tables):
    """The tokens' shape, rotary_dim (default: the table's width) and the angles."""
    q, k = np.asarray(q), np.asarray(k)
    if q.ndim < 2 or k.ndim < 2 or q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have shapes (..., heads, head_dim) with the same leading axes and "
                         f"head_dim, got {q.shape} and {k.shape}")
    table = tables["cos"] if tables["cos"] is not None else tables["cos_sin_cache"]
    width = np.shape(table)[-1]
    rd = width if rotary_dim is None else int(rotary_dim)
    if rd != width or rd % 2 or not 2 <= rd <= q.shape[-1]:
        raise ValueError(f"rotary_dim must be the table's width {width}, even and at most head_dim "
                         f"{q.shape[-1]}, got {rotary_dim}")
    return rd, rope_angles(q.shape[:-2], rd, is_neox, **tables)


def qk_norm_rope_reference(q, k, q_weight=None, k_weight=None, eps=1e-6, weight_offset=0.0, casting_mode="fp32", *,
                           cos=None, sin=None, positions=None, cos_sin_cache=None, rotary_dim=None, is_neox=True):
    """``(q_out, k_out)``: each head of q and k normalized (rms_norm with q_weight / k_weight),
    then its first rotary_dim channels rotated in float32 and rounded once to q's dtype,
    following the contract above. The angles: ``cos`` and ``sin`` (transformers), or
    ``positions`` and ``cos_sin_cache`` (vLLM, FlashInfer); a position outside the cache gives
    NaN in the rotated channels (the kernels' behaviour). Quiet about infinities and NaNs."""
    tables = dict(cos=cos, sin=sin, positions=positions, cos_sin_cache=cos_sin_cache)
    rd, (c, s) = _rope_inputs(q, k, rotary_dim, is_neox, tables)
    outs = []
    with np.errstate(divide="ignore", over="ignore", invalid="ignore", under="ignore"):
        for x, w in ((np.asarray(q), q_weight), (np.asarray(k), k_weight)):
            y = _normalized(x, w, eps, weight_offset, casting_mode)
            outs.append(_rotated(y, c, s, rd, is_neox).astype(x.dtype))
    return tuple(outs)


def qk_norm_rope_backward_reference(dq_out, dk_out, q, k, q_weight=None, k_weight=None, eps=1e-6, weight_offset=0.0,
                                    casting_mode="fp32", *, cos=None, sin=None, positions=None, cos_sin_cache=None,
                                    rotary_dim=None, is_neox=True):
    """``(dq, dk, dq_weight, dk_weight)`` of ``qk_norm_rope`` given the gradients of its outputs
    (q's and k's shapes, q's dtype), following the contract above: dq and dk in q's dtype, the
    weights' gradients in their dtype (None without weights). Quiet about infinities and NaNs."""
    tables = dict(cos=cos, sin=sin, positions=positions, cos_sin_cache=cos_sin_cache)
    rd, (c, s) = _rope_inputs(q, k, rotary_dim, is_neox, tables)
    grads, weight_grads = [], []
    with np.errstate(divide="ignore", over="ignore", invalid="ignore", under="ignore"):
        for do, x, w in ((dq_out, np.asarray(q), q_weight), (dk_out, np.asarray(k), k_weight)):
            if np.shape(do) != x.shape:
                raise ValueError(f"the output gradients must have q's and k's shapes, got {np.shape(do)} for {x.shape}")
            dy = _rotated(np.asarray(do, dtype=np.float32), c, s, rd, is_neox, inverse=True)
            dx, dw = _backward_float32(dy, x, w, eps, weight_offset, casting_mode, llama_dtype=x.dtype)
            grads.append(dx.astype(x.dtype))
            weight_grads.append(dw)
    return grads[0], grads[1], weight_grads[0], weight_grads[1]
