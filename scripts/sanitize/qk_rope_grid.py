"""A small, representative grid of QK norm + RoPE calls (forward and backward) for
compute-sanitizer (scripts/sanitize.sh).

    PYTHONPATH=$PWD python3 scripts/sanitize/qk_rope_grid.py [--quick]

Covers every dtype, head sizes whose channels find their partner in the same vector, another
lane, another vector of the thread and through shared memory (NeoX halves that are no power of
two), interleaved pairs (and across lanes, one element a vector), both conventions of angles
(a cos_sin_cache with positions past its end and below zero: NaN, and nothing read outside
it), tables and weights of q's dtype and float32, no weights, q and k as views of one packed
projection rotated in place, rows one element off the vector grid, few and many heads a token
(several tokens a block; heads split over chunks), and the backward's plans made for a device
of one multiprocessor, so that every block walks many items and several partial rows are
reduced. Every array is its own cudaMalloc ending where its data ends (the cache and the
positions too: a read past them is a memcheck error); outputs are never initialized
(initcheck sees a read of an unwritten element); results are checked against the NumPy
reference on the host. Exit status: 0 all right; 3 a result was wrong; 4 a code path was missed.
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
# (head_dim, rotary_dim, is_neox): NeoX halves in another vector of the thread (128), another lane
# (64 half), the same vector (8 of 64), through shared memory (96, 80 half), interleaved pairs;
# 512: sixteen elements a thread
HEADS = ((128, 128, True), (64, 32, True), (64, 8, True), (96, 96, True), (80, 40, True), (128, 64, False),
         (512, 512, True))
QUICK_HEADS = ((128, 128, True), (96, 96, True), (128, 64, False))
LAYOUTS = ("separate", "in_place", "offset")
HEAD_COUNTS = ((8, 2), (2, 1), (72, 8))          # (q heads, k heads): a block a token; tokens a block; chunks
MAX_POSITION = 40
RTOL = {"float32": 3e-5, "float16": 2.0 ** -9, "bfloat16": 2.0 ** -6}


def device_copy(a):
    """``a`` (host) in a cudaMalloc of its own that ends where the array ends (bfloat16 by its bits)."""
    a = np.ascontiguousarray(a)
    if a.dtype == DTYPES["bfloat16"]:
        return cp.asarray(a.view(np.uint16)).view(DTYPES["bfloat16"])
    return cp.asarray(a)


def host(a):
    if a.dtype == DTYPES["bfloat16"]:
        return cp.asnumpy(a.view(cp.uint16)).view(DTYPES["bfloat16"])
    return cp.asnumpy(a)


def mismatch(got, want, dtype_name):
    """'' if ``got`` (device) matches ``want`` (host) within the dtype's tolerance, else what differs."""
    g = host(got).astype(np.float64)
    w = np.asarray(want).astype(np.float64)
    if g.shape != w.shape:
        return f"shape {g.shape} != {w.shape}"
    if not np.array_equal(np.isnan(g), np.isnan(w)):
        return f"NaN at {np.argwhere(np.isnan(g) != np.isnan(w))[:4].tolist()}"
    finite = np.isfinite(w)
    tol = RTOL[dtype_name] * (np.abs(w) + 0.25 * max(np.abs(w[finite]).max(initial=0.0), 1e-30))
    excess = np.where(finite, np.abs(g - w) - tol, -np.inf)
    if np.all(excess <= 0):
        return ""
    worst = np.unravel_index(np.argmax(excess), w.shape)
    return (f"{int(np.sum(excess > 0))} of {w.size} off, worst at {tuple(int(i) for i in worst)}: "
            f"{g[worst]!r} vs {w[worst]!r} (tolerance {tol[worst]:.3g})")


def heads_view(buf, start, heads, head_dim):
    item = buf.itemsize
    return cp.lib.stride_tricks.as_strided(buf[:, start:], (buf.shape[0], heads, head_dim),
                                           (buf.strides[0], head_dim * item, item))


