"""A small, representative grid of backward calls for compute-sanitizer (scripts/sanitize.sh).

    PYTHONPATH=$PWD python3 scripts/sanitize/backward_grid.py [--quick]

Covers every launch shape of cupy_rmsnorm.backward_plan (warp groups sharing a block, a
block per row with the row in registers, the same for no more rows than SMs (one row a
block: the row kernel, a call of one row per dtype, op and layout), a streamed block per row, rows staged in shared
memory by bulk copies where the device has them, one or two at a time) and the dweight
reduction, every dtype, both backward ops (the fused one with and without a residual_out
gradient), both casting modes, weights of x's dtype / float32 / none (offsets 0 and 1),
rows at odd element offsets, strided rows (each row at another alignment), a (tokens,
heads, head_dim) view, and dy off x's alignment (the scalar path). The plans are made for
a device of SANITIZE_SMS multiprocessors, so that with few rows every row group still loops
over several rows (the per-row barriers and the dweight sums carried from row to row are
what racecheck and initcheck must see).

As in forward_grid.py every array is its own cudaMalloc and every view ends where its
allocation ends; the library's outputs and workspace are never initialized, so initcheck
sees a read of an element not yet written. Results are checked against the NumPy
reference on the host. Exit status: 0 all right; 3 a result was wrong; 4 a launch shape
was missed.
"""

import argparse
import itertools
import sys

import cupy as cp
import numpy as np
from forward_grid import DTYPES, MODES, WEIGHTS, make_input, to_device, to_host   # puts tests/ on sys.path

import cupy_rmsnorm as rn
from cupy_rmsnorm import _cache, _driver, _plan

OPS = ("rms_norm", "fused", "fused_dres")
# warp groups; blocks (both widths; 1000: staged pairs of 128 threads for 16-bit); 4096: staged
# (pairs of 256 threads for 16-bit); streamed
HIDDEN = (7, 255, 1000, 4095, 4096, 33001)
LAYOUTS = ("contiguous", "offset_out", "strided", "heads", "mixed")
QUICK_LAYOUTS = ("contiguous", "strided", "mixed")   # contiguous: the staged rows
SANITIZE_SMS = 1                         # plans as for 1 SM: a few blocks, each looping over 8+ rows
ROWS_SHORT, ROWS_LONG = 600, 64          # hidden <= 255 (32 groups of a block need 2+ rows each); longer
SHAPES = {"warp", "block", "row", "stream"}    # and STAGED_SHAPES on sm_90+
STAGED_SHAPES = {"staged", "staged pairs 256x2", "staged pairs 128x1"}   # pairs: threads x steps
# float32 arithmetic in another order than NumPy's; dx is a difference (cancellation): a
# tolerance relative to the magnitudes that meet in it
NOISE = 3e-5
SPACING = {"float32": 2.0 ** -22, "float16": 2.0 ** -9, "bfloat16": 2.0 ** -6}   # two ulps, relative


def launch_shapes(plans):
    return {(f"staged pairs {p.threads_per_row}x{p.vecs_per_thread}" if p.variant == "staged" and p.rows_per_step == 2
             else p.variant if p.variant in ("staged", "row") else "stream" if p.vecs_per_thread == 0
             else "warp" if p.threads_per_row <= _plan.WARP else "block", p.vec) for p in plans}


def close(name, got, want, scale, dtype_name):
    g, w = to_host(got).astype(np.float64), np.asarray(want).astype(np.float64)
    tol = SPACING[dtype_name] * np.abs(w) + NOISE * scale + 1e-30
    ok = g.shape == w.shape and bool(np.all(np.abs(g - w) <= tol))
    if not ok:
        print(f"WRONG {name}: max abs error {np.max(np.abs(g - w)):.3g}", flush=True)
    return ok


