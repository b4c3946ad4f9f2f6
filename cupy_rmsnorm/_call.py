"""The flow of one call, for every op:

caller's arrays -> interop (kind, device, stream) -> validation (dtype, shape, layout,
overlap; nothing launched or written on error) -> launch plan -> kernel cache -> launch on
the caller's stream -> results as the caller's array type.

A call whose signature (everything but the arrays' addresses, ``_interop.signature``) was
seen before takes the fast path: the launcher remembered for it (``_cache``) reads the
pointers and launches. Any other call takes the full path: ``resolve`` finds the arrays'
one kind and prepares them, then come the checks, the layout, and a new launcher
(remembered) or the NumPy reference.

The torch layer (``_torch_ops``: the registered ops, their fakes and autograd) plugs in
through ``install_torch``; this module never imports it. The package's ``__init__`` sets
``load_torch_ops`` to a function that imports it, which the full path calls when the first
torch tensor arrives (``__init__`` calls it at once when torch is already imported).
"""

import sys
from typing import NamedTuple

from . import _cache, _interop, _validate
from ._interop import CupyKind, DlpackKind, NumpyKind, TorchKind
from ._launcher import (BackwardLauncher, GatedBackwardLauncher, GatedLauncher, Launcher, MixedBackward,
                        MixedLauncher, QkRopeBackwardLauncher, QkRopeLauncher, QuantLauncher)
from ._layout import (OUT, OUTPUTS, QK_ROPE_OUTPUTS, RESIDUAL_OUT, SCALE, SCALES, Arrays, GatedArrays,
                      GatedBackwardArrays, QkRopeArrays, QkRopeBackwardArrays, QuantArrays, backward_layout,
                      call_layout, gated_backward_layout, gated_layout, new_scales, qk_rope_layout, quant_layout)
from ._reference import (fused_add_rms_norm_backward_reference, fused_add_rms_norm_quant_reference,
                         fused_add_rms_norm_reference, qk_norm_rope_backward_reference, qk_norm_rope_reference,
                         rms_norm_backward_reference, rms_norm_gated_backward_reference, rms_norm_gated_reference,
                         rms_norm_quant_reference, rms_norm_reference)

# The arguments' names of each form's arrays, for messages (the backward's second array is x,
# or the fused op's residual_out: the array the others must match).
NAMES = Arrays._fields
QUANT_NAMES = NAMES + ("scale", "scales_out")
BACKWARD_NAMES = {False: ("dy", "x", "d_residual_out", "weight"),
                  True: ("dy", "residual_out", "d_residual_out", "weight")}
BACKWARD_TAGS = {False: "rms_norm_backward", True: "fused_add_rms_norm_backward"}   # the backward's signature keys

# -- the torch layer ------------------------------------------------------------------------------
load_torch_ops = None   # set by the package's __init__: imports _torch_ops, which calls install_torch
_compiling = None       # torch.compiler.is_dynamo_compiling once the torch layer is installed
_torch_forward = None   # the torch layer's forward through the registered ops (tracing; autograd)
_torch_quant = None     # the same for the quantized forms
_torch_gated = None     # and for the gated one
_torch_qk_rope = None   # QK norm + RoPE, forward and backward
_torch_qk_rope_backward = None


def install_torch(compiling, forward, quant, gated, qk_rope, qk_rope_backward):
    """Called by the torch layer when it is loaded: calls made while torch.compile traces go to
    its registered ops (``forward``, ``quant``, ``gated``, ``qk_rope`` and ``qk_rope_backward``
    take the arguments of ``forward_call``, ``quant_call``, ``gated_call``, ``qk_rope_call`` and
    ``qk_rope_backward_call``; ``forward``, ``gated`` and ``qk_rope`` also take
    ``differentiable=True`` for eager autograd)."""
    global _compiling, _torch_forward, _torch_quant, _torch_gated, _torch_qk_rope, _torch_qk_rope_backward
    _torch_forward, _torch_quant, _torch_gated = forward, quant, gated
    _torch_qk_rope, _torch_qk_rope_backward = qk_rope, qk_rope_backward
    TorchKind.bind()
    _compiling = compiling


def _load_torch():
    if _compiling is None:
        load_torch_ops()


