"""Batch invariance on the GPU: a row's outputs are the same bits whatever else is in the call.

Needs a CUDA GPU; skipped, with the reason shown, everywhere else. Run on the H200 with
``python3 -m pytest -n 8 tests/gpu/test_gpu_invariance.py``.

The contract (cupy_rmsnorm/_reference.py): every row that starts on the vector grid of the
call (no scalar head) is summed in the canonical tree of its hidden size, so its y (and the
fused op's residual_out) depend only on its values, the hidden size and the arguments. Here
a few probe rows are computed alone, checked against the canonical model
(``canonical_sum_of_squares`` on the host, the hardware rsqrtf, the float32 products, one
rounding), then placed in batches of 1 to 16384 rows at several positions, under every plan
the launcher chooses for those batches (warp groups, blocks, clusters, streamed rows),
under forced plans (``_cache.forced_plan``), in strided and 3-D layouts, in place, and
with the narrower vector widths that the arrays' relative alignment leaves; every time
their outputs must be the alone bits. float32 shows any change of the sum in y's bits;
16-bit outputs show it only where a product lies near a rounding midpoint, hence the
several probes and the model check.
"""

import math

import numpy as np
import pytest
from helpers import DTYPE_NAMES, DTYPES, EPS, FUSED, OPS, gpu_missing, requires_gpu, seed

from cupy_rmsnorm import _cache
from cupy_rmsnorm._reference import canonical_sum_of_squares

if gpu_missing() is None:
    import cupy as cp
    import gpu_reference as G

    _rsqrtf = cp.ElementwiseKernel("float32 q", "float32 r", "r = rsqrtf(q)", "invariance_rsqrtf")

pytestmark = [requires_gpu, pytest.mark.usefixtures("free_gpu_memory")]

HIDDEN = (1, 7, 100, 255, 256, 1000, 4095, 4096, 5120, 8192, 16384, 32768, 65536, 262144)
BATCHES = (1, 2, 3, 5, 17, 33, 67, 255, 256, 257, 1024, 4096, 16384)
MAX_ELEMENTS = 2 ** 25    # per batch array: rows are capped for long rows (8 workers share the GPU)
PROBES = 4
VECTOR_BYTES = 16


def _call(op, x, res, w, **kw):
    """(y, residual_out or None), outputs new unless given in kw."""
    return G.call(op, x, res, w, kw.pop("mode", "fp32"), kw.pop("out", None), kw.pop("res_out", None))


def _copy_rows(dst, src):
    """dst[...] = src, through the bits (no bfloat16 arithmetic)."""
    G.bits(dst)[...] = G.bits(src)


def _random(rs, shape, dtype):
    """Normal values whose magnitudes vary by rows and elements: any change of summation
    order changes the float32 sum's bits."""
    scale = cp.exp2(rs.uniform(-3, 3, shape).astype(cp.float32))
    return G.from_float32(G.normal(rs, shape, 1.0) * scale, dtype)


