"""Shared test helpers: GPU / torch availability (with the reason shown on skip), dtypes."""

import functools
import os

import ml_dtypes
import numpy as np
import pytest

DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
          "bfloat16": np.dtype(ml_dtypes.bfloat16)}


@functools.lru_cache(maxsize=None)
def gpu_missing():
    """None when a CUDA GPU is usable through CuPy, else why not (the benchmark's own check)."""
    from cupy_rmsnorm.bench.timing import gpu_missing as reason
    why = reason()
    return None if why is None else f"no CUDA GPU: {why}"


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


def child_env(**overrides):
    """The environment of a child Python that is to import the cupy_rmsnorm this session
    imported: that package's folder first on PYTHONPATH. Run the child in a folder with
    no cupy_rmsnorm/ of its own (``tmp_path``): ``-c`` and ``-m`` put the working folder first."""
    import cupy_rmsnorm
    root = os.path.dirname(os.path.dirname(os.path.abspath(cupy_rmsnorm.__file__)))
    env = dict(os.environ, **overrides)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


requires_gpu = pytest.mark.skipif(gpu_missing() is not None, reason=f"GPU test: {gpu_missing()}")
requires_torch_gpu = pytest.mark.skipif(torch_cuda_missing() is not None,
                                        reason=f"torch GPU test: {torch_cuda_missing()}")
