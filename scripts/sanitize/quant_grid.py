"""A small, representative grid of quantized calls for compute-sanitizer (scripts/sanitize.sh,
``SANITIZE_GRIDS=quant_grid``).

    PYTHONPATH=$PWD python3 scripts/sanitize/quant_grid.py [--quick]

Covers the quantized forms (static, per-token, per-128-group) of both ops over every launch
shape of launch_plan (warp groups, a block per row in registers, streamed, clusters), the
per-group reductions past a warp (vector width 1: a group spans 128 threads) and over several
vectors of one thread (short rows at width 1), e4m3 / e5m2 / int8 by turns, every dtype by
turns, weights of x's dtype / float32 / none, rows at odd element offsets (q at x's alignment,
or apart: width 1), strided rows, (tokens, heads, head_dim) views, given q / scales_out /
in-place residual, and grids split into rows of blocks (at 8 blocks instead of 2**31).

As in forward_grid.py every array is its own cudaMalloc, every view ends where its allocation
ends, the library's own outputs are never initialized, and results are checked on the host
against the NumPy reference (within one FP8 step at near ties: tests/gpu_reference.py's
comparisons, as tests/gpu/test_gpu_quant.py checks).
Exit status: 0 all right; 3 a result was wrong; 4 a launch shape was missed.
"""

import argparse
import itertools
import sys

import cupy as cp
import numpy as np
from forward_grid import launch_shapes, make_input   # puts tests/ on sys.path
from gpu_reference import compare_q, compare_scales, to_device, to_host, tolerances
from helpers import DTYPES

import cupy_rmsnorm as rn
from cupy_rmsnorm import _cache, _plan
from cupy_rmsnorm import _reference as R
from cupy_rmsnorm.ops.quant import reference as quant_reference

FORMS = ("static", "per_token", "per_group")
QUANT = ("float8_e4m3fn", "float8_e5m2", "int8")
OPS = ("rms_norm_quant", "fused_add_rms_norm_quant")
HIDDEN = {"static": (7, 1000, 4095, 33001), "per_token": (1, 7, 1000, 4095, 33001),
          "per_group": (128, 1024, 4096, 33024)}
LAYOUTS = ("contiguous", "offset", "offset_given", "strided", "heads")
QUICK_LAYOUTS = ("offset", "heads")
WEIGHTS = ((None, 0.0), ("same", 0.0), ("float32", 1.0), ("same", 1.0), ("float32", 0.0))
ROWS = 5                  # 5 rows of 33001: a cluster of 8 blocks per row
# (rows, hidden) of the split-grid pass: warp groups, a streamed row, clusters of 2; groups at
# width 1 over two warps (300 rows of 128)
SPLIT_CASES = ((300, 128), (70, 33024), (37, 4096))
SHAPES = {"warp", "block", "stream", "cluster"}


