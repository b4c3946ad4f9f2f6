"""The ops registered with ``torch.library``, so torch.compile sees one op per call, and
autograd through them.

    cupy_rmsnorm::rms_norm(Tensor x, Tensor? weight, float eps, float weight_offset,
                           str casting_mode) -> Tensor
    cupy_rmsnorm::fused_add_rms_norm(Tensor x, Tensor residual, Tensor? weight, float eps,
                                     float weight_offset, str casting_mode) -> (Tensor, Tensor)
    cupy_rmsnorm::fused_add_rms_norm_inplace(Tensor(a0!) x, Tensor(a1!) residual, Tensor? weight,
                                             float eps, float weight_offset, str casting_mode) -> ()
        (vLLM's in-place form: x becomes the normalized output, residual the sum; forward-only)
    cupy_rmsnorm::rms_norm_backward(Tensor dy, Tensor x, Tensor? weight, float eps,
                                    float weight_offset, str casting_mode, bool weight_grad)
                                    -> (Tensor, Tensor)
    cupy_rmsnorm::fused_add_rms_norm_backward(Tensor dy, Tensor? d_residual_out, Tensor residual_out,
                                              Tensor? weight, float eps, float weight_offset,
                                              str casting_mode, bool weight_grad) -> (Tensor, Tensor)
        (dx or d_input, and dweight; dweight is an empty tensor of x's dtype when weight is
        None or weight_grad is False)
    cupy_rmsnorm::rms_norm_quant(Tensor x, Tensor? weight, Tensor? scale, float eps, float weight_offset,
                                 str casting_mode, SymInt? group_size, float? scale_ub, str quant_dtype)
                                 -> (Tensor, Tensor)
    cupy_rmsnorm::fused_add_rms_norm_quant(Tensor x, Tensor residual, ...the same...) -> (Tensor, Tensor, Tensor)
    cupy_rmsnorm::fused_add_rms_norm_quant_inplace(Tensor x, Tensor(a1!) residual, ...) -> (Tensor, Tensor)
        (q, [residual_out,] scales; residual becomes residual_out in the in-place form; with a
        static scale, scales is an empty float32 tensor and the public functions return the
        scale itself; forward-only: FP8 outputs have no gradient)
    cupy_rmsnorm::rms_norm_gated(...), rms_norm_gated_backward(...)
    cupy_rmsnorm::qk_norm_rope(Tensor q, Tensor k, Tensor? q_weight, Tensor? k_weight, Tensor? cos,
                               Tensor? sin, Tensor? positions, Tensor? cos_sin_cache, float eps,
                               float weight_offset, str casting_mode, SymInt? rotary_dim, bool is_neox)
                               -> (Tensor, Tensor)
    cupy_rmsnorm::qk_norm_rope_inplace(Tensor(a0!) q, Tensor(a1!) k, ...the same...) -> ()
        (vLLM's call, out_q=q and out_k=k; forward-only)
    cupy_rmsnorm::qk_norm_rope_backward(Tensor dq_out, Tensor dk_out, Tensor q, Tensor k, ...the same...,
                                        bool weight_grad) -> (Tensor, Tensor, Tensor, Tensor)
        (dq, dk, dq_weight, dk_weight; the weights' gradients empty tensors of q's dtype without
        weights or with weight_grad False)

Autograd (``torch.library.register_autograd``): rms_norm and fused_add_rms_norm save their
input x (the fused op: its output residual_out) and the weight, rms_norm_gated also the gate,
qk_norm_rope q, k, both weights and the angles (which get no gradient), and their backward is
the backward op, one node in a compiled backward graph. The in-place ops stay
forward-only: a call of the in-place form that autograd would have to record is a
RuntimeError. In eager mode a public call with a tensor that requires grad while grad mode
is on goes through an autograd.Function with the same setup and gradients around the
direct paths (far cheaper than a custom op's eager dispatch); every other eager call keeps
the direct path.

Each has a fake implementation (outputs of the right shape and dtype, no data), so
dynamo traces a call as one node, inductor schedules around it and CUDA graphs capture
it. The real implementations are the library's direct path. In eager mode the public
functions keep that direct path (the dispatcher costs microseconds a call); while
torch.compile traces, the public functions call these ops instead (``call``,
``call_quant``): importing this module installs them into the call flow
(``_call.install_torch``), which never imports this module itself. Importing it imports
torch; ``import cupy_rmsnorm`` does it when torch is already loaded, the first torch tensor
a call meets does it otherwise, and so does ``import cupy_rmsnorm.torch``.
"""

from typing import Optional

import torch

