"""The public functions. Each states its formula and hands its arguments, as one tuple of
arrays, to the call flow (``_call``), which runs them on the arrays' kind: CuPy on the GPU,
NumPy through the reference on the CPU, torch tensors zero-copy on torch's current stream.
"""

from typing import Any, Literal, Optional, Tuple

from ._call import (backward_call, forward_call, gated_backward_call, gated_call, qk_rope_backward_call, qk_rope_call,
                    quant_call)
from ._layout import BackwardArrays, GatedBackwardArrays, QkRopeBackwardArrays

Array = Any
"""A CuPy array, a NumPy array, a PyTorch tensor or a CUDA array with ``__dlpack__``."""
CastingMode = Literal["fp32", "llama"]


def rms_norm(x: Array, weight: Optional[Array] = None, eps: float = 1e-6, *, out: Optional[Array] = None,
             out_dtype: Any = None, weight_offset: float = 0.0, casting_mode: CastingMode = "fp32") -> Array:
    """Root-mean-square normalization over the last axis.

    ``out[..., i] = x[..., i] / sqrt(mean(x[..., :]**2) + eps) * (weight[i] + weight_offset)``

    The sum of squares is accumulated in float32. ``casting_mode="fp32"`` rounds once
    at the end (torch.nn.functional.rms_norm); ``"llama"`` rounds the normalized value
    to x's dtype before the weight multiply (HF LlamaRMSNorm, vLLM).

    Args:
        x: (..., hidden) float32, float16 or bfloat16 array: CuPy (runs on the GPU, on
            CuPy's current stream), NumPy (runs the reference on the CPU), a PyTorch CUDA
            tensor or any CUDA array with ``__dlpack__`` (zero copy, on torch's current
            stream for tensors).
        weight: (hidden,) array of float32, float16 or bfloat16 (any, whatever x's), or None
            for no scaling.
        eps: added to the mean of squares; finite, >= 0.
        out: optional destination of x's shape and the output dtype; may be ``x`` itself (in
            place). Overwritten.
        out_dtype: the output's dtype (float32, float16 or bfloat16, as a name or a NumPy,
            ml_dtypes or torch dtype); default x's. ``"llama"`` rounds to it.
        weight_offset: added to the weight in float32 (Gemma uses 1.0).
        casting_mode: ``"fp32"`` or ``"llama"``.

    Returns:
        ``out`` (a new array of x's kind when ``out`` is None).
    """
    return forward_call(False, (x, None, weight, out, None), eps, weight_offset, casting_mode, out_dtype)


def fused_add_rms_norm(x: Array, residual: Array, weight: Optional[Array] = None, eps: float = 1e-6, *,
                       out: Optional[Array] = None, residual_out: Optional[Array] = None, out_dtype: Any = None,
                       weight_offset: float = 0.0, casting_mode: CastingMode = "fp32") -> Tuple[Array, Array]:
    """Residual add then RMSNorm, in one pass over memory.

    ``residual_out = round(x + residual)`` (to the residual's dtype), then
    ``out = rms_norm(residual_out, weight, eps)``: the rounded sum is what gets
    normalized, so the result equals the unfused ops exactly.

    Mixed precision: the residual (and residual_out) may be float32 with x of any dtype, a
    float32 residual stream: residual_out = x + residual in float32, normalized from that
    float32 value; out has ``out_dtype`` (default x's).

    ``out=x, residual_out=residual`` is the in-place form of vLLM's and FlashInfer's
    fused op (both arguments overwritten, nothing allocated). Other arguments as in
    ``rms_norm``.

    Returns:
        ``(out, residual_out)``.
    """
    return forward_call(True, (x, residual, weight, out, residual_out), eps, weight_offset, casting_mode, out_dtype)


