"""The tests import whichever cupy_rmsnorm Python finds: the installed package (README's
``pip install ".[cuda12,test]" && pytest -q tests``), or the source tree where it comes
first on the path (``PYTHONPATH=$PWD``, as the GPU scripts run it). The header says which.
"""


def pytest_report_header(config):
    import cupy_rmsnorm
    return f"cupy_rmsnorm: {cupy_rmsnorm.__file__}"
