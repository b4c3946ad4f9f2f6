"""Bad arguments to the backward functions: TypeError / ValueError naming the argument,
before anything runs (checked on NumPy arrays, which take the same validation as GPU arrays)."""

import numpy as np
import pytest

import cupy_rmsnorm as rn

X = np.ones((4, 8), np.float16)
W = np.ones(8, np.float16)


@pytest.mark.parametrize("call, error, match", [
    (lambda: rn.rms_norm_backward(X[:, :4], X, W), ValueError, r"^dy must have x's shape \(4, 8\)"),
    (lambda: rn.rms_norm_backward(X.astype(np.float64), X, W), TypeError, r"^dy must be float32, float16 or bfloat16"),
    (lambda: rn.rms_norm_backward(None, X, W), TypeError, r"^dy must be an array"),
    (lambda: rn.rms_norm_backward(X, X.astype(np.float64)), TypeError, r"^x must be float32, float16 or bfloat16"),
    (lambda: rn.rms_norm_backward(X, X, W[:4]), ValueError, r"^weight must have shape \(8,\)"),
    (lambda: rn.rms_norm_backward(X, X, W.astype(np.float64)), TypeError, r"^weight must be float32, float16 or bfloat16"),
    (lambda: rn.rms_norm_backward(X, X, None, weight_offset=1.0), ValueError, r"^weight_offset needs a weight"),
    (lambda: rn.rms_norm_backward(X, X, W, casting_mode="gemma"), ValueError, r"^casting_mode must be"),
    (lambda: rn.rms_norm_backward(X, X, W, eps=-1), ValueError, r"^eps must be finite"),
    (lambda: rn.rms_norm_backward(X.tolist(), X, W), TypeError, r"^dy must be a CuPy array, a NumPy array"),
    (lambda: rn.rms_norm_backward(X, np.ones((4, 0), np.float16)), ValueError, r"^x has hidden size 0"),
    (lambda: rn.fused_add_rms_norm_backward(X, X.astype(np.float32), X, W), TypeError,
     r"^d_residual_out must have residual_out's dtype float16"),
    (lambda: rn.fused_add_rms_norm_backward(X, X[:2], X, W), ValueError, r"^d_residual_out must have residual_out's shape"),
    (lambda: rn.fused_add_rms_norm_backward(X, None, X.astype(np.int8), W), TypeError, r"^residual_out must be float32"),
    (lambda: rn.fused_add_rms_norm_backward(X, None, "s", W), TypeError, r"^residual_out must be a CuPy array"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_backward_errors_name_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()