from . import _call, _interop
from ._layout import Arrays, BackwardArrays, GatedBackwardArrays, QkRopeArrays, QkRopeBackwardArrays, new_scales
from ._validate import (check_arrays, check_backward_arrays, check_gated, check_gated_arrays, check_gated_backward_arrays,
                        check_qk_rope, check_qk_rope_arrays, check_quant, check_quant_arrays, check_scalars, dtype_name)

Tensor = torch.Tensor


def _direct(fused, x, residual, weight, out, residual_out, eps, weight_offset, casting_mode, out_dtype=None):
    # the library's eager path: not tracing when the op itself runs, so _call goes direct
    return _call.forward_call(fused, (x, residual, weight, out, residual_out), eps, weight_offset, casting_mode,
                              out_dtype)


def _dtype_arg(out_dtype):
    """A torch dtype (or None) as the call flow's dtype name."""
    return None if out_dtype is None else str(out_dtype).replace("torch.", "")


@torch.library.custom_op("cupy_rmsnorm::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Optional[Tensor], eps: float, weight_offset: float,
             casting_mode: str, out_dtype: Optional[torch.dtype] = None) -> Tensor:
    return _direct(False, x, None, weight, None, None, eps, weight_offset, casting_mode, _dtype_arg(out_dtype))


@torch.library.custom_op("cupy_rmsnorm::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float,
                       weight_offset: float, casting_mode: str,
                       out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
    return _direct(True, x, residual, weight, None, None, eps, weight_offset, casting_mode, _dtype_arg(out_dtype))


@torch.library.custom_op("cupy_rmsnorm::fused_add_rms_norm_inplace", mutates_args=("x", "residual"))
def fused_add_rms_norm_inplace(x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float,
                               weight_offset: float, casting_mode: str) -> None:
    _direct(True, x, residual, weight, x, residual, eps, weight_offset, casting_mode)


def _fake_meta(t):
    if t is None:
        return None
    name = _interop.TorchKind._dtype_map().get(t.dtype) or str(t.dtype).replace("torch.", "")
    return _interop.Meta(0, tuple(t.shape), tuple(t.stride()), name, t.element_size(), 0)


def _check_fake(x, residual, weight, out_dtype=None):
    """The shape and dtype checks of the real path, on fake tensors (no addresses): the
    (residual, output) torch dtypes."""
    residual_dtype, out_dtype = check_arrays(Arrays(_fake_meta(x), _fake_meta(residual), _fake_meta(weight)),
                                             _dtype_arg(out_dtype))
    return getattr(torch, residual_dtype), getattr(torch, out_dtype)


@rms_norm.register_fake
def _(x, weight, eps, weight_offset, casting_mode, out_dtype=None):
    _, out_dtype = _check_fake(x, None, weight, out_dtype)
    return torch.empty(x.shape, dtype=out_dtype, device=x.device)


@fused_add_rms_norm.register_fake
def _(x, residual, weight, eps, weight_offset, casting_mode, out_dtype=None):
    residual_dtype, out_dtype = _check_fake(x, residual, weight, out_dtype)
    return (torch.empty(x.shape, dtype=out_dtype, device=x.device),
            torch.empty(x.shape, dtype=residual_dtype, device=x.device))


@fused_add_rms_norm_inplace.register_fake
def _(x, residual, weight, eps, weight_offset, casting_mode):
    _check_fake(x, residual, weight)


# -- quantized forms ---------------------------------------------------------------------------

def _quant_direct(fused, x, residual, weight, residual_out, scale, eps, weight_offset, casting_mode, group_size,
                  scale_ub, quant_dtype):
    result = _call.quant_call(fused, (x, residual, weight, None, residual_out, scale, None), eps, weight_offset,
                              casting_mode, group_size, scale_ub, quant_dtype)
    if scale is None:
        return result
    return result[:-1] + (x.new_empty(0, dtype=torch.float32),)    # no alias of an input


@torch.library.custom_op("cupy_rmsnorm::rms_norm_quant", mutates_args=())
def rms_norm_quant(x: Tensor, weight: Optional[Tensor], scale: Optional[Tensor], eps: float, weight_offset: float,
                   casting_mode: str, group_size: Optional[int], scale_ub: Optional[float],
                   quant_dtype: str) -> tuple[Tensor, Tensor]:
    return _quant_direct(False, x, None, weight, None, scale, eps, weight_offset, casting_mode, group_size,
                         scale_ub, quant_dtype)


@torch.library.custom_op("cupy_rmsnorm::fused_add_rms_norm_quant", mutates_args=())
def fused_add_rms_norm_quant(x: Tensor, residual: Tensor, weight: Optional[Tensor], scale: Optional[Tensor],
                             eps: float, weight_offset: float, casting_mode: str, group_size: Optional[int],
                             scale_ub: Optional[float], quant_dtype: str) -> tuple[Tensor, Tensor, Tensor]:
    return _quant_direct(True, x, residual, weight, None, scale, eps, weight_offset, casting_mode, group_size,
                         scale_ub, quant_dtype)


@torch.library.custom_op("cupy_rmsnorm::fused_add_rms_norm_quant_inplace", mutates_args=("residual",))
def fused_add_rms_norm_quant_inplace(x: Tensor, residual: Tensor, weight: Optional[Tensor], scale: Optional[Tensor],
                                     eps: float, weight_offset: float, casting_mode: str, group_size: Optional[int],
                                     scale_ub: Optional[float], quant_dtype: str) -> tuple[Tensor, Tensor]:
    q, _, scales = _quant_direct(True, x, residual, weight, residual, scale, eps, weight_offset, casting_mode,
                                 group_size, scale_ub, quant_dtype)
    return q, scales


def _fake_quant(x, residual, weight, scale, group_size, scale_ub, quant_dtype):
    """(q, scales) of the real path's dtypes, shapes and strides, after its checks."""
    spec = check_quant(scale is not None, group_size, scale_ub, quant_dtype)
    check_quant_arrays(Arrays(_fake_meta(x), _fake_meta(residual), _fake_meta(weight)), _fake_meta(scale), None, spec)
    q = torch.empty(x.shape, dtype=getattr(torch, spec.quant_dtype), device=x.device)
    if scale is not None:
        return q, x.new_empty(0, dtype=torch.float32)
    empty = lambda shape: torch.empty(shape, dtype=torch.float32, device=x.device)  # noqa: E731
    return q, new_scales(empty, spec.form, spec.scales_shape(tuple(x.shape)))


@rms_norm_quant.register_fake
def _(x, weight, scale, eps, weight_offset, casting_mode, group_size, scale_ub, quant_dtype):
    return _fake_quant(x, None, weight, scale, group_size, scale_ub, quant_dtype)


@fused_add_rms_norm_quant.register_fake
def _(x, residual, weight, scale, eps, weight_offset, casting_mode, group_size, scale_ub, quant_dtype):
    q, scales = _fake_quant(x, residual, weight, scale, group_size, scale_ub, quant_dtype)
    return q, torch.empty(x.shape, dtype=residual.dtype, device=x.device), scales


@fused_add_rms_norm_quant_inplace.register_fake
def _(x, residual, weight, scale, eps, weight_offset, casting_mode, group_size, scale_ub, quant_dtype):
    return _fake_quant(x, residual, weight, scale, group_size, scale_ub, quant_dtype)


def call_quant(fused, arrays, eps, weight_offset, casting_mode, group_size, scale_ub, quant_dtype):
    """A public quantized call through the registered ops (while torch.compile traces), given
    outputs filled by a copy (``residual_out=residual`` is the in-place op)."""
    x, residual, weight, out, residual_out, scale, scales_out = arrays
    if fused and residual is None:
        raise TypeError("residual must be an array of x's shape and dtype, got None")
    scalars = check_scalars(eps, weight_offset, casting_mode, weight is not None)
    spec = check_quant(scale is not None, group_size, scale_ub, quant_dtype)
    args = (weight, scale, scalars.eps, scalars.weight_offset, scalars.casting_mode, spec.group_size,
            None if spec.scale_ub == float("inf") else spec.scale_ub, spec.quant_dtype)
    if not fused:
        q, scales = rms_norm_quant(x, *args)
    elif residual_out is residual:
        q, scales = fused_add_rms_norm_quant_inplace(x, residual, *args)
    else:
        q, s, scales = fused_add_rms_norm_quant(x, residual, *args)
        residual_out = s if residual_out is None else residual_out.copy_(s)
    if out is not None:       # a uint8 out takes the bits
        (out if out.dtype == q.dtype else out.view(q.dtype)).copy_(q)
        q = out
    if scale is not None:
        scales = scale
    elif scales_out is not None:
        scales = scales_out.copy_(scales)
    return (q, residual_out, scales) if fused else (q, scales)


# -- backward ---------------------------------------------------------------------------------

def _no_weight_grad(x):
    return x.new_empty(0)


@torch.library.custom_op("cupy_rmsnorm::rms_norm_backward", mutates_args=())
def rms_norm_backward(dy: Tensor, x: Tensor, weight: Optional[Tensor], eps: float, weight_offset: float,
                      casting_mode: str, weight_grad: bool) -> tuple[Tensor, Tensor]:
    dx, dweight = _call.backward_call(False, BackwardArrays(dy, x, None, weight), eps, weight_offset,
                                      casting_mode, weight_grad)
    return dx, (_no_weight_grad(x) if dweight is None else dweight)


@torch.library.custom_op("cupy_rmsnorm::fused_add_rms_norm_backward", mutates_args=())
def fused_add_rms_norm_backward(dy: Tensor, d_residual_out: Optional[Tensor], residual_out: Tensor,
                                weight: Optional[Tensor], eps: float, weight_offset: float, casting_mode: str,
                                weight_grad: bool) -> tuple[Tensor, Tensor]:
    dx, dweight = _call.backward_call(True, BackwardArrays(dy, residual_out, d_residual_out, weight), eps,
                                      weight_offset, casting_mode, weight_grad)
    return dx, (_no_weight_grad(residual_out) if dweight is None else dweight)


def _fake_backward(names, arrays, weight_grad):
    check_backward_arrays(BackwardArrays(*(_fake_meta(t) for t in arrays)), names)
    x, weight = arrays.x, arrays.weight
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    if weight is None or not weight_grad:
        return dx, _no_weight_grad(x)
    return dx, torch.empty_like(weight, memory_format=torch.contiguous_format)


@rms_norm_backward.register_fake
def _(dy, x, weight, eps, weight_offset, casting_mode, weight_grad):
    return _fake_backward(_call.BACKWARD_NAMES[False], BackwardArrays(dy, x, None, weight), weight_grad)


@fused_add_rms_norm_backward.register_fake
def _(dy, d_residual_out, residual_out, weight, eps, weight_offset, casting_mode, weight_grad):
    return _fake_backward(_call.BACKWARD_NAMES[True], BackwardArrays(dy, residual_out, d_residual_out, weight),
                          weight_grad)


def _setup_rms_norm(ctx, inputs, output):
    x, weight, eps, weight_offset, casting_mode = inputs[:5]
    ctx.save_for_backward(x, weight)
    ctx.scalars = (eps, weight_offset, casting_mode)


def _rms_norm_grad(ctx, dy, backward=rms_norm_backward):
    x, weight = ctx.saved_tensors
    weight_grad = weight is not None and ctx.needs_input_grad[1]
    dx, dweight = backward(dy, x, weight, *ctx.scalars, weight_grad)
    return (dx if ctx.needs_input_grad[0] else None), (dweight if weight_grad else None), None, None, None, None


def _setup_fused(ctx, inputs, output):
    x, residual, weight, eps, weight_offset, casting_mode = inputs[:6]
    ctx.save_for_backward(output[1], weight)      # residual_out: what was normalized
    ctx.scalars = (eps, weight_offset, casting_mode)
    ctx.x_dtype = x.dtype                         # a float32 residual stream: x's gradient in x's dtype


def _fused_grad(ctx, dy, d_residual_out, backward=fused_add_rms_norm_backward):
    residual_out, weight = ctx.saved_tensors
    if dy is None:                                # the normalized output was not used
        dy = torch.zeros_like(residual_out)
    weight_grad = weight is not None and ctx.needs_input_grad[2]
    d_input, dweight = backward(dy, d_residual_out, residual_out, weight, *ctx.scalars, weight_grad)
    # one tensor: the gradient of x + residual reaches both unchanged (x's in x's dtype)
    dx = d_input if d_input.dtype == ctx.x_dtype or not ctx.needs_input_grad[0] else d_input.to(ctx.x_dtype)
    return ((dx if ctx.needs_input_grad[0] else None), (d_input if ctx.needs_input_grad[1] else None),
            (dweight if weight_grad else None), None, None, None, None)


torch.library.register_autograd("cupy_rmsnorm::rms_norm", _rms_norm_grad, setup_context=_setup_rms_norm)
torch.library.register_autograd("cupy_rmsnorm::fused_add_rms_norm", _fused_grad, setup_context=_setup_fused)


# Eager autograd: the same setup and gradients on an autograd.Function around the direct
# paths. A custom op's eager dispatch under autograd costs hundreds of microseconds a call
# (forward + backward of 1 x 1024 on the H200: 634 us, against 147 for F.rms_norm), which a
# training step pays per norm; torch.compile keeps the registered ops.

def _eager_rms_norm_backward(dy, x, weight, eps, weight_offset, casting_mode, weight_grad):
    return _call.backward_call(False, BackwardArrays(dy, x, None, weight), eps, weight_offset, casting_mode,
                               weight_grad)


def _eager_fused_backward(dy, d_residual_out, residual_out, weight, eps, weight_offset, casting_mode, weight_grad):
    return _call.backward_call(True, BackwardArrays(dy, residual_out, d_residual_out, weight), eps,
                               weight_offset, casting_mode, weight_grad)


class _EagerRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(x, weight, eps, weight_offset, casting_mode, out_dtype):
        return _direct(False, x, None, weight, None, None, eps, weight_offset, casting_mode, _dtype_arg(out_dtype))

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup_rms_norm(ctx, inputs, output)

    @staticmethod
    def backward(ctx, dy):
        return _rms_norm_grad(ctx, dy, _eager_rms_norm_backward)


class _EagerFusedAddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(x, residual, weight, eps, weight_offset, casting_mode, out_dtype):
        return _direct(True, x, residual, weight, None, None, eps, weight_offset, casting_mode, _dtype_arg(out_dtype))

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup_fused(ctx, inputs, output)

    @staticmethod
    def backward(ctx, dy, d_residual_out):
        return _fused_grad(ctx, dy, d_residual_out, _eager_fused_backward)


def call(fused, arrays, eps, weight_offset, casting_mode, out_dtype=None, differentiable=False):
    """A public call through the registered ops, with any given outputs filled by a copy
    (the in-place fused form, ``out=x, residual_out=residual``, is its own op): while
    torch.compile traces, and (``differentiable``) in eager mode when autograd must record
    the call."""
    x, residual, weight, out, residual_out = arrays
    if fused and residual is None:
        raise TypeError("residual must be an array of x's shape and dtype, got None")
    scalars = check_scalars(eps, weight_offset, casting_mode, weight is not None)
    out_dtype = dtype_name(out_dtype, "out_dtype")
    args = (weight, scalars.eps, scalars.weight_offset, scalars.casting_mode)
    typed = args + (None if out_dtype is None else getattr(torch, out_dtype),)
    # (CUDA tensors: a device with its own kernels registered for the ops keeps them)
    eager = differentiable and x.is_cuda and not _is_compiling()
    if not fused:
        y = _EagerRMSNorm.apply(x, *typed) if eager else rms_norm(x, *typed)
        return y if out is None else out.copy_(y)
    if out is x and residual_out is residual and out_dtype in (None, _dtype_arg(x.dtype)):
        if differentiable:
            raise RuntimeError("fused_add_rms_norm in place (out=x, residual_out=residual) is forward-only, "
                               "and a tensor of this call requires grad: call it without out= / "
                               "residual_out= to train, or under torch.no_grad()")
        fused_add_rms_norm_inplace(x, residual, *args)
        return x, residual
    y, s = _EagerFusedAddRMSNorm.apply(x, residual, *typed) if eager else fused_add_rms_norm(x, residual, *typed)
    return (y if out is None else out.copy_(y)), (s if residual_out is None else residual_out.copy_(s))


# -- gated ---------------------------------------------------------------------------------------

@torch.library.custom_op("cupy_rmsnorm::rms_norm_gated", mutates_args=())
def rms_norm_gated(x: Tensor, gate: Tensor, weight: Optional[Tensor], eps: float, weight_offset: float,
                   casting_mode: str, group_size: Optional[int], norm_before_gate: bool, activation: str,
                   out_dtype: Optional[torch.dtype]) -> Tensor:
    return _call.gated_call((x, gate, weight, None), eps, weight_offset, casting_mode, group_size, norm_before_gate,
                            activation, _dtype_arg(out_dtype))


@rms_norm_gated.register_fake
def _(x, gate, weight, eps, weight_offset, casting_mode, group_size, norm_before_gate, activation, out_dtype):
    spec = check_gated(group_size, norm_before_gate, activation, _dtype_arg(out_dtype))
    check_gated_arrays((_fake_meta(x), _fake_meta(gate), _fake_meta(weight), None), spec)
    return torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)


