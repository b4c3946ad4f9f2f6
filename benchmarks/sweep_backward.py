"""Sweep the backward's plans per shape (graph-mode GPU time) to justify backward_plan.

    PYTHONPATH=$PWD python3 benchmarks/sweep_backward.py --out results/sweep_backward.csv

For each shape (bf16, weight of x's dtype) and op (rms_norm's backward; the fused op's with a
residual_out gradient) it times the heuristic's plan, the register kernel's plan and
neighbours of it (threads per row halved or quartered, vectors per thread following), and staged plans
(rows in shared memory) of 128..512 threads with 2 and 4 stages, a row at a time and two at a time, forced through
backward_plan's keyword arguments. Every plan's dx must equal the register plan's within a
few ulps and its dweight within float32 reordering noise. Bytes moved: dy, x (and
d_residual_out) read, dx written, weight read and written: the copy column is that at the
device-copy bandwidth measured first.
"""

import argparse
import csv

import cupy as cp
import ml_dtypes
import numpy as np

import cupy_rmsnorm as rn
from cupy_rmsnorm import _driver, _launcher
from cupy_rmsnorm._plan import backward_geometry, staged_geometry
from cupy_rmsnorm.bench import timing
from cupy_rmsnorm.bench.shapes import shape_list

SHAPES = [(1, 4096), (32, 4096), (256, 4096), (1024, 4096), (4096, 4096), (16384, 4096),
          (256, 8192), (4096, 8192), (16384, 8192), (4096, 1024), (4096, 2048), (4096, 16384),
          (16384, 2048), (4096, 5120)]
CALLS, REPEATS = 50, 7


def candidates(hidden, dev):
    out = [("registers", {"stages": 0}), ("heuristic", {})]     # the first is the reference
    g, nv = backward_geometry(hidden, 8)
    if nv:
        for g2, nv2 in ((g // 2, nv * 2), (g // 4, nv * 4)):
            if g2 > 32 and nv2 <= 4:
                out.append((f"registers/G{g2}/NV{nv2}", {"threads_per_row": g2, "vecs_per_thread": nv2, "stages": 0}))
    if dev.shared_per_sm:
        n = hidden // 8
        sg, _ = staged_geometry(hidden, 8)
        for g2 in sorted({sg, sg // 2, sg // 4, 512, 256}, reverse=True):
            nv2 = -(-n // g2) if g2 > 32 else 99
            if nv2 > 4 or g2 < 64:
                continue
            for k in (2, 4):
                out.append((f"staged/G{g2}/NV{nv2}/S{k}", {"threads_per_row": g2, "vecs_per_thread": nv2, "stages": k}))
        # rows one at a time, and two at a time at the staged geometry and at half its threads
        # (twice the steps)
        out.append(("staged/R1", {"rows_per_step": 1}))
        for g2, stages in ((sg, (4, 8)), (sg // 2, (4, 6))):
            nv2 = -(-n // g2)
            if g2 > 32 and nv2 <= 4:
                for k in stages:
                    out.append((f"staged/G{g2}/NV{nv2}/R2/S{k}", {"threads_per_row": g2, "vecs_per_thread": nv2,
                                                                 "rows_per_step": 2, "stages": k}))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default=None, help="e.g. 4096x4096,1x8192")
    args = ap.parse_args()
    shapes = SHAPES if not args.shapes else shape_list(args.shapes)
    dev = _driver.device(0)
    print(f"device: {dev}", flush=True)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    copy_gbps, _ = timing.copy_bandwidth_gbps()
    print(f"copy bandwidth {copy_gbps:.0f} GB/s", flush=True)
    fields = ["op", "rows", "hidden", "config", "plan", "us", "copy_us", "ratio_copy", "dx_ulps", "dw_rel"]
    sink = open(args.out, "w", newline="") if args.out else None
    writer = csv.DictWriter(sink, fieldnames=fields) if sink else None
    if writer:
        writer.writeheader()
    rng = cp.random.default_rng(0)
    for rows, hidden in shapes:
        x = rng.standard_normal((rows, hidden), dtype=cp.float32).astype(bf16)
        dy = rng.standard_normal((rows, hidden), dtype=cp.float32).astype(bf16)
        dres = rng.standard_normal((rows, hidden), dtype=cp.float32).astype(bf16)
        w = (1 + 0.1 * rng.standard_normal(hidden, dtype=cp.float32)).astype(bf16)
        for op in ("rms", "fused"):
            nbytes = (4 if op == "fused" else 3) * x.nbytes + 2 * w.nbytes
            if op == "rms":
                fn = lambda: rn.rms_norm_backward(dy, x, w)  # noqa: E731
            else:
                fn = lambda: rn.fused_add_rms_norm_backward(dy, dres, x, w)  # noqa: E731
            want = None
            results = []
            for name, ov in candidates(hidden, dev):
                plans = []
                try:
                    with _launcher.forced_backward_plan(record=plans, **ov):
                        dx, dw = fn()
                        us = timing.graph_us(fn, CALLS, REPEATS)
                except Exception as e:  # noqa: BLE001 - report the config and go on
                    print(f"  {op} {rows}x{hidden} {name}: {type(e).__name__}: {e}", flush=True)
                    continue
                dxf, dwf = dx.astype(cp.float32), dw.astype(cp.float32)
                if want is None:
                    want = (dxf, dwf)
                ulp = float(cp.abs(dxf - want[0]).max() / max(float(cp.abs(want[0]).max()), 1e-30)) * 128
                dwr = float(cp.abs(dwf - want[1]).max() / max(float(cp.abs(want[1]).max()), 1e-30))
                bad = ulp > 4 or dwr > 1e-2
                plan = plans[-1] if plans else None
                row = dict(op=op, rows=rows, hidden=hidden, config=name + (" WRONG" if bad else ""), plan=str(plan),
                           us=round(us, 3), copy_us=round(nbytes / copy_gbps / 1e3, 3),
                           ratio_copy=round(us / (nbytes / copy_gbps / 1e3), 3), dx_ulps=round(ulp, 2),
                           dw_rel=f"{dwr:.2e}")
                if writer:
                    writer.writerow(row)
                    sink.flush()
                results.append((us, name))
                print(f"  {op} {rows}x{hidden} {name:28s} {us:9.2f} us  x{row['ratio_copy']:.2f} copy"
                      f"{'  WRONG' if bad else ''}  {plan.variant if plan else ''} grid={plan.grid if plan else ''}"
                      f" stages={plan.stages if plan else ''} rows/step={plan.rows_per_step if plan else ''}",
                      flush=True)
            if results:
                best = min(results)
                heur = [u for u, n in results if n == "heuristic"]
                print(f"{op} {rows}x{hidden}: best {best[1]} {best[0]:.2f} us; heuristic {heur[0] if heur else 'n/a'}",
                      flush=True)
    if sink:
        sink.close()


if __name__ == "__main__":
    main()
