"""GPU time against the number of rows at one hidden size: the quantized forms and the copy of
their bytes, to split a form's time into a cost per row and a cost per call.

    PYTHONPATH=$PWD python3 benchmarks/rows_scan.py [--hidden 4096] [--rows 2048,4096,...]
        [--cases static,per_token,per_group,copy] [--fit-from 8192] [--out FILE]

Each case is benchmarks/quant.py's (bf16 in, FP8 e4m3 out, graph mode); ``copy`` is its device
copy of the per-token form's bytes. Prints one line per row count, then for each case a
least-squares line through the row counts from --fit-from up: microseconds per 1000 rows and
at zero rows (the part of the time that does not grow with the rows). The default rows are
2^k and 3 x 2^k: torch's copy ran at two thirds of its speed at some other counts
(benchmarks/NOTES.md 31).
"""

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

ROWS = "2048,3072,4096,6144,8192,12288,16384,24576,32768"
CASES = "static,per_token,per_group,copy"


def parse_args(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--rows", default=ROWS)
    ap.add_argument("--cases", default=CASES)
    ap.add_argument("--fit-from", type=int, default=8192, help="the fit's smallest row count")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.rows = [int(r) for r in args.rows.split(",")]
    args.cases = args.cases.split(",")
    bad = set(args.cases) - {"static", "per_token", "per_group", "copy"}
    if bad:
        ap.error(f"unknown cases {sorted(bad)}")
    return args


def fit_line(points):
    """Least squares through (rows, us) points: (us per row, us at zero rows)."""
    n = len(points)
    if n < 2:
        raise ValueError(f"a line needs two points or more, got {n}")
    mx = sum(r for r, _ in points) / n
    my = sum(u for _, u in points) / n
    sxx = sum((r - mx) ** 2 for r, _ in points)
    if sxx == 0:
        raise ValueError("a line needs two different row counts")
    slope = sum((r - mx) * (u - my) for r, u in points) / sxx
    return slope, my - slope * mx


def main(argv=None):
    args = parse_args(argv)
    from cupy_rmsnorm.bench import peers, timing
    why = timing.gpu_missing() or peers.torch_missing()
    if why:
        print(f"rows scan: no GPU run ({why})")
        return 2
    import torch

    import quant
    quant.torch = torch
    runner = timing.TorchRunner()
    bandwidth, _ = timing.copy_bandwidth_gbps()
    timing_args = argparse.Namespace(repeats=args.repeats, target_us=1000.0)
    lines, times = [], {case: [] for case in args.cases}
    for rows in args.rows:
        x, r, w, scale = quant.inputs(rows, args.hidden)
        cells = []
        for case in args.cases:
            nbytes = quant.moved_bytes("per_token" if case == "copy" else case, rows, args.hidden)
            with runner.context():
                fn = quant.device_copy(nbytes) if case == "copy" else quant.ours(case, x, r, w, scale)
            us = quant.measure(runner, fn, nbytes, bandwidth, timing_args)
            times[case].append((rows, us))
            cells.append(f"{case}={us:.3f}")
        lines.append(f"{rows}x{args.hidden} " + " ".join(cells))
        print(lines[-1], flush=True)
    for case, points in times.items():
        tail = [(r, u) for r, u in points if r >= args.fit_from]
        if len(tail) >= 2:
            per_row, at_zero = fit_line(tail)
            lines.append(f"fit {case} (rows >= {args.fit_from}): {1000 * per_row:.3f} us per 1000 rows, "
                         f"{at_zero:.2f} us at zero rows")
            print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