def _refuse_unregistered_trace():
    """torch was imported after this library and no tensor has reached it yet, so the torch
    ops are not registered; registering them now would happen inside dynamo's trace, which
    cannot import them. Say so, rather than let dynamo trip over this module's Python."""
    if sys.modules["torch"].compiler.is_dynamo_compiling():
        raise RuntimeError("torch.compile is tracing a cupy_rmsnorm call before the library's torch ops were "
                           "registered (torch was imported after cupy_rmsnorm, and no tensor has been passed "
                           "yet): import cupy_rmsnorm.torch before compiling")


# -- the full path's first step: one kind for all arrays -----------------------------------------

class Resolved(NamedTuple):
    """A call's arrays as its kind runs them. ``arrays``: the caller's (DLPack producers as
    zero-copy CuPy views); ``resolved``: what the kernel reads (torch tensors with the lazy
    negation bit resolved by a copy); ``metas``: their Meta records; ``copied``: an input was
    copied; ``cacheable``: the call may leave its launcher in the signature cache (not for
    DLPack producers, whose signature is CuPy's views')."""
    kind: type
    arrays: tuple
    resolved: tuple
    metas: tuple
    copied: bool
    cacheable: bool


def array_kind(arrays, names, anchor=0):
    """The one kind of a call's ``arrays`` (a NamedTuple, None where absent): (kind, the arrays
    as that kind takes them, whether the call may be cached). TypeError when an array is of no
    known kind or of another kind than ``arrays[anchor]`` (``names``: the arguments' names).
    DLPack producers become zero-copy CuPy views (and the call is not cached: its signature
    would be CuPy's views'); the first torch tensor loads the torch layer."""
    kind = _interop.kind_of(arrays[anchor], names[anchor])
    for name, a in zip(names, arrays):
        if a is not None and _interop.kind_of(a, name) is not kind:
            raise TypeError(f"{name} must be the same kind of array as {names[anchor]} ({kind.name}), "
                            f"got {type(a).__module__}.{type(a).__name__}")
    if kind is NumpyKind:
        return kind, arrays, True
    _interop.require_cupy()
    if kind is DlpackKind:
        return CupyKind, type(arrays)(*(None if a is None else kind.to_cupy(a, n) for n, a in zip(names, arrays))), False
    if kind is TorchKind:
        _load_torch()
    return kind, arrays, True


def prepare(kind, arrays, names, outputs=(), cacheable=True):
    """``Resolved`` for arrays of one ``kind`` (array_kind's): torch tensors must be on CUDA
    (ValueError), ``outputs`` (positions) plain memory, inputs with the lazy negation bit are
    resolved by a copy; NumPy inputs of another byte order are made native (the reference
    reads values)."""
    make = type(arrays)
    resolved = arrays
    if kind is TorchKind:
        _check_torch(arrays, names, outputs)
        resolved = make(*(None if a is None else kind.resolve(a, n) for n, a in zip(names, arrays)))
    elif kind is NumpyKind:
        resolved = make(*(a if a is None or k in outputs else kind.native(a) for k, a in enumerate(arrays)))
    metas = make(*(None if a is None else kind.meta(a) for a in resolved))
    copied = any(a is not b for a, b in zip(arrays, resolved))
    return Resolved(kind, arrays, resolved, metas, copied, cacheable)


def resolve(arrays, names, anchor=0, outputs=()):
    """``prepare(*array_kind(...))``: the full path's first step for every op."""
    kind, arrays, cacheable = array_kind(arrays, names, anchor)
    return prepare(kind, arrays, names, outputs, cacheable)


def _check_torch(arrays, names, outputs):
    """Torch tensors must be on a CUDA device; outputs must be plain memory."""
    torch = sys.modules["torch"]
    for k, (name, t) in enumerate(zip(names, arrays)):
        if t is None:
            continue
        if t.device.type != "cuda":
            raise ValueError(f"{name} is a torch tensor on {t.device}; pass CUDA tensors "
                             f"(tensor.cuda()) or NumPy arrays (tensor.numpy()) for the CPU path")
        if k in outputs and t.layout == torch.strided and (t.is_neg() or t.is_conj()):
            raise ValueError(f"{name} has torch's lazy negation (or conjugation) bit set, so its memory "
                             f"holds the values without the sign; pass a plain tensor "
                             f"({name}.resolve_neg() makes one)")


