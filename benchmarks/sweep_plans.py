"""Sweep launch-plan choices per shape (graph-mode GPU time) to justify the heuristic.

    PYTHONPATH=$PWD python3 benchmarks/sweep_plans.py --out results/sweep.csv

For each op and shape it times the heuristic's plan and neighbours of it (threads per
row quartered / halved / doubled, eight vectors per thread, streaming for long rows, clusters of 1
to 8 blocks per row for few long rows), the heuristic's plan without programmatic
dependent launch, each with the same inputs, and prints the best. The plan is forced
through launch_plan's keyword arguments; nothing else changes.
"""

import argparse
import csv
import sys

import cupy as cp
import ml_dtypes
import numpy as np

import cupy_rmsnorm as rn
from cupy_rmsnorm import _driver, _launcher
from cupy_rmsnorm._plan import launch_plan as heuristic
from cupy_rmsnorm.bench import timing
from cupy_rmsnorm.bench.shapes import shape_list

SHAPES = [(1, 4096), (32, 4096), (256, 4096), (1024, 4096), (4096, 4096), (16384, 4096),
          (1, 8192), (256, 8192), (1024, 8192), (4096, 8192), (16384, 8192),
          (4096, 512), (4096, 1024), (4096, 2048), (4096, 255), (4096, 4095), (4096, 8193),
          (256, 5120), (256, 7168), (1, 16384), (8, 16384), (32, 16384), (1, 32768), (32, 32768),
          (32, 8192)]
CALLS, REPEATS = 100, 7    # calls per CUDA graph, replays timed (the median counts)


PDL = {}   # device 0: whether the driver launches with PDL at all (found in main)


def forced(pdl=True, **overrides):
    """A context in which the launcher plans with these launch_plan keyword overrides
    (none: the heuristic) and launches with programmatic dependent launch or not."""
    _driver.device(0).pdl = pdl and PDL[0]
    return _launcher.forced_plan(**overrides)


