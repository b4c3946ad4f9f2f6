import numpy as np

from ..._reference import _out_dtype, _round_to, canonical_sum_of_squares, offset_weight

ACTIVATIONS = ("silu", "sigmoid")                        # the gated op's act(gate)


def _group_size(hidden, group_size):
    """g: ``group_size`` (None: hidden), which must divide hidden."""
    g = hidden if group_size is None else int(group_size)
    if g <= 0 or hidden % g:
        raise ValueError(f"group_size must be a positive divisor of hidden={hidden}, got {group_size}")
    return g


def _activation(z, activation):
    """(act(z), act'(z)) in float32, z float32 (see the contract above)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    one = np.float32(1)
    s = one / (one + np.exp(-z))
    if activation == "silu":
        return z * s, s * (one + z * (one - s))
    return s, s * (one - s)


def _round_product(casting_mode, weight, weight_offset, dtype):
    """Whether llama mode rounds n * w' to ``dtype`` too (the weight is in that dtype)."""
    return (casting_mode == "llama" and weight is not None and np.asarray(weight).dtype == dtype
            and weight_offset == 0)


def _gated_inputs(x, gate, weight, weight_offset, group_size):
    """x, z as float32 (..., groups, g), w' as (groups, g) or None, g and the row's shape."""
    shape = np.shape(x)
    if np.shape(gate) != shape:
        raise ValueError(f"gate must have x's shape {shape}, got {np.shape(gate)}")
    hidden = shape[-1]
    g = _group_size(hidden, group_size)
    grouped = shape[:-1] + (hidden // g, g)
    xf = np.asarray(x, dtype=np.float32).reshape(grouped)
    zf = np.asarray(gate, dtype=np.float32).reshape(grouped)
    w = None if weight is None else offset_weight(weight, weight_offset).reshape(hidden // g, g)
    return xf, zf, w, g


def rms_norm_gated_reference(x, gate, weight=None, eps=1e-6, weight_offset=0.0, casting_mode="fp32", *,
                             group_size=None, norm_before_gate=True, activation="silu", out_dtype=None):
    """Gated ``rms_norm`` over the last axis of NumPy arrays, following the contract above:
    ``rmsnorm(x) * w' * act(gate)`` (``norm_before_gate``) or ``rmsnorm(x * act(gate)) * w'``,
    each of ``group_size`` consecutive elements normalized on its own, y in ``out_dtype``
    (None: x's dtype). Quiet about infinities and NaNs, as ``rms_norm_reference``."""
    out = _out_dtype(x, out_dtype)
    xf, zf, w, g = _gated_inputs(x, gate, weight, weight_offset, group_size)
    llama = casting_mode == "llama"
    with np.errstate(divide="ignore", over="ignore", invalid="ignore", under="ignore"):
        act, _ = _activation(zf, activation)
        v = xf if norm_before_gate else xf * act
        sumsq = canonical_sum_of_squares(v)[..., None]
        inv_rms = np.float32(1.0) / np.sqrt(sumsq / np.float32(g) + np.float32(eps))
        n = v * inv_rms
        if llama:
            n = _round_to(n, out)
        p = n if w is None else n * w
        if norm_before_gate:
            if _round_product(casting_mode, weight, weight_offset, out):
                p = _round_to(p, out)
            p = p * act
        return p.reshape(np.shape(x)).astype(out)


def rms_norm_gated_backward_reference(dy, x, gate, weight=None, eps=1e-6, weight_offset=0.0, casting_mode="fp32",
                                      *, group_size=None, norm_before_gate=True, activation="silu"):
    """``(dx, dgate, dweight)`` of ``rms_norm_gated`` in NumPy, following the contract above:
    dy in the forward's output dtype (llama mode's roundings are to it), dx in x's dtype,
    dgate in the gate's dtype, dweight in the weight's dtype (None without a weight). Quiet
    about infinities and NaNs, as the forward."""
    shape = np.shape(x)
    hidden = shape[-1]
    xf, zf, w, g = _gated_inputs(x, gate, weight, weight_offset, group_size)
    if np.shape(dy) != shape:
        raise ValueError(f"dy must have x's shape {shape}, got {np.shape(dy)}")
    d_dtype = np.asarray(dy).dtype
    dyf = np.asarray(dy, dtype=np.float32).reshape(xf.shape)
    llama = casting_mode == "llama"
    gsize = np.float32(g)

    def group_sum(v):
        return np.sum(v, axis=-1, keepdims=True, dtype=np.float32)

    with np.errstate(divide="ignore", over="ignore", invalid="ignore", under="ignore"):
        act, dact = _activation(zf, activation)
        gw = dyf if w is None else dyf * w
        if norm_before_gate:
            inv_rms = np.float32(1.0) / np.sqrt(group_sum(xf * xf) / gsize + np.float32(eps))
            xhat = xf * inv_rms
            gx = gw * act
            c = group_sum(gx * xhat) / gsize
            dx = inv_rms * (gx - xhat * c)
            xw = _round_to(xhat, d_dtype) if llama else xhat
            p = xw if w is None else xw * w
            if _round_product(casting_mode, weight, weight_offset, d_dtype):
                p = _round_to(p, d_dtype)
            dgate = dyf * p * dact
            dw_terms = dyf * act * xw
        else:
            h = xf * act
            inv_rms = np.float32(1.0) / np.sqrt(group_sum(h * h) / gsize + np.float32(eps))
            hhat = h * inv_rms
            c = group_sum(gw * hhat) / gsize
            dh = inv_rms * (gw - hhat * c)
            dx = dh * act
            dgate = dh * xf * dact
            dw_terms = dyf * (_round_to(hhat, d_dtype) if llama else hhat)
        dweight = None
        if weight is not None:
            dweight = np.sum(dw_terms.reshape(-1, hidden), axis=0, dtype=np.float32).astype(np.asarray(weight).dtype)
        return (dx.reshape(shape).astype(np.asarray(x).dtype), dgate.reshape(shape).astype(np.asarray(gate).dtype),
                dweight)
