"""Sweep launch-plan choices per shape (graph-mode GPU time) to justify the heuristic.

    PYTHONPATH=$PWD python3 benchmarks/sweep_plans.py --out results/sweep.csv

For each op and shape it times the heuristic's plan and neighbours of it (threads per
row halved / doubled, streaming for long rows), each with the same inputs, and prints
the best. The plan is forced through launch_plan's keyword
arguments; nothing else changes.
"""

import argparse
import csv
import sys

import cupy as cp
import ml_dtypes
import numpy as np

import cupy_rmsnorm as rn
from cupy_rmsnorm import _api, _launcher
from cupy_rmsnorm._plan import launch_plan as heuristic

SHAPES = [(1, 4096), (32, 4096), (256, 4096), (1024, 4096), (4096, 4096), (16384, 4096),
          (1, 8192), (256, 8192), (1024, 8192), (4096, 8192), (16384, 8192),
          (4096, 512), (4096, 1024), (4096, 2048), (4096, 255), (4096, 4095), (4096, 8193),
          (256, 5120), (256, 7168), (1, 16384), (32, 16384), (1, 32768), (32, 32768)]


def graph_us(fn, calls=100, repeats=7):
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        fn()
        s.synchronize()
        s.begin_capture()
        for _ in range(calls):
            fn()
        g = s.end_capture()
        g.launch(s)
        s.synchronize()
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        ts = []
        for _ in range(repeats):
            e0.record(s)
            g.launch(s)
            e1.record(s)
            e1.synchronize()
            ts.append(cp.cuda.get_elapsed_time(e0, e1) * 1000 / calls)
    return float(np.median(ts))


def force(**overrides):
    """Make the launcher use launch_plan with these keyword overrides (None: the heuristic)."""
    _launcher.launch_plan = lambda *a, **k: heuristic(*a, **{**k, **overrides})
    _api._launchers.clear()


def candidates(rows, hidden, fused, sm):
    """The heuristic's plan, then threads per row halved and doubled (vectors per thread
    following), and streaming for long rows."""
    base = heuristic(rows, hidden, 2, 8, sm, fused)
    out = [("heuristic", {})]
    n = hidden // 8
    g0 = base.threads_per_row
    for g in (g0 // 2, g0 * 2):
        if not 8 <= g <= 1024:
            continue
        nv = 1
        while g * nv < n:
            nv *= 2
        if nv <= 4 and (g <= 32 or g * nv < 2 * n):
            out.append((f"G{g}/NV{nv}", dict(threads_per_row=g, vecs_per_thread=nv)))
    if n >= 1024:
        out.append(("stream", dict(threads_per_row=1024, vecs_per_thread=0)))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default=None, help="e.g. 4096x4096,1x8192")
    args = ap.parse_args()
    shapes = SHAPES if not args.shapes else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    sm = cp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    bf16 = np.dtype(ml_dtypes.bfloat16)
    big = cp.empty(1 << 30, dtype=cp.uint8)
    copy_dst = cp.empty_like(big)
    d2d = cp.cuda.runtime.memcpyDeviceToDevice
    copy_us = graph_us(lambda: cp.cuda.runtime.memcpyAsync(copy_dst.data.ptr, big.data.ptr, big.nbytes, d2d,
                                                           cp.cuda.get_current_stream().ptr), calls=10)
    copy_gbps = 2 * big.nbytes / copy_us / 1e3
    print(f"copy bandwidth {copy_gbps:.0f} GB/s", flush=True)
    del big, copy_dst
    rows_out = []
    rng = cp.random.default_rng(0)
    for rows, hidden in shapes:
        x = rng.standard_normal((rows, hidden), dtype=cp.float32).astype(bf16)
        r = rng.standard_normal((rows, hidden), dtype=cp.float32).astype(bf16)
        w = rng.standard_normal(hidden, dtype=cp.float32).astype(bf16)
        y, ro = cp.empty_like(x), cp.empty_like(x)
        for fused in (False, True):
            nbytes = (4 if fused else 2) * x.nbytes + w.nbytes
            results = []
            for name, ov in candidates(rows, hidden, fused, sm):
                force(**ov)
                if fused:
                    fn = lambda: rn.fused_add_rms_norm(x, r, w, out=y, residual_out=ro)  # noqa: E731
                else:
                    fn = lambda: rn.rms_norm(x, w, out=y)  # noqa: E731
                plan = heuristic(rows, hidden, 2, 8, sm, fused, **ov)
                try:
                    us = graph_us(fn)
                except Exception as e:  # noqa: BLE001 - report the config and go on
                    print(f"  {name} {plan}: {type(e).__name__}: {e}", flush=True)
                    continue
                results.append((us, name))
                rows_out.append(dict(op="fused" if fused else "rms", rows=rows, hidden=hidden, config=name,
                                     plan=str(plan), us=round(us, 3), gbps=round(nbytes / us / 1e3, 1),
                                     pct_copy=round(100 * nbytes / us / 1e3 / copy_gbps, 1)))
            force()
            h = results[0][0]
            best = min(results)
            print(f"{'fused' if fused else 'rms':5s} {rows:6d}x{hidden:<6d} heuristic {h:8.2f} us "
                  f"({nbytes / h / 1e3 / copy_gbps * 100:5.1f}% copy)  best {best[0]:8.2f} us {best[1]}", flush=True)
        del x, r, y, ro
    if args.out:
        with open(args.out, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(rows_out[0]))
            wr.writeheader()
            wr.writerows(rows_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
