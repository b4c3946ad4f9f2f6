"""Importing cupy_rmsnorm does not import torch (on the CPU: a child Python runs the NumPy
path and looks at sys.modules)."""

import subprocess
import sys

import pytest
from helpers import child_env

import cupy_rmsnorm as rn


def test_importing_the_library_does_not_import_torch(tmp_path):
    try:
        import torch  # noqa: F401
    except ImportError:
        pytest.skip("torch is not installed: nothing could import it")
    code = ("import sys, numpy as np, cupy_rmsnorm as rn\n"
            f"assert rn.__file__ == {rn.__file__!r}, 'the child imported another cupy_rmsnorm: ' + rn.__file__\n"
            "rn.rms_norm(np.ones((2, 8), np.float32), np.ones(8, np.float32))\n"
            "assert 'torch' not in sys.modules, 'cupy_rmsnorm imported torch'\n")
    proc = subprocess.run([sys.executable, "-c", code], env=child_env(), cwd=tmp_path,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
