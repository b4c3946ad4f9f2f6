"""One call each of rms_norm and the static / per-token / per-group quantized forms at
4096 x 4096 bf16, between cudaProfilerStart / Stop, for Nsight Compute (results/quant_ncu_forms_run_gd.txt):

    PYTHONPATH=$PWD ncu --clock-control none --profile-from-start off \
        --metrics smsp__inst_executed.sum,gpu__time_duration.sum,launch__registers_per_thread,... \
        python3 benchmarks/quant_ncu_probe.py
"""

import cupy as cp
import ml_dtypes
import numpy as np

import cupy_rmsnorm as rn


def main():
    bf16 = np.dtype(ml_dtypes.bfloat16)
    rng = cp.random.default_rng(0)
    x = rng.standard_normal((4096, 4096), dtype=cp.float32).astype(bf16)
    w = (1 + 0.1 * rng.standard_normal(4096, dtype=cp.float32)).astype(bf16)
    scale = cp.full((), 0.05, dtype=cp.float32)
    calls = (lambda: rn.rms_norm(x, w), lambda: rn.rms_norm_quant(x, w, scale=scale),
             lambda: rn.rms_norm_quant(x, w), lambda: rn.rms_norm_quant(x, w, group_size=128))
    for f in calls:          # compile and warm up outside the profiled range
        f()
        f()
    cp.cuda.Device().synchronize()
    cp.cuda.runtime.profilerStart()
    for f in calls:
        f()
    cp.cuda.Device().synchronize()
    cp.cuda.runtime.profilerStop()


if __name__ == "__main__":
    main()
