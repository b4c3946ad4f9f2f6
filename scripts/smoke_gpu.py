"""Quick GPU smoke check: compile, correctness on a few shapes, and rough timings.

    PYTHONPATH=$PWD python3 scripts/smoke_gpu.py
"""
import sys
import time

import cupy as cp
import ml_dtypes
import numpy as np

import cupy_rmsnorm as rn
from cupy_rmsnorm import _compile

BF16 = np.dtype(ml_dtypes.bfloat16)
fails = 0


def check(name, got, ref, atol, rtol):
    global fails
    g = cp.asnumpy(got).astype(np.float64)
    r = np.asarray(ref).astype(np.float64)
    ok = np.allclose(g, r, atol=atol, rtol=rtol) and not np.isnan(g).any()
    err = np.nanmax(np.abs(g - r)) if g.size else 0.0
    print(f"{'ok  ' if ok else 'FAIL'} {name}: max abs err {err:.3g}")
    fails += not ok


print("include dirs:", _compile.cuda_include_dirs())
rng = np.random.default_rng(0)
for dtype, tol in ((np.float32, 1e-5), (np.float16, 2e-3), (BF16, 2e-2)):
    for rows, hidden in ((3, 7), (257, 255), (64, 4096), (5, 4095), (2, 65536 + 3), (1, 16384)):
        x = rng.standard_normal((rows, hidden)).astype(dtype)
        r = rng.standard_normal((rows, hidden)).astype(dtype)
        w = (1 + 0.1 * rng.standard_normal(hidden)).astype(dtype)
        for mode in ("fp32", "llama"):
            y = rn.rms_norm(cp.asarray(x), cp.asarray(w), casting_mode=mode)
            check(f"rms {np.dtype(dtype).name} {rows}x{hidden} {mode}", y,
                  rn.rms_norm_reference(x, w, casting_mode=mode), tol, tol)
            y, s = rn.fused_add_rms_norm(cp.asarray(x), cp.asarray(r), cp.asarray(w), casting_mode=mode)
            ry, rs = rn.fused_add_rms_norm_reference(x, r, w, casting_mode=mode)
            check(f"fused {np.dtype(dtype).name} {rows}x{hidden} {mode}", y, ry, tol, tol)
            check(f"fused residual {np.dtype(dtype).name} {rows}x{hidden} {mode}", s, rs, 0, 0)
# many rows: the pipelined variant
for dtype, tol in ((np.float32, 1e-5), (np.float16, 2e-3), (BF16, 2e-2)):
    for rows, hidden in ((4096, 4096), (2000, 4095), (3000, 255), (1000, 8192), (4096, 1)):
        x = rng.standard_normal((rows, hidden)).astype(dtype)
        r = rng.standard_normal((rows, hidden)).astype(dtype)
        w = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
        print(rn.launch_plan(rows, hidden, np.dtype(dtype).itemsize, 16 // np.dtype(dtype).itemsize, 132, True))
        y = rn.rms_norm(cp.asarray(x), cp.asarray(w), casting_mode="llama")
        check(f"rms {np.dtype(dtype).name} {rows}x{hidden}", y, rn.rms_norm_reference(x, w, casting_mode="llama"), tol, tol)
        xc, rc = cp.asarray(x), cp.asarray(r)
        y, s = rn.fused_add_rms_norm(xc, rc, cp.asarray(w), out=xc, residual_out=rc)
        ry, rs = rn.fused_add_rms_norm_reference(x, r, w)
        check(f"fused in place {np.dtype(dtype).name} {rows}x{hidden}", y, ry, tol, tol)
        check(f"fused residual {np.dtype(dtype).name} {rows}x{hidden}", s, rs, 0, 0)
# odd offset view, in place
buf = cp.asarray(rng.standard_normal(10 * 4095 + 1).astype(BF16))
x = buf[1:].reshape(10, 4095)
ref = rn.rms_norm_reference(cp.asnumpy(x))
rn.rms_norm(x, out=x)
check("in-place odd offset bf16 10x4095", x, ref, 2e-2, 2e-2)

# timings: graph of 200 calls, 1x4096 and 4096x4096 bf16
def graph_time(fn, n=200):
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        fn(); s.synchronize()
        s.begin_capture()
        for _ in range(n):
            fn()
        g = s.end_capture()
        g.launch(s); s.synchronize()
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        ts = []
        for _ in range(5):
            e0.record(s); g.launch(s); e1.record(s); e1.synchronize()
            ts.append(cp.cuda.get_elapsed_time(e0, e1) * 1000 / n)
    return float(np.median(ts))

for rows, hidden in ((1, 4096), (256, 4096), (4096, 4096), (16384, 4096), (4096, 8192), (4096, 4095)):
    x = cp.asarray(rng.standard_normal((rows, hidden)).astype(BF16))
    r = cp.asarray(rng.standard_normal((rows, hidden)).astype(BF16))
    w = cp.asarray(np.ones(hidden, BF16))
    y = cp.empty_like(x); ro = cp.empty_like(x)
    t1 = graph_time(lambda: rn.rms_norm(x, w, out=y))
    t2 = graph_time(lambda: rn.fused_add_rms_norm(x, r, w, out=y, residual_out=ro))
    b = rows * hidden * 2
    print(f"graph bf16 {rows}x{hidden}: rms {t1:.2f} us ({2*b/t1/1e3:.0f} GB/s)  fused {t2:.2f} us ({4*b/t2/1e3:.0f} GB/s)")

# host overhead
x = cp.asarray(rng.standard_normal((1, 4096)).astype(BF16)); w = cp.asarray(np.ones(4096, BF16))
for _ in range(100):
    rn.rms_norm(x, w)
cp.cuda.Device().synchronize()
t = time.perf_counter()
for _ in range(2000):
    rn.rms_norm(x, w)
cp.cuda.Device().synchronize()
print(f"hot cupy 1x4096 bf16: {(time.perf_counter() - t) / 2000 * 1e6:.1f} us/call")
try:
    import torch
    xt = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16); wt = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    for f, name in ((lambda: rn.rms_norm(xt, wt), "ours torch"), (lambda: torch.nn.functional.rms_norm(xt, (4096,), wt, 1e-6), "F.rms_norm")):
        for _ in range(100):
            f()
        torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(2000):
            f()
        torch.cuda.synchronize()
        print(f"hot {name} 1x4096 bf16: {(time.perf_counter() - t) / 2000 * 1e6:.1f} us/call")
    ref = torch.nn.functional.rms_norm(xt.float(), (4096,), wt.float(), 1e-6)
    print("torch agreement max err", (rn.rms_norm(xt, wt).float() - ref).abs().max().item())
except ImportError:
    print("no torch")
print("compiled kernels:", len(_compile.kernel_cache))
print("SMOKE", "FAILED" if fails else "PASSED", fails)
sys.exit(1 if fails else 0)
