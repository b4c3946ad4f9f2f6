"""The two public ops and the flow of one call:

caller's arrays -> interop (kind, device, stream) -> validation (dtype, shape, layout,
overlap; nothing launched or written on error) -> launch plan -> kernel cache ->
launch on the caller's stream -> results as the caller's array type.
"""

import numpy as np

from . import _interop, _validate
from ._interop import CupyKind, NumpyKind, TorchKind
from ._launcher import NAMES as _NAMES, Launcher
from ._reference import fused_add_rms_norm_reference, rms_norm_reference

_INPUTS = ("x", "residual")
_OUTPUTS = ("out", "residual_out")
_MAX_LAUNCHERS = 1024
_launchers = {}   # call signature -> Launcher (see _launcher.py)


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
    return _call(False, x, None, weight, eps, out, None, weight_offset, casting_mode)


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
    return _call(True, x, residual, weight, eps, out, residual_out, weight_offset, casting_mode)


def _call(fused, x, residual, weight, eps, out, residual_out, weight_offset, casting_mode):
    arrays = [x, residual, weight, out, residual_out]
    # Fast path: a signature seen before needs only the pointer-dependent checks.
    signature = _interop.signature(fused, arrays, eps, weight_offset, casting_mode)
    try:
        launcher = _launchers.get(signature)
    except TypeError:   # unhashable: no fast path for this call
        launcher = signature = None
    if launcher is not None:
        result = launcher(arrays)
        if result is not None:
            return result
    named = {k: a for k, a in zip(_NAMES, (x, residual, weight, out, residual_out)) if a is not None}
    return _full_call(fused, named, eps, weight_offset, casting_mode, signature)


def _full_call(fused, arrays, eps, weight_offset, casting_mode, signature):
    """Validate everything, then run (and remember a Launcher for the signature)."""
    eps, offset = _validate.check_scalars(eps, weight_offset, casting_mode, "weight" in arrays)
    kind = _interop.kind_of(arrays["x"], "x")
    for name, a in arrays.items():
        if name != "x" and _interop.kind_of(a, name) is not kind:
            raise TypeError(f"{name} must be the same kind of array as x ({_kind_name(kind)}), "
                            f"got {type(a).__module__}.{type(a).__name__}")
    if kind == "dlpack":  # any CUDA DLPack producer: work on zero-copy CuPy views, return CuPy arrays
        arrays = {k: _interop.from_dlpack(v, k) for k, v in arrays.items()}
        kind, signature = CupyKind, None
    elif kind is TorchKind:
        _check_torch(arrays)
    metas = {k: kind.meta(v) for k, v in arrays.items()}
    _validate.check_arrays(*((k, metas[k]) if k in metas else None for k in _NAMES))
    job = _Job(fused, kind, arrays, metas, eps, offset, casting_mode)
    if kind is NumpyKind:
        return job.run_numpy()
    launcher = job.launcher()
    if signature is not None and not job.copied:
        if len(_launchers) >= _MAX_LAUNCHERS:
            _launchers.clear()
        _launchers[signature] = launcher
    return launcher([job.named.get(k) for k in _NAMES], checked=True)


def _kind_name(kind):
    return kind if isinstance(kind, str) else kind.name


def _check_torch(named):
    import torch
    for name, t in named.items():
        if t.device.type != "cuda":
            raise ValueError(f"{name} is a torch tensor on {t.device}; pass CUDA tensors "
                             f"(tensor.cuda()) or NumPy arrays (tensor.numpy()) for the CPU path")
        if t.requires_grad and torch.is_grad_enabled():
            raise RuntimeError(f"{name} requires grad, and cupy_rmsnorm is forward-only (no backward "
                               f"yet): call it under torch.no_grad() / torch.inference_mode(), pass "
                               f"{name}.detach(), or for a model's weights call model.requires_grad_(False)")


