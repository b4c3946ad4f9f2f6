"""rms_norm_quant and fused_add_rms_norm_quant: RMSNorm with an FP8 or int8 output, the public
functions, their specs and their torch ops (forward-only: FP8 outputs have no gradient).

The family's parts: ``checks`` (the quant dtype, scales and group size), ``launch`` (the
quantized launcher on the forward's kernels, the scales' layout), ``reference``. The kernels:
kernels/rms_norm.cu with kernels/quant.cuh.
"""

from typing import Any, Optional, Tuple

import numpy as np

from ... import _interop
from ..._layout import Arrays
from ..._pipeline import Array, CastingMode, OpSpec, call, register, store
from ..._validate import check_scalars
from .checks import check_quant, check_quant_arrays
from .launch import OUT, RESIDUAL_OUT, SCALE, SCALES, QuantArrays, QuantLauncher, new_scales, quant_layout
from .reference import fused_add_rms_norm_quant_reference, rms_norm_quant_reference


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
    return call(RMS_NORM_QUANT, (x, None, weight, out, None, scale, scales_out),
                (eps, weight_offset, casting_mode, group_size, scale_ub, quant_dtype))


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
    return call(FUSED_ADD_RMS_NORM_QUANT, (x, residual, weight, out, residual_out, scale, scales_out),
                (eps, weight_offset, casting_mode, group_size, scale_ub, quant_dtype))


# -- the spec's hooks ------------------------------------------------------------------------------

def _check(arrays, eps, weight_offset, casting_mode, group_size, scale_ub, quant_dtype):
    return (check_scalars(eps, weight_offset, casting_mode, arrays.weight is not None),
            check_quant(arrays.scale is not None, group_size, scale_ub, quant_dtype))


def _layout_of(fused):
    def laid_out(call, options):
        spec, metas = options[1], call.metas
        residual_dtype = check_quant_arrays(Arrays(*metas[:5]), metas[SCALE], metas[SCALES], spec)
        arrays, layout = quant_layout(call.kind, fused, call.resolved, metas, spec.form,
                                      spec.scales_shape(metas.x.shape), call.copied)
        return arrays, (layout, residual_dtype), layout.call.copied
    return laid_out


def _reference(arrays, options, layouts):
    """The reference on the CPU, stored into the given outputs (fresh scales in the GPU's layout)."""
    scalars, spec = options
    layout = layouts[0]
    args = (scalars.eps, scalars.weight_offset, scalars.casting_mode)
    quant = dict(scale=arrays.scale, group_size=spec.group_size, quant_dtype=spec.quant_dtype,
                 scale_ub=None if spec.scale_ub == float("inf") else spec.scale_ub)
    fused = arrays.residual is not None
    if fused:
        q, summed, scales = fused_add_rms_norm_quant_reference(arrays.x, arrays.residual, arrays.weight, *args,
                                                               **quant)
    else:
        q, scales = rms_norm_quant_reference(arrays.x, arrays.weight, *args, **quant)
    q = store(arrays.out, q)
    if spec.form == "static":
        scales = arrays.scale
    else:
        dest = arrays.scales
        if dest is None:
            dest = new_scales(lambda shape: np.empty(shape, np.float32), spec.form, layout.scales_shape)
        scales = store(dest, scales)
    if fused:
        return q, store(arrays.residual_out, summed), scales
    return q, scales


def _launcher(layouts, options, kind):
    layout, residual_dtype = layouts
    launcher = QuantLauncher(layout, options[0], kind, options[1], residual_dtype)
    return launcher.entry, lambda arrays: launcher(arrays, checked=True)


_hooks = dict(check=_check, reference=_reference, launcher=_launcher, outputs=(OUT, RESIDUAL_OUT, SCALES),
              names=Arrays._fields + ("scale", "scales_out"))
RMS_NORM_QUANT = OpSpec("rms_norm_quant", QuantArrays, layout=_layout_of(False), public=rms_norm_quant, **_hooks)
FUSED_ADD_RMS_NORM_QUANT = OpSpec("fused_add_rms_norm_quant", QuantArrays, layout=_layout_of(True),
                                  public=fused_add_rms_norm_quant,
                                  required={"residual": "an array of x's shape and dtype"}, **_hooks)
register(RMS_NORM_QUANT, FUSED_ADD_RMS_NORM_QUANT)
REFERENCES = (rms_norm_quant_reference, fused_add_rms_norm_quant_reference)


# -- torch --------------------------------------------------------------------------------------------

