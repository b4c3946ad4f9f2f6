"""A small, representative grid of calls for compute-sanitizer (scripts/sanitize.sh).

    PYTHONPATH=$PWD python3 scripts/sanitize/forward_grid.py [--quick]

Covers every launch shape of cupy_rmsnorm.launch_plan (a warp group per row, a block per
row with the row in registers, a streamed block per row, a cluster of blocks per row),
every dtype, both ops, both casting modes, weights of x's dtype / float32 / none (with
weight_offset 0 and 1), rows starting at odd element offsets (in place, and out of place
into a contiguous output: vector width 1), strided rows, a two-level (tokens, heads,
head_dim) view, and grids split into rows of blocks with surplus blocks (the split made
to happen at 8 blocks instead of 2**31), and forced plans: streamed rows of several epochs
(alone and in a cluster) and a cluster with spare vector slots. Row counts stay small so
racecheck finishes; --quick keeps fewer layouts.

Every array is its own cudaMalloc (CuPy's memory pool is switched off) and every view
ends where its allocation ends (and the unshifted ones start where it starts), so
memcheck sees an access one element past a row or before it; outputs the library
allocates are never initialized, so initcheck sees a read of an element not yet written.
Results are checked against the NumPy reference on the host (no CuPy kernels besides the
library's own and copies, which keeps the sanitizers' reports about our kernel).

Exit status: 0 all results right; 3 a result was wrong; 4 the grid missed a launch shape.
(The sanitizer's --error-exitcode reports what the sanitizer itself finds.)
"""

import argparse
import itertools
import os
import sys

# tests/helpers.py and tests/gpu_reference.py, shared with the GPU tests
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests"))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402
from gpu_reference import to_device, to_host  # noqa: E402
from helpers import DTYPES, HOST_ATOL, HOST_RTOL, MODES, OPS  # noqa: E402

import cupy_rmsnorm as rn  # noqa: E402
from cupy_rmsnorm import _cache, _driver, _plan  # noqa: E402

WEIGHTS = ((None, 0.0), ("same", 0.0), ("float32", 1.0), ("same", 1.0), ("float32", 0.0))
HIDDEN = (1, 7, 1000, 4095, 33001)   # warp groups; block per row (both widths); clusters
LAYOUTS = ("contiguous", "inplace", "offset_inplace", "offset_out", "strided", "heads")
QUICK_LAYOUTS = ("contiguous", "offset_inplace", "heads")
ROWS = 5                  # 5 rows of 33001: a cluster of 8 blocks per row
# (rows, hidden) of the split-grid pass: warp groups, blocks, 70 streamed rows (too many
# rows for clusters), 37 rows in clusters of 2 (streamed for the fused op)
SPLIT_CASES = ((300, 7), (37, 1000), (70, 33001), (37, 33001))
# (rows, hidden, forced plan) of the forced pass: streamed rows of several epochs (32 steps
# each: shared memory reused, the epochs' counter), alone and in a cluster of 2, and a
# cluster with more vector slots than the row needs
FORCED_CASES = ((3, 33001, dict(threads_per_row=64, vecs_per_thread=0)),
                (2, 33001, dict(threads_per_row=64, vecs_per_thread=0, cluster=2)),
                (3, 1000, dict(threads_per_row=64, vecs_per_thread=4, cluster=2)))

SHAPES = {"warp", "block", "stream", "cluster"}


def launch_shapes(plans):
    """(launch shape, vector width) of each plan."""
    seen = set()
    for plan in plans:
        shape = "stream" if plan.vecs_per_thread == 0 else "warp" if plan.threads_per_row <= _plan.WARP else "block"
        seen.add((shape, plan.vec))
        if plan.cluster > 1:
            seen.add(("cluster", plan.vec))
    return seen


def make_input(rng, layout, rows, hidden, dtype):
    """Random data in ``layout``, in an allocation of its own that the view ends at."""
    def data(*shape):
        return (rng.standard_normal(shape) * 3 + 0.25).astype(dtype)

    if layout in ("contiguous", "inplace"):
        return to_device(data(rows, hidden))
    if layout in ("offset_inplace", "offset_out"):     # a flat buffer sliced at offset 1
        return to_device(data(rows * hidden + 1))[1:].reshape(rows, hidden)
    if layout == "strided":                             # rows start 3 elements into a wider buffer
        return to_device(data(rows, hidden + 3))[:, 3:]
    if layout == "heads":                               # heads 2 and 3 of (tokens, 4 heads, head_dim)
        return to_device(data(rows, 4, hidden))[:, 2:]
    raise AssertionError(layout)


