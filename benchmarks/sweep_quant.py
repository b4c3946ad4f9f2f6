"""Sweep the quantized forms' launch plans per shape, FlashInfer in the same process.

    PYTHONPATH=$PWD python3 benchmarks/sweep_quant.py [--shapes 256x4096,32x7168] [--cases "fused per_group"]
        [--flashinfer .flashinfer/libfiquant.so] [--out FILE.csv]

For each shape and case (benchmarks/quant.py's: bf16 in, FP8 e4m3 out; fused in place) it times
ours under the heuristic's plan and its neighbours (benchmarks/sweep_plans.py's candidates:
threads per row quartered / halved / doubled, streaming, clusters of 1 to 8 blocks for few long
rows), forced through launch_plan's keyword arguments, and FlashInfer's kernel of the case where
it has one, all in graph mode (CUDA events around a graph of many calls, median of the replays).
Each plan's q must agree with the heuristic's on 99.9% of its bytes or more (plans sum the
squares in another order, which moves values that sit on a rounding tie).
"""

import argparse
import csv
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import quant  # noqa: E402 - the benchmark's cases, inputs and FlashInfer calls
from sweep_plans import candidates  # noqa: E402

SHAPES = "1x4096,32x7168,256x4096"
CASES = "fused per_group,fused static,static"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--cases", default=CASES)
    ap.add_argument("--flashinfer", default=None)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    from cupy_rmsnorm import _driver, _launcher
    from cupy_rmsnorm._plan import launch_plan
    from cupy_rmsnorm.bench import timing
    from cupy_rmsnorm.bench.shapes import shape_list

    quant.torch = torch
    lib, why = quant.load_flashinfer(args.flashinfer)
    print(f"flashinfer: {why or 'yes'}", flush=True)
    dev = _driver.device(0)
    runner = timing.TorchRunner()
    bandwidth, _ = timing.copy_bandwidth_gbps()
    timing_args = argparse.Namespace(repeats=args.repeats, target_us=1000.0)
    fields = ["case", "rows", "hidden", "config", "plan", "us", "agree"]
    sink = open(args.out, "w", newline="") if args.out else None
    writer = csv.DictWriter(sink, fieldnames=fields) if sink else None
    if writer:
        writer.writeheader()
    for rows, hidden in shape_list(args.shapes):
        x, r0, w, scale = quant.inputs(rows, hidden)
        for case in args.cases.split(","):
            form, fused = case.split()[-1], case.startswith("fused")
            nbytes = quant.moved_bytes(case, rows, hidden)
            results, want = [], None
            for name, ov in candidates(rows, hidden, fused, dev.sm_count, dev.max_cluster):
                ov = {k: v for k, v in ov.items() if k != "pdl"}
                if name.endswith("no-pdl"):
                    continue
                try:
                    plan = launch_plan(rows, hidden, 2, 8, dev.sm_count, fused, edges=False,
                                       max_cluster=dev.max_cluster, quant=form, **ov)
                    with _launcher.forced_plan(**ov):
                        q = quant.ours(case, x, r0.clone(), w, scale)()[0].view(torch.uint8).clone()
                        with runner.context():
                            fn = quant.ours(case, x, r0.clone(), w, scale)
                        us = quant.measure(runner, fn, nbytes, bandwidth, timing_args)
                except Exception as e:  # noqa: BLE001 - report the plan and go on
                    print(f"  {case} {rows}x{hidden} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                want = q if want is None else want
                agree = float((q == want).float().mean())
                if agree < 0.999:
                    print(f"  {case} {rows}x{hidden} {name}: WRONG, q agrees on {agree:.5f}", flush=True)
                    continue
                results.append((us, name, str(plan), agree))
            if lib is not None:
                with runner.context():
                    fn = quant.flashinfer(lib, case, x, r0.clone(), w, scale)
                if fn is not None:
                    results.append((quant.measure(runner, fn, nbytes, bandwidth, timing_args), "flashinfer", "", None))
            for us, name, plan, agree in results:
                row = dict(case=case, rows=rows, hidden=hidden, config=name, plan=plan, us=round(us, 3),
                           agree=agree)
                print(f"{case:16s} {rows:6d}x{hidden:<6d} {name:24s} {us:8.3f} us  {plan}", flush=True)
                if writer:
                    writer.writerow(row)
                    sink.flush()
            best = min(results)
            print(f"== {case} {rows}x{hidden}: heuristic {results[0][0]:.3f} us, best {best[0]:.3f} {best[1]}",
                  flush=True)
    if sink:
        sink.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