def run(rng, op, dtype_name, form, quant_dtype, hidden, layout, rows, mode, wkind, woff):
    """One call; True if its results are right."""
    dtype = DTYPES[dtype_name]
    fused = op == OPS[1]
    x_layout = "offset_inplace" if layout.startswith("offset") else layout
    x = make_input(rng, x_layout, rows, hidden, dtype)
    res = make_input(rng, x_layout, rows, hidden, dtype) if fused else None
    w = None
    if wkind is not None:
        w = to_device((rng.standard_normal(hidden) * 0.5 + (0.0 if woff else 1.0))
                      .astype(dtype if wkind == "same" else np.float32))
    x_h, r_h = to_host(x), (to_host(res) if fused else None)
    w_h = to_host(w) if w is not None else None
    scale_h = np.array([2.0 / quant_reference.quant_max(quant_dtype)], np.float32) if form == "static" else None
    group = 128 if form == "per_group" else None
    kw = dict(scale=cp.asarray(scale_h) if scale_h is not None else None, group_size=group, quant_dtype=quant_dtype,
              weight_offset=woff, casting_mode=mode)
    store = "int8" if quant_dtype == "int8" else "uint8"
    if layout == "offset_given":     # q one byte into its allocation, like x: x's alignment
        kw["out"] = cp.empty(rows * hidden + 1, store)[1:].reshape(rows, hidden)
        if form != "static":
            shape = x.shape[:-1] + ((hidden // 128) if group else 1,)
            kw["scales_out"] = cp.empty(shape, cp.float32)
        if fused:
            kw["residual_out"] = res
    name = f"{op} {form} {quant_dtype} {dtype_name} hidden={hidden} {layout} rows={rows} {mode} weight={wkind}+{woff}"
    ref_kw = dict(scale=scale_h, group_size=group, quant_dtype=quant_dtype)
    if fused:
        q, s, scales = rn.fused_add_rms_norm_quant(x, res, w, 1e-6, **kw)
        _, want_s, want_scales = rn.fused_add_rms_norm_quant_reference(x_h, r_h, w_h, 1e-6, woff, mode, **ref_kw)
        if not np.array_equal(to_host(s).view(f"u{want_s.itemsize}"), want_s.view(f"u{want_s.itemsize}")):
            print(f"WRONG {name}: residual_out", flush=True)
            return False
    else:
        q, scales = rn.rms_norm_quant(x, w, 1e-6, **kw)
        _, want_scales = rn.rms_norm_quant_reference(x_h, w_h, 1e-6, woff, mode, **ref_kw)
        want_s = x_h
    y = R._normalized(want_s, w_h, 1e-6, woff, mode)
    near, rel = tolerances(mode, dtype_name)
    if form == "static":
        got_scales = scale_h.reshape(())
    else:
        msg = compare_scales(scales, want_scales, False, rel)
        if msg:
            print(f"WRONG {name}: {msg}", flush=True)
            return False
        got_scales = cp.asnumpy(cp.ascontiguousarray(scales))
    got = cp.asnumpy(cp.ascontiguousarray(q)).view(np.uint8)
    if group:
        y = y.reshape(y.shape[:-1] + (hidden // 128, 128))
        got_scales = got_scales[..., None]
    msg = compare_q(got.reshape(y.shape), y, got_scales, quant_dtype, False, near)
    if msg:
        print(f"WRONG {name}: {msg}", flush=True)
    return msg is None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer layouts (for racecheck)")
    args = parser.parse_args()
    cp.cuda.set_allocator(None)        # one cudaMalloc per array: memcheck sees exact bounds
    plans = []
    with _cache.forced_plan(record=plans):
        wrong, calls = run_grid(args)
    cp.cuda.Device().synchronize()
    seen = launch_shapes(plans)
    shapes = sorted({s for s, _ in seen})
    widths = sorted({v for _, v in seen})
    print(f"quant_grid: {calls} calls, {wrong} wrong; launch shapes {'/'.join(shapes)}; "
          f"vector widths {widths}", flush=True)
    if wrong:
        return 3
    if set(shapes) != SHAPES:
        print("quant_grid: the grid missed a launch shape", flush=True)
        return 4
    return 0


def run_grid(args):
    rng = np.random.default_rng(0)
    layouts = QUICK_LAYOUTS if args.quick else LAYOUTS
    dtypes = list(DTYPES)
    calls = wrong = 0
    for i, (form, op, layout) in enumerate(itertools.product(FORMS, OPS, layouts)):
        for j, hidden in enumerate(HIDDEN[form]):
            n = i + j
            wkind, woff = WEIGHTS[n % 5]
            calls += 1
            wrong += not run(rng, op, dtypes[n % 3], form, QUANT[n % 3], hidden, layout, ROWS,
                             ("fp32", "llama")[n % 2], wkind, woff)
    grid_limits = _plan.MAX_GRID_X, _plan.GRID_ROW
    _plan.MAX_GRID_X, _plan.GRID_ROW = 7, 8
    _cache.clear()
    for i, (form, op, (rows, hidden)) in enumerate(itertools.product(FORMS, OPS, SPLIT_CASES)):
        wkind, woff = WEIGHTS[i % 5]
        calls += 1
        wrong += not run(rng, op, dtypes[i % 3], form, QUANT[i % 3], hidden, "offset" if i % 2 else "contiguous",
                         rows, ("fp32", "llama")[i % 2], wkind, woff)
    _plan.MAX_GRID_X, _plan.GRID_ROW = grid_limits
    _cache.clear()
    return wrong, calls


if __name__ == "__main__":
    sys.exit(main())