def _padded(rows, hidden, dtype):
    """A NaN-filled (rows, hidden) view whose rows start on 16-byte boundaries (its row
    stride rounded up)."""
    itemsize = np.dtype(dtype).itemsize
    stride = -(-hidden * itemsize // VECTOR_BYTES) * VECTOR_BYTES // itemsize
    buf = cp.empty((rows, stride), dtype)
    G.poison(buf)
    return buf[:, :hidden]


def _aligned_every(hidden, itemsize):
    """In a contiguous batch, rows start 16-byte aligned every this many rows."""
    return VECTOR_BYTES // math.gcd(VECTOR_BYTES, hidden * itemsize)


def _positions(rows, every, rng, k=PROBES):
    """Up to k distinct aligned row positions: the first, the last, the middle, random ones."""
    aligned = list(range(0, rows, every))
    picks = [aligned[0], aligned[-1], aligned[len(aligned) // 2]]
    picks += [int(p) for p in rng.choice(aligned, size=min(len(aligned), k), replace=False)]
    return list(dict.fromkeys(picks))[:k]


class Probes:
    """PROBES random rows (and residuals, and one weight), with each one's outputs computed
    alone (a fresh (1, hidden) call), checked against the canonical model."""

    def __init__(self, op, dtype_name, hidden, mode="fp32"):
        self.op, self.dtype_name, self.hidden, self.mode = op, dtype_name, hidden, mode
        self.dtype = DTYPES[dtype_name]
        rs = cp.random.RandomState(seed("invariance", op, dtype_name, hidden, mode))
        self.rs, self.rng = rs, np.random.default_rng(seed("positions", op, dtype_name, hidden))
        self.x = _random(rs, (PROBES, hidden), self.dtype)
        self.res = _random(rs, (PROBES, hidden), self.dtype) if op == FUSED else None
        self.w = G.random_weight(rs, "same", 0.0, hidden, self.dtype)
        self.y, self.s = [], []
        for p in range(PROBES):
            x1 = cp.empty((1, hidden), self.dtype)
            _copy_rows(x1, self.x[p:p + 1])
            r1 = None
            if op == FUSED:
                r1 = cp.empty((1, hidden), self.dtype)
                _copy_rows(r1, self.res[p:p + 1])
            y1, s1 = _call(op, x1, r1, self.w, mode=mode)
            self.y.append(y1[0])
            self.s.append(s1[0] if op == FUSED else None)
        if mode == "fp32":
            self._check_model()

    def _check_model(self):
        """The alone outputs are the canonical model's: its float32 sum (flushing subnormal
        squares, as the kernels do), the hardware rsqrtf, x * inv_rms * w, one rounding."""
        rows = cp.stack(self.s) if self.op == FUSED else self.x
        xf = G.to_host(rows).astype(np.float32)
        sums = canonical_sum_of_squares(xf, flush_subnormals=True)
        q = sums / np.float32(self.hidden) + np.float32(EPS)
        inv = cp.asnumpy(_rsqrtf(cp.asarray(q.astype(np.float32))))
        w = G.to_host(self.w).astype(np.float32)
        want = ((xf * inv[:, None]).astype(np.float32) * w).astype(np.float32).astype(self.dtype)
        got = G.to_host(cp.stack(self.y))
        uint = f"u{got.itemsize}"
        bad = np.flatnonzero(got.view(uint) != want.view(uint))
        assert bad.size == 0, (f"alone outputs are not the canonical tree's: {bad.size} of {got.size} "
                               f"elements differ (first at {np.unravel_index(bad[0], got.shape)})")

    def place(self, x, res, rows):
        """Copy probe p into row rows[p] of x (and res)."""
        for p, r in enumerate(rows):
            _copy_rows(x[r], self.x[p])
            if res is not None:
                _copy_rows(res[r], self.res[p])

    def check(self, y, s, rows, what):
        """Row rows[p] of y (and s) holds probe p's alone bits."""
        for p, r in enumerate(rows):
            msg = G.same_bits(y[r], self.y[p])
            assert msg is None, f"{what}: probe {p} at row {r}: y {msg}"
            if s is not None:
                msg = G.same_bits(s[r], self.s[p])
                assert msg is None, f"{what}: probe {p} at row {r}: residual_out {msg}"


def _batch(probes, rows, layout="contiguous"):
    """(x, res) of `rows` random rows in a layout."""
    h, dt = probes.hidden, probes.dtype
    if layout == "contiguous":
        x = _random(probes.rs, (rows, h), dt)
        res = _random(probes.rs, (rows, h), dt) if probes.op == FUSED else None
        return x, res
    x = _padded(rows, h, dt)
    _copy_rows(x, _random(probes.rs, (rows, h), dt))
    res = None
    if probes.op == FUSED:
        res = _padded(rows, h, dt)
        _copy_rows(res, _random(probes.rs, (rows, h), dt))
    return x, res


def _cases():
    return [pytest.param(op, d, h, id=f"{op}-{d}-hidden{h}") for op in OPS for d in DTYPE_NAMES for h in HIDDEN]


@pytest.mark.parametrize("op, dtype_name, hidden", _cases())
def test_a_row_alone_and_in_batches(op, dtype_name, hidden):
    """Probes at aligned positions of contiguous batches of 1..16384 rows (the launcher's
    plans for each: warp groups, blocks, clusters of 8 / 4 / 2, streamed rows) give their
    alone bits; so do they in batches whose rows are all aligned (padded row strides)."""
    probes = Probes(op, dtype_name, hidden)
    every = _aligned_every(hidden, probes.dtype.itemsize)
    cap = max(1, MAX_ELEMENTS // hidden)
    plans = []
    with _cache.forced_plan(record=plans):          # no override: the heuristic's plans, recorded
        for rows in sorted({min(n, cap) for n in BATCHES}):
            for layout in ("contiguous", "padded"):
                x, res = _batch(probes, rows, layout)
                step = every if layout == "contiguous" else 1
                at = _positions(rows, step, probes.rng)
                probes.place(x, res, at)
                y, s = _call(op, x, res, probes.w)
                probes.check(y, s, at, f"{layout} batch of {rows}")
    # the batches met the plans they are here for
    vec = VECTOR_BYTES // probes.dtype.itemsize
    if -(-hidden // vec) > 512 and _has_clusters():
        assert any(p.cluster > 1 for p in plans), "no cluster plan"
    if hidden >= 65536:
        assert any(p.vecs_per_thread == 0 for p in plans), "no streamed plan"


def _has_clusters():
    return int(cp.cuda.Device().compute_capability) >= 90


def _forced_overrides(hidden, vec, clusters):
    """Forced plans that cover the row: warp groups, blocks with more slots than needed,
    streamed blocks of 64 threads (many epochs for long rows) and of 1024, clusters."""
    n = -(-hidden // vec)
    out = []

    def add(g, nv, c=1):
        if nv and g * nv * c < n:
            return
        out.append(dict(threads_per_row=g, vecs_per_thread=nv, cluster=c))

    def cover(g, c=1):
        return 1 << max(0, (-(-n // (g * c)) - 1).bit_length())

    for g in (8, 32):
        if cover(g) <= 8:
            add(g, cover(g))
    for g in (64, 256, 1024):
        if cover(g) <= 4:
            add(g, cover(g))
            add(g, 2 * cover(g))                        # padded slots: zeros added
    add(64, 0)
    add(1024, 0)
    if clusters:
        for g, c in ((128, 2), (512, 8)):
            if cover(g, c) <= 4:
                add(g, cover(g, c), c)
        add(256, 0, 2)
    return out


@pytest.mark.parametrize("op, dtype_name, hidden", _cases())
def test_forced_plans(op, dtype_name, hidden):
    """Every forced plan (threads per row, vectors per thread, cluster, streaming) gives the
    probes' alone bits, in a batch of a few aligned rows (outputs padded alike: full width)."""
    probes = Probes(op, dtype_name, hidden)
    vec = VECTOR_BYTES // probes.dtype.itemsize
    rows = PROBES + 1
    for overrides in _forced_overrides(hidden, vec, _has_clusters()):
        x, res = _batch(probes, rows, "padded")
        out = _padded(rows, hidden, probes.dtype)
        res_out = _padded(rows, hidden, probes.dtype) if op == FUSED else None
        at = list(range(1, PROBES + 1))
        probes.place(x, res, at)
        plans = []
        with _cache.forced_plan(record=plans, **overrides):
            y, s = _call(op, x, res, probes.w, out=out, res_out=res_out)
        assert plans and all(getattr(plans[0], k) == v for k, v in overrides.items()), (overrides, plans)
        probes.check(y, s, at, f"forced {overrides} (vec {plans[0].vec})")


LAYOUT_HIDDEN = (7, 255, 1000, 4095, 4096, 8192, 65536)
LAYOUTS = ("wide_stride", "inplace_odd_stride", "out_offset", "heads")
LAYOUT_ROWS = 40


def _layout(probes, layout):
    """(x, res, out, res_out, row) for a layout of LAYOUT_ROWS rows; row(a, r) is row r of
    any of them (None outputs: new ones)."""
    h, dt, fused = probes.hidden, probes.dtype, probes.op == FUSED
    rows = LAYOUT_ROWS
    out = res_out = None
    if layout == "heads":                       # heads 1 and 2 of (tokens, 4 heads, head_dim)
        x = _random(probes.rs, (rows // 2, 4, h), dt)[:, 1:3]
        res = _random(probes.rs, (rows // 2, 4, h), dt)[:, 1:3] if fused else None
        return x, res, out, res_out, lambda a, r: a[r // 2, r % 2]
    pad = {"wide_stride": 8, "inplace_odd_stride": 1, "out_offset": 0}[layout]
    x = _random(probes.rs, (rows, h + pad), dt)[:, :h]
    res = _random(probes.rs, (rows, h + pad), dt)[:, :h] if fused else None
    if layout == "inplace_odd_stride":          # rows on and off the vector grid, in place
        out, res_out = x, res
    if layout == "out_offset":                  # outputs one element off x: the scalar path
        out = cp.empty(rows * h + 1, dt)[1:].reshape(rows, h)
        res_out = cp.empty(rows * h + 1, dt)[1:].reshape(rows, h) if fused else None
    return x, res, out, res_out, lambda a, r: a[r]


def _row_starts(a):
    """Byte address of each row of a 2-D or 3-D view, rows in C order of the leading axes."""
    idx = np.indices(a.shape[:-1]).reshape(a.ndim - 1, -1)
    return a.data.ptr + sum(i * s for i, s in zip(idx, a.strides[:-1]))


@pytest.mark.parametrize("op, dtype_name, hidden",
                         [pytest.param(op, d, h, id=f"{op}-{d}-hidden{h}")
                          for op in OPS for d in DTYPE_NAMES for h in LAYOUT_HIDDEN])
def test_layouts_and_vector_widths(op, dtype_name, hidden):
    """Probes in strided, in-place, offset-output and per-head layouts: the rows that start
    on the call's vector grid (every row on the scalar path) give their alone bits, whatever
    vector width the arrays' relative alignment leaves."""
    probes = Probes(op, dtype_name, hidden)
    itemsize, widths = probes.dtype.itemsize, set()
    for layout in LAYOUTS:
        x, res, out, res_out, row = _layout(probes, layout)
        plans = []
        with _cache.forced_plan(record=plans):     # a first call shows the call's vector width
            _call(op, x, res, probes.w, out=out, res_out=res_out)
        vec_bytes = plans[0].vec * itemsize
        widths.add(plans[0].vec)
        on_grid = np.flatnonzero(_row_starts(x) % vec_bytes == 0)
        assert on_grid.size, f"{layout}: no row on the vector grid"
        if layout == "out_offset":
            assert plans[0].vec == 1 and on_grid.size == LAYOUT_ROWS, "the scalar path: every row"
        at = _positions(on_grid.size, 1, probes.rng)
        at = [int(on_grid[i]) for i in at]
        for p, r in enumerate(at):
            _copy_rows(row(x, r), probes.x[p])
            if res is not None:
                _copy_rows(row(res, r), probes.res[p])
        y, s = _call(op, x, res, probes.w, out=out, res_out=res_out)
        for p, r in enumerate(at):
            what = f"{layout} (vector width {plans[0].vec}): probe {p} at row {r}"
            msg = G.same_bits(row(y, r), probes.y[p])
            assert msg is None, f"{what}: y {msg}"
            if s is not None:
                msg = G.same_bits(row(s, r), probes.s[p])
                assert msg is None, f"{what}: residual_out {msg}"
    assert 1 in widths and max(widths) * itemsize == VECTOR_BYTES, widths


@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
@pytest.mark.parametrize("op", OPS)
def test_llama_mode_is_invariant_too(op, dtype_name):
    """casting_mode="llama" shares the sum: probes alone and in batches agree."""
    for hidden in (255, 4096, 65536):
        probes = Probes(op, dtype_name, hidden, mode="llama")
        for rows in (3, 300, min(4096, MAX_ELEMENTS // hidden)):
            x, res = _batch(probes, rows, "padded")
            at = _positions(rows, 1, probes.rng)
            probes.place(x, res, at)
            y, s = _call(op, x, res, probes.w, mode="llama")
            probes.check(y, s, at, f"llama, batch of {rows}")


@pytest.mark.parametrize("op", OPS)
def test_rows_off_the_grid_are_deterministic(op):
    """Rows with a scalar head (outside the contract's invariance) still give the same bits
    call after call."""
    rs = cp.random.RandomState(seed("off-grid", op))
    for hidden in (255, 4095, 33001):
        x = _random(rs, (33, hidden + 1), DTYPES["bfloat16"])[:, 1:]
        res = _random(rs, (33, hidden + 1), DTYPES["bfloat16"])[:, 1:] if op == FUSED else None
        first = [a.copy() for a in _call(op, x, res, None) if a is not None]
        for _ in range(2):
            again = [a for a in _call(op, x, res, None) if a is not None]
            for a, b in zip(again, first):
                assert G.same_bits(a, b) is None, f"hidden={hidden}"
