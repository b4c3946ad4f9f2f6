from ..._layout import OUT, OUTPUTS, RESIDUAL, RESIDUAL_OUT, WEIGHT, Arrays, X
from ..._validate import DTYPES, _check_like_x


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
