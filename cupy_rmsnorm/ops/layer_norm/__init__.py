"""LayerNorm: layer_norm, fused_add_layer_norm, layer_norm_modulate (adaLN) and their backward,
the public functions, their specs and their torch ops.

The family's parts: ``checks``, ``plan`` (threads and vectors a row, the backward's row
groups), ``launch`` (arrays, ABI, layouts, launchers), ``reference`` (the contract),
``module`` (``cupy_rmsnorm.torch.LayerNorm`` and the Hugging Face patch). The kernels:
kernels/layer_norm.cu and kernels/layer_norm_backward.cu, with kernels/layer_norm.cuh.
"""

from typing import Any, Optional, Tuple

from ... import _interop
from ..._pipeline import Array, OpSpec, call, register, store
from ..._validate import _float32_scalar, dtype_name
from .checks import check_layer_norm_arrays, check_layer_norm_backward_arrays
from .launch import (OUTPUTS, LayerNormArrays, LayerNormBackwardArrays, LayerNormBackwardLauncher, LayerNormLauncher,
                     layer_norm_backward_layout, layer_norm_layout)
from .reference import (fused_add_layer_norm_backward_reference, fused_add_layer_norm_reference,
                        layer_norm_backward_reference, layer_norm_modulate_backward_reference,
                        layer_norm_modulate_reference, layer_norm_reference)


def layer_norm(x: Array, weight: Optional[Array] = None, bias: Optional[Array] = None, eps: float = 1e-5, *,
               out: Optional[Array] = None, out_dtype: Any = None) -> Array:
    """Layer normalization over the last axis.

    ``out[..., i] = (x[..., i] - mean) / sqrt(var + eps) * weight[i] + bias[i]``, mean and the
    population variance over the row, in float32 with one rounding at the end (what
    ``torch.nn.functional.layer_norm`` computes for 16-bit inputs); the row sums in the
    library's canonical order (a row's result depends on that row alone).

    Args:
        x: (..., hidden) float32, float16 or bfloat16 array of any kind the library takes
            (CuPy, NumPy, torch CUDA or CPU tensors, CUDA DLPack producers).
        weight, bias: (hidden,) arrays of any of the three dtypes, or None.
        eps: added to the variance; finite, >= 0.
        out: optional destination of x's shape and the output dtype; may be ``x`` (in place).
        out_dtype: the output's dtype (default x's).

    Returns:
        ``out`` (a new array of x's kind when ``out`` is None). Rows of up to 16384 elements
        on the GPU (8192 for the backward).
    """
    return call(LAYER_NORM, (x, None, weight, bias, out, None, None, None), (eps, out_dtype))


def fused_add_layer_norm(x: Array, residual: Array, weight: Optional[Array] = None, bias: Optional[Array] = None,
                         eps: float = 1e-5, *, out: Optional[Array] = None,
                         residual_out: Optional[Array] = None) -> Tuple[Array, Array]:
    """``(layer_norm(x + residual), x + residual)`` in one pass: the sum rounded to the
    residual's dtype (x's, or float32 for a float32 residual stream) and normalized from that
    rounded value. ``out=x, residual_out=residual`` works in place.

    Returns:
        ``(out, residual_out)``.
    """
    return call(FUSED_ADD_LAYER_NORM, (x, residual, weight, bias, out, residual_out, None, None), (eps, None))


def layer_norm_modulate(x: Array, shift: Array, scale: Array, eps: float = 1e-6, *, weight: Optional[Array] = None,
                        bias: Optional[Array] = None, out: Optional[Array] = None) -> Array:
    """The adaptive norm of diffusion transformers (DiT's ``modulate``, diffusers'
    ``AdaLayerNormZero``): ``layer_norm(x, weight, bias, eps) * (1 + scale) + shift``, all in
    float32 with one rounding. ``shift`` and ``scale`` broadcast against x NumPy's way, keeping
    x's last axis: typically (B, 1, D) beside x of shape (B, S, D); also (B, S, D) or (D,).

    Returns:
        ``out`` (a new array of x's kind when ``out`` is None; ``out=x`` works in place).
    """
    return call(LAYER_NORM_MODULATE, (x, None, weight, bias, out, None, shift, scale), (eps, None))