@torch.library.custom_op("cupy_rmsnorm::rms_norm_gated_backward", mutates_args=())
def rms_norm_gated_backward(dy: Tensor, x: Tensor, gate: Tensor, weight: Optional[Tensor], eps: float,
                            weight_offset: float, casting_mode: str, group_size: Optional[int], norm_before_gate: bool,
                            activation: str, weight_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    dx, dgate, dweight = _eager_gated_backward(dy, x, gate, weight, eps, weight_offset, casting_mode, group_size,
                                               norm_before_gate, activation, weight_grad)
    return dx, dgate, (_no_weight_grad(x) if dweight is None else dweight)


@rms_norm_gated_backward.register_fake
def _(dy, x, gate, weight, eps, weight_offset, casting_mode, group_size, norm_before_gate, activation, weight_grad):
    spec = check_gated(group_size, norm_before_gate, activation)
    check_gated_backward_arrays((_fake_meta(dy), _fake_meta(x), _fake_meta(gate), _fake_meta(weight)), spec)
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    dgate = torch.empty_like(x, memory_format=torch.contiguous_format)
    if weight is None or not weight_grad:
        return dx, dgate, _no_weight_grad(x)
    return dx, dgate, torch.empty_like(weight, memory_format=torch.contiguous_format)


def _eager_gated_backward(dy, x, gate, weight, eps, weight_offset, casting_mode, group_size, norm_before_gate,
                          activation, weight_grad):
    return _call.gated_backward_call(GatedBackwardArrays(dy, x, gate, weight), eps, weight_offset, casting_mode,
                                     group_size, norm_before_gate, activation, weight_grad)


def _setup_gated(ctx, inputs, output):
    x, gate, weight = inputs[:3]
    ctx.save_for_backward(x, gate, weight)
    ctx.scalars = inputs[3:9]         # eps, weight_offset, casting_mode, group_size, norm_before_gate, activation


def _gated_grad(ctx, dy, backward=rms_norm_gated_backward):
    x, gate, weight = ctx.saved_tensors
    weight_grad = weight is not None and ctx.needs_input_grad[2]
    dx, dgate, dweight = backward(dy, x, gate, weight, *ctx.scalars, weight_grad)
    return ((dx if ctx.needs_input_grad[0] else None), (dgate if ctx.needs_input_grad[1] else None),
            (dweight if weight_grad else None)) + (None,) * 7


torch.library.register_autograd("cupy_rmsnorm::rms_norm_gated", _gated_grad, setup_context=_setup_gated)


class _EagerGated(torch.autograd.Function):
    @staticmethod
    def forward(x, gate, weight, eps, weight_offset, casting_mode, group_size, norm_before_gate, activation,
                out_dtype):
        return _call.gated_call((x, gate, weight, None), eps, weight_offset, casting_mode, group_size,
                                norm_before_gate, activation, _dtype_arg(out_dtype))

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup_gated(ctx, inputs, output)

    @staticmethod
    def backward(ctx, dy):
        return _gated_grad(ctx, dy, _eager_gated_backward)


def call_gated(arrays, eps, weight_offset, casting_mode, group_size, norm_before_gate, activation, out_dtype,
               differentiable=False):
    """A public gated call through the registered op (while torch.compile traces, and in eager
    mode when autograd must record it), a given out filled by a copy."""
    x, gate, weight, out = arrays
    if gate is None:
        raise TypeError("gate must be an array of x's shape and dtype, got None")
    scalars = check_scalars(eps, weight_offset, casting_mode, weight is not None)
    spec = check_gated(group_size, norm_before_gate, activation, out_dtype)
    args = (weight, scalars.eps, scalars.weight_offset, scalars.casting_mode, spec.group_size, spec.norm_before_gate,
            spec.activation, None if spec.out_dtype is None else getattr(torch, spec.out_dtype))
    eager = differentiable and x.is_cuda and not _is_compiling()
    y = _EagerGated.apply(x, gate, *args) if eager else rms_norm_gated(x, gate, *args)
    return y if out is None else out.copy_(y)


# -- QK norm + RoPE ----------------------------------------------------------------------------------
# The arrays in QkRopeArrays order (q, k, q_weight, k_weight, cos, sin, positions, cos_sin_cache),
# then eps, weight_offset, casting_mode, rotary_dim, is_neox.
_ANGLES = ("cos", "sin", "positions", "cos_sin_cache")


@torch.library.custom_op("cupy_rmsnorm::qk_norm_rope", mutates_args=())
def qk_norm_rope(q: Tensor, k: Tensor, q_weight: Optional[Tensor], k_weight: Optional[Tensor], cos: Optional[Tensor],
                 sin: Optional[Tensor], positions: Optional[Tensor], cos_sin_cache: Optional[Tensor], eps: float,
                 weight_offset: float, casting_mode: str, rotary_dim: Optional[int],
                 is_neox: bool) -> tuple[Tensor, Tensor]:
    return _call.qk_rope_call((q, k, q_weight, k_weight, cos, sin, positions, cos_sin_cache, None, None), eps,
                              weight_offset, casting_mode, rotary_dim, is_neox)


@torch.library.custom_op("cupy_rmsnorm::qk_norm_rope_inplace", mutates_args=("q", "k"))
def qk_norm_rope_inplace(q: Tensor, k: Tensor, q_weight: Optional[Tensor], k_weight: Optional[Tensor],
                         cos: Optional[Tensor], sin: Optional[Tensor], positions: Optional[Tensor],
                         cos_sin_cache: Optional[Tensor], eps: float, weight_offset: float, casting_mode: str,
                         rotary_dim: Optional[int], is_neox: bool) -> None:
    _call.qk_rope_call((q, k, q_weight, k_weight, cos, sin, positions, cos_sin_cache, q, k), eps, weight_offset,
                       casting_mode, rotary_dim, is_neox)


@torch.library.custom_op("cupy_rmsnorm::qk_norm_rope_backward", mutates_args=())
def qk_norm_rope_backward(dq_out: Tensor, dk_out: Tensor, q: Tensor, k: Tensor, q_weight: Optional[Tensor],
                          k_weight: Optional[Tensor], cos: Optional[Tensor], sin: Optional[Tensor],
                          positions: Optional[Tensor], cos_sin_cache: Optional[Tensor], eps: float,
                          weight_offset: float, casting_mode: str, rotary_dim: Optional[int], is_neox: bool,
                          weight_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dq, dk, dq_weight, dk_weight = _eager_qk_rope_backward(dq_out, dk_out, q, k, q_weight, k_weight, cos, sin,
                                                           positions, cos_sin_cache, eps, weight_offset,
                                                           casting_mode, rotary_dim, is_neox, weight_grad)
    if dq_weight is None:
        return dq, dk, _no_weight_grad(q), _no_weight_grad(q)
    # the kernel writes both weights' gradients into one buffer; an op's outputs must not alias
    return dq, dk, dq_weight, dk_weight.clone()


def _check_fake_qk_rope(arrays, rotary_dim, is_neox, gradients=None):
    """The real path's argument, shape and dtype checks on fake tensors (``arrays``: the eight
    inputs in QkRopeArrays order; ``gradients``: the backward's dq_out and dk_out)."""
    metas = QkRopeArrays(*(_fake_meta(t) for t in arrays))
    spec = check_qk_rope(metas, rotary_dim, is_neox)
    check_qk_rope_arrays(metas, spec, None if gradients is None else tuple(_fake_meta(t) for t in gradients))


@qk_norm_rope.register_fake
def _(q, k, q_weight, k_weight, cos, sin, positions, cos_sin_cache, eps, weight_offset, casting_mode, rotary_dim,
      is_neox):
    _check_fake_qk_rope((q, k, q_weight, k_weight, cos, sin, positions, cos_sin_cache), rotary_dim, is_neox)
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device))


