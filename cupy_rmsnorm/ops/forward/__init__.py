"""rms_norm and fused_add_rms_norm: the public functions, their specs and their torch ops.

The family's parts: ``checks`` (the arrays' dtypes and shapes), ``launch`` (the launchers of
rms_norm_kernel and its cluster form, their instantiation names), ``reference`` (the NumPy
contract). The kernels: kernels/rms_norm.cu.
"""

from typing import Any, Optional, Tuple

from ... import _interop
from ..._layout import Arrays, call_layout
from ..._pipeline import Array, CastingMode, OpSpec, call, register, store
from ..._validate import check_scalars, dtype_name
from .checks import check_arrays
from .launch import Launcher, MixedLauncher
from .reference import fused_add_rms_norm_reference, rms_norm_reference


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
    return call(RMS_NORM, (x, None, weight, out, None), (eps, weight_offset, casting_mode, out_dtype))


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
    return call(FUSED_ADD_RMS_NORM, (x, residual, weight, out, residual_out),
                (eps, weight_offset, casting_mode, out_dtype))


# -- the spec's hooks ------------------------------------------------------------------------------

def _check(arrays, eps, weight_offset, casting_mode, out_dtype):
    return check_scalars(eps, weight_offset, casting_mode, arrays.weight is not None), \
        dtype_name(out_dtype, "out_dtype")


def _layout_of(fused):
    def laid_out(call, options):
        residual_dtype, out_dtype = check_arrays(call.metas, options[1])
        arrays, layout = call_layout(call.kind, fused, call.resolved, call.metas, call.copied)
        return arrays, (layout, residual_dtype, out_dtype), layout.copied
    return laid_out


def _reference(arrays, options, layout):
    """The reference on the CPU, stored into the given outputs."""
    scalars, out_dtype = options[0], layout[2]
    args = (scalars.eps, scalars.weight_offset, scalars.casting_mode)
    if arrays.residual is not None:
        y, s = fused_add_rms_norm_reference(arrays.x, arrays.residual, arrays.weight, *args, out_dtype=out_dtype)
        return store(arrays.out, y), store(arrays.residual_out, s)
    return store(arrays.out, rms_norm_reference(arrays.x, arrays.weight, *args, out_dtype=out_dtype))


def _launcher(layouts, options, kind):
    layout, residual_dtype, out_dtype = layouts
    if residual_dtype == layout.dtype and out_dtype == layout.dtype:
        launcher = Launcher(layout, options[0], kind)
    else:
        launcher = MixedLauncher(layout, options[0], kind, residual_dtype, out_dtype)
    return launcher.entry, lambda arrays: launcher(arrays, checked=True)


_hooks = dict(check=_check, reference=_reference, launcher=_launcher, outputs=_interop.FORWARD_OUTPUTS,
              autograd=True)
RMS_NORM = OpSpec("rms_norm", Arrays, layout=_layout_of(False), public=rms_norm, **_hooks)
FUSED_ADD_RMS_NORM = OpSpec("fused_add_rms_norm", Arrays, layout=_layout_of(True), public=fused_add_rms_norm,
                            required={"residual": "an array of x's shape and dtype"}, **_hooks)
register(RMS_NORM, FUSED_ADD_RMS_NORM)
REFERENCES = (rms_norm_reference, fused_add_rms_norm_reference)


# -- torch: the registered ops, their fakes and autograd -----------------------------------------