class _Job:
    """One validated call: resolves layout, overlap, copies and outputs, then runs."""

    def __init__(self, fused, kind, named, metas, eps, offset, casting_mode):
        self.fused, self.kind, self.named, self.metas = fused, kind, named, metas
        self.eps, self.offset, self.llama = eps, offset, casting_mode == "llama"
        xm = metas["x"]
        self.hidden, self.itemsize = xm.shape[-1], xm.itemsize
        self.inputs = [k for k in _INPUTS if k in metas]
        self.outputs = [k for k in _OUTPUTS if k in metas]
        self.copied = False
        self._layout_and_copies()
        self._check_overlap()

    # -- layout ------------------------------------------------------------------------
    def _unit_last(self, m):
        # NumPy gives arrays with no elements zero strides: with no rows, any layout will do
        return m.strides is not None and (self.hidden == 1 or m.strides[-1] == 1 or 0 in m.shape) \
            and m.ptr % m.itemsize == 0

    def _layout_and_copies(self):
        m = self.metas
        for k in self.outputs:
            if not self._unit_last(m[k]):
                raise ValueError(f"{k} must have a unit-stride last axis, element-aligned; "
                                 f"got strides {m[k].strides} (in elements) at address {m[k].ptr:#x}")
        for k in self.inputs + (["weight"] if "weight" in m else []):
            if not self._unit_last(m[k]):
                self._copy(k)
        order = self.outputs + self.inputs
        layout = _validate.row_layout(m["x"].shape, [m[k].strides[:-1] for k in order])
        for k, st in zip(order, layout.strides):
            if st is None and k in self.outputs:
                raise ValueError(f"{k}'s leading axes cannot be addressed as at most two strided "
                                 f"levels alongside the other arrays; pass a contiguous {k}")
        if any(st is None for st in layout.strides):
            for k, st in zip(order, layout.strides):
                if st is None:
                    self._copy(k)
            layout = _validate.row_layout(m["x"].shape, [m[k].strides[:-1] for k in order])
            if any(st is None for st in layout.strides):  # outputs disagree with each other
                raise ValueError("out and residual_out need leading-axis layouts that agree; "
                                 "pass contiguous outputs")
        self.rows, self.n_inner = layout.rows, layout.n_inner
        n_outer = self.rows // self.n_inner if self.n_inner else 0
        # strides that do not matter (a level of one) are zeroed so comparisons see equals
        self.row_strides = {k: (st[0] if n_outer > 1 else 0, st[1] if self.n_inner > 1 else 0)
                            for k, st in zip(order, layout.strides)}

    def _copy(self, k):
        self.copied = True
        self.named[k] = self.kind.contiguous(self.named[k]) if self.kind is not NumpyKind \
            else np.ascontiguousarray(self.named[k])
        self.metas[k] = self.kind.meta(self.named[k])

    # -- overlap -------------------------------------------------------------------------
    def _span(self, k):
        m = self.metas[k]
        if k == "weight":
            return (m.ptr, (0, 0), (m.ptr, m.ptr + self.hidden * m.itemsize))
        st = self.row_strides[k]
        return (m.ptr, st, _validate.extent(m.ptr, st, self.rows, self.n_inner, self.hidden, m.itemsize))

    def _check_overlap(self):
        if self.rows == 0:
            return
        args = (self.rows, self.n_inner, self.hidden, self.itemsize)
        for k in self.outputs:
            if _validate.rows_overlap_themselves(self.row_strides[k], self.rows, self.n_inner, self.hidden):
                raise ValueError(f"{k} has rows that overlap each other in memory (a broadcast or "
                                 f"too-small stride); it cannot be written")
        if len(self.outputs) == 2 and _validate.overlap(self._span("out"), self._span("residual_out"), *args):
            raise ValueError("out and residual_out must not share memory")
        for k in self.outputs:
            if "weight" in self.metas:
                w = self._span("weight")
                if not (w[2][1] <= self._span(k)[2][0] or self._span(k)[2][1] <= w[2][0]):
                    raise ValueError(f"{k} overlaps weight; weight is read by every row")
            for i in self.inputs:
                if _validate.overlap(self._span(k), self._span(i), *args) == "partial":
                    raise ValueError(f"{k} partially overlaps {i}: pass the very same array "
                                     f"({k}={i}) to work in place, or memory apart from it")

    # -- NumPy: the reference on the CPU -------------------------------------------------
    def run_numpy(self):
        n = self.named
        w = n.get("weight")
        mode = "llama" if self.llama else "fp32"
        if self.fused:
            y, s = fused_add_rms_norm_reference(n["x"], n["residual"], w, self.eps, self.offset, mode)
            return self._numpy_store("out", y), self._numpy_store("residual_out", s)
        return self._numpy_store("out", rms_norm_reference(n["x"], w, self.eps, self.offset, mode))

    def _numpy_store(self, k, value):
        dest = self.named.get(k)
        if dest is None:
            return value
        dest[...] = value
        return dest

    # -- GPU -----------------------------------------------------------------------------
    def launcher(self):
        """A Launcher for this call's signature (see _launcher.py), by array position."""
        m = self.metas
        strides = dict(self.row_strides)
        for k in _OUTPUTS[: 2 if self.fused else 1]:
            strides.setdefault(k, self._contiguous_row_strides())  # fresh outputs are contiguous
        extents = {}
        for k in self.inputs + self.outputs + (["weight"] if "weight" in m else []):
            _, _, (lo, hi) = self._span(k)
            extents[k] = (lo - m[k].ptr, hi - m[k].ptr)
        by_pos = lambda d: [d.get(k) for k in _NAMES]  # noqa: E731
        wm = m.get("weight")
        grad_check = self.kind is TorchKind and any(t.requires_grad for t in self.named.values())
        return Launcher(self.kind, self.fused, m["x"].device, tuple(m["x"].shape), m["x"].dtype,
                        self.itemsize, wm.dtype if wm else None, wm.itemsize if wm else 0,
                        self.rows, self.n_inner, by_pos(strides), by_pos(extents),
                        tuple(_NAMES.index(k) for k in self.outputs),
                        self.eps, self.offset, self.llama, grad_check)

    def _contiguous_row_strides(self):
        n_outer = self.rows // self.n_inner if self.n_inner else 0
        return (self.hidden * self.n_inner if n_outer > 1 else 0, self.hidden if self.n_inner > 1 else 0)


