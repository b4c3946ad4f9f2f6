"""GPU correctness suite of issue 2: the CuPy path against a float64 reference on the GPU.

Needs a CUDA GPU (run on the H200 with ``python3 -m pytest -n 8 tests/test_gpu_correctness.py``);
skipped, with the reason shown, everywhere else. The reference (tests/gpu_reference.py)
follows the numerics contract of cupy_rmsnorm/_reference.py in float64.

How test_grid covers issue 2's grid
-----------------------------------
One pytest item per (op, dtype, hidden): 2 x 3 x 12 = 72 items. Inside, each loops over
casting mode (fp32, llama) x weight (None; x's dtype or float32, each with weight_offset
0 and 1) x layout (2d; 3d (rows, 2, hidden); strided rows x[:, :hidden] of a
(rows, hidden + 3) buffer; a flat buffer sliced at element offset 1; the two query heads
(rows, 2, head_dim) of a (tokens, 4 heads, head_dim) QKV buffer) x placement (out-of-place
into NaN-poisoned outputs; in place; for the 2d layout also out=None and, for the fused
op, the swapped in-place form out=residual, residual_out=x) x rows (0, 1, 3, 257, 4096;
the 3d and QKV layouts hold 2 x rows rows).
- Shapes are capped at MAX_ELEMENTS = 2**27 elements per array: rows=4096 runs in full for
  every hidden size up to 16384 (4096 x 16384 is 2**26 in 2d, 2**27 in 3d), and becomes
  2048 (2d) / 1024 (3d) rows at hidden 65536 and 512 / 256 at 262144.
- Calls past BIG_ELEMENTS = 2**22 elements (after the cap) do not run the whole (mode x
  weight) product for every layout: the 2d out-of-place calls run all ten (mode, weight)
  pairs; every other (layout, placement) runs one pair, rotating with layout, placement
  and row count. Every value of every factor thus meets every (op, dtype, hidden), and
  meets the big shapes too.
- Vector widths the grid reaches: full (16 bytes) for 2d / 3d / QKV and for every in-place
  call (with a per-row scalar head where rows start unaligned); 1 for strided rows written
  to a contiguous out (row strides 3 elements apart); 2 or 4 elements for the offset
  layout out-of-place (outputs start 2 or 4 elements off x's alignment).
Every (layout, placement) runs twice on fresh buffers: the first call of a signature is
validated in full and leaves a launcher behind, the second takes the launcher's fast path.
Every call checks: the returned objects; every output element against the reference
(a NaN left from the poisoning fails; fp32 mode within half an ulp plus float32 noise,
so a second rounding fails; llama mode within two ulps); residual_out bit-exact against
CuPy's dtype add x + residual; nothing written outside the views (padding, QKV's other
heads, the elements around an offset slice hold NaN, so a read past a row's end also
shows up, as a NaN in that row) and nothing at all in inputs that are not outputs.
The kernels compile once per (dtype, weight dtype, fused, vector width, threads per row,
vectors per thread): a handful per (op, dtype, hidden) item, about 0.3 s each.
"""

import math
import re
import zlib

import numpy as np
import pytest
from helpers import DTYPES, gpu_missing, requires_gpu, requires_torch_gpu

import cupy_rmsnorm as rn
from cupy_rmsnorm import _launcher, _plan

if gpu_missing() is None:
    import cupy as cp
    import gpu_reference as G

pytestmark = requires_gpu

FUSED = "fused_add_rms_norm"
OPS = ("rms_norm", FUSED)
DTYPE_NAMES = tuple(DTYPES)                      # float32, float16, bfloat16
HIDDEN = (1, 7, 255, 256, 1000, 4095, 4096, 5120, 8192, 16384, 65536, 262144)
ROWS = (0, 1, 3, 257, 4096)
MODES = ("fp32", "llama")
WEIGHTS = ((None, 0.0), ("same", 0.0), ("same", 1.0), ("float32", 0.0), ("float32", 1.0))
LAYOUTS = ("2d", "3d", "strided", "offset", "qkv")
LEAD = {"2d": 1, "3d": 2, "strided": 1, "offset": 1, "qkv": 2}   # rows per leading index
PAD = 3                   # strided layout: row stride hidden + 3 (odd: rows start unaligned)
OFFSET_ROOM = 8           # offset layout: spare elements around the slice
MAX_ELEMENTS = 2 ** 27    # cap on rows x hidden per array (8 xdist workers share the GPU)
BIG_ELEMENTS = 2 ** 22    # past this, the thinned (mode x weight) rotation applies
CHUNK_ELEMENTS = 2 ** 24  # the float64 reference is computed this many elements at a time
EPS = 1e-6
MAX_FAILURES = 25         # per item: stop collecting after this many


def _seed(*parts):
    return zlib.crc32("-".join(map(str, parts)).encode())


@pytest.fixture(autouse=True)
def _free_gpu_memory():
    """Give the memory pool back after each test: eight workers share one GPU."""
    yield
    if gpu_missing() is None:
        cp.get_default_memory_pool().free_all_blocks()


# -- layouts ------------------------------------------------------------------------------

def buffer_elements(layout, rows, hidden):
    return {"2d": rows * hidden, "3d": 2 * rows * hidden, "strided": rows * (hidden + PAD),
            "offset": rows * hidden + OFFSET_ROOM, "qkv": 4 * rows * hidden}[layout]


