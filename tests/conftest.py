"""The tests import whichever cupy_rmsnorm Python finds: the installed package (README's
``pip install ".[cuda12,test]" && pytest -q tests``), or the source tree where it comes
first on the path (``PYTHONPATH=$PWD``, as the GPU scripts run it). The header says which.
"""

import pytest
from helpers import gpu_missing


def pytest_report_header(config):
    import cupy_rmsnorm
    return f"cupy_rmsnorm: {cupy_rmsnorm.__file__}"


@pytest.fixture
def free_gpu_memory():
    """Gives CuPy's memory pool back after the test: eight xdist workers share one GPU
    (the GPU suites use it for every test)."""
    yield
    if gpu_missing() is None:
        import cupy
        cupy.get_default_memory_pool().free_all_blocks()