# -- rms_norm and fused_add_rms_norm ----------------------------------------------------------
# The fast path is inline here: a repeated call's Python is a few microseconds, and every frame
# costs tens of ns. An array type's signature function is looked up (_interop.signature finds and
# records it for a new type); then the signature is compared with the last hit's before the
# cache's dict, whose lookup hashes it (_cache.lookup is the same steps as a function).
_signatures_get = _interop.SIGNATURES.get
_launches_get = _cache.launches.get


def forward_call(fused, arrays, eps, weight_offset, casting_mode, out_dtype=None):
    """``arrays``: the five in ``Arrays`` order, as a plain tuple (naming them costs a
    NamedTuple's construction, about 0.3 us, on every call; the full path names them).
    ``out_dtype``: the output's dtype as given (None: x's)."""
    if _compiling is not None and _compiling():
        return _torch_forward(fused, arrays, eps, weight_offset, casting_mode, out_dtype)
    if _compiling is None and sys.modules.get("torch") is not None:
        _refuse_unregistered_trace()
    op = fused if out_dtype is None else (fused, out_dtype)     # the signature's op: with out_dtype if given
    signature = _signatures_get(type(arrays[0]), _interop.signature)(op, arrays, eps, weight_offset, casting_mode)
    last_signature, launch = _cache.last_hit
    try:
        if signature != last_signature:
            launch = _launches_get(signature)
            if launch is not None:
                _cache.last_hit = signature, launch
    except Exception:       # an odd part (an eps that cannot be hashed or compared): no fast path
        launch = None
    if launch is not None:
        result = launch(arrays)
        if result is not None:
            return result
    return _full_forward(fused, arrays, eps, weight_offset, casting_mode, out_dtype, signature)


def _full_forward(fused, arrays, eps, weight_offset, casting_mode, out_dtype, signature):
    """Validate everything, then run (and remember a launcher for the signature)."""
    arrays = Arrays._make(arrays)
    if fused and arrays.residual is None:
        raise TypeError("residual must be an array of x's shape and dtype, got None")
    scalars = _validate.check_scalars(eps, weight_offset, casting_mode, arrays.weight is not None)
    out_dtype = _validate.dtype_name(out_dtype, "out_dtype")
    kind, arrays, cacheable = array_kind(arrays, NAMES)
    if kind is TorchKind and _interop.autograd_records(arrays):   # the registered op runs this path
        return _torch_forward(fused, arrays, eps, weight_offset, casting_mode, out_dtype, differentiable=True)
    call = prepare(kind, arrays, NAMES, OUTPUTS, cacheable)
    residual_dtype, out_dtype = _validate.check_arrays(call.metas, out_dtype)
    arrays, layout = call_layout(call.kind, fused, call.resolved, call.metas, call.copied)
    if call.kind is NumpyKind:
        return _numpy_forward(arrays, scalars, fused, out_dtype)
    if residual_dtype == layout.dtype and out_dtype == layout.dtype:
        launcher = Launcher(layout, scalars, call.kind)
    else:
        launcher = MixedLauncher(layout, scalars, call.kind, residual_dtype, out_dtype)
    if call.cacheable and not layout.copied:
        _cache.remember(signature, launcher.entry)
    return launcher(arrays, checked=True)


def _numpy_forward(arrays, scalars, fused, out_dtype):
    """The reference on the CPU, stored into the given outputs."""
    x, residual, weight = arrays.x, arrays.residual, arrays.weight
    args = (scalars.eps, scalars.weight_offset, scalars.casting_mode)
    if fused:
        y, s = fused_add_rms_norm_reference(x, residual, weight, *args, out_dtype=out_dtype)
        return _store(arrays[OUT], y), _store(arrays[RESIDUAL_OUT], s)
    return _store(arrays[OUT], rms_norm_reference(x, weight, *args, out_dtype=out_dtype))


def _store(dest, value):
    """``value`` into ``dest`` (None: ``value`` itself): by value, any byte order; a uint8
    ``dest`` of quantized values takes their bits."""
    if dest is None:
        return value
    bits = dest.dtype != value.dtype and dest.dtype.kind == "u" and value.dtype.itemsize == 1
    (dest.view(value.dtype) if bits else dest)[...] = value
    return dest


