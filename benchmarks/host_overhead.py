"""Per-call host cost of cupy_rmsnorm from Python, against torch, in one run.

Decode normalizes one row per sequence, and its kernels take a few microseconds, so
what each call costs the CPU decides the step time. Each case makes CALLS back-to-back
calls on a 1 x 4096 row (bfloat16 unless --dtype says float16) after a warm-up:

- host:  the time to issue the calls, per call (time.perf_counter around the loop);
- total: the same plus the final device synchronize, per call: when the GPU is the
         slower side, this is the GPU-bound rate and host is the queue filling up.

Each figure is the median of REPEATS repeats. torch cases run under
torch.inference_mode(), as decode does. Then the comparisons with torch in pairs
(PAIRS): ours and torch's way of doing the same in alternating blocks of CALLS calls,
ROUNDS rounds (``paired_host_ratio``): the median per-round ratio is the figure to
quote, since one process's times drift by tens of percent. "launch floor" cases call the cached
kernel directly with the arguments the library built (what is left when all of the
library's Python is gone).

    python benchmarks/host_overhead.py --out host_overhead.json

Run from a checkout, it measures that checkout's library (its folder goes first on the path).
"""

import argparse
import contextlib
import functools
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cupy_rmsnorm as rn  # noqa: E402
from cupy_rmsnorm.bench import common, report  # noqa: E402
from cupy_rmsnorm.bench.timing import host_times, paired_host_ratio  # noqa: E402

# (ours, torch's way of doing the same): compared in alternating blocks
PAIRS = (("cupy_rmsnorm rms_norm, torch", "torch F.rms_norm"),
         ("cupy_rmsnorm rms_norm, torch, Parameter weight", "torch F.rms_norm, Parameter weight"),
         ("cupy_rmsnorm rms_norm, torch, out=", "torch F.rms_norm"),
         ("cupy_rmsnorm fused, torch", "torch x + r, then F.rms_norm"),
         ("cupy_rmsnorm fused in place, torch", "torch r.add_(x), then F.rms_norm"))


def launch_floor(call):
    """The library's driver launch of ``call``'s kernel, with the arguments ``call`` built: one
    call run with the launch function spied on. The launch function is a private name of the
    library (``cupy_rmsnorm._driver.launch``); where it is gone the floor is left out."""
    from cupy_rmsnorm import _driver
    raw = _driver.launch
    seen = []

    def spy(*args):
        seen.append(args)
        return raw(*args)

    _driver.launch = spy
    try:
        call()
    finally:
        _driver.launch = raw
    if not seen:
        raise RuntimeError("no launch seen")
    return functools.partial(raw, *seen[-1])


def cupy_cases(rows, hidden, dtype):
    import cupy
    import ml_dtypes

    rng = np.random.default_rng(0)
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    x = cupy.asarray(rng.standard_normal((rows, hidden)).astype(dt))
    r = cupy.asarray(rng.standard_normal((rows, hidden)).astype(dt))
    w = cupy.asarray((1 + 0.1 * rng.standard_normal(hidden)).astype(dt))
    out, res_out = cupy.empty_like(x), cupy.empty_like(x)
    cases = {
        "cupy_rmsnorm rms_norm, CuPy": functools.partial(rn.rms_norm, x, w),
        "cupy_rmsnorm rms_norm, CuPy, out=": functools.partial(rn.rms_norm, x, w, out=out),
        "cupy_rmsnorm fused, CuPy": functools.partial(rn.fused_add_rms_norm, x, r, w),
        "cupy_rmsnorm fused, CuPy, out= residual_out=": functools.partial(
            rn.fused_add_rms_norm, x, r, w, out=out, residual_out=res_out),
    }
    try:
        cases["launch floor: cached kernel, CuPy"] = launch_floor(cases["cupy_rmsnorm rms_norm, CuPy, out="])
    except Exception as e:  # noqa: BLE001 - the floor is informative, not essential
        print(f"(no CuPy launch floor: {type(e).__name__}: {e})")
    return cases


