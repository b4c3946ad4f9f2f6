"""The public checks of a call's arguments, before anything is launched or written.

Works on ``Meta`` records (pointer, shape, strides in elements, dtype), so CuPy arrays,
torch tensors and NumPy arrays go through the same checks with the same messages.
Row layout and overlap are ``_layout``'s.
"""

import math
from typing import NamedTuple, Optional

import numpy as np

from ._abi import ACTIVATIONS
from ._layout import OUT, OUTPUTS, RESIDUAL, RESIDUAL_OUT, WEIGHT, X, Arrays
from ._plan import QK_ROPE_MAX_HEAD_DIM
from ._reference import CASTING_MODES, GROUP_SIZES, QUANT_DTYPES

DTYPES = ("float32", "float16", "bfloat16")
MAX_HIDDEN = 2 ** 31 - 1                 # the kernels index a row with an int
FLOAT32_MAX = 3.4028234663852886e38     # the kernels take eps and weight_offset as float32


class Scalars(NamedTuple):
    """A call's checked scalar arguments, as the kernel takes them."""
    eps: float
    weight_offset: float
    llama: bool          # casting_mode == "llama"

    @property
    def casting_mode(self):
        return "llama" if self.llama else "fp32"


def _float32_scalar(value, name, what):
    """``value`` (a real number: not a string or a bool) as a Python float that is finite in
    float32, or TypeError / ValueError."""
    if isinstance(value, (str, bytes, bytearray, bool, np.bool_)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    try:
        f = float(value)
    except OverflowError:        # an int past the float range
        f = math.inf
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}") from None
    if not math.isfinite(f) or abs(f) > FLOAT32_MAX or (what and f < 0):
        raise ValueError(f"{name} must be finite{what} in float32 (|{name}| <= {FLOAT32_MAX:.4g}), "
                         f"got {value!r}")
    return f


def check_scalars(eps, weight_offset, casting_mode, has_weight):
    # a string check first: `in` on an array would ask for its truth value
    if not isinstance(casting_mode, str) or casting_mode not in CASTING_MODES:
        raise ValueError(f"casting_mode must be 'fp32' or 'llama', got {casting_mode!r}")
    eps_f = _float32_scalar(eps, "eps", " and >= 0")
    off = _float32_scalar(weight_offset, "weight_offset", "")
    if off != 0.0 and not has_weight:
        raise ValueError("weight_offset needs a weight: with weight=None nothing is scaled")
    return Scalars(eps_f, off, casting_mode == "llama")


def check_arrays(metas, out_dtype=None):
    """dtype, shape and device checks; ``metas``: an Arrays of Meta records (None where absent);
    ``out_dtype``: the output's dtype name (None: x's). Mixed precision: the residual (and
    residual_out) may be float32 with any x (a float32 residual stream), out has out_dtype,
    the weight any float dtype. Returns (residual dtype, output dtype) names."""
    names = Arrays._fields
    xm = metas[X]
    rm = metas[RESIDUAL]
    residual_dtype = rm.dtype if rm is not None and rm.dtype == "float32" else xm.dtype
    out_dtype = out_dtype or xm.dtype
    _check_like_x(xm, [], metas[WEIGHT], "x", list(zip(names[1:], metas[1:])), weight_dtypes=DTYPES)
    for k, dtype, rule in ((RESIDUAL, residual_dtype, "x's dtype or float32"),
                           (RESIDUAL_OUT, residual_dtype, "the residual's dtype"),
                           (OUT, out_dtype, "out_dtype, or x's dtype")):
        m = metas[k]
        if m is None:
            continue
        if m.dtype != dtype:
            raise TypeError(f"{names[k]} must have dtype {dtype} ({rule}), got {m.dtype}")
        if tuple(m.shape) != tuple(xm.shape):
            raise ValueError(f"{names[k]} must have x's shape {tuple(xm.shape)}, got {tuple(m.shape)}")
    for k in OUTPUTS:
        if metas[k] is not None and not metas[k].writeable:
            raise ValueError(f"{names[k]} is read-only (for a torch inference tensor: writeable only "
                             f"inside torch.inference_mode()); pass a writeable {names[k]}")
    return residual_dtype, out_dtype


