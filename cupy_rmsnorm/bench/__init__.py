"""Benchmarks of cupy_rmsnorm against its peers: ``python -m cupy_rmsnorm.bench [SUBCOMMAND]``.

Modules: ``cli`` (the command line), ``common`` (what every sub-command shares: options,
shapes, exit codes, the no-GPU path, run metadata, tables, files), one module per sub-command
(``forward`` with ``peers``, ``backward``, ``quant`` and ``qk_rope`` with ``flashinfer``,
``gated``, ``e2e`` with ``serving``, ``train``), ``timing`` (CUDA events, graphs, the modes, copy
bandwidth, first-call latency, host cost) and ``arrays`` (bfloat16 through its bits, the NaN
poison, torch views). Nothing here imports CuPy or torch until a GPU run starts.
"""