@qk_norm_rope_inplace.register_fake
def _(q, k, q_weight, k_weight, cos, sin, positions, cos_sin_cache, eps, weight_offset, casting_mode, rotary_dim,
      is_neox):
    _check_fake_qk_rope((q, k, q_weight, k_weight, cos, sin, positions, cos_sin_cache), rotary_dim, is_neox)


@qk_norm_rope_backward.register_fake
def _(dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, positions, cos_sin_cache, eps, weight_offset, casting_mode,
      rotary_dim, is_neox, weight_grad):
    _check_fake_qk_rope((q, k, q_weight, k_weight, cos, sin, positions, cos_sin_cache), rotary_dim, is_neox,
                        (dq_out, dk_out))
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if q_weight is None or not weight_grad:
        return dq, dk, _no_weight_grad(q), _no_weight_grad(q)
    return (dq, dk, torch.empty_like(q_weight, memory_format=torch.contiguous_format),
            torch.empty_like(k_weight, memory_format=torch.contiguous_format))


def _eager_qk_rope_backward(dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, positions, cos_sin_cache, eps,
                            weight_offset, casting_mode, rotary_dim, is_neox, weight_grad):
    return _call.qk_rope_backward_call(QkRopeBackwardArrays(dq_out, dk_out, q, k, q_weight, k_weight, cos, sin,
                                                            positions, cos_sin_cache), eps, weight_offset,
                                       casting_mode, rotary_dim, is_neox, weight_grad)


