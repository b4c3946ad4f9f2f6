"""rms_norm_gated and its backward: the norm of linear-attention and state-space layers, the
public functions, their specs and their torch ops.

The family's parts: ``checks``, ``launch`` (the gated plans and launchers, forward and
backward), ``reference``. The kernels: kernels/rms_norm_gated.cu.
"""

import functools
from typing import Any, Optional, Tuple

from ... import _interop
from ..._pipeline import Array, CastingMode, OpSpec, call, register, store
from ..._validate import check_scalars
from .checks import check_gated, check_gated_arrays, check_gated_backward_arrays
from .launch import (GatedArrays, GatedBackwardArrays, GatedBackwardLauncher, GatedLauncher, gated_backward_layout,
                     gated_layout)
from .reference import rms_norm_gated_backward_reference, rms_norm_gated_reference


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
    return call(RMS_NORM_GATED, (x, gate, weight, out),
                (eps, weight_offset, casting_mode, group_size, norm_before_gate, activation, out_dtype))


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
    return call(RMS_NORM_GATED_BACKWARD, (dy, x, gate, weight),
                (eps, weight_offset, casting_mode, group_size, norm_before_gate, activation, None, True))


# -- the spec's hooks ------------------------------------------------------------------------------

def _check(arrays, eps, weight_offset, casting_mode, group_size, norm_before_gate, activation, out_dtype,
           weight_grad=True):
    return (check_scalars(eps, weight_offset, casting_mode, arrays.weight is not None),
            check_gated(group_size, norm_before_gate, activation, out_dtype), bool(weight_grad))


def _layout(call, options):
    spec = options[1]
    out_dtype = check_gated_arrays(call.metas, spec)
    arrays, layout = gated_layout(call.kind, call.resolved, call.metas, spec.group_size, out_dtype, call.copied)
    return arrays, (layout, out_dtype), layout.call.copied


def _reference(arrays, options, layouts):
    scalars, spec, _ = options
    y = rms_norm_gated_reference(arrays.x, arrays.gate, arrays.weight, scalars.eps, scalars.weight_offset,
                                 scalars.casting_mode, group_size=spec.group_size,
                                 norm_before_gate=spec.norm_before_gate, activation=spec.activation,
                                 out_dtype=layouts[1])
    return store(arrays.out, y)


def _launcher(layouts, options, kind):
    launcher = GatedLauncher(layouts[0], options[0], kind, options[1])
    return launcher.entry, lambda arrays: launcher(arrays, checked=True)


def _backward_layout(call, options):
    spec = options[1]
    check_gated_backward_arrays(call.metas, spec)
    arrays, layout = gated_backward_layout(call.kind, call.resolved, call.metas, spec.group_size)
    return arrays, layout, call.copied or layout.call.copied


def _backward_reference(arrays, options, layout):
    scalars, spec, weight_grad = options
    dx, dgate, dweight = rms_norm_gated_backward_reference(
        arrays.dy, arrays.x, arrays.gate, arrays.weight, scalars.eps, scalars.weight_offset, scalars.casting_mode,
        group_size=spec.group_size, norm_before_gate=spec.norm_before_gate, activation=spec.activation)
    return dx, dgate, (dweight if weight_grad else None)


def _backward_launcher(layout, options, kind):
    scalars, spec, weight_grad = options
    launcher = GatedBackwardLauncher(layout, scalars, kind, spec)
    entry = functools.partial(launcher.__call__, weight_grad=weight_grad)
    return entry, entry


RMS_NORM_GATED = OpSpec("rms_norm_gated", GatedArrays, check=_check, layout=_layout, reference=_reference,
                        launcher=_launcher, outputs=(3,), autograd=True, public=rms_norm_gated,
                        required={"gate": "an array of x's shape and dtype"})
RMS_NORM_GATED_BACKWARD = OpSpec("rms_norm_gated_backward", GatedBackwardArrays, check=_check,
                                 layout=_backward_layout, reference=_backward_reference,
                                 launcher=_backward_launcher, anchor=1, public=rms_norm_gated_backward,
                                 required={"dy": "an array of x's shape", "gate": "an array of x's shape"})
register(RMS_NORM_GATED, RMS_NORM_GATED_BACKWARD)
REFERENCES = (rms_norm_gated_reference, rms_norm_gated_backward_reference)


# -- torch --------------------------------------------------------------------------------------------