# -- the quantized forms ---------------------------------------------------------------------

def quant_call(fused, arrays, eps, weight_offset, casting_mode, group_size, scale_ub, quant_dtype):
    """``arrays``: the seven in ``QuantArrays`` order, as a plain tuple (see forward_call)."""
    if _compiling is not None and _compiling():
        return _torch_quant(fused, arrays, eps, weight_offset, casting_mode, group_size, scale_ub, quant_dtype)
    if _compiling is None and sys.modules.get("torch") is not None:
        _refuse_unregistered_trace()
    quant = (group_size, scale_ub, quant_dtype)
    signature = _interop.quant_signature(fused, arrays, eps, weight_offset, casting_mode, quant)
    launch = _cache.lookup(signature)
    if launch is not None:
        result = launch(arrays)
        if result is not None:
            return result
    return _full_quant(fused, arrays, eps, weight_offset, casting_mode, quant, signature)


def _full_quant(fused, arrays, eps, weight_offset, casting_mode, quant, signature):
    """Validate everything, then run (and remember a QuantLauncher for the signature)."""
    arrays = QuantArrays._make(arrays)
    if fused and arrays.residual is None:
        raise TypeError("residual must be an array of x's shape and dtype, got None")
    scalars = _validate.check_scalars(eps, weight_offset, casting_mode, arrays.weight is not None)
    spec = _validate.check_quant(arrays.scale is not None, *quant)
    call = resolve(arrays, QUANT_NAMES, outputs=(OUT, RESIDUAL_OUT, SCALES))
    metas = call.metas
    residual_dtype = _validate.check_quant_arrays(Arrays(*metas[:5]), metas[SCALE], metas[SCALES], spec)
    arrays, layout = quant_layout(call.kind, fused, call.resolved, metas, spec.form, spec.scales_shape(metas.x.shape),
                                  call.copied)
    if call.kind is NumpyKind:
        return _numpy_quant(arrays, scalars, spec, layout, fused)
    launcher = QuantLauncher(layout, scalars, call.kind, spec, residual_dtype)
    if call.cacheable and not layout.call.copied:
        _cache.remember(signature, launcher.entry)
    return launcher(arrays, checked=True)


def _numpy_quant(arrays, scalars, spec, layout, fused):
    """The reference on the CPU, stored into the given outputs (fresh scales in the GPU's layout)."""
    import numpy as np
    args = (scalars.eps, scalars.weight_offset, scalars.casting_mode)
    quant = dict(scale=arrays.scale, group_size=spec.group_size, quant_dtype=spec.quant_dtype,
                 scale_ub=None if spec.scale_ub == float("inf") else spec.scale_ub)
    if fused:
        q, summed, scales = fused_add_rms_norm_quant_reference(arrays.x, arrays.residual, arrays.weight, *args,
                                                               **quant)
    else:
        q, scales = rms_norm_quant_reference(arrays.x, arrays.weight, *args, **quant)
    q = _store(arrays.out, q)
    if spec.form == "static":
        scales = arrays.scale
    else:
        dest = arrays.scales
        if dest is None:
            dest = new_scales(lambda shape: np.empty(shape, np.float32), spec.form, layout.scales_shape)
        scales = _store(dest, scales)
    if fused:
        return q, _store(arrays.residual_out, summed), scales
    return q, scales


# -- the backward ----------------------------------------------------------------------------