def rms_norm_quant(x: Array, weight: Optional[Array] = None, eps: float = 1e-6, *, scale: Optional[Array] = None,
                   group_size: Optional[int] = None, out: Optional[Array] = None, scales_out: Optional[Array] = None,
                   scale_ub: Optional[float] = None, quant_dtype: Any = "float8_e4m3fn", weight_offset: float = 0.0,
                   casting_mode: CastingMode = "fp32") -> Tuple[Array, Array]:
    """RMSNorm with its output quantized (FP8 or int8) in the same pass.

    ``y = x / sqrt(mean(x**2) + eps) * (weight + weight_offset)``, in float32 as ``rms_norm``
    computes it before its final rounding (``casting_mode="llama"``: x * inv_rms rounded to
    x's dtype first), then ``q = sat(round(y * (1 / s)))``: round to nearest even, saturating
    at the quant dtype's largest value QMAX (448 for float8_e4m3fn, 57344 for float8_e5m2,
    127 for int8); NaN stays NaN (int8: 0). The scale s is

    - ``scale`` given (static): that float32 (one element, in device memory: it may change
      between CUDA-graph replays);
    - else per token: ``max(min(amax, scale_ub) / QMAX, 1 / (QMAX * 512))``, amax the row's
      max |y| (NaN ignored); an all-zero row gives zeros;
    - ``group_size=128``: the same per 128 consecutive elements of a row (hidden a multiple
      of 128), for block-scaled FP8 GEMMs (DeepSeek-style, DeepGEMM, FlashInfer).

    Args:
        x, weight, eps, weight_offset, casting_mode: as in ``rms_norm``.
        scale: the static form's float32 scale (one element), an array of x's kind.
        group_size: None (one scale per row) or 128.
        out: optional destination of x's shape: the quant dtype, or uint8 for the FP8 bytes.
            Overwritten.
        scales_out: optional float32 destination of the scales' shape (dynamic forms; its
            leading axes at one stride from row to row). Overwritten.
        scale_ub: optional upper bound on amax (vLLM's), a positive float.
        quant_dtype: ``"float8_e4m3fn"`` (default), ``"float8_e5m2"`` or ``"int8"`` (or the
            torch / ml_dtypes dtype of that name).

    Returns:
        ``(q, scales)``: q of x's shape (torch: a torch.float8_e4m3fn / float8_e5m2 / int8
        tensor; CuPy, which has no FP8 dtype: uint8 holding the FP8 bits; NumPy: ml_dtypes);
        scales float32: the given ``scale`` (static), x.shape[:-1] + (1,) (per token,
        contiguous) or x.shape[:-1] + (hidden // 128,) (per group; fresh ones column-major
        with each column padded to a multiple of 4 rows: element (r, g) at g * round_up(rows,
        4) + r, the layout DeepGEMM and FlashInfer's block-scaled GEMMs read). Dequantize
        with ``q.astype(float32) * scales`` (per group: broadcast over each group).
    """
    return quant_call(False, (x, None, weight, out, None, scale, scales_out), eps, weight_offset, casting_mode,
                      group_size, scale_ub, quant_dtype)


def fused_add_rms_norm_quant(x: Array, residual: Array, weight: Optional[Array] = None, eps: float = 1e-6, *,
                             scale: Optional[Array] = None, group_size: Optional[int] = None,
                             out: Optional[Array] = None, residual_out: Optional[Array] = None,
                             scales_out: Optional[Array] = None, scale_ub: Optional[float] = None,
                             quant_dtype: Any = "float8_e4m3fn", weight_offset: float = 0.0,
                             casting_mode: CastingMode = "fp32") -> Tuple[Array, Array, Array]:
    """Residual add, RMSNorm and quantization in one pass.

    ``residual_out = round(x + residual)`` (to x's dtype), then ``rms_norm_quant(residual_out,
    ...)``. ``residual_out=residual`` updates the residual in place (vLLM's
    ``fused_add_rms_norm_static_fp8_quant``; overwritten). Other arguments as in
    ``rms_norm_quant``.

    Returns:
        ``(q, residual_out, scales)``.
    """
    return quant_call(True, (x, residual, weight, out, residual_out, scale, scales_out), eps, weight_offset,
                      casting_mode, group_size, scale_ub, quant_dtype)


