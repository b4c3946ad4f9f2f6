from typing import NamedTuple, Optional

import numpy as np

from ..._validate import DTYPES
from .plan import QK_ROPE_MAX_HEAD_DIM


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