def check_backward_arrays(metas, names):
    """The same checks for a backward call: ``metas`` a BackwardArrays of Meta records,
    ``names`` its arguments' names (the second, x's place, is the array the others follow)."""
    dy, x, d_residual_out, weight = metas
    anchor = names[1]
    _check_like_x(x, [(names[2], d_residual_out)], weight, anchor,
                  [(names[0], dy), (names[2], d_residual_out), (names[3], weight)], weight_dtypes=DTYPES)
    if dy is not None:      # the forward's output: any float dtype (out_dtype)
        if dy.dtype not in DTYPES:
            raise TypeError(f"{names[0]} must be float32, float16 or bfloat16, got {dy.dtype}")
        if tuple(dy.shape) != tuple(x.shape):
            raise ValueError(f"{names[0]} must have {anchor}'s shape {tuple(x.shape)}, got {tuple(dy.shape)}")


def _check_like_x(xm, rows, wm, anchor, on_device, weight_dtypes=None):
    """x (called ``anchor``) a float array with a hidden size; ``rows`` (name, Meta) pairs of
    x's shape and dtype; the weight (``weight_dtypes``: the dtypes it may have, default x's
    and float32); every array of ``on_device`` on x's device."""
    if xm.dtype not in DTYPES:
        raise TypeError(f"{anchor} must be float32, float16 or bfloat16, got {xm.dtype}")
    if len(xm.shape) < 1:
        raise ValueError(f"{anchor} must have at least one dimension, got a 0-d array")
    if xm.shape[-1] == 0:
        raise ValueError(f"{anchor} has hidden size 0 (its last axis is empty); there is nothing to normalize")
    if xm.shape[-1] > MAX_HIDDEN:
        raise ValueError(f"{anchor} has hidden size {xm.shape[-1]}; at most {MAX_HIDDEN} (2**31 - 1) is supported")
    for name, m in rows:
        if m is None:
            continue
        if m.dtype != xm.dtype:
            raise TypeError(f"{name} must have {anchor}'s dtype {xm.dtype}, got {m.dtype}")
        if tuple(m.shape) != tuple(xm.shape):
            raise ValueError(f"{name} must have {anchor}'s shape {tuple(xm.shape)}, got {tuple(m.shape)}")
    if wm is not None:
        if len(wm.shape) != 1 or wm.shape[0] != xm.shape[-1]:
            raise ValueError(f"weight must have shape ({xm.shape[-1]},) ({anchor}'s last axis), "
                             f"got {tuple(wm.shape)}")
        if wm.dtype not in (weight_dtypes or (xm.dtype, "float32")):
            if weight_dtypes:
                raise TypeError(f"weight must be float32, float16 or bfloat16, got {wm.dtype}")
            raise TypeError(f"weight must have {anchor}'s dtype {xm.dtype} or float32, got {wm.dtype}")
    for name, m in on_device:
        if m is not None and m.device != xm.device:
            raise ValueError(f"{name} is on device {m.device} but {anchor} is on device {xm.device}; "
                             f"all arrays must be on one device")


# -- quantized forms -----------------------------------------------------------------------------

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


# -- dtypes given by name ---------------------------------------------------------------------------

def dtype_name(dtype, arg):
    """The name of a float dtype given as a string, a NumPy / ml_dtypes dtype or type, or a
    torch dtype; None for None. TypeError for anything else."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        name = dtype
    elif type(dtype).__module__.startswith("torch"):
        name = str(dtype).replace("torch.", "")
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = None
    if name not in DTYPES:
        raise TypeError(f"{arg} must be float32, float16 or bfloat16 (or None), got {dtype!r}")
    return name


# -- gated ------------------------------------------------------------------------------------------

class GatedSpec(NamedTuple):
    """A gated call's checked arguments (out_dtype: the output's dtype name, or None for x's)."""
    group_size: Optional[int]
    norm_before_gate: bool
    activation: str
    out_dtype: Optional[str]


