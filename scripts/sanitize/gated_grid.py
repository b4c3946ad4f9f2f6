"""A small, representative grid of gated RMSNorm and mixed-precision calls for
compute-sanitizer (scripts/sanitize.sh).

    PYTHONPATH=$PWD python3 scripts/sanitize/gated_grid.py [--quick]

Gated: rms_norm_gated and its backward over every dtype, both orders and activations, group
sizes, groups short enough for warp groups, block rows, rows too long for registers
(streamed), vector widths down to one element (odd offsets), a gate that is a strided view
of a packed buffer, weights of x's dtype / float32 / none, an out_dtype; the backward's
plans made for a device of one multiprocessor, so that every block loops over several rows
and several chunks' partial rows are reduced. Mixed precision: rms_norm with an out_dtype,
fused_add_rms_norm with a float32 residual stream (in place too) at odd offsets, and the
mixed backward. Every array is its own cudaMalloc ending where its view ends, outputs are
never initialized (initcheck sees a read of an unwritten element); results are checked
against the NumPy reference on the host. Exit status: 0 all right; 3 a result was wrong; 4 a
launch shape was missed.
"""

import argparse
import itertools
import sys

import cupy as cp
import ml_dtypes
import numpy as np

import cupy_rmsnorm as rn
from cupy_rmsnorm import _cache, _driver

DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
HIDDEN = (64, 255, 1024, 8192, 40000)          # warp groups, vector width 1, blocks, streamed
QUICK_HIDDEN = (64, 1024, 40000)
GROUPS = {64: (None,), 255: (None,), 1024: (None, 256), 8192: (None, 1024), 40000: (None,)}
LAYOUTS = ("contiguous", "packed", "offset")
WEIGHTS = (("x", 0.0), ("float32", 1.0), (None, 0.0))
ROWS = {64: 300, 255: 40, 1024: 24, 8192: 6, 40000: 2}
RTOL = {"float32": 3e-5, "float16": 2.0 ** -9, "bfloat16": 2.0 ** -6}


def device_copy(a):
    """``a`` (host) in a cudaMalloc of its own that ends where the array ends."""
    return cp.asarray(np.ascontiguousarray(a))


def place(host, layout):
    """x-shaped device views: contiguous; 'packed' (a view into a wider buffer, the gate of a
    projection); 'offset' (rows one element past their allocation's start: vector width 1)."""
    rows, hidden = host.shape
    if layout == "contiguous":
        return device_copy(host)
    pad = 3 * hidden if layout == "packed" else 1
    buf = np.zeros((rows, hidden + pad), host.dtype)
    buf[:, pad:] = host
    return device_copy(buf)[:, pad:]


def close(got, want, dtype_name):
    g = cp.asnumpy(got).astype(np.float64)
    w = np.asarray(want).astype(np.float64)
    tol = RTOL[dtype_name] * np.abs(w) + RTOL[dtype_name] * max(np.abs(w).max(), 1e-30) * 0.25
    return g.shape == w.shape and bool(np.all(np.abs(g - w) <= tol))


def gated_case(rng, dtype_name, hidden, group_size, layout, nbg, act, weight, offset, out_dtype):
    dt = DTYPES[dtype_name]
    rows = ROWS[hidden]
    xh = rng.standard_normal((rows, hidden)).astype(np.float32).astype(dt)
    zh = rng.standard_normal((rows, hidden)).astype(np.float32).astype(dt)
    dyh = rng.standard_normal((rows, hidden)).astype(np.float32).astype(dt if out_dtype is None else DTYPES[out_dtype])
    wh = None if weight is None else (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32).astype(
        dt if weight == "x" else np.float32)
    kw = dict(group_size=group_size, norm_before_gate=nbg, activation=act, weight_offset=offset)
    x, z = place(xh, layout), place(zh, "packed" if layout == "contiguous" else layout)
    w = None if wh is None else device_copy(wh)
    y = rn.rms_norm_gated(x, z, w, out_dtype=out_dtype, **kw)
    ok = close(y, rn.rms_norm_gated_reference(xh, zh, wh, out_dtype=out_dtype, **kw), out_dtype or dtype_name)
    dx, dz, dw = rn.rms_norm_gated_backward(device_copy(dyh), x, z, w, **kw)
    rdx, rdz, rdw = rn.rms_norm_gated_backward_reference(dyh, xh, zh, wh, **kw)
    ok &= close(dx, rdx, dtype_name) and close(dz, rdz, dtype_name)
    if w is not None:
        ok &= close(dw, rdw, "float32" if weight == "float32" else dtype_name)
    return ok


