"""The numerics contract, written once in NumPy.

This is the CPU path for NumPy arrays and the reference the GPU tests compare with.
Every step mirrors ``kernels/rms_norm.cu``:

- the sum of squares is accumulated in float32 whatever the storage dtype, in one
  canonical order per hidden size (``canonical_sum_of_squares``: a binary tree over the
  element index), ``inv_rms = 1 / sqrt(sum / hidden + eps)``;
- fused: ``residual_out = round(x + residual)`` to the storage dtype first, and that
  rounded value is what gets squared and normalized;
- ``casting_mode="fp32"``: ``y = round(x * inv_rms * (weight + weight_offset))``,
  one rounding at the end (torch.nn.functional.rms_norm, Gemma);
  ``casting_mode="llama"``: ``y = round(round(x * inv_rms) * (weight + weight_offset))``
  (HF LlamaRMSNorm, vLLM). ``weight + weight_offset`` is the weight itself when the offset
  is 0 (no add: a -0 weight stays -0, as in HF's ``weight * x``; ``offset_weight``).
- the quantized forms (``rms_norm_quant`` / ``fused_add_rms_norm_quant``) quantize y as it
  stands in float32 before that final rounding (see "quantized outputs" below).
- mixed precision: y is in O = ``out_dtype`` or x's dtype, and llama mode's intermediate
  rounding is to O; the fused ops' residual may be float32 while x is 16-bit (a float32
  residual stream): round(x + residual) is to the residual's dtype, and y normalizes that
  sum's values; the weight may have any float dtype (it is used as float32).
- gated RMSNorm (``rms_norm_gated_reference``: Gated DeltaNet, Mamba2): see "gated RMSNorm"
  below.
- QK norm + RoPE (``qk_norm_rope_reference``: Qwen3, Gemma 3): see "QK norm + RoPE" below.

Batch invariance: the kernels add the squares in that same canonical tree whatever their
launch plan (threads per row, vectors per thread, cluster, streamed or in registers, vector
width), so a row's outputs depend only on its own values, the hidden size and the call's
arguments: not on how many rows share the call or where the row sits. That holds for every
row that starts on the vector grid the call uses (no scalar head): every row whose start is
16-byte aligned (all rows of a contiguous tensor whose rows are a multiple of 16 bytes
long: a hidden size that is a multiple of 8 for the 16-bit dtypes, of 4 for float32; all
rows of a view whose row strides are), and every call on the scalar path (vector width 1:
where the arrays' relative alignment allows no wider vectors). A row that starts off that
grid is summed in a deterministic order of its own (the same call gives the same bits
every run), not the canonical one. The backward recomputes inv_rms in its own fixed order.

Known differences from the GPU kernels, all within a float32 ulp or two: the kernels use
the hardware ``rsqrtf`` and, as CuPy compiles them, flush float32 subnormals to zero
(``canonical_sum_of_squares(..., flush_subnormals=True)`` models their sum exactly).
"""

import ml_dtypes
import numpy as np

CASTING_MODES = ("fp32", "llama")
ACTIVATIONS = ("silu", "sigmoid")                        # the gated op's act(gate)
FLOAT32_TINY = np.float32(np.finfo(np.float32).tiny)    # the smallest normal float32