def layer_norm_backward(dy: Array, x: Array, weight: Optional[Array] = None, bias: Optional[Array] = None,
                        eps: float = 1e-5) -> Tuple[Array, Optional[Array], Optional[Array]]:
    """Gradients of ``layer_norm(x, weight, bias, eps)`` given ``dy`` (x's shape, the output's
    dtype). Per row, in float32: ``n = (x - mean) * rstd``, ``g = dy * weight``,
    ``dx = rstd * (g - mean(g) - n * mean(g * n))``; ``dweight = sum over rows of dy * n``,
    ``dbias = sum over rows of dy``, added in a fixed order (the same bits every run).

    Returns:
        ``(dx, dweight, dbias)``: dx of x's shape and dtype, contiguous; dweight and dbias of
        the parameters' dtypes, None for an absent parameter.
    """
    return call(LAYER_NORM_BACKWARD, (dy, x, None, weight, bias, None, None), (eps, True))


def fused_add_layer_norm_backward(dy: Array, d_residual_out: Optional[Array], residual_out: Array,
                                  weight: Optional[Array] = None, bias: Optional[Array] = None,
                                  eps: float = 1e-5) -> Tuple[Array, Optional[Array], Optional[Array]]:
    """Gradients of ``fused_add_layer_norm``: ``residual_out`` is the forward's rounded sum;
    the gradient reaching it is ``layer_norm_backward``'s dx plus ``d_residual_out`` (None for
    zero), rounded once, and it flows unchanged to both x and residual.

    Returns:
        ``(d_input, dweight, dbias)``.
    """
    return call(FUSED_ADD_LAYER_NORM_BACKWARD, (dy, residual_out, d_residual_out, weight, bias, None, None),
                (eps, True))


def layer_norm_modulate_backward(dy: Array, x: Array, shift: Array, scale: Array, eps: float = 1e-6, *,
                                 weight: Optional[Array] = None, bias: Optional[Array] = None):
    """Gradients of ``layer_norm_modulate``: with ``a = layer_norm(x, weight, bias)``,
    ``dshift = dy`` and ``dscale = dy * a`` summed over the rows that share a shift / scale row
    (reduced to their shapes: (B, 1, D), (B, S, D) or (D,)), and x's, the weight's and the
    bias's gradients as ``layer_norm_backward``'s with ``dy * (1 + scale)``; every sum over
    rows in a fixed order.

    Returns:
        ``(dx, dshift, dscale, dweight, dbias)`` (None for an absent parameter).
    """
    return call(LAYER_NORM_MODULATE_BACKWARD, (dy, x, None, weight, bias, shift, scale), (eps, True))


# -- the spec's hooks ------------------------------------------------------------------------------

def _check_forward(arrays, eps, out_dtype):
    return _float32_scalar(eps, "eps", " and >= 0"), dtype_name(out_dtype, "out_dtype")


def _check_backward(arrays, eps, weight_grad):
    return _float32_scalar(eps, "eps", " and >= 0"), bool(weight_grad)


BACKWARD_NAMES = {False: ("dy", "x", "d_residual_out", "weight", "bias", "shift", "scale"),
                  True: ("dy", "residual_out", "d_residual_out", "weight", "bias", "shift", "scale")}


class _Scalars:
    """The launchers' view of the checked scalars."""
    def __init__(self, eps):
        self.eps = eps


def _forward_layout(fused, modulate):
    def laid_out(call, options):
        residual_dtype, out_dtype = check_layer_norm_arrays(call.metas, options[1])
        arrays, layout = layer_norm_layout(call.kind, call.resolved, call.metas, fused, modulate, out_dtype,
                                           residual_dtype, call.copied)
        # given outputs are checked against the inputs on the full path only: no fast path for them
        return arrays, layout, layout.rows.copied or bool(layout.given_outputs)
    return laid_out


def _forward_reference(arrays, options, layout):
    eps, out_dtype = options[0], layout.out_dtype
    if layout.modulate:
        y = layer_norm_modulate_reference(arrays.x, arrays.shift, arrays.scale, eps, weight=arrays.weight,
                                          bias=arrays.bias, out_dtype=out_dtype)
    elif layout.fused:
        y, s = fused_add_layer_norm_reference(arrays.x, arrays.residual, arrays.weight, arrays.bias, eps,
                                              out_dtype=out_dtype)
        return store(arrays.out, y), store(arrays.residual_out, s)
    else:
        y = layer_norm_reference(arrays.x, arrays.weight, arrays.bias, eps, out_dtype=out_dtype)
    return store(arrays.out, y)


