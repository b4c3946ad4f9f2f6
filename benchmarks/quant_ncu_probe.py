"""Calls of the quantized forms between cudaProfilerStart / Stop, for Nsight Compute.

    PYTHONPATH=$PWD ncu --clock-control none --profile-from-start off \\
        --metrics smsp__inst_executed.sum,gpu__time_duration.sum,launch__registers_per_thread,... \\
        python3 benchmarks/quant_ncu_probe.py [--fused ROWSxHIDDEN --flashinfer LIB]

Default (results/quant_ncu_forms_run_gd.txt): one call each of rms_norm and the static /
per-token / per-group quantized forms at 4096 x 4096 bf16. ``--fused``: the fused forms at that
shape instead (static and per-group, the residual updated in place), each followed by
FlashInfer's kernel of the same form when ``--flashinfer`` names benchmarks/flashinfer_quant.cu's
library. Every call runs twice before the profiled range (compiles, warm caches).
"""

import argparse
import ctypes

import cupy as cp
import ml_dtypes
import numpy as np

import cupy_rmsnorm as rn


def flashinfer_calls(lib, x, r, w, scale):
    """FlashInfer's fused static and fused per-group (1x128 block) kernels, bf16 in, e4m3 out."""
    rows, hidden = x.shape
    out = cp.empty((rows, hidden), dtype=cp.uint8)
    block_scale = cp.empty((hidden // 128, (rows + 3) // 4 * 4), dtype=cp.float32)
    normed = cp.empty_like(x)
    p = ctypes.c_void_p
    stream = p(cp.cuda.get_current_stream().ptr)
    eps = ctypes.c_float(1e-6)
    return (lambda: lib.fi_fused_add_rmsnorm_quant(p(x.data.ptr), p(r.data.ptr), p(w.data.ptr), p(out.data.ptr),
                                                   rows, hidden, p(scale.data.ptr), eps, stream),
            lambda: lib.fi_fused_add_rmsnorm_fp8_block_quant(p(x.data.ptr), p(r.data.ptr), p(w.data.ptr),
                                                             p(out.data.ptr), p(block_scale.data.ptr),
                                                             p(normed.data.ptr), rows, hidden, eps, stream))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fused", default=None, help="ROWSxHIDDEN: the fused forms (and FlashInfer's) at that shape")
    ap.add_argument("--flashinfer", default=None)
    args = ap.parse_args()
    bf16 = np.dtype(ml_dtypes.bfloat16)
    rng = cp.random.default_rng(0)
    rows, hidden = map(int, args.fused.split("x")) if args.fused else (4096, 4096)
    x = rng.standard_normal((rows, hidden), dtype=cp.float32).astype(bf16)
    w = (1 + 0.1 * rng.standard_normal(hidden, dtype=cp.float32)).astype(bf16)
    scale = cp.full((1,), 0.05, dtype=cp.float32)
    if args.fused:
        r = rng.standard_normal((rows, hidden), dtype=cp.float32).astype(bf16)
        ours = (lambda: rn.fused_add_rms_norm_quant(x, r, w, scale=scale, residual_out=r),
                lambda: rn.fused_add_rms_norm_quant(x, r, w, group_size=128, residual_out=r))
        theirs = flashinfer_calls(ctypes.CDLL(args.flashinfer), x, r, w, scale) if args.flashinfer else ()
        calls = [c for pair in zip(ours, theirs or (None, None)) for c in pair if c is not None]
    else:
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
