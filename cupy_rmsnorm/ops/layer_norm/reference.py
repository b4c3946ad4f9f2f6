"""LayerNorm's numerics contract in NumPy: the CPU path and the reference of the GPU kernels
(kernels/layer_norm.cu, kernels/layer_norm_backward.cu compute the very same steps).

Forward, per row of K = hidden elements (the last axis), every step a float32 operation
rounded on its own (the kernels use __fadd_rn, __fmul_rn, ...: no FMA), one rounding to the
output dtype O at the end:

    mean = canonical_sum(x) / K
    d    = x - mean
    var  = canonical_sum(d * d) / K            (population variance; two passes)
    rstd = 1 / sqrt(var + eps)                 (correctly rounded sqrt and division)
    n    = d * rstd
    a    = n * w + b                           (an absent weight or bias is skipped)
    modulate (adaLN):  a = a * (1 + scale) + shift
    y    = round_O(a)

``canonical_sum`` is the tree of ``_reference.canonical_sum_of_squares`` (a complete binary
tree over the element index, padded with zeros to a power of two, neighbours first) applied
to the values themselves: the kernels add a row in that tree whatever their launch plan, so
a row's bits depend on the row alone (batch invariance), and the kernels give the
reference's bits except where a float32 intermediate is subnormal (the kernels are compiled
with flush to zero).

Types: x float32, float16 or bfloat16 (ml_dtypes); weight and bias of any of the three (or
None), used as float32; O = ``out_dtype`` or x's dtype. The fused op's
s = round(x + residual) is rounded to the residual's dtype (x's, or float32 for a float32
residual stream beside 16-bit x) and normalized from that rounded value.

Backward, per row (float32, same conventions; the row sums in the canonical tree, so dx is
bit for bit the kernels' too):

    e      = dy (modulate: dy * (1 + scale));  g = e * w (e without a weight)
    mean_g = canonical_sum(g) / K;  c = (canonical_sum(g * d) * rstd) / K   (= mean(g * n))
    dx     = rstd * ((g - mean_g) - n * c)      (+ d_residual_out for the fused op), rounded once
    terms  : dweight e * n, dbias e, dshift dy, dscale dy * a (a before the modulation)

The column sums (dweight, dbias over all rows; dshift, dscale over the rows that share a
shift / scale row) are float32 sums of those float32 terms. Here NumPy adds them
(``np.sum(..., dtype=float32)`` over the rows, its pairwise order); the kernels add them in
their own fixed order (each thread its rows in order, a block's row groups in order, then
the blocks' partial rows by a second kernel), deterministic but not NumPy's. So a GPU
comparison of dweight / dbias / dshift / dscale needs a tolerance: both are float32 sums of
the same N terms t_i, each within (N - 1) * 2**-24 * sum|t_i| of the exact sum; compare
within ``2 * N * 2**-24 * sum|t_i|`` plus one unit in the last place of the result's dtype
(in practice errors grow like sqrt(N): ``1e-5 * sum|t_i|`` plus one unit passes for N up
to ~1e5 rows). dx needs no tolerance beyond flush to zero.
"""

import numpy as np


