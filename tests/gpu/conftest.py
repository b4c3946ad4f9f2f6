"""Every test in tests/gpu needs a CUDA GPU: where there is none usable, each one is marked
skipped at collection with the reason (``helpers.gpu_missing()``; ``-ra`` shows it). The
check looks for the driver library first, so a machine without one never imports CuPy
here; the test modules import CuPy only where a GPU is usable.
"""

import os

import pytest
from helpers import gpu_missing

_HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
    mine = [item for item in items if os.path.abspath(str(item.path)).startswith(_HERE + os.sep)]
    if not mine:
        return
    reason = gpu_missing()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {reason}")
    for item in mine:
        item.add_marker(skip)


@pytest.fixture
def free_gpu_memory():
    """Gives CuPy's memory pool back after the test: eight xdist workers share one GPU
    (the GPU suites use it for every test)."""
    yield
    if gpu_missing() is None:
        import cupy
        cupy.get_default_memory_pool().free_all_blocks()
