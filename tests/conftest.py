"""The tests import whichever cupy_rmsnorm Python finds: the installed package (README's
``pip install ".[cuda12,test]" && pytest -q tests``), or the source tree where it comes
first on the path (``PYTHONPATH=$PWD``, as the GPU scripts run it). The header says
which (with -q, the last lines).

Layout: ``tests/cpu/`` needs no GPU, ``tests/gpu/`` needs a CUDA GPU (its conftest skips
every test there, with the reason, where there is none). ``helpers.py`` and
``gpu_reference.py`` stay here, shared by both: this folder goes on ``sys.path`` so that
test modules in either folder ``import helpers`` (test modules never import each other).
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


def _imported():
    import cupy_rmsnorm
    return f"cupy_rmsnorm: {cupy_rmsnorm.__file__}"


def pytest_report_header(config):
    return _imported()


def pytest_terminal_summary(terminalreporter, config):
    if config.get_verbosity() < 0:      # -q shows no header: say it at the end
        terminalreporter.write_line(_imported())
