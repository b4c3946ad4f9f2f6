"""Fixtures of the GPU benchmarks: the source tree and tests/helpers.py on the path, and
one session-wide set of GPU objects (stream, L2 flush buffer, copy bandwidth)."""

import os
import sys
import types

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (os.path.join(_ROOT, "tests"), _ROOT):  # run from the source tree, share helpers
    if _path not in sys.path:
        sys.path.insert(0, _path)


@pytest.fixture(scope="session")
def gpu():
    """What every benchmark shares: the CuPy runner (its own stream), the cold-mode
    scratch buffer, the SM count and the copy bandwidth measured once per session."""
    from helpers import gpu_missing
    reason = gpu_missing()
    if reason:
        pytest.skip(f"GPU benchmark: {reason}")
    from cupy_rmsnorm.bench import timing
    copy_gbps, _ = timing.copy_bandwidth_gbps()
    info = timing.device_info()
    return types.SimpleNamespace(copy_gbps=copy_gbps, sm_count=info["sm_count"], max_cluster=info["max_cluster"],
                                 runner=timing.CupyRunner(), scratch=timing.Scratch())