def _setup_qk_rope(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:8])      # q, k, the weights and the angles: the norm is recomputed
    ctx.scalars = inputs[8:13]              # eps, weight_offset, casting_mode, rotary_dim, is_neox


def _qk_rope_grad(ctx, dq_out, dk_out, backward=qk_norm_rope_backward):
    q, k, q_weight, k_weight, *angles = ctx.saved_tensors
    need = ctx.needs_input_grad
    if dq_out is None:                      # one of the two outputs was not used
        dq_out = torch.zeros_like(q)
    if dk_out is None:
        dk_out = torch.zeros_like(k)
    weight_grad = q_weight is not None and (need[2] or need[3])
    dq, dk, dq_weight, dk_weight = backward(dq_out, dk_out, q, k, q_weight, k_weight, *angles, *ctx.scalars,
                                            weight_grad)
    return ((dq if need[0] else None), (dk if need[1] else None), (dq_weight if weight_grad and need[2] else None),
            (dk_weight if weight_grad and need[3] else None)) + (None,) * 9


torch.library.register_autograd("cupy_rmsnorm::qk_norm_rope", _qk_rope_grad, setup_context=_setup_qk_rope)


class _EagerQkRope(torch.autograd.Function):
    @staticmethod
    def forward(q, k, q_weight, k_weight, cos, sin, positions, cos_sin_cache, eps, weight_offset, casting_mode,
                rotary_dim, is_neox):
        return _call.qk_rope_call((q, k, q_weight, k_weight, cos, sin, positions, cos_sin_cache, None, None), eps,
                                  weight_offset, casting_mode, rotary_dim, is_neox)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup_qk_rope(ctx, inputs, output)

    @staticmethod
    def backward(ctx, dq_out, dk_out):
        return _qk_rope_grad(ctx, dq_out, dk_out, _eager_qk_rope_backward)