def check_gated(group_size, norm_before_gate, activation, out_dtype=None):
    """The GatedSpec of a call's gated arguments, or TypeError / ValueError."""
    if group_size is not None:
        if isinstance(group_size, (bool, np.bool_)) or not hasattr(group_size, "__index__"):
            raise TypeError(f"group_size must be an int or None, got {type(group_size).__name__}")
        group_size = int(group_size)
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1 (or None for the whole row), got {group_size}")
    if not isinstance(norm_before_gate, (bool, np.bool_)):
        raise TypeError(f"norm_before_gate must be a bool, got {type(norm_before_gate).__name__}")
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(map(repr, ACTIVATIONS))}, got {activation!r}")
    return GatedSpec(group_size, bool(norm_before_gate), activation, dtype_name(out_dtype, "out_dtype"))


def check_gated_arrays(metas, spec, names=("x", "gate", "weight", "out")):
    """dtype, shape and device checks of a gated call (``metas``: the GatedArrays' Meta
    records, None where absent). Returns the output's dtype name."""
    xm, gm, wm, om = metas
    anchor = names[0]
    _check_like_x(xm, [(names[1], gm)], None, anchor, list(zip(names[1:], metas[1:])))
    hidden = xm.shape[-1]
    if spec.group_size is not None and hidden % spec.group_size:
        raise ValueError(f"group_size={spec.group_size} needs a hidden size that is a multiple of it; "
                         f"{anchor} has hidden size {hidden}")
    if wm is not None:
        if len(wm.shape) != 1 or wm.shape[0] != hidden:
            raise ValueError(f"weight must have shape ({hidden},) ({anchor}'s last axis), got {tuple(wm.shape)}")
        if wm.dtype not in DTYPES:
            raise TypeError(f"weight must be float32, float16 or bfloat16, got {wm.dtype}")
    out_dtype = spec.out_dtype or xm.dtype
    if om is not None:
        if om.dtype != out_dtype:
            raise TypeError(f"{names[3]} must have dtype {out_dtype} (out_dtype, or x's dtype), got {om.dtype}")
        if tuple(om.shape) != tuple(xm.shape):
            raise ValueError(f"{names[3]} must have {anchor}'s shape {tuple(xm.shape)}, got {tuple(om.shape)}")
        if not om.writeable:
            raise ValueError(f"{names[3]} is read-only (for a torch inference tensor: writeable only "
                             f"inside torch.inference_mode()); pass a writeable {names[3]}")
    return out_dtype


def check_gated_backward_arrays(metas, spec, names=("dy", "x", "gate", "weight")):
    """The gated backward's checks: dy of x's shape (any float dtype: the forward's output),
    the gate and weight as in check_gated_arrays."""
    dym, xm, gm, wm = metas
    check_gated_arrays((xm, gm, wm, None), spec, (names[1], names[2], names[3], "out"))
    if dym.dtype not in DTYPES:
        raise TypeError(f"{names[0]} must be float32, float16 or bfloat16, got {dym.dtype}")
    if tuple(dym.shape) != tuple(xm.shape):
        raise ValueError(f"{names[0]} must have {names[1]}'s shape {tuple(xm.shape)}, got {tuple(dym.shape)}")
    if dym.device != xm.device:
        raise ValueError(f"{names[0]} is on device {dym.device} but {names[1]} is on device {xm.device}; "
                         f"all arrays must be on one device")


# -- QK norm + RoPE ---------------------------------------------------------------------------------

class QkRopeSpec(NamedTuple):
    """A QK norm + RoPE call's checked rotary arguments. ``cache``: the angles come from
    positions and cos_sin_cache (vLLM's and FlashInfer's convention), else from cos and sin
    (transformers'); ``rotary_dim``: None until check_qk_rope_arrays reads the table's width."""
    rotary_dim: Optional[int]
    is_neox: bool
    cache: bool


