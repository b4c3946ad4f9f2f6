"""Cold mode: is ours' extra time the code (instruction fetch after the L2 flush) or the data?

Per shape (bf16, CuPy arrays, out= given), the L2 flushed as the benchmark's cold mode does it,
then: "cold", the call alone; "code-warm", first the same kernel on other buffers (code,
constants and weights warm, this call's rows still cold); "all-warm", first the same call.
GPU microseconds between events around the call, median of 40.

    python benchmarks/cold_probe.py          (the cupy_rmsnorm on PYTHONPATH)
"""
import statistics

import cupy as cp
import ml_dtypes
import numpy as np

import cupy_rmsnorm as rn
from cupy_rmsnorm.bench.timing import Scratch
bf16 = ml_dtypes.bfloat16
rng = np.random.default_rng(0)
scratch = Scratch()
s = cp.cuda.Stream(non_blocking=True)
e0, e1 = cp.cuda.Event(), cp.cuda.Event()
print("shape        op     cold   code-warm   all-warm  (us, median of 40)")
for op in ("rms", "fused"):
    for r, h in [(32, 8192), (256, 7168), (256, 8192), (1024, 4096), (4096, 2048), (4096, 4096)]:
        mk = lambda: cp.asarray(rng.standard_normal((r, h)).astype(bf16))
        xa, xb, ra, rb = mk(), mk(), mk(), mk()
        w = cp.asarray((1 + 0.1 * rng.standard_normal(h)).astype(bf16))
        oa, ob, pa, pb = (cp.empty_like(xa) for _ in range(4))
        if op == "rms":
            call_a = lambda: rn.rms_norm(xa, w, out=oa)
            call_b = lambda: rn.rms_norm(xb, w, out=ob)
        else:
            call_a = lambda: rn.fused_add_rms_norm(xa, ra, w, out=oa, residual_out=pa)
            call_b = lambda: rn.fused_add_rms_norm(xb, rb, w, out=ob, residual_out=pb)
        res = {}
        with s:
            call_a(); call_b(); s.synchronize()
            for mode in ("cold", "code-warm", "all-warm"):
                ts = []
                for i in range(40):
                    scratch.write(s)
                    if mode == "code-warm":
                        call_b()
                    elif mode == "all-warm":
                        call_a()
                    e0.record(s); call_a(); e1.record(s); e1.synchronize()
                    ts.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
                res[mode] = statistics.median(ts)
        print(f"{r}x{h:<8} {op:<6} {res['cold']:6.2f} {res['code-warm']:10.2f} {res['all-warm']:10.2f}", flush=True)
