"""LayerNorm's argument checks on Meta records (TypeError / ValueError naming the argument)."""

from ..._validate import DTYPES, _check_like_x


def _check_vector(name, m, hidden):
    if m is None:
        return
    if len(m.shape) != 1 or m.shape[0] != hidden:
        raise ValueError(f"{name} must have shape ({hidden},) (x's last axis), got {tuple(m.shape)}")
    if m.dtype not in DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {m.dtype}")


def _check_broadcast(name, m, shape):
    """``m`` broadcasts to ``shape`` NumPy's way and keeps its last axis (hidden)."""
    if m.dtype not in DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {m.dtype}")
    ok = 1 <= len(m.shape) <= len(shape) and m.shape[-1] == shape[-1] and all(
        a in (1, b) for a, b in zip(reversed(m.shape[:-1]), reversed(shape[:-1])))
    if not ok:
        raise ValueError(f"{name} must broadcast to x's shape {tuple(shape)} with x's last axis, got "
                         f"{tuple(m.shape)}")


def check_layer_norm_arrays(metas, out_dtype=None):
    """The forward's arrays (a LayerNormArrays of Meta records): returns (residual dtype,
    output dtype) names. The residual (and residual_out) x's dtype or float32, out the output
    dtype, weight and bias of any float dtype, shift and scale broadcasting to x."""
    xm = metas.x
    others = [(n, m) for n, m in zip(metas._fields[1:], metas[1:])]
    _check_like_x(xm, [], None, "x", others)
    hidden = xm.shape[-1]
    _check_vector("weight", metas.weight, hidden)
    _check_vector("bias", metas.bias, hidden)
    for name in ("shift", "scale"):
        if getattr(metas, name) is not None:
            _check_broadcast(name, getattr(metas, name), xm.shape)
    rm = metas.residual
    residual_dtype = rm.dtype if rm is not None and rm.dtype == "float32" else xm.dtype
    out_dtype = out_dtype or xm.dtype
    for name, dtype, rule in (("residual", residual_dtype, "x's dtype or float32"),
                              ("residual_out", residual_dtype, "the residual's dtype"),
                              ("out", out_dtype, "out_dtype, or x's dtype")):
        m = getattr(metas, name)
        if m is None:
            continue
        if m.dtype != dtype:
            raise TypeError(f"{name} must have dtype {dtype} ({rule}), got {m.dtype}")
        if tuple(m.shape) != tuple(xm.shape):
            raise ValueError(f"{name} must have x's shape {tuple(xm.shape)}, got {tuple(m.shape)}")
    for name in ("out", "residual_out"):
        m = getattr(metas, name)
        if m is not None and not m.writeable:
            raise ValueError(f"{name} is read-only (for a torch inference tensor: writeable only inside "
                             f"torch.inference_mode()); pass a writeable {name}")
    return residual_dtype, out_dtype


def check_layer_norm_backward_arrays(metas, names):
    """The backward's arrays (a LayerNormBackwardArrays of Meta records; ``names``: their names
    in messages, x's being residual_out for the fused op): dy of x's shape in any float dtype,
    d_residual_out of x's shape and dtype."""
    xm, anchor = metas.x, names[1]
    _check_like_x(xm, [(names[2], metas.d_residual_out)], None, anchor,
                  list(zip(names, metas)))
    if metas.dy.dtype not in DTYPES:
        raise TypeError(f"dy must be float32, float16 or bfloat16, got {metas.dy.dtype}")
    if tuple(metas.dy.shape) != tuple(xm.shape):
        raise ValueError(f"dy must have {anchor}'s shape {tuple(xm.shape)}, got {tuple(metas.dy.shape)}")
    hidden = xm.shape[-1]
    _check_vector("weight", metas.weight, hidden)
    _check_vector("bias", metas.bias, hidden)
    for name in ("shift", "scale"):
        if getattr(metas, name) is not None:
            _check_broadcast(name, getattr(metas, name), xm.shape)
