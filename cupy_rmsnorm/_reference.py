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

import numpy as np

CASTING_MODES = ("fp32", "llama")
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


def _summed(x, residual):
    """round(x + residual): the float32 sum rounded to the residual's dtype."""
    residual = np.asarray(residual)
    with np.errstate(over="ignore", invalid="ignore"):
        return (np.asarray(x, dtype=np.float32) + np.asarray(residual, dtype=np.float32)).astype(residual.dtype)


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