def _bind_torch():
    import torch

    from ..._torch import dtype_arg, fake_meta, is_compiling, no_weight_grad
    Tensor = torch.Tensor

    @torch.library.custom_op("cupy_rmsnorm::rms_norm_gated", mutates_args=())
    def gated_op(x: Tensor, gate: Tensor, weight: Optional[Tensor], eps: float, weight_offset: float,
                 casting_mode: str, group_size: Optional[int], norm_before_gate: bool, activation: str,
                 out_dtype: Optional[torch.dtype]) -> Tensor:
        return call(RMS_NORM_GATED, (x, gate, weight, None), (eps, weight_offset, casting_mode, group_size,
                                                             norm_before_gate, activation, dtype_arg(out_dtype)))

    @gated_op.register_fake
    def _(x, gate, weight, eps, weight_offset, casting_mode, group_size, norm_before_gate, activation, out_dtype):
        spec = check_gated(group_size, norm_before_gate, activation, dtype_arg(out_dtype))
        check_gated_arrays((fake_meta(x), fake_meta(gate), fake_meta(weight), None), spec)
        return torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)

    def eager_backward(dy, x, gate, weight, eps, weight_offset, casting_mode, group_size, norm_before_gate,
                       activation, weight_grad):
        return call(RMS_NORM_GATED_BACKWARD, (dy, x, gate, weight), (eps, weight_offset, casting_mode, group_size,
                                                                     norm_before_gate, activation, None, weight_grad))

    @torch.library.custom_op("cupy_rmsnorm::rms_norm_gated_backward", mutates_args=())
    def gated_backward_op(dy: Tensor, x: Tensor, gate: Tensor, weight: Optional[Tensor], eps: float,
                          weight_offset: float, casting_mode: str, group_size: Optional[int], norm_before_gate: bool,
                          activation: str, weight_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
        dx, dgate, dweight = eager_backward(dy, x, gate, weight, eps, weight_offset, casting_mode, group_size,
                                            norm_before_gate, activation, weight_grad)
        return dx, dgate, (no_weight_grad(x) if dweight is None else dweight)

    @gated_backward_op.register_fake
    def _(dy, x, gate, weight, eps, weight_offset, casting_mode, group_size, norm_before_gate, activation,
          weight_grad):
        spec = check_gated(group_size, norm_before_gate, activation)
        check_gated_backward_arrays((fake_meta(dy), fake_meta(x), fake_meta(gate), fake_meta(weight)), spec)
        dx = torch.empty_like(x, memory_format=torch.contiguous_format)
        dgate = torch.empty_like(x, memory_format=torch.contiguous_format)
        if weight is None or not weight_grad:
            return dx, dgate, no_weight_grad(x)
        return dx, dgate, torch.empty_like(weight, memory_format=torch.contiguous_format)

    def setup(ctx, inputs, output):
        x, gate, weight = inputs[:3]
        ctx.save_for_backward(x, gate, weight)
        ctx.scalars = inputs[3:9]     # eps, weight_offset, casting_mode, group_size, norm_before_gate, activation

    def grad(ctx, dy, backward=gated_backward_op):
        x, gate, weight = ctx.saved_tensors
        weight_grad = weight is not None and ctx.needs_input_grad[2]
        dx, dgate, dweight = backward(dy, x, gate, weight, *ctx.scalars, weight_grad)
        return ((dx if ctx.needs_input_grad[0] else None), (dgate if ctx.needs_input_grad[1] else None),
                (dweight if weight_grad else None)) + (None,) * 7

    torch.library.register_autograd("cupy_rmsnorm::rms_norm_gated", grad, setup_context=setup)

    class EagerGated(torch.autograd.Function):
        @staticmethod
        def forward(x, gate, weight, eps, weight_offset, casting_mode, group_size, norm_before_gate, activation,
                    out_dtype):
            return call(RMS_NORM_GATED, (x, gate, weight, None), (eps, weight_offset, casting_mode, group_size,
                                                                 norm_before_gate, activation, dtype_arg(out_dtype)))

        @staticmethod
        def setup_context(ctx, inputs, output):
            setup(ctx, inputs, output)

        @staticmethod
        def backward(ctx, dy):
            return grad(ctx, dy, eager_backward)

    def traced(arrays, options, differentiable):
        """A public gated call through the registered op (while torch.compile traces, and in eager
        mode when autograd must record it), a given out filled by a copy."""
        x, gate, weight, out = arrays
        scalars, spec, _ = options
        args = (weight, scalars.eps, scalars.weight_offset, scalars.casting_mode, spec.group_size,
                spec.norm_before_gate, spec.activation, None if spec.out_dtype is None else getattr(torch, spec.out_dtype))
        eager = differentiable and x.is_cuda and not is_compiling()
        y = EagerGated.apply(x, gate, *args) if eager else gated_op(x, gate, *args)
        return y if out is None else out.copy_(y)

    def traced_backward(arrays, options, differentiable):
        dy, x, gate, weight = arrays
        scalars, spec, weight_grad = options
        weight_grad = weight_grad and weight is not None
        dx, dgate, dweight = gated_backward_op(dy, x, gate, weight, scalars.eps, scalars.weight_offset,
                                               scalars.casting_mode, spec.group_size, spec.norm_before_gate,
                                               spec.activation, weight_grad)
        return dx, dgate, (dweight if weight_grad else None)

    RMS_NORM_GATED.traced, RMS_NORM_GATED_BACKWARD.traced = traced, traced_backward

    # DTensor: rows are independent (groups lie within a row), dweight a partial sum
    from ..._distributed import PARTIAL, ROWS, shard_rows
    shard_rows(gated_op, rows=("x", "gate"), outputs=(ROWS,))
    shard_rows(gated_backward_op, rows=("x", "dy", "gate"), outputs=(ROWS, ROWS, PARTIAL))


_interop.TorchKind.add_binding(_bind_torch)