def backward_call(fused, arrays, eps, weight_offset, casting_mode, weight_grad=True):
    """``arrays``: a BackwardArrays. ``weight_grad``: False skips dweight (autograd, when the
    weight needs no gradient). The backward writes only fresh outputs, so a signature seen
    before needs no check of its pointers but their alignment (the launcher's)."""
    dy, x, d_residual_out, weight = arrays
    signature = _interop.signature(BACKWARD_TAGS[fused], (x, d_residual_out, weight, dy, None), eps, weight_offset,
                                   casting_mode)
    launch = _cache.lookup(signature)
    if launch is not None:
        return launch(arrays, weight_grad)
    names = BACKWARD_NAMES[fused]
    if dy is None:
        raise TypeError(f"dy must be an array of {names[1]}'s shape and dtype, got None")
    scalars = _validate.check_scalars(eps, weight_offset, casting_mode, weight is not None)
    call = resolve(arrays, names, anchor=1)
    _validate.check_backward_arrays(call.metas, names)
    dy_dtype, x_dtype = call.metas.dy.dtype, call.metas.x.dtype
    if call.kind is not NumpyKind and dy_dtype != x_dtype:       # mixed precision
        launcher = MixedBackward(scalars, call.kind, dy_dtype, x_dtype)
        if call.cacheable:
            _cache.remember(signature, launcher.__call__)
        return launcher(call.resolved, weight_grad)
    arrays, layout = backward_layout(call.kind, call.resolved, call.metas)
    if call.kind is NumpyKind:
        return _numpy_backward(fused, arrays, scalars, weight_grad)
    launcher = BackwardLauncher(layout, scalars, call.kind)
    if call.cacheable and not (call.copied or layout.copied):
        _cache.remember(signature, launcher.__call__)
    return launcher(arrays, weight_grad)


def _numpy_backward(fused, arrays, scalars, weight_grad):
    dy, x, d_residual_out, weight = arrays
    args = (scalars.eps, scalars.weight_offset, scalars.casting_mode)
    if fused:
        dx, dweight = fused_add_rms_norm_backward_reference(dy, d_residual_out, x, weight, *args)
    else:
        dx, dweight = rms_norm_backward_reference(dy, x, weight, *args)
    return dx, (dweight if weight_grad else None)


# -- gated RMSNorm ---------------------------------------------------------------------------------
GATED_NAMES = GatedArrays._fields
GATED_BACKWARD_NAMES = GatedBackwardArrays._fields


def _gated_signature(tag, arrays, eps, weight_offset, casting_mode, gated):
    """The signature of a gated call: the five-array signature of (x, gate, weight, out) with
    the gated arguments."""
    sig = _interop.signature(tag, tuple(arrays) + (None,), eps, weight_offset, casting_mode)
    return None if sig is None else (sig, gated)


def gated_call(arrays, eps, weight_offset, casting_mode, group_size, norm_before_gate, activation, out_dtype):
    """``arrays``: the four of GatedArrays, as a plain tuple."""
    gated = (group_size, norm_before_gate, activation, out_dtype)
    if _compiling is not None and _compiling():
        return _torch_gated(arrays, eps, weight_offset, casting_mode, *gated)
    if _compiling is None and sys.modules.get("torch") is not None:
        _refuse_unregistered_trace()
    signature = _gated_signature("rms_norm_gated", arrays, eps, weight_offset, casting_mode, gated)
    launch = _cache.lookup(signature)
    if launch is not None:
        result = launch(arrays)
        if result is not None:
            return result
    arrays = GatedArrays._make(arrays)
    if arrays.gate is None:
        raise TypeError("gate must be an array of x's shape and dtype, got None")
    scalars = _validate.check_scalars(eps, weight_offset, casting_mode, arrays.weight is not None)
    spec = _validate.check_gated(*gated)
    kind, arrays, cacheable = array_kind(arrays, GATED_NAMES)
    if kind is TorchKind and _interop.autograd_records(arrays):   # the registered op runs this path
        return _torch_gated(arrays, eps, weight_offset, casting_mode, *gated, differentiable=True)
    call = prepare(kind, arrays, GATED_NAMES, (3,), cacheable)
    out_dtype = _validate.check_gated_arrays(call.metas, spec)
    arrays, layout = gated_layout(kind, call.resolved, call.metas, spec.group_size, out_dtype, call.copied)
    if kind is NumpyKind:
        y = rms_norm_gated_reference(arrays.x, arrays.gate, arrays.weight, scalars.eps, scalars.weight_offset,
                                     scalars.casting_mode, group_size=spec.group_size,
                                     norm_before_gate=spec.norm_before_gate, activation=spec.activation,
                                     out_dtype=out_dtype)
        return _store(arrays.out, y)
    launcher = GatedLauncher(layout, scalars, kind, spec)
    if call.cacheable and not layout.call.copied:
        _cache.remember(signature, launcher.entry)
    return launcher(arrays, checked=True)