def rms_norm_backward(dy: Array, x: Array, weight: Optional[Array] = None, eps: float = 1e-6, *,
                      weight_offset: float = 0.0, casting_mode: CastingMode = "fp32") -> Tuple[Array, Optional[Array]]:
    """Gradients of ``rms_norm(x, weight, eps, ...)`` given ``dy``, the gradient of its output.

    Per row, in float32: ``r = rsqrt(mean(x**2) + eps)``, ``xhat = x * r``,
    ``g = dy * (weight + weight_offset)`` (``dy`` without a weight),
    ``dx = r * (g - xhat * mean(g * xhat))``; ``dweight = sum over rows of dy * xhat``
    (``"llama"``: xhat rounded to x's dtype first, as the forward multiplied it), added
    in float32 in a fixed order (the same bits every run) and returned in the weight's
    dtype. inv_rms is recomputed from x: the forward saves nothing.

    Args:
        dy: the gradient of the output: x's shape, the output's dtype (x's, or the forward's
            out_dtype).
        x, weight, eps, weight_offset, casting_mode: the forward's arguments.

    Returns:
        ``(dx, dweight)``: new arrays of x's kind (dx: x's shape and dtype, contiguous;
        dweight: the weight's shape and dtype), dweight None when weight is None. Not
        differentiable itself (no double backward).
    """
    return backward_call(False, BackwardArrays(dy, x, None, weight), eps, weight_offset, casting_mode)


def fused_add_rms_norm_backward(dy: Array, d_residual_out: Optional[Array], residual_out: Array,
                                weight: Optional[Array] = None, eps: float = 1e-6, *, weight_offset: float = 0.0,
                                casting_mode: CastingMode = "fp32") -> Tuple[Array, Optional[Array]]:
    """Gradients of ``fused_add_rms_norm(x, residual, weight, eps, ...)``.

    ``residual_out`` is the forward's ``s = round(x + residual)``; the gradient reaching s
    is ``rms_norm_backward``'s dx at s plus ``d_residual_out`` (the gradient of the
    forward's residual_out; None for zero), added in float32 and rounded once, and it
    flows unchanged to both x and residual.

    Returns:
        ``(d_input, dweight)``: d_input (residual_out's shape and dtype) is the gradient of
        both x and residual; dweight as in ``rms_norm_backward``.
    """
    return backward_call(True, BackwardArrays(dy, residual_out, d_residual_out, weight), eps, weight_offset,
                         casting_mode)


def rms_norm_gated(x: Array, gate: Array, weight: Optional[Array] = None, eps: float = 1e-6, *,
                   group_size: Optional[int] = None, norm_before_gate: bool = True, activation: str = "silu",
                   out: Optional[Array] = None, out_dtype: Any = None, weight_offset: float = 0.0,
                   casting_mode: CastingMode = "fp32") -> Array:
    """Gated RMSNorm, the norm of linear-attention and state-space layers (Gated DeltaNet in
    Qwen3-Next / Qwen3.5, Mamba2, Nemotron-H, flash-linear-attention).

    ``norm_before_gate=True``: ``y = rmsnorm(x) * (weight + weight_offset) * act(gate)``;
    ``False`` (Mamba2): ``y = rmsnorm(x * act(gate)) * (weight + weight_offset)``. ``act`` is
    ``"silu"`` (``z * sigmoid(z)``) or ``"sigmoid"``, in float32. With ``group_size`` each run
    of that many channels of a row is normalized on its own (hidden a multiple of it); the
    weight runs over the whole row. Float32 throughout with one rounding at the end
    (``casting_mode="fp32"``), or Hugging Face's roundings (``"llama"``: the normalized value
    rounded to the output dtype before the weight multiply, the product with a weight of that
    dtype rounded too, then the gate).

    Args:
        x: (..., hidden) float32, float16 or bfloat16 array (CuPy, NumPy, a PyTorch CUDA tensor
            or a CUDA ``__dlpack__`` producer), rows may be strided views.
        gate: x's shape and dtype; typically a view into a packed projection output.
        weight: (hidden,) of any of the three dtypes, or None.
        eps, weight_offset, casting_mode: as in ``rms_norm``.
        group_size: channels normalized together, or None for the whole row.
        norm_before_gate, activation: see above.
        out: optional destination of x's shape and the output dtype (overwritten; may be x or
            gate themselves).
        out_dtype: the output's dtype (default x's).

    Returns:
        ``out`` (a new array of x's kind when ``out`` is None).
    """
    return gated_call((x, gate, weight, out), eps, weight_offset, casting_mode, group_size, norm_before_gate,
                      activation, out_dtype)


