"""Benchmarks of cupy_rmsnorm against its peers: ``python -m cupy_rmsnorm.bench``.

Modules: ``cli`` (the command line), ``run`` (the steps of a measured run), ``sweep``
(first-call latency and the sweep over cases, implementations and modes), ``shapes``
(what is measured), ``timing`` (CUDA events, graphs, the three modes, copy bandwidth,
first-call latency, the timing loops the scripts share), ``first_call`` (the program a
fresh process runs for it), ``peers`` (the implementations compared), ``arrays``
(bfloat16 through its bits, the NaN poison, torch views), ``metadata`` (what a run
records about itself), ``report`` (tables, CSV / JSON / Markdown, charts) and
``progress`` (the progress bar). Nothing here imports CuPy or torch until a GPU run
starts.
"""

from .cli import main

__all__ = ["main"]