def gated_backward_call(arrays, eps, weight_offset, casting_mode, group_size, norm_before_gate, activation,
                        weight_grad=True):
    """``arrays``: a GatedBackwardArrays; (dx, dgate, dweight)."""
    gated = (group_size, norm_before_gate, activation)
    dy, x, gate, weight = arrays
    signature = _gated_signature("rms_norm_gated_backward", (x, gate, weight, dy), eps, weight_offset, casting_mode,
                                 gated)
    launch = _cache.lookup(signature)
    if launch is not None:
        return launch(arrays, weight_grad)
    for name, a in (("dy", dy), ("gate", gate)):
        if a is None:
            raise TypeError(f"{name} must be an array of x's shape, got None")
    scalars = _validate.check_scalars(eps, weight_offset, casting_mode, weight is not None)
    spec = _validate.check_gated(*gated)
    call = resolve(arrays, GATED_BACKWARD_NAMES, anchor=1)
    _validate.check_gated_backward_arrays(call.metas, spec)
    arrays, layout = gated_backward_layout(call.kind, call.resolved, call.metas, spec.group_size)
    if call.kind is NumpyKind:
        dx, dgate, dweight = rms_norm_gated_backward_reference(
            arrays.dy, arrays.x, arrays.gate, arrays.weight, scalars.eps, scalars.weight_offset, scalars.casting_mode,
            group_size=spec.group_size, norm_before_gate=spec.norm_before_gate, activation=spec.activation)
        return dx, dgate, (dweight if weight_grad else None)
    launcher = GatedBackwardLauncher(layout, scalars, call.kind, spec)
    if call.cacheable and not (call.copied or layout.call.copied):
        _cache.remember(signature, launcher.__call__)
    return launcher(arrays, weight_grad)


# -- QK norm + RoPE ----------------------------------------------------------------------------------
QK_ROPE_NAMES = QkRopeArrays._fields
QK_ROPE_BACKWARD_NAMES = QkRopeBackwardArrays._fields


def _numpy_rope_tables(arrays, spec):
    """The angles' keyword arguments of the reference, after checking (the NumPy path can, the
    kernels cannot) that every position lies in the cache: ValueError otherwise."""
    if spec.cache:
        positions, rows = arrays.positions, arrays.cos_sin_cache.shape[0]
        if positions.size and (positions.min() < 0 or positions.max() >= rows):
            raise ValueError(f"positions must lie in [0, {rows}) (cos_sin_cache's rows), got values from "
                             f"{positions.min()} to {positions.max()}")
        return dict(positions=arrays.positions, cos_sin_cache=arrays.cos_sin_cache)
    return dict(cos=arrays.cos, sin=arrays.sin)


def _qk_rope_kind(arrays, names, eps, weight_offset, casting_mode, rotary_dim, is_neox, gradients=0):
    """The full path's first checks of a forward or backward call: (its Scalars, its QkRopeSpec,
    and array_kind's kind, arrays and cacheable). ``gradients``: how many output gradients lead
    ``arrays`` (the backward's dq_out and dk_out; q anchors the kind)."""
    scalars = _validate.check_scalars(eps, weight_offset, casting_mode, arrays.q_weight is not None)
    spec = _validate.check_qk_rope(arrays, rotary_dim, is_neox)
    return (scalars, spec) + array_kind(arrays, names, anchor=gradients)


def _prepared_qk_rope(kind, arrays, names, cacheable, spec, outputs=(), gradients=0):
    """The Resolved call of checked kind and its QkRopeSpec with rotary_dim set (``outputs``: the
    positions of given outputs)."""
    call = prepare(kind, arrays, names, outputs, cacheable)
    metas = call.metas
    if gradients:
        forward = QkRopeArrays(*metas[gradients:])
        return call, _validate.check_qk_rope_arrays(forward, spec, metas[:gradients])
    return call, _validate.check_qk_rope_arrays(metas, spec)