POSITION_DTYPES = ("int32", "int64")


def check_qk_rope(arrays, rotary_dim, is_neox):
    """The QkRopeSpec of a call (``arrays``: a QkRopeArrays, or the backward's, of arrays or
    Meta records): exactly one convention of angles, both weights or neither, ``rotary_dim`` an
    even int >= 2 or None, ``is_neox`` a bool; or TypeError / ValueError."""
    table = {"cos": arrays.cos, "sin": arrays.sin}
    cache = {"positions": arrays.positions, "cos_sin_cache": arrays.cos_sin_cache}
    given = [name for name, a in {**table, **cache}.items() if a is not None]
    if not given:
        raise ValueError("qk_norm_rope needs the angles: cos and sin (transformers' convention), or positions and "
                         "cos_sin_cache (vLLM's and FlashInfer's)")
    if set(given) & set(table) and set(given) & set(cache):
        raise ValueError(f"pass cos and sin, or positions and cos_sin_cache, not both (got {', '.join(given)})")
    uses_cache = not set(given) & set(table)
    pair = cache if uses_cache else table
    missing = [name for name, a in pair.items() if a is None]
    if missing:
        raise ValueError(f"{' and '.join(pair)} go together: {missing[0]} is None")
    if (arrays.q_weight is None) != (arrays.k_weight is None):
        raise ValueError("q_weight and k_weight go together: pass both (head_dim,) arrays, or neither")
    if not isinstance(is_neox, (bool, np.bool_)):
        raise TypeError(f"is_neox must be a bool, got {type(is_neox).__name__}")
    if rotary_dim is not None:
        if isinstance(rotary_dim, (bool, np.bool_)) or not hasattr(rotary_dim, "__index__"):
            raise TypeError(f"rotary_dim must be an int or None, got {type(rotary_dim).__name__}")
        rotary_dim = int(rotary_dim)
        if rotary_dim < 2 or rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even and >= 2 (channels turn in pairs), got {rotary_dim}")
    return QkRopeSpec(rotary_dim, bool(is_neox), uses_cache)


def _broadcasts_to(shape, target):
    """Whether an array of ``shape`` broadcasts to ``target`` (NumPy's rule)."""
    if len(shape) > len(target):
        return False
    return all(a in (1, b) for a, b in zip(reversed(shape), reversed(target)))