def case(rng, dtype_name, head, layout, counts, convention, weight, table, mode, int64_positions):
    """One forward and one backward call; what was wrong (nothing: an empty list)."""
    head_dim, rotary_dim, is_neox = head
    dt = DTYPES[dtype_name]
    hq, hk = counts
    tokens = 19
    shift = 1 if layout == "offset" else 0
    width = (hq + 2 * hk) * head_dim
    packed = (rng.standard_normal((tokens, width + shift)) * 2).astype(np.float32).astype(dt)
    q_host = np.ascontiguousarray(packed[:, shift:shift + hq * head_dim]).reshape(tokens, hq, head_dim)
    k_host = np.ascontiguousarray(packed[:, shift + hq * head_dim:shift + (hq + hk) * head_dim]).reshape(
        tokens, hk, head_dim)
    if layout == "separate":
        q, k = device_copy(q_host), device_copy(k_host)
    else:
        buf = device_copy(packed)
        q, k = heads_view(buf, shift, hq, head_dim), heads_view(buf, shift + hq * head_dim, hk, head_dim)
    wdt = {"x": dt, "float32": np.dtype(np.float32)}.get(weight)
    qw_host = kw_host = None
    if wdt is not None:
        qw_host = (1 + 0.2 * rng.standard_normal(head_dim)).astype(np.float32).astype(wdt)
        kw_host = (1 + 0.2 * rng.standard_normal(head_dim)).astype(np.float32).astype(wdt)
    tdt = dt if table == "x" else np.dtype(np.float32)
    if convention == "cache":
        cache = rng.standard_normal((MAX_POSITION, rotary_dim)).astype(np.float32).astype(tdt)
        pos = rng.integers(0, MAX_POSITION, tokens).astype(np.int64 if int64_positions else np.int32)
        pos[3], pos[5] = MAX_POSITION, -1            # outside the cache: NaN, no read
        angles_host = dict(positions=pos, cos_sin_cache=cache)
    else:
        angles_host = dict(cos=rng.standard_normal((tokens, rotary_dim)).astype(np.float32).astype(tdt),
                           sin=rng.standard_normal((tokens, rotary_dim)).astype(np.float32).astype(tdt))
    angles = {name: device_copy(a) for name, a in angles_host.items()}
    qw, kw = (None, None) if qw_host is None else (device_copy(qw_host), device_copy(kw_host))
    kwargs = dict(rotary_dim=rotary_dim, is_neox=is_neox, casting_mode=mode)
    want_q, want_k = rn.qk_norm_rope_reference(q_host, k_host, qw_host, kw_host, 1e-6, 0.0, mode,
                                               rotary_dim=rotary_dim, is_neox=is_neox, **angles_host)
    out = dict(out_q=q, out_k=k) if layout == "in_place" else {}
    dq_host = rng.standard_normal(q_host.shape).astype(np.float32).astype(dt)
    dk_host = rng.standard_normal(k_host.shape).astype(np.float32).astype(dt)
    grads = rn.qk_norm_rope_backward(device_copy(dq_host), device_copy(dk_host), q, k, qw, kw, **angles, **kwargs)
    q_out, k_out = rn.qk_norm_rope(q, k, qw, kw, **angles, **kwargs, **out)
    # (the reference function, not the public NumPy path: NaN where a position is outside the cache)
    want = rn.qk_norm_rope_backward_reference(dq_host, dk_host, q_host, k_host, qw_host, kw_host, 1e-6, 0.0, mode,
                                              rotary_dim=rotary_dim, is_neox=is_neox, **angles_host)
    checks = [("q_out", q_out, want_q, dtype_name), ("k_out", k_out, want_k, dtype_name),
              ("dq", grads[0], want[0], dtype_name), ("dk", grads[1], want[1], dtype_name)]
    if qw is not None:
        # llama mode rounds xhat to q's dtype before its product with dy, and an inv_rms one float32
        # ulp away (another summation order) can move that rounding by an ulp of q's dtype: weight
        # sums are held to q's dtype's tolerance there
        wtol = dtype_name if mode == "llama" else np.dtype(wdt).name
        checks += [("dq_weight", grads[2], want[2], wtol), ("dk_weight", grads[3], want[3], wtol)]
    found = ((name, mismatch(got, w, d)) for name, got, w, d in checks)
    return [f"{name}: {what}" for name, what in found if what]


def pairing(plan):
    p, vec, lanes = plan.pairs, plan.vec, plan.threads_per_head
    return "shared" if p == 0 else "vector" if p < vec else "lane" if p < vec * lanes else "thread"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer head sizes (for racecheck)")
    args = parser.parse_args()
    cp.cuda.set_allocator(None)
    rng = np.random.default_rng(0)
    device = _driver.device(cp.cuda.Device().id)
    sm_count, device.sm_count = device.sm_count, 1
    plans, calls, wrong = [], 0, 0
    try:     # no overrides: the heuristic's plans, forward and backward, recorded (one record at a time)
        with _cache.forced_plan(), _cache.forced_backward_plan(record=plans):
            heads = QUICK_HEADS if args.quick else HEADS
            for i, (dtype_name, head) in enumerate(itertools.product(DTYPES, heads)):
                for j, layout in enumerate(LAYOUTS):
                    n = i + j
                    calls += 1
                    setting = dict(counts=HEAD_COUNTS[n % 3], convention=("cache", "cos_sin")[n % 2],
                                   weight=("x", "float32", None)[n % 3], table=("x", "float32")[(n // 2) % 2],
                                   mode=("fp32", "llama")[n % 2], int64_positions=(n // 3) % 2 == 0)
                    wrong_arrays = case(rng, dtype_name, head, layout, **setting)
                    if wrong_arrays:
                        print(f"WRONG {dtype_name} head={head} {layout} {setting}: " + "; ".join(wrong_arrays),
                              flush=True)
                    wrong += bool(wrong_arrays)
    finally:
        device.sm_count = sm_count
    cp.cuda.Device().synchronize()
    seen = sorted({("fwd", pairing(p), p.pairs == 1) for p in plans if hasattr(p, "head_chunks")}
                  | {("bwd", pairing(p), p.pairs == 1, p.grid > 1) for p in plans if hasattr(p, "groups")})
    print(f"qk_rope_grid: {calls} calls, {wrong} wrong; code paths {seen}", flush=True)
    if wrong:
        return 3
    wanted = {("fwd", "thread", False), ("fwd", "shared", False), ("bwd", "shared", False, True)}
    if not args.quick:
        wanted |= {("fwd", "lane", False), ("fwd", "vector", False), ("fwd", "vector", True), ("fwd", "lane", True)}
    if not wanted <= set(seen):
        print(f"qk_rope_grid: the grid missed {sorted(wanted - set(seen))}", flush=True)
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
