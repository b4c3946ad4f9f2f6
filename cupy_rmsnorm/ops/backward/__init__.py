"""rms_norm_backward and fused_add_rms_norm_backward: the public functions, their specs and
their torch ops (the forward family's autograd calls them).

The family's parts: ``checks``, ``launch`` (the backward plans: register, row and staged
kernels; the launchers of dx and of dweight's fixed-order reduction), ``reference``. The
kernels: kernels/rms_norm_backward.cu.
"""

import functools
from typing import NamedTuple, Optional, Tuple

from ... import _interop
from ..._pipeline import Array, CastingMode, OpSpec, call, register
from ..._validate import check_scalars
from .checks import check_backward_arrays
from .launch import BackwardArrays, BackwardLauncher, MixedBackward, backward_layout
from .reference import fused_add_rms_norm_backward_reference, rms_norm_backward_reference


class FusedBackwardArrays(NamedTuple):
    """The fused op's backward arrays: BackwardArrays with the forward's residual_out for x."""
    dy: object
    residual_out: object
    d_residual_out: object = None
    weight: object = None


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
    return call(RMS_NORM_BACKWARD, (dy, x, None, weight), (eps, weight_offset, casting_mode, True))


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
    return call(FUSED_ADD_RMS_NORM_BACKWARD, (dy, residual_out, d_residual_out, weight),
                (eps, weight_offset, casting_mode, True))


# -- the spec's hooks ------------------------------------------------------------------------------

def _check(arrays, eps, weight_offset, casting_mode, weight_grad):
    return check_scalars(eps, weight_offset, casting_mode, arrays.weight is not None), bool(weight_grad)


class _Mixed(NamedTuple):
    """The layout of a mixed-precision backward: the float32 kernels on float32 copies."""
    dy_dtype: str
    x_dtype: str


def _layout(call, options):
    names = call.arrays._fields
    check_backward_arrays(call.metas, names)
    dy_dtype, x_dtype = call.metas.dy.dtype, call.metas[1].dtype
    if call.kind is not _interop.NumpyKind and dy_dtype != x_dtype:       # mixed precision
        return call.resolved, _Mixed(dy_dtype, x_dtype), call.copied
    arrays, layout = backward_layout(call.kind, BackwardArrays(*call.resolved), call.metas)
    return arrays, layout, call.copied or layout.copied


def _reference_of(fused):
    def reference(arrays, options, layout):
        scalars, weight_grad = options
        dy, x, d_residual_out, weight = arrays
        args = (scalars.eps, scalars.weight_offset, scalars.casting_mode)
        if fused:
            dx, dweight = fused_add_rms_norm_backward_reference(dy, d_residual_out, x, weight, *args)
        else:
            dx, dweight = rms_norm_backward_reference(dy, x, weight, *args)
        return dx, (dweight if weight_grad else None)
    return reference


def _launcher(layout, options, kind):
    scalars, weight_grad = options
    if isinstance(layout, _Mixed):
        launcher = MixedBackward(scalars, kind, layout.dy_dtype, layout.x_dtype)
    else:
        launcher = BackwardLauncher(layout, scalars, kind)
    entry = functools.partial(launcher.__call__, weight_grad=weight_grad)
    return entry, entry


_hooks = dict(check=_check, layout=_layout, launcher=_launcher, anchor=1)
RMS_NORM_BACKWARD = OpSpec("rms_norm_backward", BackwardArrays, public=rms_norm_backward, reference=_reference_of(False),
                           required={"dy": "an array of x's shape and dtype"}, **_hooks)
FUSED_ADD_RMS_NORM_BACKWARD = OpSpec("fused_add_rms_norm_backward", FusedBackwardArrays,
                                     public=fused_add_rms_norm_backward, reference=_reference_of(True),
                                     required={"dy": "an array of residual_out's shape and dtype"}, **_hooks)
register(RMS_NORM_BACKWARD, FUSED_ADD_RMS_NORM_BACKWARD)
REFERENCES = (rms_norm_backward_reference, fused_add_rms_norm_backward_reference)


# -- torch --------------------------------------------------------------------------------------------

def _bind_torch():
    import torch

    from ..._torch import fake_meta, no_weight_grad
    Tensor = torch.Tensor

    @torch.library.custom_op("cupy_rmsnorm::rms_norm_backward", mutates_args=())
    def rms_norm_backward_op(dy: Tensor, x: Tensor, weight: Optional[Tensor], eps: float, weight_offset: float,
                             casting_mode: str, weight_grad: bool) -> tuple[Tensor, Tensor]:
        dx, dweight = call(RMS_NORM_BACKWARD, (dy, x, None, weight), (eps, weight_offset, casting_mode, weight_grad))
        return dx, (no_weight_grad(x) if dweight is None else dweight)

    @torch.library.custom_op("cupy_rmsnorm::fused_add_rms_norm_backward", mutates_args=())
    def fused_backward_op(dy: Tensor, d_residual_out: Optional[Tensor], residual_out: Tensor,
                          weight: Optional[Tensor], eps: float, weight_offset: float, casting_mode: str,
                          weight_grad: bool) -> tuple[Tensor, Tensor]:
        dx, dweight = call(FUSED_ADD_RMS_NORM_BACKWARD, (dy, residual_out, d_residual_out, weight),
                           (eps, weight_offset, casting_mode, weight_grad))
        return dx, (no_weight_grad(residual_out) if dweight is None else dweight)

    def fake_backward(arrays, weight_grad):
        check_backward_arrays(type(arrays)(*(fake_meta(t) for t in arrays)), arrays._fields)
        x, weight = arrays[1], arrays.weight
        dx = torch.empty_like(x, memory_format=torch.contiguous_format)
        if weight is None or not weight_grad:
            return dx, no_weight_grad(x)
        return dx, torch.empty_like(weight, memory_format=torch.contiguous_format)

    @rms_norm_backward_op.register_fake
    def _(dy, x, weight, eps, weight_offset, casting_mode, weight_grad):
        return fake_backward(BackwardArrays(dy, x, None, weight), weight_grad)

    @fused_backward_op.register_fake
    def _(dy, d_residual_out, residual_out, weight, eps, weight_offset, casting_mode, weight_grad):
        return fake_backward(FusedBackwardArrays(dy, residual_out, d_residual_out, weight), weight_grad)

    def traced(op):
        def run(arrays, options, differentiable):
            scalars, weight_grad = options
            dy, x, d_residual_out, weight = arrays
            head = (dy, x, weight) if op is rms_norm_backward_op else (dy, d_residual_out, x, weight)
            dx, dweight = op(*head, scalars.eps, scalars.weight_offset, scalars.casting_mode,
                             weight_grad and weight is not None)
            return dx, (dweight if weight_grad and weight is not None else None)
        return run

    RMS_NORM_BACKWARD.traced = traced(rms_norm_backward_op)
    FUSED_ADD_RMS_NORM_BACKWARD.traced = traced(fused_backward_op)

    # DTensor: dx with the rows, dweight a partial sum over the row shards
    from ..._distributed import PARTIAL, ROWS, shard_rows
    shard_rows(rms_norm_backward_op, rows=("x", "dy"), outputs=(ROWS, PARTIAL))
    shard_rows(fused_backward_op, rows=("residual_out", "dy", "d_residual_out"), outputs=(ROWS, PARTIAL))


_interop.TorchKind.add_binding(_bind_torch)