def check_qk_rope_arrays(metas, spec, gradients=None):
    """dtype, shape and device checks of a QK norm + RoPE call (``metas``: a QkRopeArrays of Meta
    records, None where absent; ``gradients``: the backward's (dq_out, dk_out) Meta records).
    Returns the spec with rotary_dim set (the table's width when not given)."""
    qm, km = metas.q, metas.k
    if qm.dtype not in DTYPES:
        raise TypeError(f"q must be float32, float16 or bfloat16, got {qm.dtype}")
    if km.dtype != qm.dtype:
        raise TypeError(f"k must have q's dtype {qm.dtype}, got {km.dtype}")
    for name, m in (("q", qm), ("k", km)):
        if len(m.shape) < 2:
            raise ValueError(f"{name} must have shape (..., heads, head_dim), got {tuple(m.shape)}")
    tokens, head_dim = tuple(qm.shape[:-2]), qm.shape[-1]
    if tuple(km.shape[:-2]) != tokens or km.shape[-1] != head_dim:
        raise ValueError(f"k must have q's leading axes {tokens} and head_dim {head_dim} (shape (..., k_heads, "
                         f"head_dim)), got {tuple(km.shape)}")
    if not 2 <= head_dim <= QK_ROPE_MAX_HEAD_DIM:
        raise ValueError(f"q and k have head_dim {head_dim}; from 2 to {QK_ROPE_MAX_HEAD_DIM} is supported (a head "
                         f"is kept in one warp's registers)")
    for name in ("q_weight", "k_weight"):
        m = getattr(metas, name)
        if m is None:
            continue
        if tuple(m.shape) != (head_dim,):
            raise ValueError(f"{name} must have shape ({head_dim},) (head_dim), got {tuple(m.shape)}")
        if m.dtype not in (qm.dtype, "float32"):
            raise TypeError(f"{name} must have q's dtype {qm.dtype} or float32, got {m.dtype}")
    if metas.q_weight is not None and metas.k_weight.dtype != metas.q_weight.dtype:
        raise TypeError(f"k_weight must have q_weight's dtype {metas.q_weight.dtype}, got {metas.k_weight.dtype}")
    if spec.cache:
        table_names, cm = ("cos_sin_cache",), metas.cos_sin_cache
        if len(cm.shape) != 2:
            raise ValueError(f"cos_sin_cache must have shape (max_position, rotary_dim), got {tuple(cm.shape)}")
        pm = metas.positions
        if pm.dtype not in POSITION_DTYPES:
            raise TypeError(f"positions must be int32 or int64, got {pm.dtype}")
        if not _broadcasts_to(tuple(pm.shape), tokens):
            raise ValueError(f"positions must have q's leading axes {tokens} (or broadcast to them), got "
                             f"{tuple(pm.shape)}")
    else:
        table_names, cm = ("cos", "sin"), metas.cos
        if tuple(metas.sin.shape) != tuple(cm.shape):
            raise ValueError(f"sin must have cos's shape {tuple(cm.shape)}, got {tuple(metas.sin.shape)}")
        if len(cm.shape) < 1 or not _broadcasts_to(tuple(cm.shape[:-1]), tokens):
            raise ValueError(f"cos and sin must have shape (..., rotary_dim) whose leading axes broadcast to q's "
                             f"{tokens}, got {tuple(cm.shape)}")
        if metas.sin.dtype != cm.dtype:
            raise TypeError(f"sin must have cos's dtype {cm.dtype}, got {metas.sin.dtype}")
    if cm.dtype not in (qm.dtype, "float32"):
        raise TypeError(f"{table_names[0]} must have q's dtype {qm.dtype} or float32, got {cm.dtype}")
    width = cm.shape[-1]
    rotary_dim = width if spec.rotary_dim is None else spec.rotary_dim
    if width != rotary_dim or width < 2 or width % 2:
        raise ValueError(f"{' and '.join(table_names)} must be rotary_dim wide, an even width >= 2: their last axis "
                         f"is {width}" + ("" if spec.rotary_dim is None else f", rotary_dim is {spec.rotary_dim}"))
    if rotary_dim > head_dim:
        raise ValueError(f"rotary_dim {rotary_dim} is more than head_dim {head_dim}")
    outputs = [("out_q", metas.out_q, qm), ("out_k", metas.out_k, km)]
    for name, m, like in outputs if gradients is None else zip(("dq_out", "dk_out"), gradients, (qm, km)):
        if m is None:
            continue
        if m.dtype != qm.dtype:
            raise TypeError(f"{name} must have q's dtype {qm.dtype}, got {m.dtype}")
        if tuple(m.shape) != tuple(like.shape):
            raise ValueError(f"{name} must have {'q' if like is qm else 'k'}'s shape {tuple(like.shape)}, "
                             f"got {tuple(m.shape)}")
        if gradients is None and not m.writeable:
            raise ValueError(f"{name} is read-only (for a torch inference tensor: writeable only inside "
                             f"torch.inference_mode()); pass a writeable {name}")
    named = list(zip(type(metas)._fields, metas)) + list(zip(("dq_out", "dk_out"), gradients or ()))
    for name, m in named:
        if m is not None and m.device != qm.device:
            raise ValueError(f"{name} is on device {m.device} but q is on device {qm.device}; all arrays must be "
                             f"on one device")
    return spec._replace(rotary_dim=rotary_dim)