def _forward_launcher(layout, options, kind):
    launcher = LayerNormLauncher(layout, _Scalars(options[0]), kind)
    return launcher, launcher


def _result_of(modulate):
    """The launcher's (dx, dweight, dbias, dshift, dscale) in the public order."""
    if modulate:
        return lambda r: (r[0], r[3], r[4], r[1], r[2])
    return lambda r: r[:3]


def _backward_layout(modulate, names):
    def laid_out(call, options):
        check_layer_norm_backward_arrays(call.metas, names)
        arrays, layout = layer_norm_backward_layout(call.kind, LayerNormBackwardArrays(*call.resolved),
                                                    LayerNormBackwardArrays(*call.metas), modulate)
        return arrays, layout, layout.rows.copied
    return laid_out


def _backward_reference(fused, modulate):
    order = _result_of(modulate)

    def reference(arrays, options, layout):
        eps, weight_grad = options
        if modulate:
            dx, dshift, dscale, dw, db = layer_norm_modulate_backward_reference(
                arrays.dy, arrays.x, arrays.shift, arrays.scale, eps, weight=arrays.weight, bias=arrays.bias)
            result = (dx, dw, db, dshift, dscale)
        elif fused:
            result = fused_add_layer_norm_backward_reference(arrays.dy, arrays.d_residual_out, arrays.x,
                                                             arrays.weight, arrays.bias, eps) + (None, None)
        else:
            result = layer_norm_backward_reference(arrays.dy, arrays.x, arrays.weight, arrays.bias, eps) + (None, None)
        if not weight_grad:
            result = (result[0], None, None) + result[3:]
        return order(result)
    return reference


def _backward_launcher(modulate):
    order = _result_of(modulate)

    def launcher(layout, options, kind):
        run = LayerNormBackwardLauncher(layout, _Scalars(options[0]), kind)
        weight_grad = options[1]

        def entry(arrays):
            return order(run(arrays, weight_grad))
        return entry, entry
    return launcher


_forward = dict(check=_check_forward, reference=_forward_reference, launcher=_forward_launcher, outputs=OUTPUTS,
                autograd=True)
LAYER_NORM = OpSpec("layer_norm", LayerNormArrays, layout=_forward_layout(False, False), public=layer_norm,
                    **_forward)
FUSED_ADD_LAYER_NORM = OpSpec("fused_add_layer_norm", LayerNormArrays, layout=_forward_layout(True, False),
                              public=fused_add_layer_norm, required={"residual": "an array of x's shape"},
                              **_forward)
LAYER_NORM_MODULATE = OpSpec("layer_norm_modulate", LayerNormArrays, layout=_forward_layout(False, True),
                             public=layer_norm_modulate,
                             required={"shift": "an array broadcasting to x", "scale": "an array broadcasting to x"},
                             **_forward)
_backward = dict(check=_check_backward, anchor=1)
LAYER_NORM_BACKWARD = OpSpec("layer_norm_backward", LayerNormBackwardArrays, layout=_backward_layout(False, BACKWARD_NAMES[False]),
                             reference=_backward_reference(False, False), launcher=_backward_launcher(False),
                             public=layer_norm_backward, required={"dy": "an array of x's shape"}, **_backward)
FUSED_ADD_LAYER_NORM_BACKWARD = OpSpec(
    "fused_add_layer_norm_backward", LayerNormBackwardArrays, layout=_backward_layout(False, BACKWARD_NAMES[True]),
    reference=_backward_reference(True, False), launcher=_backward_launcher(False),
    public=fused_add_layer_norm_backward, names=BACKWARD_NAMES[True],
    required={"dy": "an array of residual_out's shape"}, **_backward)
LAYER_NORM_MODULATE_BACKWARD = OpSpec(
    "layer_norm_modulate_backward", LayerNormBackwardArrays, layout=_backward_layout(True, BACKWARD_NAMES[False]),
    reference=_backward_reference(False, True), launcher=_backward_launcher(True),
    public=layer_norm_modulate_backward,
    required={"dy": "an array of x's shape", "shift": "an array broadcasting to x",
              "scale": "an array broadcasting to x"}, **_backward)
