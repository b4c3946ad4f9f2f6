"""qk_norm_rope and its backward: per-head RMSNorm of q and k fused with the rotary embedding,
the public functions, their specs and their torch ops.

The family's parts: ``checks`` (the angles' conventions, heads and rotary_dim), ``launch``
(the per-head layouts, plans and launchers, forward and backward), ``reference``. The kernels:
kernels/qk_norm_rope.cu with kernels/rope.cuh.
"""

import functools
from typing import Optional, Tuple

from ... import _interop
from ..._pipeline import Array, CastingMode, OpSpec, call, register, store
from ..._validate import check_scalars
from .checks import check_qk_rope, check_qk_rope_arrays
from .launch import (QK_ROPE_OUTPUTS, QkRopeArrays, QkRopeBackwardArrays, QkRopeBackwardLauncher, QkRopeLauncher,
                     qk_rope_layout)
from .reference import qk_norm_rope_backward_reference, qk_norm_rope_reference

ANGLES = ("cos", "sin", "positions", "cos_sin_cache")


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
    return call(QK_NORM_ROPE, (q, k, q_weight, k_weight, cos, sin, positions, cos_sin_cache, out_q, out_k),
                (eps, weight_offset, casting_mode, rotary_dim, is_neox))


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
    return call(QK_NORM_ROPE_BACKWARD, (dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, positions, cos_sin_cache),
                (eps, weight_offset, casting_mode, rotary_dim, is_neox, True))


# -- the spec's hooks ------------------------------------------------------------------------------

def _check(arrays, eps, weight_offset, casting_mode, rotary_dim, is_neox, weight_grad=True):
    return (check_scalars(eps, weight_offset, casting_mode, arrays.q_weight is not None),
            check_qk_rope(arrays, rotary_dim, is_neox), bool(weight_grad))


def _layout_of(gradients):
    """``gradients``: how many output gradients lead the arrays (the backward's dq_out, dk_out)."""
    def laid_out(call, options):
        metas = call.metas
        if gradients:
            spec = check_qk_rope_arrays(QkRopeArrays(*metas[gradients:]), options[1], metas[:gradients])
        else:
            spec = check_qk_rope_arrays(metas, options[1])
        arrays, layout = qk_rope_layout(call.kind, call.resolved, call.metas, spec, call.copied)
        return arrays, (layout, spec), layout.copied
    return laid_out


def _rope_tables(arrays, spec):
    """The angles' keyword arguments of the reference, after checking (the NumPy path can, the
    kernels cannot) that every position lies in the cache: ValueError otherwise."""
    if spec.cache:
        positions, rows = arrays.positions, arrays.cos_sin_cache.shape[0]
        if positions.size and (positions.min() < 0 or positions.max() >= rows):
            raise ValueError(f"positions must lie in [0, {rows}) (cos_sin_cache's rows), got values from "
                             f"{positions.min()} to {positions.max()}")
        return dict(positions=arrays.positions, cos_sin_cache=arrays.cos_sin_cache)
    return dict(cos=arrays.cos, sin=arrays.sin)


def _reference(arrays, options, layouts):
    scalars, spec = options[0], layouts[1]
    q_out, k_out = qk_norm_rope_reference(arrays.q, arrays.k, arrays.q_weight, arrays.k_weight, scalars.eps,
                                          scalars.weight_offset, scalars.casting_mode, rotary_dim=spec.rotary_dim,
                                          is_neox=spec.is_neox, **_rope_tables(arrays, spec))
    return store(arrays.out_q, q_out), store(arrays.out_k, k_out)


def _launcher(layouts, options, kind):
    launcher = QkRopeLauncher(layouts[0], options[0], kind)
    return launcher.entry, lambda arrays: launcher(arrays, checked=True)