def rms_norm_gated_backward(dy: Array, x: Array, gate: Array, weight: Optional[Array] = None, eps: float = 1e-6, *,
                            group_size: Optional[int] = None, norm_before_gate: bool = True,
                            activation: str = "silu", weight_offset: float = 0.0,
                            casting_mode: CastingMode = "fp32") -> Tuple[Array, Array, Optional[Array]]:
    """Gradients of ``rms_norm_gated(x, gate, weight, eps, ...)`` given ``dy``, the gradient of
    its output (x's shape, the output's dtype).

    In float32, per group: r = inv_rms, a = act(gate), a' = act'(gate), g = dy * w'. Norm before
    gate: ``dx = r * (g*a - xhat * mean(g*a * xhat))``, ``dgate = dy * xhat * w' * a'``,
    ``dweight = sum over rows of dy * a * xhat``; gate before norm (h = x * a): ``dh = r * (g -
    hhat * mean(g * hhat))``, ``dx = dh * a``, ``dgate = dh * x * a'``, ``dweight = sum of dy *
    hhat`` (llama: xhat / hhat rounded as the forward multiplied them). dweight is added in a
    fixed order (the same bits every run).

    Returns:
        ``(dx, dgate, dweight)``: new arrays of x's kind (dx and dgate of x's shape and dtype,
        contiguous; dweight of the weight's dtype, None without a weight).
    """
    return gated_backward_call(GatedBackwardArrays(dy, x, gate, weight), eps, weight_offset, casting_mode, group_size,
                               norm_before_gate, activation)