def view_of(buf, layout, rows, hidden, offset=1):
    """The array of ``layout`` inside the flat buffer ``buf`` (a view, no copy)."""
    if layout == "2d":
        return buf.reshape(rows, hidden)
    if layout == "3d":
        return buf.reshape(rows, 2, hidden)
    if layout == "strided":
        return buf.reshape(rows, hidden + PAD)[:, :hidden]
    if layout == "offset":
        return buf[offset:offset + rows * hidden].reshape(rows, hidden)
    if layout == "qkv":       # (tokens, heads q0 q1 k v, head_dim): the query heads
        return buf.reshape(rows, 4, hidden)[:, :2]
    raise AssertionError(layout)


def output_layout(layout, hidden):
    """(layout, offset) of the poisoned outputs of an out-of-place call with x in ``layout``."""
    if layout == "strided":
        return "2d", 0        # contiguous: row strides 3 elements apart -> vector width 1
    if layout == "qkv":
        return "3d", 0        # contiguous (tokens, heads, head_dim)
    if layout == "offset":
        return "offset", 1 + (2 if hidden % 2 else 4)   # 2 or 4 elements off x's alignment
    return layout, 0


class Arr:
    """A view of ``layout`` in a flat buffer of its own, holding ``data`` (or the poison).

    Everything outside the view holds the NaN poison: a read past a row's end turns that
    row's result into NaN, and a write outside the view changes the poison's count.
    """

    def __init__(self, layout, rows, hidden, dtype, offset=1, data=None):
        self.buf = cp.empty(buffer_elements(layout, rows, hidden), dtype)
        G.poison(self.buf)
        self.view = view_of(self.buf, layout, rows, hidden, offset)
        if data is not None and self.view.size:
            G.bits(self.view)[...] = G.bits(data.reshape(self.view.shape))

    def writes_outside(self):
        """How many elements outside the view are no longer the poison (a 0-d device
        array), or None when the view is the whole buffer."""
        if self.buf.size == self.view.size:
            return None
        return G.count_not_poison(self.buf) - G.count_not_poison(self.view)


def normal(rs, shape, scale=1.0):
    """Fresh float32 normal values (CuPy's generator is not asked for zero elements)."""
    if math.prod(shape) == 0:
        return cp.zeros(shape, cp.float32)
    return rs.standard_normal(shape, dtype=cp.float32) * scale


def random_weight(rs, kind, weight_offset, hidden, dtype):
    if kind is None:
        return None
    w = normal(rs, (hidden,), 0.5) + (0.0 if weight_offset else 1.0)
    return G.from_float32(w, dtype if kind == "same" else np.float32)


