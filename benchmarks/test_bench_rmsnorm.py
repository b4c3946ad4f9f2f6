"""pytest-benchmark benchmarks of rms_norm and fused_add_rms_norm over part of the grid.

    python -m pytest benchmarks/ --benchmark-only [--benchmark-json=bench.json]

Every round does real GPU work and ends with a synchronize: ``graph`` replays one CUDA
graph of N captured calls, ``cold`` runs one call after a 512 MiB write has flushed L2,
``hot`` issues N calls back to back from Python. pytest-benchmark's statistics are the
wall time of a round; ``extra_info`` carries the CUDA-event time per call (median over
the rounds) with bytes, GB/s, % of the copy bandwidth, shape, dtype, mode and our launch
plan. The full comparison with the peers is ``python -m cupy_rmsnorm.bench``.
"""

import statistics

import pytest
from helpers import ULP_REL, requires_gpu

pytestmark = requires_gpu

SHAPES = [(1, 4096), (32, 4096), (256, 4096), (1024, 4096), (4096, 4096), (16384, 4096),
          (1, 8192), (4096, 8192), (4096, 512), (4096, 255), (4096, 4095)]
DTYPES = ("bfloat16", "float16")
ROUNDS = {"graph": 10, "cold": 30, "hot": 5}


@pytest.mark.parametrize("mode", list(ROUNDS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("op", ("rms", "fused"))
def test_rmsnorm(benchmark, gpu, op, shape, dtype, mode):
    from cupy_rmsnorm.bench import common, forward, peers, timing
    tokens, hidden = shape
    case = peers.Case(op, dtype, tokens, hidden)
    fn = peers.build("ours", case)
    err = case.max_abs_err(timing.warm_up(gpu.runner, fn))
    # what is timed must compute the op: within two ulp of the largest output
    tol = 2 * ULP_REL[dtype] * float(abs(case.reference()).max())
    assert err <= tol, f"max abs error {err} > {tol}"

    nbytes = peers.logical_bytes(op, tokens, hidden, common.ITEMSIZE[dtype])
    limits = forward.CALL_LIMITS           # as the forward report's
    calls = timing.calls_for(nbytes, gpu.copy_gbps, *limits[mode]) if mode in limits else 1
    timer = timing.make_timer(mode, gpu.runner, fn, calls, gpu.scratch)
    try:
        benchmark.group = f"{op} {dtype} {mode}"
        benchmark.pedantic(timer.round, rounds=ROUNDS[mode], iterations=1, warmup_rounds=1)
    finally:
        timer.close()
    us = statistics.median(timer.samples[-ROUNDS[mode]:])   # the timed rounds, not the warm-up
    plan = forward.plan_for(op, tokens, hidden, common.ITEMSIZE[dtype], gpu.sm_count, gpu.max_cluster)
    rec = forward.make_record(op, dtype, tokens, hidden, "ours", mode, us, nbytes, gpu.copy_gbps,
                             calls, ROUNDS[mode], err, plan)
    benchmark.extra_info.update({
        "op": op, "shape": [tokens, hidden], "dtype": dtype, "mode": mode,
        "calls_per_round": calls, "us_per_call": us, "bytes": nbytes, "GBps": rec["GBps"],
        "pct_copy_bandwidth": rec["pct_copy"], "copy_GBps": gpu.copy_gbps,
        "max_abs_err": err, "plan": rec["plan"], "plan_text": forward.plan_text(rec["plan"])})
    case.release()