def canonical_sum(v):
    """The float32 sum of each row (the last axis) of ``v`` in the kernels' canonical tree:
    a complete binary tree over the element index, padded with zeros to a power of two,
    neighbours first (``_reference.canonical_sum_of_squares`` without the squaring)."""
    level = np.asarray(v, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        n = level.shape[-1]
        width = 1 << max(0, (n - 1).bit_length())
        if width != n:
            pad = np.zeros(level.shape[:-1] + (width - n,), np.float32)
            level = np.concatenate([level, pad], axis=-1)
        while level.shape[-1] > 1:
            level = level[..., 0::2] + level[..., 1::2]
    return level[..., 0]


def _quiet():
    return np.errstate(divide="ignore", over="ignore", invalid="ignore", under="ignore")


def _param(p):
    return None if p is None else np.asarray(p, dtype=np.float32)


def _statistics(xf, eps):
    """(d = x - mean, rstd) of each row of float32 ``xf``, keepdims."""
    k = np.float32(xf.shape[-1])
    mean = canonical_sum(xf)[..., None] / k
    d = xf - mean
    var = canonical_sum(d * d)[..., None] / k
    rstd = np.float32(1) / np.sqrt(var + np.float32(eps))
    return d, rstd


def _affine(xf, weight, bias, eps):
    """(a, n, d, rstd): a = n * w + b before any modulation or rounding, all float32."""
    d, rstd = _statistics(xf, eps)
    n = d * rstd
    a = n if weight is None else n * _param(weight)
    if bias is not None:
        a = a + _param(bias)
    return a, n, d, rstd


def _out(x, out_dtype):
    return np.asarray(x).dtype if out_dtype is None else np.dtype(out_dtype)


def layer_norm_reference(x, weight=None, bias=None, eps=1e-5, *, out_dtype=None):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last axis (population
    variance), float32 throughout, rounded once to ``out_dtype`` (None: x's dtype). Quiet
    about infinities and NaNs (IEEE arithmetic decides, as on the GPU)."""
    with _quiet():
        a = _affine(np.asarray(x, dtype=np.float32), weight, bias, eps)[0]
        return a.astype(_out(x, out_dtype))


def _summed(x, residual):
    residual = np.asarray(residual)
    with _quiet():
        return (np.asarray(x, dtype=np.float32) + residual.astype(np.float32)).astype(residual.dtype)


def fused_add_layer_norm_reference(x, residual, weight=None, bias=None, eps=1e-5, *, out_dtype=None):
    """``(y, s)``: s = x + residual in float32 rounded to the residual's dtype (residual_out;
    a float32 residual beside 16-bit x is a float32 stream), y = layer_norm(s) in
    ``out_dtype`` (None: x's dtype), normalized from the rounded s."""
    if np.shape(x) != np.shape(residual):
        raise ValueError(f"residual must have x's shape {np.shape(x)}, got {np.shape(residual)}")
    s = _summed(x, residual)
    return layer_norm_reference(s, weight, bias, eps, out_dtype=_out(x, out_dtype)), s


def _modulation(x, shift, scale):
    """shift and scale as float32 broadcast to x's shape (NumPy's rules)."""
    shape = np.shape(x)
    try:
        sh = np.broadcast_to(np.asarray(shift, dtype=np.float32), shape)
        sc = np.broadcast_to(np.asarray(scale, dtype=np.float32), shape)
    except ValueError:
        raise ValueError(f"shift {np.shape(shift)} and scale {np.shape(scale)} must broadcast to x's shape "
                         f"{shape}") from None
    return sh, sc


def layer_norm_modulate_reference(x, shift, scale, eps=1e-6, *, weight=None, bias=None, out_dtype=None):
    """adaLN (DiT, SD3, Flux): ``round(layer_norm(x) * (1 + scale) + shift)``, all float32 and
    one rounding (to ``out_dtype``, None: x's dtype); shift and scale broadcast against x as
    NumPy does ((B, 1, D) or (B, S, D) beside (B, S, D), or (D,))."""
    sh, sc = _modulation(x, shift, scale)
    with _quiet():
        a = _affine(np.asarray(x, dtype=np.float32), weight, bias, eps)[0]
        return (a * (np.float32(1) + sc) + sh).astype(_out(x, out_dtype))


# -- backward --------------------------------------------------------------------------------------
def _backward(dy, x, weight, bias, eps, shift=None, scale=None):
    """(dx float32, term arrays: e * n, e, dy, dy * a) in float32, rows of x's shape."""
    xf = np.asarray(x, dtype=np.float32)
    dyf = np.asarray(dy, dtype=np.float32)
    if dyf.shape != xf.shape:
        raise ValueError(f"dy must have x's shape {xf.shape}, got {dyf.shape}")
    a, n, d, rstd = _affine(xf, weight, bias, eps)
    e = dyf if scale is None else dyf * (np.float32(1) + scale)
    g = e if weight is None else e * _param(weight)
    k = np.float32(xf.shape[-1])
    mean_g = canonical_sum(g)[..., None] / k
    c = (canonical_sum(g * d)[..., None] * rstd) / k
    dx = rstd * ((g - mean_g) - n * c)
    return dx, e * n, e, dyf, dyf * a


def _column_sum(terms, param):
    """The sum over all rows of each column, float32, in ``param``'s dtype (None: None)."""
    if param is None:
        return None
    hidden = terms.shape[-1]
    return np.sum(terms.reshape(-1, hidden), axis=0, dtype=np.float32).astype(np.asarray(param).dtype)


def _reduce_to(terms, like):
    """``terms`` (x's shape) summed over the axes that ``like`` broadcast along, in float32,
    in ``like``'s shape and dtype."""
    shape = np.shape(like)
    lead = terms.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, s in enumerate(shape) if s == 1 and terms.shape[lead + i] != 1)
    total = np.sum(terms, axis=axes, dtype=np.float32, keepdims=True) if axes else terms
    return total.reshape(shape).astype(np.asarray(like).dtype)


def layer_norm_backward_reference(dy, x, weight=None, bias=None, eps=1e-5):
    """``(dx, dweight, dbias)`` of ``layer_norm``, float32 throughout (see the module
    docstring): dx in x's dtype, dweight / dbias in the parameter's dtype (None where the
    parameter is None); the column sums are NumPy's float32 sums over the rows."""
    with _quiet():
        dx, dw, db, _, _ = _backward(dy, x, weight, bias, eps)
        return dx.astype(np.asarray(x).dtype), _column_sum(dw, weight), _column_sum(db, bias)


def fused_add_layer_norm_backward_reference(dy, d_residual_out, residual_out, weight=None, bias=None, eps=1e-5):
    """``(d_input, dweight, dbias)`` of ``fused_add_layer_norm``: ``residual_out`` is the
    forward's s, ``d_residual_out`` the gradient of that output (None: zero). d_input, the
    gradient of both x and residual, is layer_norm's dx at s plus d_residual_out, added in
    float32 and rounded once to residual_out's dtype."""
    residual_out = np.asarray(residual_out)
    with _quiet():
        dx, dw, db, _, _ = _backward(dy, residual_out, weight, bias, eps)
        if d_residual_out is not None:
            dx = dx + np.asarray(d_residual_out, dtype=np.float32)
        return dx.astype(residual_out.dtype), _column_sum(dw, weight), _column_sum(db, bias)


def layer_norm_modulate_backward_reference(dy, x, shift, scale, eps=1e-6, *, weight=None, bias=None):
    """``(dx, dshift, dscale, dweight, dbias)`` of ``layer_norm_modulate``: dx in x's dtype;
    dshift and dscale summed over the axes their shapes broadcast along, in their shapes and
    dtypes; dweight / dbias over all rows, in the parameters' dtypes (None where absent)."""
    sh, sc = _modulation(x, shift, scale)
    with _quiet():
        dx, dw, db, dsh, dsc = _backward(dy, x, weight, bias, eps, sh, sc)
        return (dx.astype(np.asarray(x).dtype), _reduce_to(dsh, shift), _reduce_to(dsc, scale),
                _column_sum(dw, weight), _column_sum(db, bias))