def check_rows(y, s0, weight, weight_offset, casting_mode, dtype_name):
    """Compare an output (any layout) with the reference of ``s0`` (contiguous, same
    shape), CHUNK_ELEMENTS at a time."""
    hidden = y.shape[-1]
    lead = math.prod(y.shape[1:-1])
    step = max(1, CHUNK_ELEMENTS // (lead * hidden))
    for i in range(0, y.shape[0], step):
        ref = G.reference(s0[i:i + step].reshape(-1, hidden), weight, EPS, weight_offset, casting_mode)
        msg = G.compare(y[i:i + step], ref, dtype_name, casting_mode, row0=i * lead)
        if msg:
            return msg
    return None


class Data:
    """Fresh inputs, weight and float64 reference for one (rows, mode, weight) of the grid,
    shared by the layouts and placements that use them (x's rows are scaled by 2..8 so
    no row's RMS is near 1: in place, an unwritten row would otherwise pass)."""

    def __init__(self, rs, fused, dtype_name, shape, mode, wkind, weight_offset):
        dtype = DTYPES[dtype_name]
        hidden = shape[-1]
        x = normal(rs, shape)
        if x.size:
            x *= cp.exp(rs.uniform(math.log(2.0), math.log(8.0), size=shape[:-1] + (1,),
                                   dtype=cp.float32))
        self.x = G.from_float32(x, dtype)
        self.res = G.from_float32(normal(rs, shape, 3.0), dtype) if fused else None
        self.w = random_weight(rs, wkind, weight_offset, hidden, dtype)
        self.s0 = self.x + self.res if fused else self.x      # CuPy's add in the dtype
        self.mode, self.weight_offset, self.dtype_name = mode, weight_offset, dtype_name
        self.ref = self.tol = None
        if self.s0.size <= CHUNK_ELEMENTS:
            self.ref = G.reference(self.s0.reshape(-1, hidden), self.w, EPS, weight_offset, mode)
            self.tol = G.tolerance_array(self.ref, dtype_name, mode)

    def bad_count(self, y):
        """Elements of the output ``y`` off the reference (a 0-d device array), or None
        for shapes whose reference is only made in chunks (then ``message`` decides)."""
        return None if self.ref is None else G.count_bad(y, self.ref, self.tol)

    def message(self, y):
        """None if ``y`` matches the reference everywhere, else why not (synchronizes)."""
        if self.ref is None:
            return check_rows(y, self.s0, self.w, self.weight_offset, self.mode, self.dtype_name)
        return G.compare(y, self.ref, self.dtype_name, self.mode)


# -- the grid -------------------------------------------------------------------------------

def placements(op, layout):
    p = ["out", "inplace"]
    if layout == "2d":
        p.append("alloc")
        if op == FUSED:
            p.append("swapped")
    return p


def run_call(data, op, dtype_name, layout, placement):
    """One call of the grid with ``data`` in ``layout``; None if all checks pass, else why not."""
    dtype = DTYPES[dtype_name]
    fused = op == FUSED
    rows, hidden = data.x.shape[0], data.x.shape[-1]
    x = Arr(layout, rows, hidden, dtype, data=data.x)
    res = Arr(layout, rows, hidden, dtype, data=data.res) if fused else None
    out = res_out = None
    if placement == "out":
        olayout, ooff = output_layout(layout, hidden)
        out = Arr(olayout, rows, hidden, dtype, ooff)
        res_out = Arr(olayout, rows, hidden, dtype, ooff) if fused else None
    elif placement == "inplace":
        out, res_out = x, res
    elif placement == "swapped":
        out, res_out = res, x

    kwargs = {"weight_offset": data.weight_offset, "casting_mode": data.mode}
    if out is not None:
        kwargs["out"] = out.view
    if fused:
        if res_out is not None:
            kwargs["residual_out"] = res_out.view
        result = rn.fused_add_rms_norm(x.view, res.view, data.w, EPS, **kwargs)
        if not (isinstance(result, tuple) and len(result) == 2):
            return f"returned {type(result).__name__}, not (out, residual_out)"
        y, s = result
    else:
        y, s = rn.rms_norm(x.view, data.w, EPS, **kwargs), None

    if out is not None and y is not out.view:
        return "did not return the out array it was given"
    if res_out is not None and s is not res_out.view:
        return "did not return the residual_out array it was given"
    for a in (y, s) if fused else (y,):
        if not isinstance(a, cp.ndarray) or a.shape != x.view.shape or a.dtype != dtype:
            return f"returned {type(a).__name__} {getattr(a, 'shape', '')} {getattr(a, 'dtype', '')}"
    # Every check counts on the device; one transfer brings the counts back.
    outputs = [a for a in (out, res_out) if a is not None]
    counts = {}
    if fused:
        counts["residual_out"] = G.count_differing_bits(s, data.s0)
    counts["out"] = data.bad_count(y)
    for label, arr, held in (("x", x, data.x), ("residual", res, data.res)):
        if arr is not None and not any(arr is o for o in outputs):
            counts[label + " (an input, not an output) changed"] = G.count_differing_bits(arr.view, held)
    seen = set()
    for label, arr in (("x", x), ("residual", res), ("out", out), ("residual_out", res_out)):
        if arr is not None and id(arr) not in seen:      # in place, x is out: count it once
            seen.add(id(arr))
            counts[f"{label}'s buffer written outside the view"] = arr.writes_outside()
    known = {k: v for k, v in counts.items() if v is not None}
    values = dict(zip(known, cp.stack(list(known.values())).get().tolist())) if known else {}
    if values.get("residual_out"):
        return f"residual_out != x + residual: {G.same_bits(s, data.s0)}"
    if values.get("out") or counts["out"] is None:
        msg = data.message(y) or (f"{values['out']} elements off" if values.get("out") else None)
        if msg:
            return f"out: {msg}"
    for label, n in values.items():
        if n and label not in ("residual_out", "out"):
            return f"{label}: {n} elements"
    return None


def grid_calls(op, hidden):
    """(data key, layout, placement) for every call of one (op, hidden) item, grouped so
    calls sharing a data key (shape, mode, weight kind, weight_offset) follow each other.
    Big shapes are thinned as the module docstring says."""
    pairs = [(m, wk, wo) for m in MODES for wk, wo in WEIGHTS]
    combos = [(lay, pl) for lay in LAYOUTS for pl in placements(op, lay)]
    for ri, rows in enumerate(ROWS):
        for lead in (1, 2):
            n = min(rows, MAX_ELEMENTS // (lead * hidden))
            big = n * lead * hidden > BIG_ELEMENTS
            shape = (n, hidden) if lead == 1 else (n, 2, hidden)
            for j, (mode, wk, wo) in enumerate(pairs):
                for ci, (layout, placement) in enumerate(combos):
                    if LEAD[layout] != lead:
                        continue
                    if big and (layout, placement) != ("2d", "out") and j != (3 * ci + ri) % len(pairs):
                        continue
                    yield (shape, mode, wk, wo), layout, placement


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
@pytest.mark.parametrize("op", OPS)
def test_grid(op, dtype_name, hidden):
    """Every (mode, weight, layout, placement, rows) for one (op, dtype, hidden)."""
    rs = cp.random.RandomState(_seed(op, dtype_name, hidden))
    failures, calls = [], 0
    data = data_key = None
    for key, layout, placement in grid_calls(op, hidden):
        shape, mode, wk, wo = key
        if key != data_key:
            data, data_key = Data(rs, op == FUSED, dtype_name, shape, mode, wk, wo), key
        where = (f"[{mode} weight={'none' if wk is None else wk}{'+1' if wo else ''} {layout} "
                 f"{placement} rows={shape[0]}{'x2' if len(shape) == 3 else ''}]")
        # The first call of a signature is validated in full and leaves a launcher behind;
        # the second (new buffers, same shapes and strides) takes the launcher's fast path.
        for attempt in ("first call", "repeat call"):
            calls += 1
            try:
                msg = run_call(data, op, dtype_name, layout, placement)
            except (cp.cuda.runtime.CUDARuntimeError, cp.cuda.driver.CUDADriverError) as e:
                msg = f"CUDA error, stopping (the context is likely gone): {e}"
                failures.append(f"{where} {attempt}: {msg}")
                break
            except Exception as e:  # noqa: BLE001 - report every failing call, not only the first
                msg = f"raised {type(e).__name__}: {e}"
            if msg:
                failures.append(f"{where} {attempt}: {msg}")
        if failures and (len(failures) >= MAX_FAILURES or "CUDA error" in failures[-1]):
            break
    assert calls > 0
    assert not failures, f"{len(failures)} failing of {calls} calls run:\n" + "\n".join(failures)


# -- particular inputs ---------------------------------------------------------------------

def _call(op, x, res, w, mode="fp32", out=None, res_out=None, eps=EPS, weight_offset=0.0):
    if op == FUSED:
        return rn.fused_add_rms_norm(x, res, w, eps, out=out, residual_out=res_out,
                                     weight_offset=weight_offset, casting_mode=mode)
    return rn.rms_norm(x, w, eps, out=out, weight_offset=weight_offset, casting_mode=mode), None


def _poisoned_like(a):
    b = cp.empty(a.shape, a.dtype)
    G.poison(b)
    return b


def _check_call(op, x, res, w, dtype_name, mode="fp32", eps=EPS, weight_offset=0.0):
    """An out-of-place call into poisoned outputs, checked against the reference (NaN
    and Inf where the reference has them). Returns (what went wrong or None, out)."""
    res = res if op == FUSED else None
    out = _poisoned_like(x)
    res_out = _poisoned_like(x) if op == FUSED else None
    y, s = _call(op, x, res, w, mode, out, res_out, eps, weight_offset)
    if y is not out or (op == FUSED and s is not res_out):
        return "did not return the outputs it was given", y
    s0 = x + res if op == FUSED else x          # CuPy's add in the dtype
    if op == FUSED:
        msg = G.nan_equal_bits(s, s0)
        if msg:
            return f"residual_out != x + residual: {msg}", y
    ref = G.reference(s0.reshape(-1, x.shape[-1]), w, eps, weight_offset, mode)
    return G.compare(y, ref, dtype_name, mode), y


@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
@pytest.mark.parametrize("op", OPS)
def test_nonfinite_values_stay_in_their_row(op, dtype_name):
    """NaN in row 2, +Inf as row 6's last element, -Inf as row 4's first residual element:
    those rows come out as the reference says (all NaN; zeros with a NaN where the Inf
    was), every other row finite and right; 9 rows share one block in the warp variant
    (hidden 256), and the block (4096) and stream (65536) variants run too."""
    dtype = DTYPES[dtype_name]
    rs = cp.random.RandomState(_seed("nonfinite", op, dtype_name))
    rows = 9
    bad_rows = {2, 6} | ({4} if op == FUSED else set())
    good = cp.asarray(sorted(set(range(rows)) - bad_rows))
    for hidden in (256, 4096, 65536):
        xf = normal(rs, (rows, hidden), 2.0)
        xf[2, 5] = cp.nan
        xf[6, hidden - 1] = cp.inf
        rf = normal(rs, (rows, hidden), 2.0)
        rf[4, 0] = -cp.inf
        x, res = G.from_float32(xf, dtype), G.from_float32(rf, dtype)
        w = random_weight(rs, "same", 0.0, hidden, dtype)
        for mode in MODES:
            msg, y = _check_call(op, x, res, w, dtype_name, mode)
            assert msg is None, f"hidden={hidden} {mode}: {msg}"
            assert G.count_nonfinite(G.take_rows(y, good)) == 0, \
                f"hidden={hidden} {mode}: a non-finite value reached another row"
            assert bool(cp.isnan(G.to_float64(y[2])).all()), f"hidden={hidden} {mode}: NaN row not all NaN"
            assert G.count_nonfinite(y[6]) >= 1, f"hidden={hidden} {mode}: the Inf row came out finite"


@pytest.mark.parametrize("op", OPS)
def test_float16_inputs_scaled_100x_stay_finite(op):
    """x (and residual) ~ N(0, 100^2) in float16: their squares overflow float16 (max
    65504), so only a float32 accumulation keeps the output finite and right."""
    dtype = DTYPES["float16"]
    rs = cp.random.RandomState(_seed("fp16x100", op))
    for hidden in (256, 4096, 5120, 65536):
        x = G.from_float32(normal(rs, (33, hidden), 100.0), dtype)
        res = G.from_float32(normal(rs, (33, hidden), 100.0), dtype)
        assert G.count_nonfinite(x) == 0 and G.count_nonfinite(res) == 0
        for wkind, mode in ((None, "fp32"), ("same", "llama"), ("float32", "fp32")):
            w = random_weight(rs, wkind, 0.0, hidden, dtype)
            msg, y = _check_call(op, x, res, w, "float16", mode)
            assert G.count_nonfinite(y) == 0, f"hidden={hidden} {mode}: non-finite output"
            assert msg is None, f"hidden={hidden} {mode}: {msg}"


@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
@pytest.mark.parametrize("op", OPS)
def test_eps_is_applied(op, dtype_name):
    """Values ~1e-2 with eps 1e-2 (eps dominates the mean of squares) and eps 0."""
    dtype = DTYPES[dtype_name]
    rs = cp.random.RandomState(_seed("eps", op, dtype_name))
    for hidden in (7, 4096, 65536):
        x = G.from_float32(normal(rs, (5, hidden), 1e-2), dtype)
        res = G.from_float32(normal(rs, (5, hidden), 1e-2), dtype)
        w = random_weight(rs, "same", 0.0, hidden, dtype)
        for eps in (1e-2, 0.0):
            msg, _ = _check_call(op, x, res, w, dtype_name, "fp32", eps=eps)
            assert msg is None, f"hidden={hidden} eps={eps}: {msg}"


@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
@pytest.mark.parametrize("op", OPS)
def test_one_dimensional_input(op, dtype_name):
    dtype = DTYPES[dtype_name]
    rs = cp.random.RandomState(_seed("1d", op, dtype_name))
    for hidden in (7, 4096):
        x = G.from_float32(normal(rs, (hidden,), 3.0), dtype)
        res = G.from_float32(normal(rs, (hidden,), 3.0), dtype)
        w = random_weight(rs, "float32", 1.0, hidden, dtype)
        y, s = _call(op, x, res, w, "llama", weight_offset=1.0)
        assert y.shape == (hidden,) and (s is None or s.shape == (hidden,))
        s0 = x + res if op == FUSED else x
        if op == FUSED:
            assert G.same_bits(s, s0) is None
        msg = G.compare(y, G.reference(s0[None], w, EPS, 1.0, "llama"), dtype_name, "llama")
        assert msg is None, f"hidden={hidden}: {msg}"


@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
@pytest.mark.parametrize("op", OPS)
def test_split_grid(monkeypatch, op, dtype_name):
    """Grids past 2**31 - 1 blocks are laid out as rows of 2**16 blocks, the last row with
    surplus blocks that must find no row (and, for clusters, surplus clusters). The split
    is made to happen at 8 blocks here (_plan.MAX_GRID_X, _plan.GRID_ROW), for warp-group,
    block, streamed and cluster plans."""
    dtype = DTYPES[dtype_name]
    plans = []
    monkeypatch.setattr(_plan, "MAX_GRID_X", 7)
    monkeypatch.setattr(_plan, "GRID_ROW", 8)
    with _launcher.forced_plan(record=plans):       # the heuristic's plans, recorded
        _split_grid_calls(op, dtype_name, dtype, plans)


def _split_grid_calls(op, dtype_name, dtype, plans):
    rs = cp.random.RandomState(_seed("split", op, dtype_name))
    clusters = 0
    for rows, hidden in ((300, 7), (200, 256), (21, 4096), (5, 65536), (37, 16384), (3, 262144)):
        x = G.from_float32(normal(rs, (rows, hidden), 3.0), dtype)
        res = G.from_float32(normal(rs, (rows, hidden), 3.0), dtype)
        for wkind, mode in (("same", "fp32"), ("float32", "llama")):
            w = random_weight(rs, wkind, 0.0, hidden, dtype)
            plans.clear()
            msg, _ = _check_call(op, x, res, w, dtype_name, mode)
            assert msg is None, f"{rows}x{hidden} {mode}: {msg}"
            assert plans and all(p.grid_dims()[1] > 1 for p in plans), f"{rows}x{hidden}: not split: {plans}"
            clusters += any(p.cluster > 1 for p in plans)
    assert clusters, "no cluster plan was split"


def test_first_call_of_a_signature_in_a_fresh_thread():
    """A thread that has never touched CUDA makes the first call of a signature with its
    output given (so no allocation binds a context first): the plan, the occupancy query
    and the launch must still find the device's context."""
    import threading
    rs = cp.random.RandomState(_seed("thread"))
    x = G.from_float32(normal(rs, (64, 4096), 3.0), DTYPES["bfloat16"])
    w = random_weight(rs, "same", 0.0, 4096, DTYPES["bfloat16"])
    out = _poisoned_like(x)
    rn.rms_norm(x, w, out=out)                     # compiled and cached here
    cp.cuda.Device().synchronize()
    _launcher.clear_cache()                        # the thread's call plans anew
    errors = []

    def call():
        try:
            rn.rms_norm(x, w, out=out)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=call)
    t.start()
    t.join()
    assert not errors, errors
    cp.cuda.Device().synchronize()
    assert G.compare(out, G.reference(x, w, EPS, 0.0, "fp32"), "bfloat16", "fp32") is None


# -- more than 2**31 elements -----------------------------------------------------------------

def _fill_random(a, rs, scale=2.0, chunk_rows=8192):
    for i in range(0, a.shape[0], chunk_rows):
        part = a[i:i + chunk_rows]
        G.bits(part)[...] = G.bits(G.from_float32(normal(rs, part.shape, scale), a.dtype))


def test_more_than_2_31_elements_bfloat16():
    """131073 x 16384 bf16 (2**31 + 16384 elements, 4.3 GB per array): rms_norm out of
    place, then the fused op in place, each checked on a sample of rows (the first, those
    around 2**31 / 2 elements, the last, whose elements all sit past 2**31, and random
    ones) against the reference of those rows, and for finiteness everywhere."""
    dtype_name, dtype = "bfloat16", DTYPES["bfloat16"]
    rows, hidden = 131073, 16384
    assert rows * hidden > 2 ** 31
    rs = cp.random.RandomState(_seed("2^31"))
    sample = sorted({0, 1, 65535, 65536, rows - 2, rows - 1}
                    | set(cp.asnumpy(rs.randint(0, rows, 58)).tolist()))
    idx = cp.asarray(sample)
    w = random_weight(rs, "same", 0.0, hidden, dtype)
    x = out = y = s = res = None
    try:
        x = cp.empty((rows, hidden), dtype)
        _fill_random(x, rs)
        out = cp.empty((rows, hidden), dtype)
        G.poison(out)
        y = rn.rms_norm(x, w, EPS, out=out)
        assert y is out
        assert G.count_nonfinite(out) == 0, "rms_norm left elements unwritten (NaN) or non-finite"
        msg = G.compare(G.take_rows(out, idx), G.reference(G.take_rows(x, idx), w, EPS), dtype_name)
        assert msg is None, f"rms_norm: {msg}"
        y = out = None
        cp.get_default_memory_pool().free_all_blocks()

        res = cp.empty((rows, hidden), dtype)
        _fill_random(res, rs)
        s0 = G.take_rows(x, idx) + G.take_rows(res, idx)      # CuPy's add in the dtype
        y, s = rn.fused_add_rms_norm(x, res, w, EPS, out=x, residual_out=res, casting_mode="llama")
        assert y is x and s is res
        msg = G.same_bits(G.take_rows(res, idx), s0)
        assert msg is None, f"fused residual_out: {msg}"
        msg = G.compare(G.take_rows(x, idx), G.reference(s0, w, EPS, 0.0, "llama"), dtype_name, "llama")
        assert msg is None, f"fused out: {msg}"
        assert G.count_nonfinite(x) == 0, "fused out has non-finite elements"
    finally:   # drop the 4.3 GB arrays even when an assert fails (the traceback keeps the frame)
        x = out = y = s = res = None
        cp.get_default_memory_pool().free_all_blocks()


# -- bad inputs: the CuPy path validates like the NumPy path and writes nothing ------------------

K = 64


def _bad_cases():
    """name -> (expected error, build(make, xp, r) -> (function, args, kwargs, watched)).

    ``make`` turns a NumPy array into the kind under test, ``r(shape, dtype)`` makes
    random NumPy data (the same for both kinds), ``watched`` are whole buffers that must
    come out unchanged.
    """
    rms = rn.rms_norm

    def x_only(make, r, **kw):
        x = make(r((4, K)))
        return rms, (x,), kw, [x]

    def with_out(make, r, out):
        x = make(r((4, K)))
        return rms, (x,), {"out": out}, [x, out]

    cases = {
        "x float64": (TypeError, lambda m, xp, r: (rms, (m(r((4, K), np.float64)),), {}, [])),
        "x int32": (TypeError, lambda m, xp, r: (rms, (m(np.arange(4 * K, dtype=np.int32).reshape(4, K)),), {}, [])),
        "x 0-d": (ValueError, lambda m, xp, r: (rms, (m(r((), np.float32)),), {}, [])),
        "hidden size 0": (ValueError, lambda m, xp, r: (rms, (m(r((4, 0))),), {}, [])),
        "eps nan": (ValueError, lambda m, xp, r: x_only(m, r, eps=float("nan"))),
        "eps negative": (ValueError, lambda m, xp, r: x_only(m, r, eps=-1e-6)),
        "eps None": (TypeError, lambda m, xp, r: x_only(m, r, eps=None)),
        "casting_mode": (ValueError, lambda m, xp, r: x_only(m, r, casting_mode="bf16")),
        "weight_offset without weight": (ValueError, lambda m, xp, r: x_only(m, r, weight_offset=1.0)),
        "weight shape": (ValueError, lambda m, xp, r: x_only(m, r, weight=m(r((K + 1,))))),
        "weight dtype": (TypeError, lambda m, xp, r: x_only(m, r, weight=m(r((K,), np.float16)))),
        "weight_offset nan": (ValueError, lambda m, xp, r: x_only(m, r, weight=m(r((K,))),
                                                                   weight_offset=float("nan"))),
        "out dtype": (TypeError, lambda m, xp, r: with_out(m, r, m(r((4, K), np.float32)))),
        "out shape": (ValueError, lambda m, xp, r: with_out(m, r, m(r((4, K + 1))))),
        "out strided last axis": (ValueError, lambda m, xp, r: _strided_out(m, r)),
        "out rows overlap each other": (ValueError, lambda m, xp, r: _broadcast_out(m, xp, r)),
        "out partially overlaps x": (ValueError, lambda m, xp, r: _partial_overlap(m, r)),
        "out overlaps weight": (ValueError, lambda m, xp, r: _out_is_weight(m, r)),
        "residual dtype": (TypeError, lambda m, xp, r: _fused(m, r, res=m(r((4, K), np.float16)))),
        "residual shape": (ValueError, lambda m, xp, r: _fused(m, r, res=m(r((4, K - 1))))),
        "residual_out dtype": (TypeError, lambda m, xp, r: _fused(m, r, residual_out=m(r((4, K), np.float32)))),
        "residual_out partially overlaps residual": (ValueError, lambda m, xp, r: _res_out_partial(m, r)),
        "out is residual_out": (ValueError, lambda m, xp, r: _out_is_res_out(m, r)),
    }
    return cases


def _fused(make, r, res=None, **kw):
    x = make(r((4, K)))
    res = make(r((4, K))) if res is None else res
    return rn.fused_add_rms_norm, (x, res), kw, [x, res] + [v for v in kw.values()]


def _strided_out(make, r):
    x, ob = make(r((4, K))), make(r((4, 2 * K)))
    return rn.rms_norm, (x,), {"out": ob[:, ::2]}, [x, ob]


def _broadcast_out(make, xp, r):
    # a writeable zero-stride view (NumPy's broadcast_to is read-only, refused for that first)
    x, ob = make(r((4, K))), make(r((1, K)))
    out = xp.lib.stride_tricks.as_strided(ob, (4, K), (0, ob.strides[1]))
    return rn.rms_norm, (x,), {"out": out}, [x, ob]


def _partial_overlap(make, r):
    buf = make(r((5, K)))
    return rn.rms_norm, (buf[:4],), {"out": buf[1:]}, [buf]


def _out_is_weight(make, r):
    x, o = make(r((4, K))), make(r((4, K)))
    return rn.rms_norm, (x, o[1]), {"out": o}, [x, o]


def _res_out_partial(make, r):
    x, rb = make(r((4, K))), make(r((5, K)))
    return rn.fused_add_rms_norm, (x, rb[:4]), {"residual_out": rb[1:]}, [x, rb]


def _out_is_res_out(make, r):
    x, res, o = make(r((4, K))), make(r((4, K))), make(r((4, K)))
    return rn.fused_add_rms_norm, (x, res), {"out": o, "residual_out": o}, [x, res, o]


BAD_CASE_NAMES = tuple(_bad_cases())


def _to_cupy(a):
    """A NumPy array on the GPU, bit for bit (bfloat16 through its bits)."""
    if a.dtype == DTYPES["bfloat16"]:
        return cp.asarray(a.view(np.uint16)).view(a.dtype)
    return cp.asarray(a)


def _raw(a, xp):
    return xp.ascontiguousarray(a).reshape(-1).view(xp.uint8).copy()


def _outcome(name, xp):
    """(exception or None, list of watched buffers that changed) for one kind."""
    expected, build = _bad_cases()[name]
    rng = np.random.default_rng(_seed("bad", name))

    def r(shape, dtype=DTYPES["bfloat16"]):
        return np.asarray(rng.standard_normal(shape) + 0.5).astype(dtype)

    make = (lambda a: a) if xp is np else _to_cupy
    fn, args, kwargs, watched = build(make, xp, r)
    before = [_raw(a, xp) for a in watched]
    err = None
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - compared below
        err = e
    if xp is not np:
        cp.cuda.Device().synchronize()
    changed = [i for i, (a, b) in enumerate(zip(watched, before)) if not bool((_raw(a, xp) == b).all())]
    return expected, err, changed


def _normalized(err):
    return re.sub(r"0x[0-9a-fA-F]+", "0x?", str(err))


@pytest.mark.parametrize("name", BAD_CASE_NAMES)
def test_bad_inputs_cupy_matches_numpy(name):
    expected, np_err, np_changed = _outcome(name, np)
    _, cp_err, cp_changed = _outcome(name, cp)
    assert isinstance(np_err, expected), f"NumPy path: expected {expected.__name__}, got {np_err!r}"
    assert isinstance(cp_err, expected), f"CuPy path: expected {expected.__name__}, got {cp_err!r}"
    assert type(cp_err) is type(np_err) and _normalized(cp_err) == _normalized(np_err), \
        f"CuPy and NumPy paths disagree:\n  NumPy: {np_err!r}\n  CuPy:  {cp_err!r}"
    assert not cp_changed, f"the failing CuPy call wrote into watched buffers {cp_changed}"
    assert not np_changed, f"the failing NumPy call wrote into watched buffers {np_changed}"


def test_mixed_array_kinds_rejected():
    dtype = DTYPES["bfloat16"]
    host = (np.random.default_rng(0).standard_normal((4, K)) + 0.5).astype(dtype)
    x = _to_cupy(host)
    before = _raw(x, cp)
    with pytest.raises(TypeError, match="weight"):
        rn.rms_norm(x, np.ones(K, dtype))
    with pytest.raises(TypeError, match="out"):
        rn.rms_norm(x, out=np.empty((4, K), dtype))
    with pytest.raises(TypeError, match="residual"):
        rn.fused_add_rms_norm(host, x)
    cp.cuda.Device().synchronize()
    assert bool((_raw(x, cp) == before).all())


def test_launcher_fast_path_still_rejects_overlap():
    """A valid call leaves a launcher for its signature; a later call with the same
    shapes and strides but overlapping memory must still be refused, writing nothing."""
    dtype = DTYPES["bfloat16"]
    rng = np.random.default_rng(_seed("fast path overlap"))

    def arr(shape):
        return _to_cupy((rng.standard_normal(shape) + 0.5).astype(dtype))

    # out partially overlapping x
    buf, other = arr((5, K)), arr((5, K))
    rn.rms_norm(buf[:4], out=other[1:])                 # valid: leaves the launcher
    buf_before = _raw(buf, cp)
    with pytest.raises(ValueError, match="partially overlaps"):
        rn.rms_norm(buf[:4], out=buf[1:])
    # out overlapping the weight
    x1, o1, w1 = arr((4, K)), arr((4, K)), arr((K,))
    rn.rms_norm(x1, w1, out=o1)
    o1_before = _raw(o1, cp)
    with pytest.raises(ValueError, match="weight"):
        rn.rms_norm(x1, o1[1], out=o1)
    # out and residual_out sharing memory
    x2, r2, o2, ro2 = arr((4, K)), arr((4, K)), arr((4, K)), arr((4, K))
    rn.fused_add_rms_norm(x2, r2, out=o2, residual_out=ro2)
    o2_before, x2_before, r2_before = _raw(o2, cp), _raw(x2, cp), _raw(r2, cp)
    with pytest.raises(ValueError, match="share memory"):
        rn.fused_add_rms_norm(x2, r2, out=o2, residual_out=o2)
    cp.cuda.Device().synchronize()
    assert bool((_raw(buf, cp) == buf_before).all()), "a refused call wrote into x / out"
    assert bool((_raw(o1, cp) == o1_before).all()), "a refused call wrote into out / weight"
    for a, before in ((o2, o2_before), (x2, x2_before), (r2, r2_before)):
        assert bool((_raw(a, cp) == before).all()), "a refused fused call wrote"


# -- agreement with PyTorch and Hugging Face ---------------------------------------------------------

def _torch_to_cupy(t):
    """A zero-copy CuPy view of a CUDA tensor (16-bit dtypes through int16 bits)."""
    import torch
    if t.dtype == torch.float32:
        return cp.from_dlpack(t)
    name = str(t.dtype).replace("torch.", "")
    return cp.from_dlpack(t.view(torch.int16)).view(DTYPES[name])


def _agreement(ours, theirs_t, dtype_name, ulps):
    """None when ours is within ``ulps`` of torch's result and, for 16-bit dtypes, at
    least 90% bit-identical (both compute in float32 and round the same way, so only
    float32 sum-order noise may flip a rounding), else why not."""
    import torch
    torch.cuda.synchronize()
    theirs = _torch_to_cupy(theirs_t.contiguous())
    msg = G.compare(ours, G.to_float64(theirs).reshape(-1, ours.shape[-1]), dtype_name, ulps=ulps)
    if msg:
        return msg
    if dtype_name != "float32":
        same = float(cp.mean(G.bits(ours) == G.bits(theirs)))
        if same < 0.9:
            return f"only {same:.1%} of elements bit-identical"
    return None


def _hf_norms(torch):
    """transformers' LlamaRMSNorm and GemmaRMSNorm forwards when transformers is there,
    else line-for-line copies of them."""
    try:
        from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
    except Exception:  # noqa: BLE001 - any import problem: use the copies
        LlamaRMSNorm = GemmaRMSNorm = None

    def llama(h, weight, eps):
        if LlamaRMSNorm is not None:
            m = LlamaRMSNorm(h.shape[-1], eps=eps).to(device=h.device, dtype=weight.dtype)
            with torch.no_grad():
                m.weight.copy_(weight)
                return m(h)
        dtype = h.dtype
        h = h.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + eps)
        return weight * h.to(dtype)

    def gemma(h, weight, eps):   # output * (1 + weight): weight_offset=1, rounded once
        if GemmaRMSNorm is not None:
            m = GemmaRMSNorm(h.shape[-1], eps=eps).to(device=h.device, dtype=weight.dtype)
            with torch.no_grad():
                m.weight.copy_(weight)
                return m(h)
        out = h.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + eps)
        return (out * (1.0 + weight.float())).type_as(h)

    return llama, gemma