def _bind_torch():
    import torch

    from ..._torch import fake_meta
    Tensor = torch.Tensor

    def direct(spec, x, residual, weight, residual_out, scale, eps, weight_offset, casting_mode, group_size,
               scale_ub, quant_dtype):
        result = call(spec, (x, residual, weight, None, residual_out, scale, None),
                      (eps, weight_offset, casting_mode, group_size, scale_ub, quant_dtype))
        if scale is None:
            return result
        return result[:-1] + (x.new_empty(0, dtype=torch.float32),)    # no alias of an input

    @torch.library.custom_op("cupy_rmsnorm::rms_norm_quant", mutates_args=())
    def quant_op(x: Tensor, weight: Optional[Tensor], scale: Optional[Tensor], eps: float, weight_offset: float,
                 casting_mode: str, group_size: Optional[int], scale_ub: Optional[float],
                 quant_dtype: str) -> tuple[Tensor, Tensor]:
        return direct(RMS_NORM_QUANT, x, None, weight, None, scale, eps, weight_offset, casting_mode, group_size,
                      scale_ub, quant_dtype)

    @torch.library.custom_op("cupy_rmsnorm::fused_add_rms_norm_quant", mutates_args=())
    def fused_quant_op(x: Tensor, residual: Tensor, weight: Optional[Tensor], scale: Optional[Tensor], eps: float,
                       weight_offset: float, casting_mode: str, group_size: Optional[int], scale_ub: Optional[float],
                       quant_dtype: str) -> tuple[Tensor, Tensor, Tensor]:
        return direct(FUSED_ADD_RMS_NORM_QUANT, x, residual, weight, None, scale, eps, weight_offset, casting_mode,
                      group_size, scale_ub, quant_dtype)

    @torch.library.custom_op("cupy_rmsnorm::fused_add_rms_norm_quant_inplace", mutates_args=("residual",))
    def fused_quant_inplace_op(x: Tensor, residual: Tensor, weight: Optional[Tensor], scale: Optional[Tensor],
                               eps: float, weight_offset: float, casting_mode: str, group_size: Optional[int],
                               scale_ub: Optional[float], quant_dtype: str) -> tuple[Tensor, Tensor]:
        q, _, scales = direct(FUSED_ADD_RMS_NORM_QUANT, x, residual, weight, residual, scale, eps, weight_offset,
                              casting_mode, group_size, scale_ub, quant_dtype)
        return q, scales

    def fake_quant(x, residual, weight, scale, group_size, scale_ub, quant_dtype):
        """(q, scales) of the real path's dtypes, shapes and strides, after its checks."""
        spec = check_quant(scale is not None, group_size, scale_ub, quant_dtype)
        check_quant_arrays(Arrays(fake_meta(x), fake_meta(residual), fake_meta(weight)), fake_meta(scale), None,
                           spec)
        q = torch.empty(x.shape, dtype=getattr(torch, spec.quant_dtype), device=x.device)
        if scale is not None:
            return q, x.new_empty(0, dtype=torch.float32)
        empty = lambda shape: torch.empty(shape, dtype=torch.float32, device=x.device)  # noqa: E731
        return q, new_scales(empty, spec.form, spec.scales_shape(tuple(x.shape)))

    @quant_op.register_fake
    def _(x, weight, scale, eps, weight_offset, casting_mode, group_size, scale_ub, quant_dtype):
        return fake_quant(x, None, weight, scale, group_size, scale_ub, quant_dtype)

    @fused_quant_op.register_fake
    def _(x, residual, weight, scale, eps, weight_offset, casting_mode, group_size, scale_ub, quant_dtype):
        q, scales = fake_quant(x, residual, weight, scale, group_size, scale_ub, quant_dtype)
        return q, torch.empty(x.shape, dtype=residual.dtype, device=x.device), scales

    @fused_quant_inplace_op.register_fake
    def _(x, residual, weight, scale, eps, weight_offset, casting_mode, group_size, scale_ub, quant_dtype):
        return fake_quant(x, residual, weight, scale, group_size, scale_ub, quant_dtype)

    def traced(arrays, options, differentiable):
        """A public quantized call through the registered ops (while torch.compile traces), given
        outputs filled by a copy (``residual_out=residual`` is the in-place op)."""
        x, residual, weight, out, residual_out, scale, scales_out = arrays
        scalars, spec = options
        args = (weight, scale, scalars.eps, scalars.weight_offset, scalars.casting_mode, spec.group_size,
                None if spec.scale_ub == float("inf") else spec.scale_ub, spec.quant_dtype)
        fused = residual is not None
        if not fused:
            q, scales = quant_op(x, *args)
        elif residual_out is residual:
            q, scales = fused_quant_inplace_op(x, residual, *args)
        else:
            q, s, scales = fused_quant_op(x, residual, *args)
            residual_out = s if residual_out is None else residual_out.copy_(s)
        if out is not None:       # a uint8 out takes the bits
            (out if out.dtype == q.dtype else out.view(q.dtype)).copy_(q)
            q = out
        if scale is not None:
            scales = scale
        elif scales_out is not None:
            scales = scales_out.copy_(scales)
        return (q, residual_out, scales) if fused else (q, scales)

    RMS_NORM_QUANT.traced = FUSED_ADD_RMS_NORM_QUANT.traced = traced

    # DTensor: per-token and per-group scales go with the rows (each rank's in its own padded layout)
    from ..._distributed import ROWS, SCALES, shard_rows
    shard_rows(quant_op, rows=("x",), outputs=(ROWS, SCALES))
    shard_rows(fused_quant_op, rows=("x", "residual"), outputs=(ROWS, ROWS, SCALES))
    shard_rows(fused_quant_inplace_op, rows=("x", "residual"), outputs=(ROWS, SCALES))


_interop.TorchKind.add_binding(_bind_torch)