def _qk_rope_args(arrays, eps, weight_offset, casting_mode, rotary_dim, is_neox, weights):
    """The ops' arguments after q and k, checked as the real path checks them first."""
    scalars = check_scalars(eps, weight_offset, casting_mode, weights)
    spec = check_qk_rope(arrays, rotary_dim, is_neox)
    return (arrays.q_weight, arrays.k_weight, arrays.cos, arrays.sin, arrays.positions, arrays.cos_sin_cache,
            scalars.eps, scalars.weight_offset, scalars.casting_mode, spec.rotary_dim, spec.is_neox)


def call_qk_rope(arrays, eps, weight_offset, casting_mode, rotary_dim, is_neox, differentiable=False):
    """A public QK norm + RoPE call through the registered ops (while torch.compile traces, and in
    eager mode when autograd must record it), given outputs filled by a copy (``out_q=q,
    out_k=k`` is the in-place op, forward-only)."""
    arrays = QkRopeArrays._make(arrays)
    q, k = arrays.q, arrays.k
    for name in ("q", "k"):
        if getattr(arrays, name) is None:
            raise TypeError(f"{name} must be an array of shape (..., heads, head_dim), got None")
    args = _qk_rope_args(arrays, eps, weight_offset, casting_mode, rotary_dim, is_neox, arrays.q_weight is not None)
    records = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in arrays[:8])
    if records:
        for name in _ANGLES:
            t = getattr(arrays, name)
            if t is not None and t.requires_grad:
                raise ValueError(f"{name} requires grad, and qk_norm_rope has no gradient for the angles: "
                                 f"pass {name}.detach()")
    if arrays.out_q is q and arrays.out_k is k:
        if records:
            raise RuntimeError("qk_norm_rope in place (out_q=q, out_k=k) is forward-only, and a tensor of this "
                               "call requires grad: call it without out_q= / out_k= to train, or under "
                               "torch.no_grad()")
        qk_norm_rope_inplace(q, k, *args)
        return q, k
    eager = differentiable and q.is_cuda and not _is_compiling()
    q_out, k_out = _EagerQkRope.apply(q, k, *args) if eager else qk_norm_rope(q, k, *args)
    out_q, out_k = arrays.out_q, arrays.out_k
    return (q_out if out_q is None else out_q.copy_(q_out)), (k_out if out_k is None else out_k.copy_(k_out))


def call_qk_rope_backward(arrays, eps, weight_offset, casting_mode, rotary_dim, is_neox, weight_grad=True):
    """A public QK norm + RoPE backward call through the registered op (while torch.compile
    traces): (dq, dk, dq_weight, dk_weight), the weights' gradients None without weights."""
    arrays = QkRopeBackwardArrays._make(arrays)
    for name in ("dq_out", "dk_out", "q", "k"):
        if getattr(arrays, name) is None:
            raise TypeError(f"{name} must be an array of shape (..., heads, head_dim), got None")
    args = _qk_rope_args(arrays, eps, weight_offset, casting_mode, rotary_dim, is_neox, arrays.q_weight is not None)
    dq, dk, dq_weight, dk_weight = qk_norm_rope_backward(arrays.dq_out, arrays.dk_out, arrays.q, arrays.k, *args,
                                                         bool(weight_grad))
    if arrays.q_weight is None or not weight_grad:
        return dq, dk, None, None
    return dq, dk, dq_weight, dk_weight


# is_dynamo_compiling: a plain `return False` in eager (cheaper than is_compiling)
_is_compiling = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)
_call.install_torch(_is_compiling, call, call_quant, call_gated, call_qk_rope, call_qk_rope_backward)