def _torch_inputs(torch, dtype_name, hidden, seed, rows=33):
    g = torch.Generator(device="cuda").manual_seed(seed)
    tdt = getattr(torch, dtype_name)
    xt = (torch.randn(rows, hidden, device="cuda", generator=g) * 3).to(tdt)
    rt = (torch.randn(rows, hidden, device="cuda", generator=g) * 3).to(tdt)
    wt = (1 + 0.5 * torch.randn(hidden, device="cuda", generator=g)).to(tdt)
    return xt, rt, wt


@requires_torch_gpu
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
@pytest.mark.parametrize("op", OPS)
def test_agrees_with_torch_rms_norm(op, dtype_name):
    """casting_mode="fp32" against torch.nn.functional.rms_norm (fused: on x + residual
    added by torch in the dtype, which residual_out must equal bit for bit)."""
    import torch
    for hidden in (7, 4096, 5120, 65536):
        xt, rt, wt = _torch_inputs(torch, dtype_name, hidden, _seed("torch", op, dtype_name, hidden))
        st = xt + rt if op == FUSED else xt
        torch.cuda.synchronize()
        x, res = _torch_to_cupy(xt), _torch_to_cupy(rt)
        for weight_t in (None, wt):
            want = torch.nn.functional.rms_norm(st, (hidden,), weight_t, EPS)
            w = None if weight_t is None else _torch_to_cupy(weight_t)
            y, s = _call(op, x, res, w, "fp32")
            if op == FUSED:
                torch.cuda.synchronize()
                msg = G.same_bits(s, _torch_to_cupy(st))
                assert msg is None, f"hidden={hidden}: residual_out vs torch's x + residual: {msg}"
            msg = _agreement(y, want, dtype_name, ulps=2)
            assert msg is None, f"hidden={hidden} weight={weight_t is not None}: {msg}"


