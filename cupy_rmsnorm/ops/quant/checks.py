import math
from typing import NamedTuple, Optional

import numpy as np

from ..._layout import OUT, RESIDUAL, RESIDUAL_OUT, WEIGHT, Arrays, X
from ..._validate import DTYPES, _check_like_x, _float32_scalar
from .reference import GROUP_SIZES, QUANT_DTYPES


class QuantSpec(NamedTuple):
    """A quantized call's checked arguments: form ("static", "per_token", "per_group"), the
    quant dtype's name, the group size (per_group) and the amax bound (+inf for none), float32."""
    form: str
    quant_dtype: str
    group_size: Optional[int]
    scale_ub: float

    def scales_shape(self, x_shape):
        """The scales' shape for x's: x.shape[:-1] + (1,) per token, + (groups,) per group."""
        groups = x_shape[-1] // self.group_size if self.form == "per_group" else 1
        return tuple(x_shape[:-1]) + (groups,)


def _quant_dtype_name(quant_dtype):
    """The name of a quant dtype given as a string, a torch dtype or a NumPy / ml_dtypes type."""
    if isinstance(quant_dtype, str):
        name = quant_dtype
    elif type(quant_dtype).__module__.startswith("torch"):
        name = str(quant_dtype).replace("torch.", "")
    else:
        try:
            name = np.dtype(quant_dtype).name
        except TypeError:
            name = None
    if name not in QUANT_DTYPES:
        raise ValueError(f"quant_dtype must be one of {', '.join(map(repr, QUANT_DTYPES))}, got {quant_dtype!r}")
    return name


def check_quant(has_scale, group_size, scale_ub, quant_dtype):
    """The QuantSpec of a call (``has_scale``: a static scale was given), or TypeError / ValueError."""
    name = _quant_dtype_name(quant_dtype)
    if group_size is not None:
        if isinstance(group_size, bool) or not hasattr(group_size, "__index__"):
            raise TypeError(f"group_size must be an int or None, got {type(group_size).__name__}")
        if int(group_size) not in GROUP_SIZES:
            raise ValueError(f"group_size must be None (one scale per row) or one of {GROUP_SIZES}, got {group_size!r}")
        group_size = int(group_size)
    ub = math.inf
    if scale_ub is not None:
        ub = _float32_scalar(scale_ub, "scale_ub", "")
        if ub <= 0:
            raise ValueError(f"scale_ub must be > 0 (an upper bound on a row's max |y|), got {scale_ub!r}")
    if has_scale and (group_size is not None or scale_ub is not None):
        raise ValueError("a static scale leaves no scale to compute: group_size and scale_ub are for the dynamic "
                         "forms (scale=None)")
    form = "static" if has_scale else "per_group" if group_size is not None else "per_token"
    return QuantSpec(form, name, group_size, ub)


def q_dtype_names(quant_dtype):
    """The dtypes a given ``out`` may have: the quant dtype, or uint8 holding FP8 bits."""
    return (quant_dtype,) if quant_dtype == "int8" else (quant_dtype, "uint8")


def check_quant_arrays(metas, scale, scales, spec, names=Arrays._fields):
    """The checks of check_arrays for a quantized call: ``metas`` an Arrays of Meta records whose
    out is q (the quantized output), ``scale`` / ``scales`` the Meta of the static scale and of
    a given scales_out (None where absent). Returns the residual's dtype name."""
    xm = metas[X]
    rm = metas[RESIDUAL]
    residual_dtype = rm.dtype if rm is not None and rm.dtype == "float32" else xm.dtype
    _check_like_x(xm, [], metas[WEIGHT], "x", list(zip(names[1:], metas[1:])) + [("scale", scale), ("scales_out", scales)],
                  weight_dtypes=DTYPES)
    for k, rule in ((RESIDUAL, "x's dtype or float32"), (RESIDUAL_OUT, "the residual's dtype")):
        m = metas[k]
        if m is not None and m.dtype != residual_dtype:
            raise TypeError(f"{names[k]} must have dtype {residual_dtype} ({rule}), got {m.dtype}")
        if m is not None and tuple(m.shape) != tuple(xm.shape):
            raise ValueError(f"{names[k]} must have x's shape {tuple(xm.shape)}, got {tuple(m.shape)}")
    qm = metas[OUT]
    if qm is not None:
        allowed = q_dtype_names(spec.quant_dtype)
        if qm.dtype not in allowed:
            raise TypeError(f"out must have dtype {' or '.join(allowed)} (quant_dtype={spec.quant_dtype!r}), "
                            f"got {qm.dtype}")
        if tuple(qm.shape) != tuple(xm.shape):
            raise ValueError(f"out must have x's shape {tuple(xm.shape)}, got {tuple(qm.shape)}")
    if spec.form == "per_group" and xm.shape[-1] % spec.group_size:
        raise ValueError(f"group_size={spec.group_size} needs a hidden size that is a multiple of it; x has "
                         f"hidden size {xm.shape[-1]}")
    if scale is not None:
        if scale.dtype != "float32":
            raise TypeError(f"scale must be a float32 array (one element, in the device memory of x), got {scale.dtype}")
        if math.prod(scale.shape) != 1:
            raise ValueError(f"scale must hold one element (the per-tensor scale), got shape {tuple(scale.shape)}")
    if scales is not None:
        if spec.form == "static":
            raise ValueError("scales_out is for the dynamic forms: with a static scale there are no scales to write")
        if scales.dtype != "float32":
            raise TypeError(f"scales_out must be float32, got {scales.dtype}")
        want = spec.scales_shape(xm.shape)
        if tuple(scales.shape) != want:
            raise ValueError(f"scales_out must have shape {want} (x.shape[:-1] + ({want[-1]},)), "
                             f"got {tuple(scales.shape)}")
        if scales.strides is None:
            raise ValueError("scales_out's strides must be whole float32 elements")
    for name, m in ((names[OUT], qm), (names[RESIDUAL_OUT], metas[RESIDUAL_OUT]), ("scales_out", scales)):
        if m is not None and not m.writeable:
            raise ValueError(f"{name} is read-only (for a torch inference tensor: writeable only "
                             f"inside torch.inference_mode()); pass a writeable {name}")
    return residual_dtype
