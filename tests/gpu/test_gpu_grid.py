"""The GPU correctness grid: the CuPy path against a float64 reference on the GPU, over
every op, dtype, hidden size, row count, casting mode, weight, layout and placement.

Needs a CUDA GPU (run on the H200 with ``python3 -m pytest -n 8 tests/gpu/test_gpu_grid.py``);
skipped, with the reason shown, everywhere else. The reference (tests/gpu_reference.py)
follows the numerics contract of cupy_rmsnorm/_reference.py in float64.

How test_grid covers the grid
-----------------------------
The factors: op (2) x dtype (3) x hidden (12) x casting mode (fp32, llama) x weight (None;
x's dtype or float32, each with weight_offset 0 and 1) x layout (2d; 3d (rows, 2, hidden);
strided rows x[:, :hidden] of a (rows, hidden + 3) buffer; a flat buffer sliced at element
offset 1; the two query heads (rows, 2, head_dim) of a (tokens, 4 heads, head_dim) QKV
buffer) x placement (out-of-place into NaN-poisoned outputs; in place; for the 2d layout
also out=None and, for the fused op, the swapped in-place form out=residual,
residual_out=x) x rows (0, 1, 3, 257, 4096; the 3d and QKV layouts hold 2 x rows rows).
One pytest item per (op, dtype, hidden, rows, 2d-like or 3d-like layouts, mode, weight),
about 6,800 items, named so that ``-k`` picks one (e.g. ``-k "fused_add_rms_norm and
bfloat16 and hidden4096 and rows257x2 and llama and w_float32+1"``); inside, it runs
every (layout, placement) of its leading axes on one set of inputs and reference.
- Shapes are capped at MAX_ELEMENTS = 2**27 elements per array: rows=4096 runs in full for
  every hidden size up to 16384 (4096 x 16384 is 2**26 in 2d, 2**27 in 3d), and becomes
  2048 (2d) / 1024 (3d) rows at hidden 65536 and 512 / 256 at 262144 (``rows4096cap2048``).
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
vectors per thread) and process (CuPy's disk cache shares them between processes).
"""

import math

import pytest
from helpers import DTYPE_NAMES, DTYPES, EPS, FUSED, MODES, OPS, gpu_missing, requires_gpu, seed

import cupy_rmsnorm as rn

if gpu_missing() is None:
    import cupy as cp
    import gpu_reference as G

pytestmark = [requires_gpu, pytest.mark.usefixtures("free_gpu_memory")]

HIDDEN = (1, 7, 255, 256, 1000, 4095, 4096, 5120, 8192, 16384, 65536, 262144)
ROWS = (0, 1, 3, 257, 4096)
WEIGHTS = ((None, 0.0), ("same", 0.0), ("same", 1.0), ("float32", 0.0), ("float32", 1.0))
LAYOUTS = ("2d", "3d", "strided", "offset", "qkv")
LEAD = {"2d": 1, "3d": 2, "strided": 1, "offset": 1, "qkv": 2}   # rows per leading index
PAD = 3                   # strided layout: row stride hidden + 3 (odd: rows start unaligned)
OFFSET_ROOM = 8           # offset layout: spare elements around the slice
MAX_ELEMENTS = 2 ** 27    # cap on rows x hidden per array (8 xdist workers share the GPU)
BIG_ELEMENTS = 2 ** 22    # past this, the thinned (mode x weight) rotation applies
CHUNK_ELEMENTS = 2 ** 24  # the float64 reference is computed this many elements at a time
MAX_FAILURES = 25         # per item: stop collecting after this many


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
        x = G.normal(rs, shape)
        if x.size:
            x *= cp.exp(rs.uniform(math.log(2.0), math.log(8.0), size=shape[:-1] + (1,),
                                   dtype=cp.float32))
        self.x = G.from_float32(x, dtype)
        self.res = G.from_float32(G.normal(rs, shape, 3.0), dtype) if fused else None
        self.w = G.random_weight(rs, wkind, weight_offset, hidden, dtype)
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


def grid_cases(op, hidden):
    """(rows, shape, mode, weight kind, weight_offset, [(layout, placement)]) for every item
    of one (op, hidden): the calls of one item share its data (shape, mode, weight).
    Big shapes are thinned as the module docstring says."""
    pairs = [(m, wk, wo) for m in MODES for wk, wo in WEIGHTS]
    combos = [(lay, pl) for lay in LAYOUTS for pl in placements(op, lay)]
    for ri, rows in enumerate(ROWS):
        for lead in (1, 2):
            n = min(rows, MAX_ELEMENTS // (lead * hidden))
            big = n * lead * hidden > BIG_ELEMENTS
            shape = (n, hidden) if lead == 1 else (n, 2, hidden)
            for j, (mode, wk, wo) in enumerate(pairs):
                calls = [(layout, placement) for ci, (layout, placement) in enumerate(combos)
                         if LEAD[layout] == lead
                         and not (big and (layout, placement) != ("2d", "out") and j != (3 * ci + ri) % len(pairs))]
                if calls:
                    yield rows, shape, mode, wk, wo, calls


def _case_id(op, dtype_name, hidden, rows, shape, mode, wk, wo):
    """e.g. fused_add_rms_norm-bfloat16-hidden4096-rows257x2-llama-w_float32+1 (rows4096cap2048: capped)"""
    n = f"rows{rows}" if shape[0] == rows else f"rows{rows}cap{shape[0]}"
    return (f"{op}-{dtype_name}-hidden{hidden}-{n}{'x2' if len(shape) == 3 else ''}-{mode}-"
            f"w_{'none' if wk is None else wk}{'+1' if wo else ''}")


GRID = [pytest.param(op, dtype_name, hidden, rows, shape, mode, wk, wo, calls,
                     id=_case_id(op, dtype_name, hidden, rows, shape, mode, wk, wo))
        for op in OPS for dtype_name in DTYPE_NAMES for hidden in HIDDEN
        for rows, shape, mode, wk, wo, calls in grid_cases(op, hidden)]
if gpu_missing() is not None:    # no GPU: one item skips with the reason, not thousands
    GRID = [pytest.param(*[None] * 9, id=f"all-{len(GRID)}-cases")]


@pytest.mark.parametrize("op, dtype_name, hidden, rows, shape, mode, wkind, weight_offset, calls", GRID)
def test_grid(op, dtype_name, hidden, rows, shape, mode, wkind, weight_offset, calls):
    """Every (layout, placement) of one (op, dtype, hidden, rows, mode, weight)."""
    rs = cp.random.RandomState(seed(op, dtype_name, hidden, rows, shape, mode, wkind, weight_offset))
    data = Data(rs, op == FUSED, dtype_name, shape, mode, wkind, weight_offset)
    failures, n_calls = [], 0
    for layout, placement in calls:
        where = (f"[{mode} weight={'none' if wkind is None else wkind}{'+1' if weight_offset else ''} {layout} "
                 f"{placement} rows={shape[0]}{'x2' if len(shape) == 3 else ''}]")
        # The first call of a signature is validated in full and leaves a launcher behind;
        # the second (new buffers, same shapes and strides) takes the launcher's fast path.
        for attempt in ("first call", "repeat call"):
            n_calls += 1
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
    assert n_calls > 0
    assert not failures, f"{len(failures)} failing of {n_calls} calls run:\n" + "\n".join(failures)
