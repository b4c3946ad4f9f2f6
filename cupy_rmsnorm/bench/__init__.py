"""Benchmarks of cupy_rmsnorm against its peers: ``python -m cupy_rmsnorm.bench [SUBCOMMAND]``.
A module per sub-command, ``common`` and ``timing`` shared; no CuPy or torch import until a GPU run.
"""
