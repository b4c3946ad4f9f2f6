"""The public ops and the flow of one call:

caller's arrays -> interop (kind, device, stream) -> validation (dtype, shape, layout,
overlap; nothing launched or written on error) -> launch plan -> kernel cache ->
launch on the caller's stream -> results as the caller's array type.
"""

import sys

from . import _interop, _launcher, _validate
from ._interop import CupyKind, DlpackKind, NumpyKind, TorchKind
from ._layout import (OUT, OUTPUTS, QUANT_NAMES, RESIDUAL_OUT, SCALE, SCALES, Arrays, BackwardArrays, QuantArrays,
                      backward_layout, call_layout, new_scales, quant_layout)
from ._reference import (fused_add_rms_norm_backward_reference, fused_add_rms_norm_quant_reference,
                         fused_add_rms_norm_reference, rms_norm_backward_reference, rms_norm_quant_reference,
                         rms_norm_reference)


def rms_norm(x, weight=None, eps=1e-6, *, out=None, weight_offset=0.0, casting_mode="fp32"):
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
        weight: (hidden,) array of x's dtype or float32, or None for no scaling.
        eps: added to the mean of squares; finite, >= 0.
        out: optional destination of x's shape and dtype; may be ``x`` itself (in place).
            Overwritten.
        weight_offset: added to the weight in float32 (Gemma uses 1.0).
        casting_mode: ``"fp32"`` or ``"llama"``.

    Returns:
        ``out`` (a new array of x's kind when ``out`` is None).
    """
    return _call(False, (x, None, weight, out, None), eps, weight_offset, casting_mode)


def fused_add_rms_norm(x, residual, weight=None, eps=1e-6, *, out=None, residual_out=None,
                       weight_offset=0.0, casting_mode="fp32"):
    """Residual add then RMSNorm, in one pass over memory.

    ``residual_out = round(x + residual)`` (to x's dtype), then
    ``out = rms_norm(residual_out, weight, eps)``: the rounded sum is what gets
    normalized, so the result equals the unfused ops exactly.

    ``out=x, residual_out=residual`` is the in-place form of vLLM's and FlashInfer's
    fused op (both arguments overwritten, nothing allocated). Other arguments as in
    ``rms_norm``.

    Returns:
        ``(out, residual_out)``.
    """
    return _call(True, (x, residual, weight, out, residual_out), eps, weight_offset, casting_mode)


def rms_norm_quant(x, weight=None, eps=1e-6, *, scale=None, group_size=None, out=None, scales_out=None,
                   scale_ub=None, quant_dtype="float8_e4m3fn", weight_offset=0.0, casting_mode="fp32"):
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
    return _quant_call(False, (x, None, weight, out, None, scale, scales_out), eps, weight_offset, casting_mode,
                       group_size, scale_ub, quant_dtype)


def fused_add_rms_norm_quant(x, residual, weight=None, eps=1e-6, *, scale=None, group_size=None, out=None,
                             residual_out=None, scales_out=None, scale_ub=None, quant_dtype="float8_e4m3fn",
                             weight_offset=0.0, casting_mode="fp32"):
    """Residual add, RMSNorm and quantization in one pass.

    ``residual_out = round(x + residual)`` (to x's dtype), then ``rms_norm_quant(residual_out,
    ...)``. ``residual_out=residual`` updates the residual in place (vLLM's
    ``fused_add_rms_norm_static_fp8_quant``; overwritten). Other arguments as in
    ``rms_norm_quant``.

    Returns:
        ``(q, residual_out, scales)``.
    """
    return _quant_call(True, (x, residual, weight, out, residual_out, scale, scales_out), eps, weight_offset,
                       casting_mode, group_size, scale_ub, quant_dtype)


def rms_norm_backward(dy, x, weight=None, eps=1e-6, *, weight_offset=0.0, casting_mode="fp32"):
    """Gradients of ``rms_norm(x, weight, eps, ...)`` given ``dy``, the gradient of its output.

    Per row, in float32: ``r = rsqrt(mean(x**2) + eps)``, ``xhat = x * r``,
    ``g = dy * (weight + weight_offset)`` (``dy`` without a weight),
    ``dx = r * (g - xhat * mean(g * xhat))``; ``dweight = sum over rows of dy * xhat``
    (``"llama"``: xhat rounded to x's dtype first, as the forward multiplied it), added
    in float32 in a fixed order (the same bits every run) and returned in the weight's
    dtype. inv_rms is recomputed from x: the forward saves nothing.

    Args:
        dy: the gradient of the output: x's shape and dtype.
        x, weight, eps, weight_offset, casting_mode: the forward's arguments.

    Returns:
        ``(dx, dweight)``: new arrays of x's kind (dx: x's shape and dtype, contiguous;
        dweight: the weight's shape and dtype), dweight None when weight is None. Not
        differentiable itself (no double backward).
    """
    return _backward_call(False, BackwardArrays(dy, x, None, weight), eps, weight_offset, casting_mode)


def fused_add_rms_norm_backward(dy, d_residual_out, residual_out, weight=None, eps=1e-6, *,
                                weight_offset=0.0, casting_mode="fp32"):
    """Gradients of ``fused_add_rms_norm(x, residual, weight, eps, ...)``.

    ``residual_out`` is the forward's ``s = round(x + residual)``; the gradient reaching s
    is ``rms_norm_backward``'s dx at s plus ``d_residual_out`` (the gradient of the
    forward's residual_out; None for zero), added in float32 and rounded once, and it
    flows unchanged to both x and residual.

    Returns:
        ``(d_input, dweight)``: d_input (residual_out's shape and dtype) is the gradient of
        both x and residual; dweight as in ``rms_norm_backward``.
    """
    return _backward_call(True, BackwardArrays(dy, residual_out, d_residual_out, weight), eps, weight_offset,
                          casting_mode)


# the argument names of each backward's BackwardArrays, for messages
_BACKWARD_NAMES = {False: ("dy", "x", "d_residual_out", "weight"),
                   True: ("dy", "residual_out", "d_residual_out", "weight")}


def _backward_call(fused, arrays, eps, weight_offset, casting_mode, weight_grad=True):
    """Validate everything (every call), then run on the caller's arrays' kind.
    ``weight_grad``: False skips dweight (autograd, when the weight needs no gradient)."""
    # Fast path: a signature seen before (everything but the pointers) needs no validation;
    # the backward writes only fresh outputs, so no pointer can overlap anything it writes.
    dy, x, d_residual_out, weight = arrays
    signature = _interop.signature(fused, (x, d_residual_out, weight, dy, None), eps, weight_offset, casting_mode)
    launcher = _launcher.backward_lookup(signature)
    if launcher is not None:
        return launcher(arrays, weight_grad)
    names = _BACKWARD_NAMES[fused]
    if arrays.dy is None:
        raise TypeError(f"dy must be an array of {names[1]}'s shape and dtype, got None")
    scalars = _validate.check_scalars(eps, weight_offset, casting_mode, arrays.weight is not None)
    kind = _interop.kind_of(arrays.x, names[1])
    for name, a in zip(names, arrays):
        if a is not None and _interop.kind_of(a, name) is not kind:
            raise TypeError(f"{name} must be the same kind of array as {names[1]} ({kind.name}), "
                            f"got {type(a).__module__}.{type(a).__name__}")
    if kind is not NumpyKind:
        _interop.require_cupy()
    if kind is DlpackKind:
        arrays = BackwardArrays(*(None if a is None else kind.to_cupy(a, n) for n, a in zip(names, arrays)))
        kind = CupyKind
    resolved = arrays
    if kind is TorchKind:
        register_torch_ops()
        _check_torch(arrays, names)
        resolved = BackwardArrays(*(None if a is None else kind.resolve(a, n) for n, a in zip(names, arrays)))
    metas = BackwardArrays(*(None if a is None else kind.meta(a) for a in resolved))
    _validate.check_backward_arrays(metas, names)
    copied = any(a is not b for a, b in zip(arrays, resolved))
    arrays, layout = backward_layout(kind, resolved, metas)
    if kind is NumpyKind:
        return _run_numpy_backward(fused, arrays, scalars, weight_grad)
    launcher = _launcher.backward_launcher(layout, scalars, kind)
    if not (copied or layout.copied):       # (NumPy and DLPack calls have no signature)
        _launcher.backward_remember(signature, launcher)
    return launcher(arrays, weight_grad)


def _run_numpy_backward(fused, arrays, scalars, weight_grad):
    dy, x, d_residual_out, weight = arrays
    args = (scalars.eps, scalars.weight_offset, scalars.casting_mode)
    if fused:
        dx, dweight = fused_add_rms_norm_backward_reference(dy, d_residual_out, x, weight, *args)
    else:
        dx, dweight = rms_norm_backward_reference(dy, x, weight, *args)
    return dx, (dweight if weight_grad else None)


# torch.compiler.is_dynamo_compiling once the torch ops are registered (register_torch_ops):
# while dynamo traces, a call becomes the registered op instead of this module's Python.
_compiling = None


def _refuse_unregistered_trace():
    """torch was imported after this library and no tensor has reached it yet, so the torch
    ops are not registered; registering them now would happen inside dynamo's trace, which
    cannot import them. Say so, rather than let dynamo trip over this module's Python."""
    if sys.modules["torch"].compiler.is_dynamo_compiling():
        raise RuntimeError("torch.compile is tracing a cupy_rmsnorm call before the library's torch ops were "
                           "registered (torch was imported after cupy_rmsnorm, and no tensor has been passed "
                           "yet): import cupy_rmsnorm.torch before compiling")


# The fast path is inline in _call and _quant_call: a repeated call's Python is a few
# microseconds, and every frame costs tens of ns. An array type's signature function is
# looked up here (_interop.signature finds and records it for a new type); then the signature
# is compared with the last hit's before the cache's dict (_launcher.last_hit), whose lookup
# hashes it.
_signatures_get = _interop.SIGNATURES.get
_launches_get = _launcher.launches.get


def _call(fused, arrays, eps, weight_offset, casting_mode):
    """``arrays``: the five in ``Arrays`` order, as a plain tuple (naming them costs a
    NamedTuple's construction, about 0.3 us, on every call; the full path names them)."""
    if _compiling is not None and _compiling():
        return sys.modules["cupy_rmsnorm._torch_ops"].call(fused, arrays, eps, weight_offset, casting_mode)
    if _compiling is None and sys.modules.get("torch") is not None:
        _refuse_unregistered_trace()
    # Fast path: a signature seen before needs only the pointer-dependent checks.
    signature = _signatures_get(type(arrays[0]), _interop.signature)(fused, arrays, eps, weight_offset,
                                                                      casting_mode)
    last_signature, launch = _launcher.last_hit
    try:
        if signature != last_signature:
            launch = _launches_get(signature)
            if launch is not None:
                _launcher.last_hit = signature, launch
    except Exception:       # an odd part (an eps that cannot be hashed or compared): no fast path
        launch = None
    if launch is not None:
        result = launch(arrays)
        if result is not None:
            return result
    return _full_call(fused, arrays, eps, weight_offset, casting_mode, signature)


def _full_call(fused, arrays, eps, weight_offset, casting_mode, signature):
    """Validate everything, then run (and remember a Launcher for the signature)."""
    arrays = Arrays._make(arrays)
    if fused and arrays.residual is None:
        raise TypeError("residual must be an array of x's shape and dtype, got None")
    scalars = _validate.check_scalars(eps, weight_offset, casting_mode, arrays.weight is not None)
    kind = _interop.kind_of(arrays.x, "x")
    for name, a in zip(Arrays._fields[1:], arrays[1:]):
        if a is not None and _interop.kind_of(a, name) is not kind:
            raise TypeError(f"{name} must be the same kind of array as x ({kind.name}), "
                            f"got {type(a).__module__}.{type(a).__name__}")
    if kind is not NumpyKind:
        _interop.require_cupy()
    if kind is DlpackKind:   # any CUDA DLPack producer: zero-copy CuPy views in, CuPy arrays out
        arrays = Arrays(*(None if a is None else kind.to_cupy(a, name) for name, a in zip(Arrays._fields, arrays)))
        kind, signature = CupyKind, None
    resolved = arrays
    if kind is TorchKind:
        register_torch_ops()
        if _interop.autograd_records(arrays):   # the registered op, which runs this path
            return sys.modules["cupy_rmsnorm._torch_ops"].call(fused, arrays, eps, weight_offset, casting_mode,
                                                               differentiable=True)
        _check_torch(arrays, Arrays._fields, OUTPUTS)
        resolved = Arrays(*(None if a is None else kind.resolve(a, name) for name, a in zip(Arrays._fields, arrays)))
    metas = Arrays(*(None if a is None else kind.meta(a) for a in resolved))
    _validate.check_arrays(metas)
    copied = any(a is not b for a, b in zip(arrays, resolved))
    arrays, layout = call_layout(kind, fused, resolved, metas, copied)
    if kind is NumpyKind:
        return _run_numpy(arrays, scalars, fused)
    launcher = _launcher.Launcher(layout, scalars, kind)
    if signature is not None and not layout.copied:
        _launcher.remember(signature, launcher)
    return launcher(arrays, checked=True)


def _quant_call(fused, arrays, eps, weight_offset, casting_mode, group_size, scale_ub, quant_dtype):
    """``arrays``: the seven in ``QuantArrays`` order, as a plain tuple (see _call)."""
    if _compiling is not None and _compiling():
        return sys.modules["cupy_rmsnorm._torch_ops"].call_quant(fused, arrays, eps, weight_offset, casting_mode,
                                                                 group_size, scale_ub, quant_dtype)
    if _compiling is None and sys.modules.get("torch") is not None:
        _refuse_unregistered_trace()
    quant = (group_size, scale_ub, quant_dtype)
    signature = _interop.quant_signature(fused, arrays, eps, weight_offset, casting_mode, quant)
    last_signature, launch = _launcher.last_hit
    try:
        if signature != last_signature:
            launch = _launches_get(signature)
            if launch is not None:
                _launcher.last_hit = signature, launch
    except Exception:
        launch = None
    if launch is not None:
        result = launch(arrays)
        if result is not None:
            return result
    return _full_quant_call(fused, arrays, eps, weight_offset, casting_mode, quant, signature)


def _full_quant_call(fused, arrays, eps, weight_offset, casting_mode, quant, signature):
    """Validate everything, then run (and remember a QuantLauncher for the signature)."""
    arrays = QuantArrays._make(arrays)
    if fused and arrays.residual is None:
        raise TypeError("residual must be an array of x's shape and dtype, got None")
    scalars = _validate.check_scalars(eps, weight_offset, casting_mode, arrays.weight is not None)
    spec = _validate.check_quant(arrays.scale is not None, *quant)
    kind = _interop.kind_of(arrays.x, "x")
    for name, a in zip(QUANT_NAMES[1:], arrays[1:]):
        if a is not None and _interop.kind_of(a, name) is not kind:
            raise TypeError(f"{name} must be the same kind of array as x ({kind.name}), "
                            f"got {type(a).__module__}.{type(a).__name__}")
    if kind is not NumpyKind:
        _interop.require_cupy()
    if kind is DlpackKind:
        arrays = QuantArrays(*(None if a is None else kind.to_cupy(a, n) for n, a in zip(QUANT_NAMES, arrays)))
        kind, signature = CupyKind, None
    resolved = arrays
    if kind is TorchKind:
        register_torch_ops()
        _check_torch(arrays, QUANT_NAMES, (OUT, RESIDUAL_OUT, SCALES))
        resolved = QuantArrays(*(None if a is None else kind.resolve(a, n) for n, a in zip(QUANT_NAMES, arrays)))
    metas = QuantArrays(*(None if a is None else kind.meta(a) for a in resolved))
    _validate.check_quant_arrays(Arrays(*metas[:5]), metas[SCALE], metas[SCALES], spec)
    copied = any(a is not b for a, b in zip(arrays, resolved))
    arrays, layout = quant_layout(kind, fused, resolved, metas, spec.form, spec.scales_shape(metas.x.shape), copied)
    if kind is NumpyKind:
        return _run_numpy_quant(arrays, scalars, spec, layout, fused)
    launcher = _launcher.QuantLauncher(layout, scalars, kind, spec)
    if signature is not None and not layout.call.copied:
        _launcher.remember(signature, launcher)
    return launcher(arrays, checked=True)


def _check_torch(arrays, names, outputs=()):
    """Torch tensors must be on a CUDA device; outputs must be plain memory."""
    import torch
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


def register_torch_ops():
    """Register the torch ops (once torch is in use) and route calls made while
    torch.compile traces to them."""
    global _compiling
    if _compiling is None:
        import torch
        from . import _torch_ops  # noqa: F401 - the import registers them
        TorchKind.bind()
        # is_dynamo_compiling: a plain `return False` in eager (cheaper than is_compiling)
        _compiling = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)


def _run_numpy(arrays, scalars, fused):
    """The reference on the CPU, stored into the given outputs."""
    x, residual, weight = arrays.x, arrays.residual, arrays.weight
    mode = scalars.casting_mode
    if fused:
        y, s = fused_add_rms_norm_reference(x, residual, weight, scalars.eps, scalars.weight_offset, mode)
        return _store(arrays[OUT], y), _store(arrays[RESIDUAL_OUT], s)
    return _store(arrays[OUT], rms_norm_reference(x, weight, scalars.eps, scalars.weight_offset, mode))


def _store(dest, value):
    if dest is None:
        return value
    # quantized bytes into a uint8 out: the bits, not the values
    (dest if dest.dtype == value.dtype else dest.view(value.dtype))[...] = value
    return dest


def _run_numpy_quant(arrays, scalars, spec, layout, fused):
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


if sys.modules.get("torch") is not None:   # torch is in use: tracing must find the ops from the start
    register_torch_ops()