@requires_torch_gpu
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
@pytest.mark.parametrize("op", OPS)
def test_agrees_with_hf_llama_and_gemma_rms_norm(op, dtype_name):
    """casting_mode="llama" against HF LlamaRMSNorm; casting_mode="fp32" with
    weight_offset=1 against HF GemmaRMSNorm (weights stored as w - 1)."""
    import torch
    llama, gemma = _hf_norms(torch)
    for hidden in (7, 4096, 5120, 65536):
        xt, rt, wt = _torch_inputs(torch, dtype_name, hidden, _seed("hf", op, dtype_name, hidden))
        st = xt + rt if op == FUSED else xt
        torch.cuda.synchronize()
        x, res, w = _torch_to_cupy(xt), _torch_to_cupy(rt), _torch_to_cupy(wt)
        with torch.no_grad():
            want_llama = llama(st, wt, EPS)
            want_gemma = gemma(st, wt - 1, EPS)
        torch.cuda.synchronize()
        w_gemma = _torch_to_cupy((wt - 1).contiguous())
        y, _ = _call(op, x, res, w, "llama")
        msg = _agreement(y, want_llama, dtype_name, ulps=2)
        assert msg is None, f"hidden={hidden} llama: {msg}"
        y, _ = _call(op, x, res, w_gemma, "fp32", weight_offset=1.0)
        msg = _agreement(y, want_gemma, dtype_name, ulps=2)
        assert msg is None, f"hidden={hidden} gemma: {msg}"