def run(rng, op, dtype_name, hidden, layout, rows, mode, wkind, woff):
    dtype = DTYPES[dtype_name]
    x_layout = "contiguous" if layout == "mixed" else layout
    dy_layout = "offset_out" if layout == "mixed" else layout      # one element off x: scalar
    x = make_input(rng, x_layout, rows, hidden, dtype)
    dy = make_input(rng, dy_layout, rows, hidden, dtype)
    dres = make_input(rng, dy_layout, rows, hidden, dtype) if op == "fused_dres" else None
    w = None
    if wkind is not None:
        w = to_device((rng.standard_normal(hidden) * 0.5 + (0.0 if woff else 1.0)).astype(
            dtype if wkind == "same" else np.float32))
    hx, hdy, hw = to_host(x), to_host(dy), (to_host(w) if w is not None else None)
    hdres = to_host(dres) if dres is not None else None
    kwargs = {"weight_offset": woff, "casting_mode": mode}
    name = f"{op} {dtype_name} hidden={hidden} {layout} rows={rows} {mode} weight={wkind}+{woff}"
    if op == "rms_norm":
        dx, dw = rn.rms_norm_backward(dy, x, w, 1e-6, **kwargs)
        want_dx, want_dw = rn.rms_norm_backward_reference(hdy, hx, hw, 1e-6, woff, mode)
    else:
        dx, dw = rn.fused_add_rms_norm_backward(dy, dres, x, w, 1e-6, **kwargs)
        want_dx, want_dw = rn.fused_add_rms_norm_backward_reference(hdy, hdres, hx, hw, 1e-6, woff, mode)
    # magnitudes: |dy| |w'| r and the mean term, per row; |dy xhat| summed over rows for dweight
    xf = hx.astype(np.float64).reshape(-1, hidden)
    r = 1.0 / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + 1e-6)
    wv = 1.0 if hw is None else np.abs(hw.astype(np.float64) + woff)
    dyf = np.abs(hdy.astype(np.float64)).reshape(-1, hidden)
    scale = r * (dyf * wv + np.mean(dyf * wv * np.abs(xf) * r, axis=-1, keepdims=True) * np.abs(xf) * r)
    if hdres is not None:
        scale = scale + np.abs(hdres.astype(np.float64)).reshape(-1, hidden)
    ok = close(name + " dx", dx, want_dx, scale.reshape(hx.shape), dtype_name)
    if hw is not None:
        dw_scale = np.sum(dyf * np.abs(xf) * r, axis=0)
        if mode == "llama" and dtype_name != "float32":
            # xhat is rounded to the dtype before it meets dy; where it lies within float32
            # noise of a rounding midpoint (the GPU's rsqrtf against NumPy's 1 / sqrt) it may
            # round the other way: allow those elements' whole step
            xhat = xf * r
            lo, hi = (np.asarray(xhat * (1 + s), np.float32).astype(dtype).astype(np.float64) for s in (-1e-6, 1e-6))
            dw_scale = dw_scale + np.sum(dyf * np.abs(hi - lo), axis=0) / NOISE
        ok = close(name + " dweight", dw, want_dw, dw_scale, hw.dtype.name) and ok
    return ok


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer layouts (for racecheck)")
    args = parser.parse_args()
    cp.cuda.set_allocator(None)
    rng = np.random.default_rng(0)
    layouts = QUICK_LAYOUTS if args.quick else LAYOUTS
    plans, calls, wrong = [], 0, 0
    device = _driver.device(cp.cuda.Device().id)
    sm_count, device.sm_count = device.sm_count, SANITIZE_SMS
    try:
        with _cache.forced_backward_plan(record=plans):     # no override: the heuristic's plans
            for i, (dtype_name, op, hidden, layout) in enumerate(itertools.product(DTYPES, OPS, HIDDEN, layouts)):
                wkind, woff = WEIGHTS[i % len(WEIGHTS)]
                rows = ROWS_SHORT if hidden <= 255 else ROWS_LONG
                calls += 1
                wrong += not run(rng, op, dtype_name, hidden, layout, rows, MODES[i % 2], wkind, woff)
                if hidden == 1000:       # one row: the row kernel (dweight written directly)
                    calls += 1
                    wrong += not run(rng, op, dtype_name, hidden, layout, 1, MODES[(i + 1) % 2], wkind, woff)
    finally:
        device.sm_count = sm_count
    cp.cuda.Device().synchronize()
    looping = [p for p in plans if p.rows_per_block > p.groups_per_block]
    if not looping:
        print("backward_grid: no block looped over rows", flush=True)
        return 4
    seen = launch_shapes(plans)
    shapes = sorted({s for s, _ in seen})
    print(f"backward_grid: {calls} calls, {wrong} wrong; launch shapes {'/'.join(shapes)}; "
          f"vector widths {sorted({v for _, v in seen})}", flush=True)
    if wrong:
        return 3
    if set(shapes) != SHAPES | (STAGED_SHAPES if device.shared_per_sm else set()):
        print("backward_grid: the grid missed a launch shape", flush=True)
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