def _backward_reference(arrays, options, layouts):
    scalars, spec, weight_grad = options[0], layouts[1], options[2]
    dq, dk, dq_weight, dk_weight = qk_norm_rope_backward_reference(
        arrays.dq_out, arrays.dk_out, arrays.q, arrays.k, arrays.q_weight, arrays.k_weight, scalars.eps,
        scalars.weight_offset, scalars.casting_mode, rotary_dim=spec.rotary_dim, is_neox=spec.is_neox,
        **_rope_tables(arrays, spec))
    return (dq, dk) + ((dq_weight, dk_weight) if weight_grad else (None, None))


def _backward_launcher(layouts, options, kind):
    launcher = QkRopeBackwardLauncher(layouts[0], options[0], kind)
    entry = functools.partial(launcher.__call__, weight_grad=options[2])
    return entry, entry


_heads = "an array of shape (..., heads, head_dim)"
QK_NORM_ROPE = OpSpec("qk_norm_rope", QkRopeArrays, check=_check, layout=_layout_of(0), reference=_reference,
                      launcher=_launcher, outputs=QK_ROPE_OUTPUTS, autograd=True, public=qk_norm_rope,
                      required={"q": _heads, "k": _heads})
QK_NORM_ROPE_BACKWARD = OpSpec("qk_norm_rope_backward", QkRopeBackwardArrays, check=_check, layout=_layout_of(2),
                               reference=_backward_reference, launcher=_backward_launcher, anchor=2,
                               public=qk_norm_rope_backward,
                               required={"dq_out": _heads, "dk_out": _heads, "q": _heads, "k": _heads})
register(QK_NORM_ROPE, QK_NORM_ROPE_BACKWARD)
REFERENCES = (qk_norm_rope_reference, qk_norm_rope_backward_reference)


# -- torch --------------------------------------------------------------------------------------------
# The arrays in QkRopeArrays order (q, k, q_weight, k_weight, cos, sin, positions, cos_sin_cache),
# then eps, weight_offset, casting_mode, rotary_dim, is_neox.