register(LAYER_NORM, FUSED_ADD_LAYER_NORM, LAYER_NORM_MODULATE, LAYER_NORM_BACKWARD, FUSED_ADD_LAYER_NORM_BACKWARD,
         LAYER_NORM_MODULATE_BACKWARD)
REFERENCES = (layer_norm_reference, fused_add_layer_norm_reference, layer_norm_modulate_reference,
              layer_norm_backward_reference, fused_add_layer_norm_backward_reference,
              layer_norm_modulate_backward_reference)


# -- torch --------------------------------------------------------------------------------------------

def _bind_torch():
    import torch

    from ..._torch import dtype_arg, fake_meta, no_weight_grad
    Tensor = torch.Tensor

    def forward(spec, x, residual, weight, bias, shift, scale, eps, out_dtype=None, out=None, residual_out=None):
        return call(spec, (x, residual, weight, bias, out, residual_out, shift, scale), (eps, out_dtype))

    @torch.library.custom_op("cupy_rmsnorm::layer_norm", mutates_args=())
    def layer_norm_op(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                      out_dtype: Optional[torch.dtype] = None) -> Tensor:
        return forward(LAYER_NORM, x, None, weight, bias, None, None, eps, dtype_arg(out_dtype))

    @torch.library.custom_op("cupy_rmsnorm::fused_add_layer_norm", mutates_args=())
    def fused_op(x: Tensor, residual: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                 eps: float) -> tuple[Tensor, Tensor]:
        return forward(FUSED_ADD_LAYER_NORM, x, residual, weight, bias, None, None, eps)

    @torch.library.custom_op("cupy_rmsnorm::fused_add_layer_norm_inplace", mutates_args=("x", "residual"))
    def fused_inplace_op(x: Tensor, residual: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                         eps: float) -> None:
        forward(FUSED_ADD_LAYER_NORM, x, residual, weight, bias, None, None, eps, out=x, residual_out=residual)

    @torch.library.custom_op("cupy_rmsnorm::layer_norm_modulate", mutates_args=())
    def modulate_op(x: Tensor, shift: Tensor, scale: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                    eps: float) -> Tensor:
        return forward(LAYER_NORM_MODULATE, x, None, weight, bias, shift, scale, eps)

    def metas(x=None, residual=None, weight=None, bias=None, shift=None, scale=None):
        return LayerNormArrays(fake_meta(x), fake_meta(residual), fake_meta(weight), fake_meta(bias), None, None,
                               fake_meta(shift), fake_meta(scale))

    @layer_norm_op.register_fake
    def _(x, weight, bias, eps, out_dtype=None):
        _, out = check_layer_norm_arrays(metas(x, weight=weight, bias=bias), dtype_arg(out_dtype))
        return torch.empty(x.shape, dtype=getattr(torch, out), device=x.device)

    @fused_op.register_fake
    def _(x, residual, weight, bias, eps):
        residual_dtype, _ = check_layer_norm_arrays(metas(x, residual, weight, bias))
        return (torch.empty(x.shape, dtype=x.dtype, device=x.device),
                torch.empty(x.shape, dtype=getattr(torch, residual_dtype), device=x.device))

    @fused_inplace_op.register_fake
    def _(x, residual, weight, bias, eps):
        check_layer_norm_arrays(metas(x, residual, weight, bias))

    @modulate_op.register_fake
    def _(x, shift, scale, weight, bias, eps):
        check_layer_norm_arrays(metas(x, None, weight, bias, shift, scale))
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)

    # -- the backward ops: gradients as tensors, an empty one for an absent parameter
    def grads(result, like):
        return tuple(no_weight_grad(like) if g is None else g for g in result)

    @torch.library.custom_op("cupy_rmsnorm::layer_norm_backward", mutates_args=())
    def backward_op(dy: Tensor, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                    weight_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
        return grads(call(LAYER_NORM_BACKWARD, (dy, x, None, weight, bias, None, None), (eps, weight_grad)), x)

    @torch.library.custom_op("cupy_rmsnorm::fused_add_layer_norm_backward", mutates_args=())
    def fused_backward_op(dy: Tensor, d_residual_out: Optional[Tensor], residual_out: Tensor,
                          weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                          weight_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
        return grads(call(FUSED_ADD_LAYER_NORM_BACKWARD, (dy, residual_out, d_residual_out, weight, bias, None, None),
                          (eps, weight_grad)), residual_out)

    @torch.library.custom_op("cupy_rmsnorm::layer_norm_modulate_backward", mutates_args=())
    def modulate_backward_op(dy: Tensor, x: Tensor, shift: Tensor, scale: Tensor, weight: Optional[Tensor],
                             bias: Optional[Tensor], eps: float,
                             weight_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        return grads(call(LAYER_NORM_MODULATE_BACKWARD, (dy, x, None, weight, bias, shift, scale),
                          (eps, weight_grad)), x)

    def fake_param_grads(weight, bias, weight_grad, like):
        return tuple(torch.empty_like(p, memory_format=torch.contiguous_format) if p is not None and weight_grad
                     else no_weight_grad(like) for p in (weight, bias))

    @backward_op.register_fake
    def _(dy, x, weight, bias, eps, weight_grad):
        check_layer_norm_backward_arrays(LayerNormBackwardArrays(fake_meta(dy), fake_meta(x), None, fake_meta(weight),
                                                                 fake_meta(bias)), BACKWARD_NAMES[False])
        return (torch.empty(x.shape, dtype=x.dtype, device=x.device),) + fake_param_grads(weight, bias, weight_grad, x)

    @fused_backward_op.register_fake
    def _(dy, d_residual_out, residual_out, weight, bias, eps, weight_grad):
        check_layer_norm_backward_arrays(LayerNormBackwardArrays(fake_meta(dy), fake_meta(residual_out),
                                                                 fake_meta(d_residual_out), fake_meta(weight),
                                                                 fake_meta(bias)), BACKWARD_NAMES[True])
        return ((torch.empty(residual_out.shape, dtype=residual_out.dtype, device=residual_out.device),)
                + fake_param_grads(weight, bias, weight_grad, residual_out))

    @modulate_backward_op.register_fake
    def _(dy, x, shift, scale, weight, bias, eps, weight_grad):
        check_layer_norm_backward_arrays(LayerNormBackwardArrays(fake_meta(dy), fake_meta(x), None, fake_meta(weight),
                                                                 fake_meta(bias), fake_meta(shift), fake_meta(scale)),
                                         BACKWARD_NAMES[False])
        return ((torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty_like(shift),
                 torch.empty_like(scale)) + fake_param_grads(weight, bias, weight_grad, x))

    # -- autograd: the backward ops, one node each in a compiled backward graph
    def setup_plain(ctx, inputs, output):
        x, weight, bias, eps = inputs[:4]
        ctx.save_for_backward(x, weight, bias)
        ctx.eps = eps

    def grad_plain(ctx, dy):
        x, weight, bias = ctx.saved_tensors
        need = ctx.needs_input_grad
        wanted = (weight is not None and need[1]) or (bias is not None and need[2])
        dx, dw, db = backward_op(dy, x, weight, bias, ctx.eps, wanted)
        return ((dx if need[0] else None), (dw if wanted and weight is not None and need[1] else None),
                (db if wanted and bias is not None and need[2] else None), None, None)

    def setup_fused(ctx, inputs, output):
        x, residual, weight, bias, eps = inputs[:5]
        ctx.save_for_backward(output[1], weight, bias)
        ctx.eps, ctx.x_dtype = eps, x.dtype

    def grad_fused(ctx, dy, d_residual_out):
        residual_out, weight, bias = ctx.saved_tensors
        need = ctx.needs_input_grad
        if dy is None:
            dy = torch.zeros_like(residual_out)
        wanted = (weight is not None and need[2]) or (bias is not None and need[3])
        d_input, dw, db = fused_backward_op(dy, d_residual_out, residual_out, weight, bias, ctx.eps, wanted)
        dx = d_input if d_input.dtype == ctx.x_dtype else d_input.to(ctx.x_dtype)
        return ((dx if need[0] else None), (d_input if need[1] else None),
                (dw if wanted and weight is not None and need[2] else None),
                (db if wanted and bias is not None and need[3] else None), None)

    def setup_modulate(ctx, inputs, output):
        x, shift, scale, weight, bias, eps = inputs
        ctx.save_for_backward(x, shift, scale, weight, bias)
        ctx.eps = eps

    def grad_modulate(ctx, dy):
        x, shift, scale, weight, bias = ctx.saved_tensors
        need = ctx.needs_input_grad
        wanted = (weight is not None and need[3]) or (bias is not None and need[4])
        dx, dshift, dscale, dw, db = modulate_backward_op(dy, x, shift, scale, weight, bias, ctx.eps, wanted)
        return ((dx if need[0] else None), (dshift if need[1] else None), (dscale if need[2] else None),
                (dw if wanted and weight is not None and need[3] else None),
                (db if wanted and bias is not None and need[4] else None), None)

    torch.library.register_autograd("cupy_rmsnorm::layer_norm", grad_plain, setup_context=setup_plain)
    torch.library.register_autograd("cupy_rmsnorm::fused_add_layer_norm", grad_fused, setup_context=setup_fused)
    torch.library.register_autograd("cupy_rmsnorm::layer_norm_modulate", grad_modulate,
                                    setup_context=setup_modulate)

    def traced(arrays, options, differentiable):
        """A public forward call through the registered ops (while torch.compile traces, and when
        autograd records an eager call), given outputs filled by a copy; the fused in-place form
        is its own (forward-only) op."""
        x, residual, weight, bias, out, residual_out, shift, scale = arrays
        eps, out_dtype = options
        if shift is not None:
            y = modulate_op(x, shift, scale, weight, bias, eps)
        elif residual is None:
            y = layer_norm_op(x, weight, bias, eps, None if out_dtype is None else getattr(torch, out_dtype))
        elif out is x and residual_out is residual:
            if differentiable:
                raise RuntimeError("fused_add_layer_norm in place (out=x, residual_out=residual) is forward-only, "
                                   "and a tensor of this call requires grad: call it without out= / residual_out= "
                                   "to train, or under torch.no_grad()")
            fused_inplace_op(x, residual, weight, bias, eps)
            return x, residual
        else:
            y, s = fused_op(x, residual, weight, bias, eps)
            return (y if out is None else out.copy_(y)), (s if residual_out is None else residual_out.copy_(s))
        return y if out is None else out.copy_(y)

    def traced_backward(op, order):
        def run(arrays, options, differentiable):
            eps, weight_grad = options
            dy, x, d_res, weight, bias, shift, scale = arrays
            wanted = weight_grad and (weight is not None or bias is not None)
            if op is backward_op:
                r = op(dy, x, weight, bias, eps, wanted)
            elif op is fused_backward_op:
                r = op(dy, d_res, x, weight, bias, eps, wanted)
            else:
                r = op(dy, x, shift, scale, weight, bias, eps, wanted)
            r = list(r)
            for k, p in order:                  # the parameters' gradients: None where absent or unwanted
                if p(arrays) is None or not wanted:
                    r[k] = None
            return tuple(r)
        return run

    params = ((1, lambda a: a.weight), (2, lambda a: a.bias))
    LAYER_NORM.traced = FUSED_ADD_LAYER_NORM.traced = LAYER_NORM_MODULATE.traced = traced
    LAYER_NORM_BACKWARD.traced = traced_backward(backward_op, params)
    FUSED_ADD_LAYER_NORM_BACKWARD.traced = traced_backward(fused_backward_op, params)
    LAYER_NORM_MODULATE_BACKWARD.traced = traced_backward(modulate_backward_op,
                                                          ((3, lambda a: a.weight), (4, lambda a: a.bias)))

    # DTensor: rows sharded alike, parameters replicated, their gradients partial sums
    from ..._distributed import PARTIAL, ROWS, grad_of, shard_rows
    tables = {"shift": 1, "scale": 1}
    shard_rows(layer_norm_op, rows=("x",), outputs=(ROWS,))
    shard_rows(fused_op, rows=("x", "residual"), outputs=(ROWS, ROWS))
    shard_rows(fused_inplace_op, rows=("x", "residual"), outputs=())
    shard_rows(modulate_op, rows=("x",), outputs=(ROWS,), per_token=tables)
    shard_rows(backward_op, rows=("x", "dy"), outputs=(ROWS, PARTIAL, PARTIAL))
    shard_rows(fused_backward_op, rows=("residual_out", "dy", "d_residual_out"), outputs=(ROWS, PARTIAL, PARTIAL))
    shard_rows(modulate_backward_op, rows=("x", "dy"),
               outputs=(ROWS, grad_of("shift"), grad_of("scale"), PARTIAL, PARTIAL), per_token=tables)


_interop.TorchKind.add_binding(_bind_torch)