def torch_cases(rows, hidden, dtype):
    import torch
    import torch.nn.functional as F

    gen = torch.Generator(device="cuda").manual_seed(0)
    dt = getattr(torch, dtype)
    x = torch.randn(rows, hidden, generator=gen, device="cuda").to(dt)
    r = torch.randn(rows, hidden, generator=gen, device="cuda").to(dt)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen, device="cuda")).to(dt)
    out = torch.empty_like(x)
    with torch.inference_mode(False):        # a model's weight: a plain tensor that requires grad
        param = torch.nn.Parameter(w.clone())
    xi, ri = x.clone(), r.clone()   # for the in-place forms; their values drift, the cost does not

    def torch_add_norm():
        return F.rms_norm(x + r, (hidden,), w, 1e-6)

    def torch_add_inplace_norm():
        ri.add_(xi)
        return F.rms_norm(ri, (hidden,), w, 1e-6)

    cases = {
        "cupy_rmsnorm rms_norm, torch": functools.partial(rn.rms_norm, x, w),
        "cupy_rmsnorm rms_norm, torch, out=": functools.partial(rn.rms_norm, x, w, out=out),
        "torch F.rms_norm": functools.partial(F.rms_norm, x, (hidden,), w, 1e-6),
        "cupy_rmsnorm rms_norm, torch, Parameter weight": functools.partial(rn.rms_norm, x, param),
        "torch F.rms_norm, Parameter weight": functools.partial(F.rms_norm, x, (hidden,), param, 1e-6),
        "cupy_rmsnorm fused, torch": functools.partial(rn.fused_add_rms_norm, x, r, w),
        "cupy_rmsnorm fused in place, torch": functools.partial(
            rn.fused_add_rms_norm, xi, ri, w, out=xi, residual_out=ri),
        "torch x + r, then F.rms_norm": torch_add_norm,
        "torch r.add_(x), then F.rms_norm": torch_add_inplace_norm,
    }
    try:
        cases["launch floor: cached kernel, torch stream"] = launch_floor(cases["cupy_rmsnorm rms_norm, torch, out="])
    except Exception as e:  # noqa: BLE001
        print(f"(no torch launch floor: {type(e).__name__}: {e})")
    return cases


def main(argv=None):
    p = argparse.ArgumentParser(description="Per-call host cost of cupy_rmsnorm vs torch (back-to-back calls).")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument("--calls", type=int, default=2000, help="calls per timed repeat")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--rounds", type=int, default=20, help="alternating rounds per pair (0: no pairs)")
    p.add_argument("--out", help="write the results as JSON to this path")
    args = p.parse_args(argv)

    from cupy_rmsnorm.bench import timing
    reason = timing.gpu_missing()
    if reason:
        sys.exit(f"host_overhead: needs a CUDA GPU ({reason})")
    import cupy

    def sync():
        cupy.cuda.Device().synchronize()

    device = common.gpu_device()
    groups = [("cupy", cupy_cases, contextlib.nullcontext)]
    why = common.torch_missing()
    if why is None:
        import torch
        groups.append(("torch", torch_cases, torch.inference_mode))
    else:
        print(f"(torch cases skipped: {why})")

    results, paired = [], []
    for group, make_cases, context in groups:
        try:
            with context():
                cases = make_cases(args.rows, args.hidden, args.dtype)
        except Exception as e:  # noqa: BLE001 - report and go on with the other group
            results.append({"case": f"({group} setup)", "error": f"{type(e).__name__}: {e}"})
            continue
        for name, fn in cases.items():
            try:
                with context():
                    m = host_times(fn, sync, args.calls, args.repeats, args.warmup)
                results.append({"case": name, **m})
            except Exception as e:  # noqa: BLE001
                results.append({"case": name, "error": f"{type(e).__name__}: {e}"})
        for mine, theirs in PAIRS if args.rounds > 0 else ():
            if mine not in cases or theirs not in cases:
                continue
            try:
                with context():
                    m = paired_host_ratio(cases[mine], cases[theirs], sync, args.calls, args.rounds, args.warmup)
                paired.append({"case": mine, "against": theirs, **m})
            except Exception as e:  # noqa: BLE001
                paired.append({"case": mine, "against": theirs, "error": f"{type(e).__name__}: {e}"})

    baseline = next((r["host_us"] for r in results if r["case"] == "torch F.rms_norm" and "host_us" in r), None)
    print(f"\nhost overhead per call, {args.rows} x {args.hidden} {args.dtype}, {args.calls} back-to-back calls, "
          f"median of {args.repeats}; {device['gpu']}")
    print(f"{'case':<48} {'host us':>9} {'total us':>9} {'host / F.rms_norm':>18}")
    for r in results:
        if "error" in r:
            print(f"{r['case']:<48} error: {r['error']}")
            continue
        ratio = f"{r['host_us'] / baseline:.2f}" if baseline else "-"
        print(f"{r['case']:<48} {r['host_us']:>9.2f} {r['total_us']:>9.2f} {ratio:>18}")

    if paired:
        print(f"\nin pairs: alternating blocks of {args.calls} calls, {args.rounds} rounds; "
              f"ratio = ours / torch's per round")
        print(f"{'case':<40} {'against':<34} {'ours us':>8} {'theirs us':>9} {'ratio median':>12} {'min-max':>12}")
        for r in paired:
            if "error" in r:
                print(f"{r['case']:<40} {r['against']:<34} error: {r['error']}")
                continue
            print(f"{r['case']:<40} {r['against']:<34} {r['host_us_median']:>8.2f} {r['other_host_us_median']:>9.2f} "
                  f"{r['ratio_median']:>12.3f} {r['ratio_min']:>5.3f}-{r['ratio_max']:.3f}")

    if args.out:
        meta = common.run_metadata("host_overhead", device, shape=[args.rows, args.hidden], dtype=args.dtype,
                                   calls=args.calls, repeats=args.repeats, warmup=args.warmup, rounds=args.rounds)
        report.write_json(args.out, {"meta": meta, "results": results, "paired": paired})
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
