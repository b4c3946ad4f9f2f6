"""Where the host time of one call goes (cProfile over back-to-back 1 x 4096 bf16 calls)."""
import cProfile
import pstats

import cupy as cp
import ml_dtypes
import numpy as np

import cupy_rmsnorm as rn
from cupy_rmsnorm.bench.timing import host_times

N = 3000


def per_call(fn, sync):
    """Microseconds per call, to the end of the final synchronize (median of 5 x N calls)."""
    return host_times(fn, sync, N, repeats=5, warmup=200)["total_us"]


x = cp.asarray(np.random.randn(1, 4096).astype(ml_dtypes.bfloat16))
r = cp.asarray(np.random.randn(1, 4096).astype(ml_dtypes.bfloat16))
w = cp.asarray(np.ones(4096, ml_dtypes.bfloat16))
y = cp.empty_like(x)
sync = cp.cuda.Device().synchronize
cases = {
    "cupy rms": lambda: rn.rms_norm(x, w),
    "cupy rms out=": lambda: rn.rms_norm(x, w, out=y),
    "cupy fused": lambda: rn.fused_add_rms_norm(x, r, w),
}
try:
    import torch
    xt = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    rt = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    wt = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    cases["torch rms"] = lambda: rn.rms_norm(xt, wt)
    cases["torch fused"] = lambda: rn.fused_add_rms_norm(xt, rt, wt)
    cases["F.rms_norm"] = lambda: torch.nn.functional.rms_norm(xt, (4096,), wt, 1e-6)
    cases["torch.empty_like"] = lambda: torch.empty_like(xt)
    cases["raw stream"] = lambda: torch._C._cuda_getCurrentRawStream(0)
except ImportError:
    pass
cases["cp.empty"] = lambda: cp.empty((1, 4096), dtype=x.dtype)
for name, fn in cases.items():
    print(f"{name:20s} {per_call(fn, sync):7.2f} us/call")
for name in ("cupy rms", "torch rms"):
    if name in cases:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(N):
            cases[name]()
        pr.disable()
        sync()
        print(f"--- profile: {name}")
        pstats.Stats(pr).sort_stats("tottime").print_stats(14)