def mixed_case(rng, dtype_name, out_dtype, layout):
    dt = DTYPES[dtype_name]
    rows, hidden = 33, 1000
    xh = rng.standard_normal((rows, hidden)).astype(np.float32).astype(dt)
    rh = rng.standard_normal((rows, hidden)).astype(np.float32)
    wh = (1 + 0.1 * rng.standard_normal(hidden)).astype(ml_dtypes.bfloat16)
    x, r, w = place(xh, layout), place(rh, layout), device_copy(wh)
    ok = close(rn.rms_norm(x, w, out_dtype=out_dtype), rn.rms_norm_reference(xh, wh, out_dtype=out_dtype), out_dtype)
    y, s = rn.fused_add_rms_norm(x, r, w, out_dtype=out_dtype)
    want_y, want_s = rn.fused_add_rms_norm_reference(xh, rh, wh, out_dtype=out_dtype)
    ok &= close(y, want_y, out_dtype) and close(s, want_s, "float32")
    y2, s2 = rn.fused_add_rms_norm(x, r, w, residual_out=r, out_dtype=out_dtype)      # in place
    ok &= s2 is r and close(y2, want_y, out_dtype) and close(s2, want_s, "float32")
    dyh = rng.standard_normal((rows, hidden)).astype(np.float32).astype(DTYPES[out_dtype])
    dx, dw = rn.rms_norm_backward(device_copy(dyh), x, w)
    rdx, rdw = rn.rms_norm_backward_reference(dyh, xh, wh)
    return ok and close(dx, rdx, dtype_name) and close(dw, rdw, "bfloat16")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes (for racecheck)")
    args = parser.parse_args()
    cp.cuda.set_allocator(None)
    rng = np.random.default_rng(0)
    device = _driver.device(cp.cuda.Device().id)
    sm_count, device.sm_count = device.sm_count, 1
    plans, calls, wrong = [], 0, 0
    try:
        with _cache.forced_backward_plan(record=plans):
            cases = itertools.product(DTYPES, QUICK_HIDDEN if args.quick else HIDDEN, (True, False))
            for i, (dtype_name, hidden, nbg) in enumerate(cases):
                for j, g in enumerate(GROUPS[hidden]):
                    weight, offset = WEIGHTS[(i + j) % 3]
                    layout = "offset" if hidden == 255 else LAYOUTS[(i + j) % 3]
                    out_dtype = "float32" if (i + j) % 4 == 3 else None
                    calls += 1
                    wrong += not gated_case(rng, dtype_name, hidden, g, layout, nbg, ("silu", "sigmoid")[i % 2],
                                            weight, offset, out_dtype)
            for dtype_name, out_dtype, layout in itertools.product(("bfloat16", "float16"), ("bfloat16", "float32"),
                                                                   ("contiguous", "offset")):
                calls += 1
                wrong += not mixed_case(rng, dtype_name, out_dtype, layout)
    finally:
        device.sm_count = sm_count
    cp.cuda.Device().synchronize()
    shapes = sorted({(p.variant, p.chunks > 1) for p in plans if hasattr(p, "chunks")})
    print(f"gated_grid: {calls} calls, {wrong} wrong; gated backward shapes (variant, several chunks) {shapes}",
          flush=True)
    if wrong:
        return 3
    if not {("registers", True), ("stream", True)} <= set(shapes):
        print("gated_grid: the grid missed a launch shape", flush=True)
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