def _bind_torch():
    import torch

    from ..._torch import dtype_arg, fake_meta, is_compiling
    Tensor = torch.Tensor

    def direct(spec, x, residual, weight, out, residual_out, eps, weight_offset, casting_mode, out_dtype=None):
        # the library's eager path: not tracing when the op itself runs, so the pipeline goes direct
        return call(spec, (x, residual, weight, out, residual_out), (eps, weight_offset, casting_mode, out_dtype))

    @torch.library.custom_op("cupy_rmsnorm::rms_norm", mutates_args=())
    def rms_norm_op(x: Tensor, weight: Optional[Tensor], eps: float, weight_offset: float,
                    casting_mode: str, out_dtype: Optional[torch.dtype] = None) -> Tensor:
        return direct(RMS_NORM, x, None, weight, None, None, eps, weight_offset, casting_mode, dtype_arg(out_dtype))

    @torch.library.custom_op("cupy_rmsnorm::fused_add_rms_norm", mutates_args=())
    def fused_op(x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float, weight_offset: float,
                 casting_mode: str, out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
        return direct(FUSED_ADD_RMS_NORM, x, residual, weight, None, None, eps, weight_offset, casting_mode,
                      dtype_arg(out_dtype))

    @torch.library.custom_op("cupy_rmsnorm::fused_add_rms_norm_inplace", mutates_args=("x", "residual"))
    def fused_inplace_op(x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float, weight_offset: float,
                         casting_mode: str) -> None:
        direct(FUSED_ADD_RMS_NORM, x, residual, weight, x, residual, eps, weight_offset, casting_mode)

    def check_fake(x, residual, weight, out_dtype=None):
        """The real path's shape and dtype checks on fake tensors: the (residual, output) torch dtypes."""
        residual_dtype, out_dtype = check_arrays(Arrays(fake_meta(x), fake_meta(residual), fake_meta(weight)),
                                                 dtype_arg(out_dtype))
        return getattr(torch, residual_dtype), getattr(torch, out_dtype)

    @rms_norm_op.register_fake
    def _(x, weight, eps, weight_offset, casting_mode, out_dtype=None):
        _, out_dtype = check_fake(x, None, weight, out_dtype)
        return torch.empty(x.shape, dtype=out_dtype, device=x.device)

    @fused_op.register_fake
    def _(x, residual, weight, eps, weight_offset, casting_mode, out_dtype=None):
        residual_dtype, out_dtype = check_fake(x, residual, weight, out_dtype)
        return (torch.empty(x.shape, dtype=out_dtype, device=x.device),
                torch.empty(x.shape, dtype=residual_dtype, device=x.device))

    @fused_inplace_op.register_fake
    def _(x, residual, weight, eps, weight_offset, casting_mode):
        check_fake(x, residual, weight)

    # autograd: the backward family's ops, one node in a compiled backward graph
    from ..backward import FUSED_ADD_RMS_NORM_BACKWARD, RMS_NORM_BACKWARD

    def setup_rms_norm(ctx, inputs, output):
        x, weight, eps, weight_offset, casting_mode = inputs[:5]
        ctx.save_for_backward(x, weight)
        ctx.scalars = (eps, weight_offset, casting_mode)

    def rms_norm_grad(ctx, dy, backward=None):
        x, weight = ctx.saved_tensors
        weight_grad = weight is not None and ctx.needs_input_grad[1]
        backward = backward or torch.ops.cupy_rmsnorm.rms_norm_backward
        dx, dweight = backward(dy, x, weight, *ctx.scalars, weight_grad)
        return (dx if ctx.needs_input_grad[0] else None), (dweight if weight_grad else None), None, None, None, None

    def setup_fused(ctx, inputs, output):
        x, residual, weight, eps, weight_offset, casting_mode = inputs[:6]
        ctx.save_for_backward(output[1], weight)      # residual_out: what was normalized
        ctx.scalars = (eps, weight_offset, casting_mode)
        ctx.x_dtype = x.dtype                         # a float32 residual stream: x's gradient in x's dtype

    def fused_grad(ctx, dy, d_residual_out, backward=None):
        residual_out, weight = ctx.saved_tensors
        if dy is None:                                # the normalized output was not used
            dy = torch.zeros_like(residual_out)
        weight_grad = weight is not None and ctx.needs_input_grad[2]
        backward = backward or torch.ops.cupy_rmsnorm.fused_add_rms_norm_backward
        d_input, dweight = backward(dy, d_residual_out, residual_out, weight, *ctx.scalars, weight_grad)
        # one tensor: the gradient of x + residual reaches both unchanged (x's in x's dtype)
        dx = d_input if d_input.dtype == ctx.x_dtype or not ctx.needs_input_grad[0] else d_input.to(ctx.x_dtype)
        return ((dx if ctx.needs_input_grad[0] else None), (d_input if ctx.needs_input_grad[1] else None),
                (dweight if weight_grad else None), None, None, None, None)

    torch.library.register_autograd("cupy_rmsnorm::rms_norm", rms_norm_grad, setup_context=setup_rms_norm)
    torch.library.register_autograd("cupy_rmsnorm::fused_add_rms_norm", fused_grad, setup_context=setup_fused)

    # Eager autograd: the same setup and gradients on an autograd.Function around the direct
    # paths. A custom op's eager dispatch under autograd costs hundreds of microseconds a call,
    # which a training step pays per norm; torch.compile keeps the registered ops.
    def rms_norm_backward_eager(dy, x, weight, eps, weight_offset, casting_mode, weight_grad):
        return call(RMS_NORM_BACKWARD, (dy, x, None, weight), (eps, weight_offset, casting_mode, weight_grad))

    def fused_backward_eager(dy, d_residual_out, residual_out, weight, eps, weight_offset, casting_mode, weight_grad):
        return call(FUSED_ADD_RMS_NORM_BACKWARD, (dy, residual_out, d_residual_out, weight),
                    (eps, weight_offset, casting_mode, weight_grad))

    class EagerRMSNorm(torch.autograd.Function):
        @staticmethod
        def forward(x, weight, eps, weight_offset, casting_mode, out_dtype):
            return direct(RMS_NORM, x, None, weight, None, None, eps, weight_offset, casting_mode,
                          dtype_arg(out_dtype))

        @staticmethod
        def setup_context(ctx, inputs, output):
            setup_rms_norm(ctx, inputs, output)

        @staticmethod
        def backward(ctx, dy):
            return rms_norm_grad(ctx, dy, rms_norm_backward_eager)

    class EagerFusedAddRMSNorm(torch.autograd.Function):
        @staticmethod
        def forward(x, residual, weight, eps, weight_offset, casting_mode, out_dtype):
            return direct(FUSED_ADD_RMS_NORM, x, residual, weight, None, None, eps, weight_offset, casting_mode,
                          dtype_arg(out_dtype))

        @staticmethod
        def setup_context(ctx, inputs, output):
            setup_fused(ctx, inputs, output)

        @staticmethod
        def backward(ctx, dy, d_residual_out):
            return fused_grad(ctx, dy, d_residual_out, fused_backward_eager)

    def traced(arrays, options, differentiable):
        """A public call through the registered ops, with any given outputs filled by a copy
        (the in-place fused form, ``out=x, residual_out=residual``, is its own op): while
        torch.compile traces, and (``differentiable``) in eager mode when autograd must record
        the call."""
        x, residual, weight, out, residual_out = arrays
        scalars, out_dtype = options
        args = (weight, scalars.eps, scalars.weight_offset, scalars.casting_mode)
        typed = args + (None if out_dtype is None else getattr(torch, out_dtype),)
        # (CUDA tensors: a device with its own kernels registered for the ops keeps them)
        eager = differentiable and x.is_cuda and not is_compiling()
        if residual is None:
            y = EagerRMSNorm.apply(x, *typed) if eager else rms_norm_op(x, *typed)
            return y if out is None else out.copy_(y)
        if out is x and residual_out is residual and out_dtype in (None, dtype_arg(x.dtype)):
            if differentiable:
                raise RuntimeError("fused_add_rms_norm in place (out=x, residual_out=residual) is forward-only, "
                                   "and a tensor of this call requires grad: call it without out= / "
                                   "residual_out= to train, or under torch.no_grad()")
            fused_inplace_op(x, residual, *args)
            return x, residual
        y, s = EagerFusedAddRMSNorm.apply(x, residual, *typed) if eager else fused_op(x, residual, *typed)
        return (y if out is None else out.copy_(y)), (s if residual_out is None else residual_out.copy_(s))

    RMS_NORM.traced = FUSED_ADD_RMS_NORM.traced = traced

    # DTensor: rows are independent
    from ..._distributed import ROWS, shard_rows
    shard_rows(torch.ops.cupy_rmsnorm.rms_norm, rows=("x",), outputs=(ROWS,))
    shard_rows(torch.ops.cupy_rmsnorm.fused_add_rms_norm, rows=("x", "residual"), outputs=(ROWS, ROWS))
    shard_rows(torch.ops.cupy_rmsnorm.fused_add_rms_norm_inplace, rows=("x", "residual"), outputs=())


_interop.TorchKind.add_binding(_bind_torch)