def check(name, got, want, dtype_name, exact=False):
    """Compare a GPU result with the host reference: bit for bit, or within tolerance."""
    got, want = to_host(got), np.ascontiguousarray(want)
    g, w = got.astype(np.float64), want.astype(np.float64)
    if exact:
        uint = f"u{got.itemsize}"
        ok = got.shape == want.shape and np.array_equal(got.view(uint), want.view(uint))
    else:
        ok = bool(np.all(np.abs(g - w) <= HOST_ATOL[dtype_name] + HOST_RTOL[dtype_name] * np.abs(w)))
    if not ok:
        print(f"WRONG {name}: max abs error {np.max(np.abs(g - w)):.3g}", flush=True)
    return ok


def run(rng, op, dtype_name, hidden, layout, rows, mode, wkind, woff):
    """One call; True if its results are right."""
    dtype = DTYPES[dtype_name]
    fused = op == "fused_add_rms_norm"
    x = make_input(rng, layout, rows, hidden, dtype)
    res = make_input(rng, layout, rows, hidden, dtype) if fused else None
    w = None
    if wkind is not None:
        w_host = (rng.standard_normal(hidden) * 0.5 + (0.0 if woff else 1.0))
        w = to_device(w_host.astype(dtype if wkind == "same" else np.float32))
    x_host = to_host(x)
    res_host = to_host(res) if fused else None
    w_host = to_host(w) if w is not None else None
    in_place = layout in ("inplace", "offset_inplace")
    kwargs = {"weight_offset": woff, "casting_mode": mode}
    if in_place:
        kwargs["out"] = x
    name = f"{op} {dtype_name} hidden={hidden} {layout} rows={rows} {mode} weight={wkind}+{woff}"
    if fused:
        if in_place:
            kwargs["residual_out"] = res
        y, s = rn.fused_add_rms_norm(x, res, w, 1e-6, **kwargs)
        want_y, want_s = rn.fused_add_rms_norm_reference(x_host, res_host, w_host, 1e-6, woff, mode)
        ok = check(name + " residual_out", s, want_s, dtype_name, exact=True)
        return check(name, y, want_y, dtype_name) and ok
    y = rn.rms_norm(x, w, 1e-6, **kwargs)
    return check(name, y, rn.rms_norm_reference(x_host, w_host, 1e-6, woff, mode), dtype_name)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer layouts (for racecheck)")
    args = parser.parse_args()
    cp.cuda.set_allocator(None)        # one cudaMalloc per array: memcheck sees exact bounds
    plans = []
    with _cache.forced_plan(record=plans):    # no override: the heuristic's plans, recorded
        wrong, calls = run_grid(args)
    cp.cuda.Device().synchronize()
    seen = launch_shapes(plans)
    shapes = sorted({s for s, _ in seen})
    widths = sorted({v for _, v in seen})
    print(f"forward_grid: {calls} calls, {wrong} wrong; launch shapes {'/'.join(shapes)}; "
          f"vector widths {widths}", flush=True)
    if wrong:
        return 3
    if set(shapes) != SHAPES:
        print("forward_grid: the grid missed a launch shape", flush=True)
        return 4
    return 0


def run_grid(args):
    """Every call of the grid; returns (wrong results, calls)."""
    rng = np.random.default_rng(0)
    layouts = QUICK_LAYOUTS if args.quick else LAYOUTS
    calls = wrong = 0
    for i, (dtype_name, op, hidden, layout) in enumerate(itertools.product(DTYPES, OPS, HIDDEN, layouts)):
        wkind, woff = WEIGHTS[i % len(WEIGHTS)]
        calls += 1
        wrong += not run(rng, op, dtype_name, hidden, layout, ROWS, MODES[i % 2], wkind, woff)

    # grids split into rows of 8 blocks, the last row with surplus blocks (or clusters)
    grid_limits = _plan.MAX_GRID_X, _plan.GRID_ROW
    _plan.MAX_GRID_X, _plan.GRID_ROW = 7, 8
    _cache.clear()            # launchers made above keep their plans
    for i, (dtype_name, op, (rows, hidden), layout) in enumerate(
            itertools.product(DTYPES, OPS, SPLIT_CASES, ("contiguous", "offset_inplace"))):
        wkind, woff = WEIGHTS[i % len(WEIGHTS)]
        calls += 1
        wrong += not run(rng, op, dtype_name, hidden, layout, rows, MODES[i % 2], wkind, woff)
    _plan.MAX_GRID_X, _plan.GRID_ROW = grid_limits
    _cache.clear()

    clusters = _driver.device(0).max_cluster > 1
    for i, (dtype_name, op, (rows, hidden, forced), layout) in enumerate(
            itertools.product(DTYPES, OPS, FORCED_CASES, ("contiguous", "offset_inplace"))):
        if forced.get("cluster", 1) > 1 and not clusters:
            continue
        wkind, woff = WEIGHTS[i % len(WEIGHTS)]
        calls += 1
        with _cache.forced_plan(**forced):
            wrong += not run(rng, op, dtype_name, hidden, layout, rows, MODES[i % 2], wkind, woff)
    return wrong, calls


if __name__ == "__main__":
    sys.exit(main())
