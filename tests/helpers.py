"""Shared test helpers: GPU / torch availability (with the reason shown on skip), dtypes."""

import functools

import ml_dtypes
import numpy as np
import pytest

DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
          "bfloat16": np.dtype(ml_dtypes.bfloat16)}


@functools.lru_cache(maxsize=None)
def gpu_missing():
    """None when a CUDA GPU is usable through CuPy, else why not."""
    try:
        import cupy
    except Exception as e:  # noqa: BLE001 - any import failure means no GPU path
        return f"CuPy is not importable ({type(e).__name__}: {e})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001
        return f"no CUDA GPU: {type(e).__name__}: {e}"
    return None if n > 0 else "no CUDA GPU: device count is 0"


@functools.lru_cache(maxsize=None)
def torch_cuda_missing():
    """None when torch with CUDA is usable, else why not."""
    reason = gpu_missing()
    if reason:
        return reason
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        return f"PyTorch is not installed ({type(e).__name__})"
    return None if torch.cuda.is_available() else "PyTorch sees no CUDA device"


requires_gpu = pytest.mark.skipif(gpu_missing() is not None, reason=f"GPU test: {gpu_missing()}")
requires_torch_gpu = pytest.mark.skipif(torch_cuda_missing() is not None,
                                        reason=f"torch GPU test: {torch_cuda_missing()}")