def canonical_sum_of_squares(x, flush_subnormals=False):
    """The float32 sum of squares of each row (the last axis) of ``x``, in the kernels' order.

    Each square is rounded to float32 on its own; the squares are then added as a complete
    binary tree over the element index j, padded with zeros to a power of two, neighbours
    first: level k adds the partial sums of j's blocks of 2**k in pairs (blocks 2m and
    2m + 1). A zero added is exact (squares are >= 0), so any padding gives the same bits,
    and so does any power-of-two split of the row into vectors, lanes, warps, blocks and
    steps that adds them low index bits first: the kernels' split, whatever the plan.
    ``flush_subnormals``: flush subnormal squares to zero, as the kernels compiled with
    flush-to-zero do (a sum of normal numbers >= 0 is never subnormal). Returns float32 of
    shape ``x.shape[:-1]``.
    """
    xf = np.asarray(x, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        level = xf * xf
        if flush_subnormals:
            level = np.where(level < FLOAT32_TINY, np.float32(0), level)
        n = level.shape[-1]
        width = 1 << max(0, (n - 1).bit_length())
        if width != n:
            pad = np.zeros(level.shape[:-1] + (width - n,), np.float32)
            level = np.concatenate([level, pad], axis=-1)
        while level.shape[-1] > 1:
            level = level[..., 0::2] + level[..., 1::2]
    return level[..., 0]


def rms_norm_reference(x, weight=None, eps=1e-6, weight_offset=0.0, casting_mode="fp32", *, out_dtype=None):
    """``rms_norm`` over the last axis of a NumPy array, following the contract above.

    ``out_dtype``: y's dtype O (None: x's); llama mode rounds x * inv_rms to O before the
    weight multiply. Infinities and NaNs come out as IEEE arithmetic makes them (an all-zero
    row with eps=0 gives NaN), quietly, as from the GPU kernels: no RuntimeWarning."""
    with np.errstate(divide="ignore", over="ignore", invalid="ignore", under="ignore"):
        return _rms_norm(x, weight, eps, weight_offset, casting_mode, out_dtype)


def _rms_norm(x, weight, eps, weight_offset, casting_mode, out_dtype=None):
    out = _out_dtype(x, out_dtype)
    return _normalized(x, weight, eps, weight_offset, casting_mode, out).astype(out)


def _out_dtype(x, out_dtype):
    """O: ``out_dtype`` as a NumPy dtype, x's dtype for None."""
    return np.asarray(x).dtype if out_dtype is None else np.dtype(out_dtype)


def _round_to(v, dtype):
    """float32 v rounded to ``dtype`` (round to nearest even) and back to float32."""
    return v.astype(dtype).astype(np.float32)


def _normalized(x, weight, eps, weight_offset, casting_mode, round_dtype=None):
    """y in float32, before the final rounding (what the quantized forms quantize);
    llama mode rounds x * inv_rms to ``round_dtype`` (None: x's dtype)."""
    dtype = x.dtype if round_dtype is None else round_dtype
    xf = np.asarray(x, dtype=np.float32)
    sumsq = canonical_sum_of_squares(xf)[..., None]
    inv_rms = np.float32(1.0) / np.sqrt(sumsq / np.float32(x.shape[-1]) + np.float32(eps))
    normed = xf * inv_rms
    if casting_mode == "llama":     # (without a weight the final rounding makes this moot)
        normed = _round_to(normed, dtype)
    if weight is None:
        return normed
    return normed * offset_weight(weight, weight_offset)


def offset_weight(weight, weight_offset):
    """w' = weight + weight_offset in float32, the weight as is for an offset of 0."""
    w = np.asarray(weight, dtype=np.float32)
    return w + np.float32(weight_offset) if weight_offset != 0 else w


def fused_add_rms_norm_reference(x, residual, weight=None, eps=1e-6, weight_offset=0.0,
                                 casting_mode="fp32", *, out_dtype=None):
    """``(rms_norm(round(x + residual)), round(x + residual))`` in NumPy.

    The sum is ``x + residual`` in float32 rounded to the residual's dtype (x's, or float32
    for a float32 residual stream with 16-bit x): that is residual_out, and y normalizes its
    values, in O = ``out_dtype`` or x's dtype (llama mode rounding to O)."""
    summed = _summed(x, residual)
    return rms_norm_reference(summed, weight, eps, weight_offset, casting_mode,
                              out_dtype=_out_dtype(x, out_dtype)), summed


def _summed(x, residual):
    """round(x + residual): the float32 sum rounded to the residual's dtype."""
    residual = np.asarray(residual)
    with np.errstate(over="ignore", invalid="ignore"):
        return (np.asarray(x, dtype=np.float32) + np.asarray(residual, dtype=np.float32)).astype(residual.dtype)


# -- quantized outputs -----------------------------------------------------------------------------
# y is the float32 value above before its final rounding (llama mode included). Then, in float32:
#   static:    scale given (one float32 in device memory);
#   per token: amax = max |y| over the row (NaN ignored, as fmaxf does), per group: over each
#              run of group_size elements; scale = max(min(amax, scale_ub) / QMAX, MIN_SCALE);
#   inv = 1 / scale (correctly rounded); q = sat(round(y * inv)) to the quant dtype: round to
#   nearest even, saturating at +-QMAX (an infinity too), NaN stays NaN (int8: 0).
# Multiplying by the reciprocal (as FlashInfer and vLLM's static form do) rather than dividing
# per element keeps the kernel off the ALU limit; both sides compute exactly this.
QUANT_DTYPES = {"float8_e4m3fn": (ml_dtypes.float8_e4m3fn, 448.0),
                "float8_e5m2": (ml_dtypes.float8_e5m2, 57344.0),
                "int8": (np.dtype(np.int8), 127.0)}
GROUP_SIZES = (128,)
MIN_SCALE_DIVISOR = 512.0   # MIN_SCALE = 1 / (QMAX * 512) (vLLM's): an all-zero row gives zeros, not NaN


def quant_max(quant_dtype):
    """QMAX: the largest finite value of the quant dtype (the saturation bound)."""
    return QUANT_DTYPES[quant_dtype][1]


def min_scale(quant_dtype):
    return np.float32(1.0) / np.float32(quant_max(quant_dtype) * MIN_SCALE_DIVISOR)


def dynamic_scales(y, quant_dtype, scale_ub=None):
    """float32 scales of y's last axis (keepdims): max(min(amax, scale_ub) / QMAX, MIN_SCALE)."""
    with np.errstate(invalid="ignore"):
        amax = np.max(np.where(np.isnan(y), np.float32(0), np.abs(y)), axis=-1, keepdims=True)
    if scale_ub is not None:
        amax = np.minimum(amax, np.float32(scale_ub))
    return np.maximum(amax / np.float32(quant_max(quant_dtype)), min_scale(quant_dtype))


def quantize(y, scale, quant_dtype):
    """``sat(round(y * (1 / scale)))`` in the quant dtype (ml_dtypes float8, or int8)."""
    dtype, qmax = QUANT_DTYPES[quant_dtype]
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        inv = np.float32(1.0) / np.asarray(scale, dtype=np.float32)
        v = np.clip(y * inv, np.float32(-qmax), np.float32(qmax))   # NaN stays NaN
        if dtype == np.int8:
            return np.where(np.isnan(v), np.float32(0), np.rint(v)).astype(np.int8)
        return v.astype(dtype)


def rms_norm_quant_reference(x, weight=None, eps=1e-6, weight_offset=0.0, casting_mode="fp32", *,
                             scale=None, group_size=None, scale_ub=None, quant_dtype="float8_e4m3fn"):
    """``(q, scales)``: ``rms_norm``'s y before its final rounding, quantized (see above).

    ``scale`` given: the static form (scales is that scale, as float32); else per token
    (scales of shape x.shape[:-1] + (1,)) or, with ``group_size``, per group of that many
    elements (scales of shape x.shape[:-1] + (hidden // group_size,), contiguous here)."""
    return _quantized(x, weight, eps, weight_offset, casting_mode, x.dtype, scale=scale, group_size=group_size,
                      scale_ub=scale_ub, quant_dtype=quant_dtype)


def _quantized(x, weight, eps, weight_offset, casting_mode, round_dtype, *, scale=None, group_size=None,
               scale_ub=None, quant_dtype="float8_e4m3fn"):
    """``(q, scales)`` of x's normalized values, llama mode rounding to ``round_dtype``."""
    with np.errstate(divide="ignore", over="ignore", invalid="ignore", under="ignore"):
        y = _normalized(x, weight, eps, weight_offset, casting_mode, round_dtype)
    if scale is not None:
        scales = np.asarray(scale, dtype=np.float32)
        return quantize(y, scales.reshape(()), quant_dtype), scales
    if group_size is None:
        scales = dynamic_scales(y, quant_dtype, scale_ub)
        return quantize(y, scales, quant_dtype), scales
    groups = y.reshape(y.shape[:-1] + (y.shape[-1] // group_size, group_size))
    scales = dynamic_scales(groups, quant_dtype, scale_ub)
    return quantize(groups, scales, quant_dtype).reshape(y.shape), scales[..., 0]


def fused_add_rms_norm_quant_reference(x, residual, weight=None, eps=1e-6, weight_offset=0.0,
                                       casting_mode="fp32", **quant):
    """``(q, residual_out, scales)``: ``rms_norm_quant_reference`` of round(x + residual).

    round(x + residual) is to the residual's dtype (a float32 residual stream: float32);
    llama mode rounds x * inv_rms to x's dtype, as the unfused quantized form does."""
    summed = _summed(x, residual)
    q, scales = _quantized(summed, weight, eps, weight_offset, casting_mode, np.asarray(x).dtype, **quant)
    return q, summed, scales


# -- backward ----------------------------------------------------------------------------------
# Per row, in float32 (kernels/rms_norm_backward.cu computes the same):
#   r = 1 / sqrt(sum(x^2) / hidden + eps), xhat = x * r, w' = weight + weight_offset,
#   g = dy * w' (dy without a weight), dx = r * (g - xhat * mean(g * xhat));
#   dweight = sum over rows of dy * xhat, with xhat rounded to dy's dtype D first in llama
#   mode (D is the forward's output dtype O: what the forward multiplied the weight by; x's
#   dtype when out_dtype was not given), summed in float32 and returned in the weight's dtype.
# The fused op's gradient at s = round(x + residual) is rms_norm's dx at s plus the gradient
# of residual_out, rounded once, to residual_out's dtype (float32 for a float32 residual
# stream, whatever dy's dtype); it is the gradient of both x and residual.


def _backward_float32(dy, x, weight, eps, weight_offset, casting_mode, weight_grad=True, llama_dtype=None):
    """(dx in float32, dweight in the weight's dtype or None); llama mode rounds xhat to
    ``llama_dtype`` (None: dy's dtype, the forward's output dtype)."""
    hidden = x.shape[-1]
    xf = np.asarray(x, dtype=np.float32)
    dyf = np.asarray(dy, dtype=np.float32)
    sumsq = np.sum(xf * xf, axis=-1, keepdims=True, dtype=np.float32)
    inv_rms = np.float32(1.0) / np.sqrt(sumsq / np.float32(hidden) + np.float32(eps))
    xhat = xf * inv_rms
    g = dyf if weight is None else dyf * offset_weight(weight, weight_offset)
    mean_gx = np.sum(g * xhat, axis=-1, keepdims=True, dtype=np.float32) / np.float32(hidden)
    dx = inv_rms * (g - xhat * mean_gx)
    if weight is None or not weight_grad:
        return dx, None
    if casting_mode == "llama":
        xhat = _round_to(xhat, np.asarray(dy).dtype if llama_dtype is None else llama_dtype)
    dweight = np.sum((dyf * xhat).reshape(-1, hidden), axis=0, dtype=np.float32)
    return dx, dweight.astype(np.asarray(weight).dtype)


def rms_norm_backward_reference(dy, x, weight=None, eps=1e-6, weight_offset=0.0, casting_mode="fp32"):
    """``(dx, dweight)`` of ``rms_norm`` in NumPy, following the contract above (dweight
    None when weight is None; dx in x's dtype; dy in the forward's output dtype, which llama
    mode's xhat is rounded to); quiet about infinities and NaNs, as the forward."""
    with np.errstate(divide="ignore", over="ignore", invalid="ignore", under="ignore"):
        dx, dweight = _backward_float32(dy, x, weight, eps, weight_offset, casting_mode)
        return dx.astype(x.dtype), dweight


def fused_add_rms_norm_backward_reference(dy, d_residual_out, residual_out, weight=None, eps=1e-6,
                                          weight_offset=0.0, casting_mode="fp32"):
    """``(d_input, dweight)`` of ``fused_add_rms_norm`` in NumPy: ``residual_out`` is the
    forward's s = round(x + residual), ``d_residual_out`` the gradient of that output (None
    for zero); d_input is the gradient of both x and residual, in residual_out's dtype (dy
    may be in another: the forward's y dtype)."""
    with np.errstate(divide="ignore", over="ignore", invalid="ignore", under="ignore"):
        dx, dweight = _backward_float32(dy, residual_out, weight, eps, weight_offset, casting_mode)
        if d_residual_out is not None:
            dx = dx + np.asarray(d_residual_out, dtype=np.float32)
        return dx.astype(residual_out.dtype), dweight


# -- gated RMSNorm ---------------------------------------------------------------------------------
# Gated DeltaNet, Mamba2, Nemotron-H, flash-linear-attention (kernels/rms_norm_gated.cu computes
# the same). x and the gate z have one shape (..., hidden); weight is (hidden,) of any float
# dtype, or None; O = out_dtype or x's dtype; round_O(v) = v rounded to O (round to nearest
# even) and back to float32. All arithmetic float32, in exactly this order:
#   s = 1 / (1 + exp(-z)); act = z * s (silu) or s (sigmoid);
#   act' = s * (1 + z * (1 - s)) (silu) or s * (1 - s) (sigmoid).
#   groups: group_size g (None: hidden; hidden a multiple of g): a row is hidden // g groups
#   of g consecutive elements, each normalized on its own (its own r); the weight runs over
#   the whole row (group k uses weight[k*g:(k+1)*g]).
#   w' = offset_weight(weight, weight_offset) (w' = 1 without a weight).
#   r(v) = 1 / sqrt(canonical_sum_of_squares(v's group) / g + eps)
#   norm before gate (norm_before_gate=True, the default):
#       n = x * r(x); llama: n = round_O(n); p = n * w'; llama with round_product:
#       p = round_O(p); y = p * act
#   gate before norm (norm_before_gate=False, Mamba2):
#       h = x * act; n = h * r(h); llama: n = round_O(n); y = n * w'
#   result: y rounded to O.
#   round_product: casting_mode == "llama", a weight is given, its dtype is O and
#   weight_offset == 0 (Hugging Face's `weight * hidden.to(dtype)` rounds in the weight's dtype).
# Backward, per group, in float32, r from a plain np.sum of the squares (as _backward_float32):
# D = dy's dtype (the forward's O); "xw" is xhat rounded to D in llama mode, xhat in fp32 mode.
#   norm before gate: xhat = x * r; gx = dy * w' * act; c = sum(gx * xhat) / g;
#       dx = r * (gx - xhat * c); p = xw * w', then round_D(p) with round_product (D for O);
#       dgate = dy * p * act'; dweight += dy * act * xw
#   gate before norm: h = x * act; hhat = h * r; gg = dy * w'; c = sum(gg * hhat) / g;
#       dh = r * (gg - hhat * c); dx = dh * act; dgate = dh * x * act';
#       dweight += dy * (llama ? round_D(hhat) : hhat)
#   dx in x's dtype, dgate in the gate's dtype, dweight (the sum over all rows of each
#   column's terms, in float32) in the weight's dtype, each rounded once; dweight None
#   without a weight.


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


# -- QK norm + RoPE -------------------------------------------------------------------------------
# Qwen3, Gemma 3, OLMo 2 (kernels/qk_norm_rope.cu computes the same). q is (..., Hq, D), k is
# (..., Hk, D) with the same leading axes (the tokens); each head is a row of rms_norm:
#   y = _normalized(head): x * inv_rms * w' in float32, the canonical tree's sum, llama mode
#       rounding x * inv_rms to the storage dtype T first (w' = w + weight_offset, 1 without
#       weights); q's heads take q_weight, k's k_weight;
# then channels j < rotary_dim turn with their partner p(j) by the token's angles, in float32:
#   NeoX (is_neox): p(j) = j + rotary_dim / 2 for the first half, j - rotary_dim / 2 for the
#   second; interleaved (GPT-J): p(j) = j ^ 1. A pair's first channel (first half, even j):
#       o[j] = y[j] * cos[j] - y[p] * sin[j]; the second: o[j] = y[j] * cos[j] + y[p] * sin[j]
#   (each product rounded to float32 on its own, then the sum), channels past rotary_dim
#   o[j] = y[j]; out = o rounded to T, once.
# The angles cos[j], sin[j] of a token: transformers' convention (cos, sin given, shape
# broadcastable to tokens + (rotary_dim,)) uses them channel by channel; vLLM's and
# FlashInfer's (positions, cos_sin_cache of shape (max_position, rotary_dim): cos in the first
# half of a row, sin in the second) takes the position's row: channel j's angle is m(j) = j mod
# (rotary_dim / 2) (NeoX) or j // 2 (interleaved), cos[j] = row[m(j)], sin[j] = row[rotary_dim
# / 2 + m(j)]. A position outside [0, max_position) gives NaN angles (its rotated channels are
# NaN), as the kernels do; the public NumPy path refuses it (ValueError) before computing.
# Backward, from do (the gradient of out, T): the rotation's transpose (by -theta),
#   dy[j] = do[j] * cos[j] - do[p] * sin[p] (j first), do[j] * cos[j] + do[p] * sin[p] (second),
# channels past rotary_dim dy = do; then _backward_float32 of each of q and k with dy (all its
# heads, all tokens as rows; llama mode rounding xhat to T): dq, dk in T, dq_weight and
# dk_weight summed over every token and head of their kind, in the weights' dtype.


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
