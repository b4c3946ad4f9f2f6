"""Benchmarks of cupy_rmsnorm against its peers: ``python -m cupy_rmsnorm.bench``.

Modules: ``shapes`` (what is measured), ``timing`` (CUDA events, graphs, the three
modes, copy bandwidth, first-call latency), ``peers`` (the implementations compared),
``report`` (tables, CSV / JSON / Markdown, charts), ``progress`` (the progress bar) and
``cli`` (the command line). Nothing here imports CuPy or torch until a GPU run starts.
"""

from .cli import main

__all__ = ["main"]