def qk_norm_rope(q: Array, k: Array, q_weight: Optional[Array], k_weight: Optional[Array], eps: float = 1e-6, *,
                 cos: Optional[Array] = None, sin: Optional[Array] = None, positions: Optional[Array] = None,
                 cos_sin_cache: Optional[Array] = None, rotary_dim: Optional[int] = None, is_neox: bool = True,
                 out_q: Optional[Array] = None, out_k: Optional[Array] = None, weight_offset: float = 0.0,
                 casting_mode: CastingMode = "fp32") -> Tuple[Array, Array]:
    """Per-head RMSNorm of q and k followed by the rotary position embedding, in one pass (the
    attention input of Qwen3, Gemma 3, OLMo 2).

    For each head x of q (weight q_weight) and of k (k_weight), in float32:
    ``y = x / sqrt(mean(x**2) + eps) * (weight + weight_offset)`` over head_dim
    (``casting_mode="llama"``: x / rms rounded to q's dtype first, as ``rms_norm``), then for
    each channel j < rotary_dim and its partner p (NeoX, ``is_neox=True``: the other half of
    rotary_dim, j +- rotary_dim / 2; GPT-J: the other of the pair 2i, 2i + 1):
    ``out[j] = y[j] * cos[j] - y[p] * sin[j]`` for the pair's first channel (first half, even
    j), ``y[j] * cos[j] + y[p] * sin[j]`` for the second; channels past rotary_dim are y
    itself. One rounding to q's dtype, after the rotation.

    The angles come from exactly one of two conventions:

    - ``cos``, ``sin`` (transformers'): per token and channel, shape ``(..., rotary_dim)``
      broadcasting over q's leading axes (HF passes ``(batch, seq, rotary_dim)``, the halves
      duplicated for NeoX), used channel by channel;
    - ``positions`` (int32 / int64, q's leading axes) and ``cos_sin_cache`` of shape
      ``(max_position, rotary_dim)``, cos in its first rotary_dim / 2 columns and sin in the
      others (vLLM's and FlashInfer's): channel j's angle is the position's column
      j mod (rotary_dim / 2) (NeoX) or j // 2 (GPT-J). A position outside [0, max_position)
      gives NaN in the rotated channels of its token's heads on the GPU (nothing outside the
      cache is read); NumPy arrays raise ValueError.

    Args:
        q: (..., q_heads, head_dim) float32, float16 or bfloat16 array: CuPy (runs on the GPU, on
            CuPy's current stream), NumPy (runs the reference on the CPU), a PyTorch CUDA tensor
            (autograd and torch.compile through the registered ops; the angles get no gradient)
            or a CUDA ``__dlpack__`` producer. Any strided leading axes, e.g.
            the per-head views of a packed ``(T, (q_heads + 2 k_heads) * head_dim)`` projection.
        k: (..., k_heads, head_dim), q's dtype and leading axes.
        q_weight, k_weight: (head_dim,) of q's dtype or float32 (both of one dtype), or both None.
        eps, weight_offset, casting_mode: as in ``rms_norm``.
        cos, sin: transformers' angles, float32 or q's dtype (see above).
        positions, cos_sin_cache: vLLM's angles, the cache float32 or q's dtype (see above).
        rotary_dim: the rotated channels, the first of each head (partial rotary); default and
            only allowed value: the table's width. Even, at most head_dim (up to 512).
        is_neox: NeoX halves (True) or GPT-J interleaved pairs (False).
        out_q, out_k: optional destinations of q's and k's shapes and dtype, overwritten;
            ``out_q=q, out_k=k`` works in place.

    Returns:
        ``(q_out, k_out)``: out_q and out_k (new arrays of q's kind where not given).
    """
    return qk_rope_call((q, k, q_weight, k_weight, cos, sin, positions, cos_sin_cache, out_q, out_k), eps,
                        weight_offset, casting_mode, rotary_dim, is_neox)


def qk_norm_rope_backward(dq_out: Array, dk_out: Array, q: Array, k: Array, q_weight: Optional[Array],
                          k_weight: Optional[Array], eps: float = 1e-6, *, cos: Optional[Array] = None,
                          sin: Optional[Array] = None, positions: Optional[Array] = None,
                          cos_sin_cache: Optional[Array] = None, rotary_dim: Optional[int] = None,
                          is_neox: bool = True, weight_offset: float = 0.0,
                          casting_mode: CastingMode = "fp32") -> Tuple[Array, Array, Optional[Array], Optional[Array]]:
    """Gradients of ``qk_norm_rope(q, k, q_weight, k_weight, eps, ...)`` given ``dq_out`` and
    ``dk_out``, the gradients of its two outputs (q's and k's shapes, q's dtype).

    Per head, in float32: the rotation's transpose (by -theta) ``dy[j] = do[j] * cos[j] +
    do[p] * sin[p]`` for a pair's first channel, ``do[j] * cos[j] - do[p] * sin[p]`` for the
    second (dy = do past rotary_dim), then the norm's backward as ``rms_norm_backward``: with
    r = rsqrt(mean(x**2) + eps), xhat = x * r, g = dy * (weight + weight_offset),
    ``dx = r * (g - xhat * mean(g * xhat))``; ``dq_weight`` / ``dk_weight`` = the sum over every
    token and head of q / k of ``dy * xhat`` (``"llama"``: xhat rounded to q's dtype first),
    added in float32 in a fixed order (the same bits every run). Other arguments: the
    forward's. Nothing is overwritten.

    Returns:
        ``(dq, dk, dq_weight, dk_weight)``: new arrays of q's kind (dq, dk of q's and k's shapes
        and dtype, contiguous; the weights' gradients of their shape and dtype, None without
        weights). Not differentiable itself.
    """
    return qk_rope_backward_call(QkRopeBackwardArrays(dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, positions,
                                                      cos_sin_cache), eps, weight_offset, casting_mode, rotary_dim,
                                 is_neox)
