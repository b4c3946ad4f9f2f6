"""A/B: the GPU time of two library trees on one machine, in alternating processes.

    PYTHONPATH=$PWD python3 benchmarks/ab_trees.py --base OLD_TREE [--rounds 2] [--shapes 4096x4096,...]
        [--dtypes bfloat16,float16] [--ops rms,fused] [--out FILE]

A is the library in OLD_TREE (a checkout or `git archive` of it), B the one this script sits in.
Processes run A B A B ... (``--rounds`` pairs), each pinned to one CPU and importing one tree;
each times every case in graph mode (CALLS calls captured in a CUDA graph, the median of
REPEATS replays). The backward: rms ``rms_norm_backward(dy, x, w)``, fused
``fused_add_rms_norm_backward(dy, d_residual_out, s, w)``. The quantized forms (FP8 e4m3):
``q:static``, ``q:per_token``, ``q:per_group`` for ``rms_norm_quant(x, w)`` and ``fq:...`` for
``fused_add_rms_norm_quant(x, r, w, residual_out=r)`` (in place, as serving runs it). Weight of
x's dtype. Per case it prints A's and B's times (one per round), B / A of the medians, each
side's plan, and whether the outputs have the same bits on both sides (a SHA-256 of their
bytes: dx and dweight; q and the scales).
"""

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys

SHAPES = "1x4096,1024x4096,2048x4096,4096x4096,16384x4096,4096x8192,16384x8192,4096x2048,4096x1024"
CALLS, REPEATS = 50, 7
HERE = os.path.dirname(os.path.abspath(__file__))


def worker(shapes, dtypes, ops):
    """One process: every case of this tree's library, as JSON lines on stdout."""
    import cupy as cp
    import ml_dtypes
    import numpy as np

    import cupy_rmsnorm as rn
    from cupy_rmsnorm import _launcher
    from cupy_rmsnorm.bench import timing
    from cupy_rmsnorm.bench.shapes import shape_list

    rng = cp.random.default_rng(0)
    scale = cp.full((1,), 0.02, dtype=cp.float32)

    def call(op, x, dy, dres, w):
        """(the timed call, the call whose outputs are hashed, how plans are recorded)"""
        if op in ("rms", "fused"):
            fn = (lambda: rn.rms_norm_backward(dy, x, w)) if op == "rms" else \
                (lambda: rn.fused_add_rms_norm_backward(dy, dres, x, w))
            return fn, fn, _launcher.forced_backward_plan
        kind, form = op.split(":")
        kw = {"scale": scale} if form == "static" else {"group_size": 128} if form == "per_group" else {}
        if kind == "q":
            fn = lambda: rn.rms_norm_quant(x, w, **kw)  # noqa: E731
            return fn, fn, _launcher.forced_plan
        r = dres.copy()     # updated in place by every call; the hashed call starts from dres
        fn = lambda: rn.fused_add_rms_norm_quant(x, r, w, residual_out=r, **kw)  # noqa: E731
        return fn, lambda: rn.fused_add_rms_norm_quant(x, dres.copy(), w, **kw), _launcher.forced_plan

    for dtype in dtypes:
        dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
        for rows, hidden in shape_list(shapes):
            make = lambda: rng.standard_normal((rows, hidden), dtype=cp.float32).astype(dt)  # noqa: E731
            x, dy, dres = make(), make(), make()
            w = (1 + 0.1 * rng.standard_normal(hidden, dtype=cp.float32)).astype(dt)
            for op in ops:
                fn, hashed, recording = call(op, x, dy, dres, w)
                plans = []
                with recording(record=plans):
                    outs = hashed()
                digest = hashlib.sha256(b"".join(cp.asnumpy(o).tobytes() for o in outs)).hexdigest()[:16]
                us = timing.graph_us(fn, CALLS, REPEATS)
                print(json.dumps({"case": f"{dtype} {op} {rows}x{hidden}", "us": us, "bits": digest,
                                  "plan": str(plans[-1]) if plans else ""}), flush=True)


def run_side(tree, args, cpu):
    env = dict(os.environ, PYTHONPATH=tree, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, os.path.join(HERE, "ab_trees.py"), "--worker", "--shapes", args.shapes,
           "--dtypes", args.dtypes, "--ops", args.ops]
    if hasattr(os, "sched_setaffinity"):
        cmd = ["taskset", "-c", str(cpu)] + cmd
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"{tree}: exit {out.returncode}\n{out.stderr[-3000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", help="the A tree (its cupy_rmsnorm/ and kernels/)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--ops", default="rms,fused", help="rms, fused, q:FORM, fq:FORM")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.shapes, args.dtypes.split(","), args.ops.split(","))
    if not args.base:
        ap.error("--base is required")
    sides = {"A": os.path.abspath(args.base), "B": os.path.dirname(HERE)}
    runs = {"A": [], "B": []}
    for r in range(args.rounds):
        for name in ("A", "B"):
            runs[name].append(run_side(sides[name], args, cpu=2 + r % 2))
            print(f"round {r + 1} {name} done", flush=True)
    lines = [f"# A = {sides['A']}, B = {sides['B']}; graph mode, {CALLS} calls a graph, median of {REPEATS} replays; "
             f"processes A B x {args.rounds}"]
    ratios = []
    for i, first in enumerate(runs["A"][0]):
        a = [run[i]["us"] for run in runs["A"]]
        b = [run[i]["us"] for run in runs["B"]]
        ratio = statistics.median(b) / statistics.median(a)
        ratios.append(ratio)
        same = "same bits" if runs["A"][0][i]["bits"] == runs["B"][0][i]["bits"] else "BITS DIFFER"
        lines.append(f"{first['case']:28s} A {' '.join(f'{u:8.2f}' for u in a)}  B {' '.join(f'{u:8.2f}' for u in b)}"
                     f"  B/A {ratio:.3f}  {same}")
        pa, pb = first["plan"], runs["B"][0][i]["plan"]
        lines.append(f"    plan {pb}" if pa == pb else f"    plan A {pa}\n    plan B {pb}")
    lines.append(f"geomean B/A {statistics.geometric_mean(ratios):.3f}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