def qk_rope_call(arrays, eps, weight_offset, casting_mode, rotary_dim, is_neox):
    """``arrays``: the ten of QkRopeArrays, as a plain tuple; (q_out, k_out)."""
    if _compiling is not None and _compiling():
        return _torch_qk_rope(arrays, eps, weight_offset, casting_mode, rotary_dim, is_neox)
    if _compiling is None and sys.modules.get("torch") is not None:
        _refuse_unregistered_trace()
    rope = (rotary_dim, is_neox)
    signature = _interop.qk_rope_signature("qk_norm_rope", arrays, eps, weight_offset, casting_mode, rope)
    launch = _cache.lookup(signature)
    if launch is not None:
        result = launch(arrays)
        if result is not None:
            return result
    arrays = QkRopeArrays._make(arrays)
    for name in ("q", "k"):
        if getattr(arrays, name) is None:
            raise TypeError(f"{name} must be an array of shape (..., heads, head_dim), got None")
    scalars, spec, kind, arrays, cacheable = _qk_rope_kind(arrays, QK_ROPE_NAMES, eps, weight_offset, casting_mode,
                                                           rotary_dim, is_neox)
    if kind is TorchKind and _interop.autograd_records(arrays):   # the registered op runs this path
        return _torch_qk_rope(arrays, eps, weight_offset, casting_mode, rotary_dim, is_neox, differentiable=True)
    call, spec = _prepared_qk_rope(kind, arrays, QK_ROPE_NAMES, cacheable, spec, QK_ROPE_OUTPUTS)
    arrays, layout = qk_rope_layout(call.kind, call.resolved, call.metas, spec, call.copied)
    if call.kind is NumpyKind:
        q_out, k_out = qk_norm_rope_reference(arrays.q, arrays.k, arrays.q_weight, arrays.k_weight, scalars.eps,
                                              scalars.weight_offset, scalars.casting_mode,
                                              rotary_dim=spec.rotary_dim, is_neox=spec.is_neox,
                                              **_numpy_rope_tables(arrays, spec))
        return _store(arrays.out_q, q_out), _store(arrays.out_k, k_out)
    launcher = QkRopeLauncher(layout, scalars, call.kind)
    if call.cacheable and not layout.copied:
        _cache.remember(signature, launcher.entry)
    return launcher(arrays, checked=True)


def qk_rope_backward_call(arrays, eps, weight_offset, casting_mode, rotary_dim, is_neox, weight_grad=True):
    """``arrays``: a QkRopeBackwardArrays; (dq, dk, dq_weight, dk_weight). Not differentiable
    itself: torch tensors that require grad run the direct path, as the other backward calls."""
    if _compiling is not None and _compiling():
        return _torch_qk_rope_backward(arrays, eps, weight_offset, casting_mode, rotary_dim, is_neox, weight_grad)
    if _compiling is None and sys.modules.get("torch") is not None:
        _refuse_unregistered_trace()
    rope = (rotary_dim, is_neox)
    signature = _interop.qk_rope_signature("qk_norm_rope_backward", arrays, eps, weight_offset, casting_mode, rope)
    launch = _cache.lookup(signature)
    if launch is not None:
        return launch(arrays, weight_grad)
    for name in ("dq_out", "dk_out", "q", "k"):
        if getattr(arrays, name) is None:
            raise TypeError(f"{name} must be an array of shape (..., heads, head_dim), got None")
    scalars, spec, kind, kinds_arrays, cacheable = _qk_rope_kind(arrays, QK_ROPE_BACKWARD_NAMES, eps, weight_offset,
                                                                 casting_mode, rotary_dim, is_neox, gradients=2)
    call, spec = _prepared_qk_rope(kind, kinds_arrays, QK_ROPE_BACKWARD_NAMES, cacheable, spec, gradients=2)
    arrays, layout = qk_rope_layout(call.kind, call.resolved, call.metas, spec, call.copied)
    if call.kind is NumpyKind:
        dq, dk, dq_weight, dk_weight = qk_norm_rope_backward_reference(
            arrays.dq_out, arrays.dk_out, arrays.q, arrays.k, arrays.q_weight, arrays.k_weight, scalars.eps,
            scalars.weight_offset, scalars.casting_mode, rotary_dim=spec.rotary_dim, is_neox=spec.is_neox,
            **_numpy_rope_tables(arrays, spec))
        return (dq, dk) + ((dq_weight, dk_weight) if weight_grad else (None, None))
    launcher = QkRopeBackwardLauncher(layout, scalars, call.kind)
    if call.cacheable and not layout.copied:
        _cache.remember(signature, launcher.__call__)
    return launcher(arrays, weight_grad)