def _bind_torch():
    import torch

    from ..._torch import fake_meta, is_compiling, no_weight_grad
    Tensor = torch.Tensor

    @torch.library.custom_op("cupy_rmsnorm::qk_norm_rope", mutates_args=())
    def qk_rope_op(q: Tensor, k: Tensor, q_weight: Optional[Tensor], k_weight: Optional[Tensor],
                   cos: Optional[Tensor], sin: Optional[Tensor], positions: Optional[Tensor],
                   cos_sin_cache: Optional[Tensor], eps: float, weight_offset: float, casting_mode: str,
                   rotary_dim: Optional[int], is_neox: bool) -> tuple[Tensor, Tensor]:
        return call(QK_NORM_ROPE, (q, k, q_weight, k_weight, cos, sin, positions, cos_sin_cache, None, None),
                    (eps, weight_offset, casting_mode, rotary_dim, is_neox))

    @torch.library.custom_op("cupy_rmsnorm::qk_norm_rope_inplace", mutates_args=("q", "k"))
    def qk_rope_inplace_op(q: Tensor, k: Tensor, q_weight: Optional[Tensor], k_weight: Optional[Tensor],
                           cos: Optional[Tensor], sin: Optional[Tensor], positions: Optional[Tensor],
                           cos_sin_cache: Optional[Tensor], eps: float, weight_offset: float, casting_mode: str,
                           rotary_dim: Optional[int], is_neox: bool) -> None:
        call(QK_NORM_ROPE, (q, k, q_weight, k_weight, cos, sin, positions, cos_sin_cache, q, k),
             (eps, weight_offset, casting_mode, rotary_dim, is_neox))

    def eager_backward(dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, positions, cos_sin_cache, eps,
                       weight_offset, casting_mode, rotary_dim, is_neox, weight_grad):
        return call(QK_NORM_ROPE_BACKWARD, (dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, positions,
                                            cos_sin_cache), (eps, weight_offset, casting_mode, rotary_dim, is_neox,
                                                             weight_grad))

    @torch.library.custom_op("cupy_rmsnorm::qk_norm_rope_backward", mutates_args=())
    def qk_rope_backward_op(dq_out: Tensor, dk_out: Tensor, q: Tensor, k: Tensor, q_weight: Optional[Tensor],
                            k_weight: Optional[Tensor], cos: Optional[Tensor], sin: Optional[Tensor],
                            positions: Optional[Tensor], cos_sin_cache: Optional[Tensor], eps: float,
                            weight_offset: float, casting_mode: str, rotary_dim: Optional[int], is_neox: bool,
                            weight_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        dq, dk, dq_weight, dk_weight = eager_backward(dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, positions,
                                                      cos_sin_cache, eps, weight_offset, casting_mode, rotary_dim,
                                                      is_neox, weight_grad)
        if dq_weight is None:
            return dq, dk, no_weight_grad(q), no_weight_grad(q)
        # the kernel writes both weights' gradients into one buffer; an op's outputs must not alias
        return dq, dk, dq_weight, dk_weight.clone()

    def check_fake(arrays, rotary_dim, is_neox, gradients=None):
        """The real path's argument, shape and dtype checks on fake tensors (``arrays``: the eight
        inputs in QkRopeArrays order; ``gradients``: the backward's dq_out and dk_out)."""
        metas = QkRopeArrays(*(fake_meta(t) for t in arrays))
        spec = check_qk_rope(metas, rotary_dim, is_neox)
        check_qk_rope_arrays(metas, spec, None if gradients is None else tuple(fake_meta(t) for t in gradients))

    @qk_rope_op.register_fake
    def _(q, k, q_weight, k_weight, cos, sin, positions, cos_sin_cache, eps, weight_offset, casting_mode,
          rotary_dim, is_neox):
        check_fake((q, k, q_weight, k_weight, cos, sin, positions, cos_sin_cache), rotary_dim, is_neox)
        return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
                torch.empty(k.shape, dtype=k.dtype, device=k.device))

    @qk_rope_inplace_op.register_fake
    def _(q, k, q_weight, k_weight, cos, sin, positions, cos_sin_cache, eps, weight_offset, casting_mode,
          rotary_dim, is_neox):
        check_fake((q, k, q_weight, k_weight, cos, sin, positions, cos_sin_cache), rotary_dim, is_neox)

    @qk_rope_backward_op.register_fake
    def _(dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, positions, cos_sin_cache, eps, weight_offset,
          casting_mode, rotary_dim, is_neox, weight_grad):
        check_fake((q, k, q_weight, k_weight, cos, sin, positions, cos_sin_cache), rotary_dim, is_neox,
                   (dq_out, dk_out))
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        if q_weight is None or not weight_grad:
            return dq, dk, no_weight_grad(q), no_weight_grad(q)
        return (dq, dk, torch.empty_like(q_weight, memory_format=torch.contiguous_format),
                torch.empty_like(k_weight, memory_format=torch.contiguous_format))

    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:8])      # q, k, the weights and the angles: the norm is recomputed
        ctx.scalars = inputs[8:13]              # eps, weight_offset, casting_mode, rotary_dim, is_neox

    def grad(ctx, dq_out, dk_out, backward=qk_rope_backward_op):
        q, k, q_weight, k_weight, *angles = ctx.saved_tensors
        need = ctx.needs_input_grad
        if dq_out is None:                      # one of the two outputs was not used
            dq_out = torch.zeros_like(q)
        if dk_out is None:
            dk_out = torch.zeros_like(k)
        weight_grad = q_weight is not None and (need[2] or need[3])
        dq, dk, dq_weight, dk_weight = backward(dq_out, dk_out, q, k, q_weight, k_weight, *angles, *ctx.scalars,
                                                weight_grad)
        return ((dq if need[0] else None), (dk if need[1] else None),
                (dq_weight if weight_grad and need[2] else None),
                (dk_weight if weight_grad and need[3] else None)) + (None,) * 9

    torch.library.register_autograd("cupy_rmsnorm::qk_norm_rope", grad, setup_context=setup)

    class EagerQkRope(torch.autograd.Function):
        @staticmethod
        def forward(q, k, q_weight, k_weight, cos, sin, positions, cos_sin_cache, eps, weight_offset, casting_mode,
                    rotary_dim, is_neox):
            return call(QK_NORM_ROPE, (q, k, q_weight, k_weight, cos, sin, positions, cos_sin_cache, None, None),
                        (eps, weight_offset, casting_mode, rotary_dim, is_neox))

        @staticmethod
        def setup_context(ctx, inputs, output):
            setup(ctx, inputs, output)

        @staticmethod
        def backward(ctx, dq_out, dk_out):
            return grad(ctx, dq_out, dk_out, eager_backward)

    def op_args(arrays, options):
        scalars, spec = options[0], options[1]
        return (arrays.q_weight, arrays.k_weight, arrays.cos, arrays.sin, arrays.positions, arrays.cos_sin_cache,
                scalars.eps, scalars.weight_offset, scalars.casting_mode, spec.rotary_dim, spec.is_neox)

    def traced(arrays, options, differentiable):
        """A public QK norm + RoPE call through the registered ops (while torch.compile traces, and
        in eager mode when autograd must record it), given outputs filled by a copy (``out_q=q,
        out_k=k`` is the in-place op, forward-only)."""
        q, k = arrays.q, arrays.k
        args = op_args(arrays, options)
        records = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in arrays[:8])
        if records:
            for name in ANGLES:
                t = getattr(arrays, name)
                if t is not None and t.requires_grad:
                    raise ValueError(f"{name} requires grad, and qk_norm_rope has no gradient for the angles: "
                                     f"pass {name}.detach()")
        if arrays.out_q is q and arrays.out_k is k:
            if records:
                raise RuntimeError("qk_norm_rope in place (out_q=q, out_k=k) is forward-only, and a tensor of this "
                                   "call requires grad: call it without out_q= / out_k= to train, or under "
                                   "torch.no_grad()")
            qk_rope_inplace_op(q, k, *args)
            return q, k
        eager = differentiable and q.is_cuda and not is_compiling()
        q_out, k_out = EagerQkRope.apply(q, k, *args) if eager else qk_rope_op(q, k, *args)
        out_q, out_k = arrays.out_q, arrays.out_k
        return (q_out if out_q is None else out_q.copy_(q_out)), (k_out if out_k is None else out_k.copy_(k_out))

    def traced_backward(arrays, options, differentiable):
        weight_grad = options[2] and arrays.q_weight is not None
        dq, dk, dq_weight, dk_weight = qk_rope_backward_op(arrays.dq_out, arrays.dk_out, arrays.q, arrays.k,
                                                           *op_args(arrays, options), weight_grad)
        if not weight_grad:
            return dq, dk, None, None
        return dq, dk, dq_weight, dk_weight

    QK_NORM_ROPE.traced, QK_NORM_ROPE_BACKWARD.traced = traced, traced_backward

    # DTensor: q and k sharded on a token axis (the per-token angles with them) or on the heads
    from ..._distributed import PARTIAL, ROWS, shard_rows
    rows, angles = ("q", "k"), dict(cos=1, sin=1, positions=0)     # angles: their axes after the tokens'
    shard_rows(qk_rope_op, rows=rows, outputs=(ROWS, ROWS), per_token=angles, inner_axes=2)
    shard_rows(qk_rope_inplace_op, rows=rows, outputs=(), per_token=angles, inner_axes=2)
    shard_rows(qk_rope_backward_op, rows=rows + ("dq_out", "dk_out"), outputs=(ROWS, ROWS, PARTIAL, PARTIAL),
               per_token=angles, inner_axes=2)


_interop.TorchKind.add_binding(_bind_torch)
