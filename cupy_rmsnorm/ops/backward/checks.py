from ..._validate import DTYPES, _check_like_x


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
