"""The tests import whichever cupy_rmsnorm Python finds: the installed package (README's
``pip install ".[cuda12,test]" && pytest -q tests``), or the source tree where it comes
first on the path (``PYTHONPATH=$PWD``, as the GPU scripts run it). The header says
which (with -q, the last lines).
"""

import pytest
from helpers import gpu_missing


def _imported():
    import cupy_rmsnorm
    return f"cupy_rmsnorm: {cupy_rmsnorm.__file__}"


def pytest_report_header(config):
    return _imported()


def pytest_terminal_summary(terminalreporter, config):
    if config.get_verbosity() < 0:      # -q shows no header: say it at the end
        terminalreporter.write_line(_imported())


@pytest.fixture
def free_gpu_memory():
    """Gives CuPy's memory pool back after the test: eight xdist workers share one GPU
    (the GPU suites use it for every test)."""
    yield
    if gpu_missing() is None:
        import cupy
        cupy.get_default_memory_pool().free_all_blocks()