def candidates(rows, hidden, fused, sm, max_cluster):
    """The heuristic's plan, the same without programmatic dependent launch, then threads
    per row quartered, halved and doubled (vectors per thread following, up to 8 for rms_norm),
    streaming for long rows, and each cluster size for few long rows."""
    base = heuristic(rows, hidden, 2, 8, sm, fused, edges=hidden % 8 != 0, max_cluster=max_cluster)
    out = [("heuristic", {}), ("heuristic/no-pdl", dict(pdl=False))]
    c0 = base.cluster
    vectors = -(-hidden // 8)       # a partial last vector counts (its thread must exist)
    n = -(-vectors // c0)
    g0 = base.threads_per_row
    for g in (g0 // 4, g0 // 2, g0 * 2):
        if not 8 <= g <= 1024:
            continue
        nv = 1
        while g * nv < n:
            nv *= 2
        if nv <= (4 if fused else 8) and (g <= 32 or g * nv < 2 * n):
            out.append((f"G{g}/NV{nv}/C{c0}", dict(threads_per_row=g, vecs_per_thread=nv, cluster=c0)))
    if n >= 1024:
        out.append((f"stream/C{c0}", dict(threads_per_row=1024, vecs_per_thread=0, cluster=c0)))
    if max_cluster > 1 and rows <= 64 and vectors >= 512:
        for c in (1, 2, 4, 8):
            if c != c0:
                out.append((f"C{c}", dict(cluster=c)))
                m = -(-vectors // c)
                if m >= 256:        # the same cluster with one vector per thread, or as few as fit
                    g = min(1024, 1 << (m - 1).bit_length())
                    nv = -(-m // g)
                    nv = 1 << (nv - 1).bit_length()
                    if nv <= (2 if fused else 4):
                        out.append((f"G{g}/NV{nv}/C{c}", dict(threads_per_row=g, vecs_per_thread=nv, cluster=c)))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default=None, help="e.g. 4096x4096,1x8192")
    args = ap.parse_args()
    shapes = SHAPES if not args.shapes else shape_list(args.shapes)
    dev = _driver.device(0)
    sm, max_cluster = dev.sm_count, dev.max_cluster
    PDL[0] = dev.pdl
    print(f"programmatic dependent launch: {PDL[0]}; largest cluster {max_cluster}", flush=True)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    big = cp.empty(1 << 30, dtype=cp.uint8)
    copy_dst = cp.empty_like(big)
    d2d = cp.cuda.runtime.memcpyDeviceToDevice
    copy_us = timing.graph_us(lambda: cp.cuda.runtime.memcpyAsync(copy_dst.data.ptr, big.data.ptr, big.nbytes, d2d,
                                                                  cp.cuda.get_current_stream().ptr), 10, REPEATS)
    copy_gbps = 2 * big.nbytes / copy_us / 1e3
    print(f"copy bandwidth {copy_gbps:.0f} GB/s", flush=True)
    del big, copy_dst
    rows_out = []
    fields = ["op", "rows", "hidden", "config", "plan", "us", "gbps", "pct_copy", "max_rel_diff"]
    sink = open(args.out, "w", newline="") if args.out else None   # written row by row
    writer = csv.DictWriter(sink, fieldnames=fields) if sink else None
    if writer:
        writer.writeheader()
    rng = cp.random.default_rng(0)
    for rows, hidden in shapes:
        x = rng.standard_normal((rows, hidden), dtype=cp.float32).astype(bf16)
        r = rng.standard_normal((rows, hidden), dtype=cp.float32).astype(bf16)
        w = rng.standard_normal(hidden, dtype=cp.float32).astype(bf16)
        y, ro = cp.empty_like(x), cp.empty_like(x)
        for fused in (False, True):
            nbytes = (4 if fused else 2) * x.nbytes + w.nbytes
            results = []
            want = None       # the heuristic's output: every other plan must agree with it
            for name, ov in candidates(rows, hidden, fused, sm, max_cluster):
                if fused:
                    fn = lambda: rn.fused_add_rms_norm(x, r, w, out=y, residual_out=ro)  # noqa: E731
                else:
                    fn = lambda: rn.rms_norm(x, w, out=y)  # noqa: E731
                plan = heuristic(rows, hidden, 2, 8, sm, fused, edges=hidden % 8 != 0, max_cluster=max_cluster,
                                 **{k: v for k, v in ov.items() if k != "pdl"})
                try:
                    with forced(**ov):
                        us = timing.graph_us(fn, CALLS, REPEATS)
                except Exception as e:  # noqa: BLE001 - report the config and go on
                    print(f"  {name} {plan}: {type(e).__name__}: {e}", flush=True)
                    continue
                got = y.astype(cp.float32)
                if want is None:
                    want = got
                diff = float(cp.abs(got - want).max() / max(float(cp.abs(want).max()), 1e-30))
                if diff > 2.0 ** -6:     # a few bf16 ulps: summation order differs between plans
                    print(f"  {name} {plan}: WRONG result, max relative difference {diff:.3g}", flush=True)
                    continue
                results.append((us, name))
                row = dict(op="fused" if fused else "rms", rows=rows, hidden=hidden, config=name,
                           plan=str(plan), us=round(us, 3), gbps=round(nbytes / us / 1e3, 1),
                           pct_copy=round(100 * nbytes / us / 1e3 / copy_gbps, 1), max_rel_diff=diff)
                rows_out.append(row)
                if writer:
                    writer.writerow(row)
                    sink.flush()
            _driver.device(0).pdl = PDL[0]
            h = results[0][0]
            best = min(results)
            print(f"{'fused' if fused else 'rms':5s} {rows:6d}x{hidden:<6d} heuristic {h:8.2f} us "
                  f"({nbytes / h / 1e3 / copy_gbps * 100:5.1f}% copy)  best {best[0]:8.2f} us {best[1]}", flush=True)
        del x, r, y, ro
    if sink:
        sink.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
