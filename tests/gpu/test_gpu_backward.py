"""GPU tests of the backward: the kernels against a float64 reference, determinism, torch
autograd through the registered ops (eager and torch.compile), opcheck.

Needs a CUDA GPU (run on the H200 with ``python3 -m pytest -n 8 tests/gpu/test_gpu_backward.py``);
skipped, with the reason shown, everywhere else.

test_grid: one item per (op, dtype, hidden); op is ``rms_norm``, ``fused`` (the fused op's
backward without a residual_out gradient) or ``fused_dres`` (with one), so ``-k
"fused_dres and bfloat16 and 4095"`` picks one item. Inside, casting mode x weight (None;
x's dtype or float32, with weight_offset 0 and 1) x input layout (2d; 3d (rows, 2, hidden);
strided rows x[:, :hidden] of a (rows, hidden + 3) buffer (each row at another alignment); a
flat buffer sliced at element offset 1; the two query heads (rows, 2, head_dim) of a (rows,
4 heads, head_dim) buffer; "mixed": dy one element off x's alignment, so the scalar path)
x rows (1, 3, 257, 4096; 3d and the heads hold 2 x rows). Shapes are capped at MAX_ELEMENTS
per array; past BIG_ELEMENTS each (layout) runs one (mode, weight) pair, rotating. Every
call checks: dx against the float64 gradient (within half a unit in the last place of the
dtype plus float32 noise relative to the magnitudes that meet in it), dweight likewise (in
the weight's dtype), the returned types, and that no input changed. A failure names the
call, the array and the first bad element with its tolerance.
"""

import math
import zlib

import numpy as np
import pytest
from helpers import DTYPES, gpu_missing, requires_gpu, torch_cuda_missing

import cupy_rmsnorm as rn
from cupy_rmsnorm import _abi, _cache, _driver, _launcher, _layout, _pipeline
from cupy_rmsnorm.ops.backward import launch as backward_launch

if gpu_missing() is None:
    import cupy as cp
    import gpu_reference as G

pytestmark = requires_gpu
requires_torch_gpu = pytest.mark.skipif(torch_cuda_missing() is not None,
                                        reason=f"torch GPU test: {torch_cuda_missing()}")

OPS = ("rms_norm", "fused", "fused_dres")
HIDDEN = (1, 7, 255, 4096, 4095, 8192, 65536)
ROWS = (1, 3, 257, 4096)
MODES = ("fp32", "llama")
WEIGHTS = ((None, 0.0), ("same", 0.0), ("same", 1.0), ("float32", 0.0), ("float32", 1.0))
LAYOUTS = {"2d": 1, "strided": 1, "offset": 1, "mixed": 1, "3d": 2, "qkv": 2}   # rows per leading index
PAD = 3
MAX_ELEMENTS = 2 ** 24
BIG_ELEMENTS = 2 ** 21
EPS = 1e-6
# float32 arithmetic against float64, relative to the magnitudes that meet in a result: dx
# (sums over the row, rsqrtf) and dweight (sums over up to a few thousand rows)
NOISE_DX = 2e-5
NOISE_DW = 3e-5
MANTISSA = {"float32": 23, "float16": 10, "bfloat16": 7}
MIN_SPACING = {"float32": 2.0 ** -149, "float16": 2.0 ** -24, "bfloat16": 2.0 ** -133}


def _seed(*parts):
    return zlib.crc32("-".join(map(str, parts)).encode())


@pytest.fixture(autouse=True)
def _free_gpu_memory():
    yield
    if gpu_missing() is None:
        cp.get_default_memory_pool().free_all_blocks()


# -- the float64 reference ------------------------------------------------------------------

def spacing(a64, dtype_name):
    _, e = cp.frexp(a64)
    return cp.maximum(cp.exp2(e.astype(cp.float64) - 1 - MANTISSA[dtype_name]), MIN_SPACING[dtype_name])


def backward_reference(dy, x, weight, weight_offset, mode, dres=None):
    """float64 (dx, dweight, dx tolerance, dweight tolerance) for (rows, hidden) arrays.

    dx = r (g - xhat mean(g xhat)) (+ dres), dweight = sum_rows dy xhat (llama: xhat rounded to
    x's dtype); the weight offset is added in float32, as the contract says."""
    hidden = x.shape[-1]
    x64, dy64 = G.to_float64(x).reshape(-1, hidden), G.to_float64(dy).reshape(-1, hidden)
    r = 1.0 / cp.sqrt(cp.mean(x64 * x64, axis=-1, keepdims=True) + EPS)
    xhat = x64 * r
    w = 1.0
    if weight is not None:
        w = (G.to_float32(weight) + np.float32(weight_offset)).astype(cp.float64)
    g = dy64 * w
    dx = r * (g - xhat * cp.mean(g * xhat, axis=-1, keepdims=True))
    scale = r * (cp.abs(g) + cp.abs(xhat) * cp.mean(cp.abs(g * xhat), axis=-1, keepdims=True))
    if dres is not None:
        d64 = G.to_float64(dres).reshape(-1, hidden)
        dx, scale = dx + d64, scale + cp.abs(d64)
    dname = G.name(x.dtype)
    dx_tol = 0.5 * spacing(dx, dname) + NOISE_DX * scale
    if weight is None:
        return dx, None, dx_tol, None
    xw = G.round_to(xhat, x.dtype) if mode == "llama" else xhat
    dw = cp.sum(dy64 * xw, axis=0)
    dw_tol = 0.5 * spacing(dw, G.name(weight.dtype)) + NOISE_DW * cp.sum(cp.abs(dy64 * xw), axis=0)
    if mode == "llama" and dname != "float32":      # an xhat at a rounding midpoint may round the other way
        dw_tol = dw_tol + cp.max(cp.abs(dy64) * spacing(xw, dname), axis=0)
    return dx, dw, dx_tol, dw_tol


def clone(a):
    """A contiguous copy of ``a`` made through its bits (any dtype, bfloat16 included)."""
    c = cp.empty(a.shape, a.dtype)
    G.bits(c)[...] = G.bits(a)
    return c


def compare(name, got, ref, tol):
    """None when got (reshaped to ref's shape) is within tol of ref everywhere, else why not."""
    g = G.to_float64(got).reshape(ref.shape)
    ok = (cp.abs(g - ref) <= tol) | (g == ref)
    if bool(ok.all()):
        return None
    bad = cp.argwhere(~ok)
    first = tuple(int(i) for i in bad[0])
    nan = int(cp.count_nonzero(cp.isnan(g)))
    worst = float(cp.nanmax(cp.where(ok, 0.0, cp.abs(g - ref) / tol)))
    return (f"{name}: {int(bad.shape[0])} of {g.size} elements off (first at {first}: got {float(g[first])!r}, "
            f"want {float(ref[first])!r}, allowed +-{float(tol[first]):.3g}; worst {worst:.3g}x the "
            f"tolerance; {nan} NaN)")


# -- inputs in layouts ------------------------------------------------------------------------

def normal(rs, shape, scale=1.0):
    if math.prod(shape) == 0:
        return cp.zeros(shape, cp.float32)
    return rs.standard_normal(shape, dtype=cp.float32) * scale


def place(layout, data, dtype, for_dy=False):
    """``data`` (contiguous) copied into a view of ``layout`` inside a NaN-poisoned buffer."""
    rows, hidden = data.shape[0], data.shape[-1]
    if layout in ("2d", "3d") or (layout == "mixed" and not for_dy):
        buf = cp.empty(data.shape, dtype)
        view = buf
    elif layout == "strided":
        buf = cp.empty((rows, hidden + PAD), dtype)
        view = buf[:, :hidden]
    elif layout in ("offset", "mixed"):
        buf = cp.empty(rows * hidden + 8, dtype)
        view = buf[1:1 + rows * hidden].reshape(rows, hidden)
    elif layout == "qkv":
        buf = cp.empty((rows, 4, hidden), dtype)
        view = buf[:, :2]
    else:
        raise AssertionError(layout)
    G.poison(buf)
    if view.size:
        G.bits(view)[...] = G.bits(data)
    return view


class Data:
    """Fresh inputs and the float64 reference for one (shape, mode, weight, op)."""

    def __init__(self, rs, op, dtype_name, shape, mode, wkind, weight_offset):
        dtype = DTYPES[dtype_name]
        hidden = shape[-1]
        x = normal(rs, shape)
        if x.size:
            x *= cp.exp(rs.uniform(math.log(2.0), math.log(8.0), size=shape[:-1] + (1,), dtype=cp.float32))
        self.x = G.from_float32(x, dtype)
        self.dy = G.from_float32(normal(rs, shape), dtype)
        self.dres = G.from_float32(normal(rs, shape), dtype) if op == "fused_dres" else None
        self.w = None
        if wkind is not None:
            w = normal(rs, (hidden,), 0.5) + (0.0 if weight_offset else 1.0)
            self.w = G.from_float32(w, dtype if wkind == "same" else np.float32)
        self.op, self.mode, self.weight_offset = op, mode, weight_offset
        self.ref = backward_reference(self.dy, self.x, self.w, weight_offset, mode, self.dres)


def run_call(data, layout):
    """One backward call with the inputs in ``layout``; None if every check passes, else why not."""
    dtype = data.x.dtype
    x = place(layout, data.x, dtype)
    dy = place(layout, data.dy, dtype, for_dy=True)
    dres = None if data.dres is None else place(layout, data.dres, dtype, for_dy=True)
    held = [(a, clone(a)) for a in (x, dy, dres) if a is not None]
    kwargs = {"weight_offset": data.weight_offset, "casting_mode": data.mode}
    if data.op == "rms_norm":
        result = rn.rms_norm_backward(dy, x, data.w, EPS, **kwargs)
    else:
        result = rn.fused_add_rms_norm_backward(dy, dres, x, data.w, EPS, **kwargs)
    if not (isinstance(result, tuple) and len(result) == 2):
        return f"returned {type(result).__name__}, not (dx, dweight)"
    dx, dw = result
    if not isinstance(dx, cp.ndarray) or dx.shape != x.shape or dx.dtype != dtype or not dx.flags.c_contiguous:
        return f"dx is {type(dx).__name__} {getattr(dx, 'shape', '')} {getattr(dx, 'dtype', '')} (not contiguous?)"
    if data.w is None:
        if dw is not None:
            return "dweight is not None without a weight"
    elif not isinstance(dw, cp.ndarray) or dw.shape != data.w.shape or dw.dtype != data.w.dtype:
        return f"dweight is {type(dw).__name__} {getattr(dw, 'shape', '')} {getattr(dw, 'dtype', '')}"
    ref_dx, ref_dw, tol_dx, tol_dw = data.ref
    msg = compare("dx", dx, ref_dx, tol_dx)
    if msg is None and data.w is not None:
        msg = compare("dweight", dw, ref_dw, tol_dw)
    if msg:
        return msg
    for a, copy in held:
        if int(G.count_differing_bits(a, copy)):
            return "an input was written"
    return None


def grid_calls(hidden):
    pairs = [(m, wk, wo) for m in MODES for wk, wo in WEIGHTS]
    for ri, rows in enumerate(ROWS):
        for lead in (1, 2):
            n = min(rows, MAX_ELEMENTS // (lead * hidden))
            shape = (n, hidden) if lead == 1 else (n, 2, hidden)
            big = n * lead * hidden > BIG_ELEMENTS
            for j, (mode, wk, wo) in enumerate(pairs):
                for li, layout in enumerate(LAYOUTS):
                    if LAYOUTS[layout] != lead:
                        continue
                    if big and j != (3 * li + ri) % len(pairs):
                        continue
                    yield (shape, mode, wk, wo), layout


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("op", OPS)
def test_grid(op, dtype_name, hidden):
    rs = cp.random.RandomState(_seed(op, dtype_name, hidden))
    failures, calls = [], 0
    data = data_key = None
    for key, layout in grid_calls(hidden):
        shape, mode, wk, wo = key
        if key != data_key:
            data, data_key = Data(rs, op, dtype_name, shape, mode, wk, wo), key
        where = (f"[{op} {dtype_name} hidden={hidden} {mode} weight={'none' if wk is None else wk}"
                 f"{'+1' if wo else ''} {layout} rows={shape[0]}{'x2' if len(shape) == 3 else ''}]")
        calls += 1
        try:
            msg = run_call(data, layout)
        except (cp.cuda.runtime.CUDARuntimeError, cp.cuda.driver.CUDADriverError) as e:
            failures.append(f"{where}: CUDA error, stopping (the context is likely gone): {e}")
            break
        except Exception as e:  # noqa: BLE001 - report every failing call
            msg = f"raised {type(e).__name__}: {e}"
        if msg:
            failures.append(f"{where}: {msg}")
        if len(failures) >= 25:
            break
    assert calls > 0
    assert not failures, f"{len(failures)} failing of {calls} calls run:\n" + "\n".join(failures)


# -- every kernel shape, forced -------------------------------------------------------------

# (forced backward_plan arguments, hidden size per dtype's item size): each within what the
# forced geometry covers at full vector width (threads x vectors x vec >= hidden)
FORCED = {
    "stream": ({"vecs_per_thread": 0}, {4: 4096, 2: 4096}),
    "block-1024": ({"threads_per_row": 1024, "vecs_per_thread": 1}, {4: 4096, 2: 8000}),
    "warp-group-32": ({"threads_per_row": 32, "vecs_per_thread": 2}, {4: 255, 2: 511}),
    # staged (sm_90+): four steps a row, and two stages refilled as the block loops
    "staged-128x4": ({"threads_per_row": 128, "vecs_per_thread": 4, "stages": 2}, {4: 2048, 2: 4096}),
    "staged-512x1": ({"threads_per_row": 512, "vecs_per_thread": 1, "stages": 3}, {4: 1500, 2: 3000}),
    # rows two at a time, five stages (a ring that is not a whole number of steps)
    "staged-256x2-pairs": ({"threads_per_row": 256, "vecs_per_thread": 2, "stages": 5, "rows_per_step": 2},
                           {4: 2048, 2: 4096}),
}


@pytest.mark.parametrize("case", list(FORCED))
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_forced_plans(case, dtype_name):
    """The streamed and block variants on ordinary rows (the grid meets the stream only at
    hidden 65536 and on the scalar path), and a warp group with rows of up to 64 vectors."""
    force, hidden_of = FORCED[case]
    if "stages" in force and not _driver.device(cp.cuda.Device().id).shared_per_sm:
        pytest.skip("staged rows need sm_90's bulk copies")
    hidden = hidden_of[np.dtype(DTYPES[dtype_name]).itemsize]
    rs = cp.random.RandomState(_seed("forced", dtype_name, case))
    plans, failures = [], []
    with _cache.forced_backward_plan(record=plans, **force):
        for op in OPS:
            # layouts that keep the full vector width (a strided x, or a qkv view, meets its
            # contiguous dx at another alignment: a narrower vector these geometries do not cover)
            for rows, layout, (mode, wk, wo) in ((257, "2d", ("llama", "same", 0.0)),
                                                 (150, "3d", ("fp32", "float32", 1.0)),
                                                 (33, "2d", ("fp32", None, 0.0))):
                shape = (rows, 2, hidden) if layout in ("qkv", "3d") else (rows, hidden)
                msg = run_call(Data(rs, op, dtype_name, shape, mode, wk, wo), layout)
                if msg:
                    failures.append(f"[{case} {op} {layout} rows={rows} {mode} {wk}+{wo}] {msg}")
    assert plans and all(p.vecs_per_thread == force["vecs_per_thread"] for p in plans), plans
    assert all(p.vec == 16 // np.dtype(DTYPES[dtype_name]).itemsize for p in plans), plans
    assert not failures, "\n".join(failures)


def test_a_plan_fitted_to_its_kernels_occupancy_keeps_that_kernel():
    """float32 rows of 4096: the heuristic gives 1000 rows the register kernel (1024 threads,
    one block an SM); planned again for that occupancy the rows would qualify for the staged
    kernel, which was not the one compiled (that launch failed: CUDA_ERROR_INVALID_VALUE)."""
    rs = cp.random.RandomState(_seed("replan", 1))
    plans = []
    with _cache.forced_backward_plan(record=plans):
        for op in OPS:
            msg = run_call(Data(rs, op, "float32", (1000, 4096), "fp32", "same", 0.0), "2d")
            assert msg is None, (op, msg)
    assert plans and all(p.variant == "registers" and p.block == 1024 for p in plans), plans


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("op", OPS)
def test_staged_rows_give_the_register_kernels_bits(op, dtype_name):
    """The staged kernel is the register kernel's arithmetic with the row read from shared
    memory: at the same geometry (one vector a thread, 512 threads) and the same blocks,
    dx and dweight are identical bit for bit."""
    if not _driver.device(cp.cuda.Device().id).shared_per_sm:
        pytest.skip("staged rows need sm_90's bulk copies")
    hidden = 4096 if np.dtype(DTYPES[dtype_name]).itemsize == 2 else 2048       # 512 vectors
    data = Data(cp.random.RandomState(_seed("staged bits", op, dtype_name)), op, dtype_name, (3000, hidden),
                "llama", "float32", 0.0)
    results, plans = [], []
    for staged in (False, True):
        with _cache.forced_backward_plan(record=plans, staged=staged, threads_per_row=512, vecs_per_thread=1):
            if op == "rms_norm":
                results.append(rn.rms_norm_backward(data.dy, data.x, data.w, EPS, casting_mode="llama"))
            else:
                dres = data.dres if op == "fused_dres" else None
                results.append(rn.fused_add_rms_norm_backward(data.dy, dres, data.x, data.w, EPS, casting_mode="llama"))
    assert [p.variant for p in plans] == ["registers", "staged"], plans
    assert plans[0].grid == plans[1].grid and plans[0].rows_per_block == plans[1].rows_per_block, plans
    for a, b in zip(*results):        # (dx, dweight): the same bytes
        assert a.dtype == b.dtype and a.shape == b.shape and bool(cp.array_equal(a.view(cp.uint8), b.view(cp.uint8)))


@pytest.mark.parametrize("vectors", [512, 128])
@pytest.mark.parametrize("stages", [4, 5])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("op", OPS)
def test_staged_pairs_give_the_one_row_kernels_bits(op, dtype_name, stages, vectors):
    """Rows two at a time (rows_per_step=2) are the one-row staged kernel's arithmetic and
    order: with the same blocks (one an SM, 21 rows each and 16 in the last) dx and
    dweight are identical bit for bit, with a ring of whole steps (4) and not (5), in
    blocks of 512 threads (rows of 512 vectors) and of 128 (128 vectors)."""
    d = _driver.device(cp.cuda.Device().id)
    if not d.shared_per_sm:
        pytest.skip("staged rows need sm_90's bulk copies")
    hidden = vectors * 16 // np.dtype(DTYPES[dtype_name]).itemsize
    data = Data(cp.random.RandomState(_seed("staged pairs", op, dtype_name)), op, dtype_name,
                (d.sm_count * 21 - 5, hidden), "fp32", "same", 0.5)
    results, plans = [], []
    for step in (1, 2):
        with _cache.forced_backward_plan(record=plans, rows_per_step=step, stages=stages, max_blocks_per_sm=1):
            if op == "rms_norm":
                results.append(rn.rms_norm_backward(data.dy, data.x, data.w, EPS, weight_offset=0.5))
            else:
                dres = data.dres if op == "fused_dres" else None
                results.append(rn.fused_add_rms_norm_backward(data.dy, dres, data.x, data.w, EPS, weight_offset=0.5))
    assert [(p.variant, p.rows_per_step, p.stages, p.grid) for p in plans] == \
        [("staged", 1, stages, d.sm_count), ("staged", 2, stages, d.sm_count)], plans
    assert plans[0].rows_per_block == 21 and all(p.threads_per_row == vectors for p in plans), plans
    for a, b in zip(*results):
        assert a.dtype == b.dtype and a.shape == b.shape and bool(cp.array_equal(a.view(cp.uint8), b.view(cp.uint8)))


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_staged_pairs_of_128_vectors_as_the_heuristic_plans_them(dtype_name):
    """Rows of 128 vectors are taken two at a time wherever they are staged: at 12 rows an SM
    three rows a block, all in the ring from the start (no refill, the last step one row);
    one row short of 24 an SM six a block with a last block of five, in four stages; one
    row short of 52 an SM 13 a block, in six; against the float64 reference."""
    d = _driver.device(cp.cuda.Device().id)
    if not d.shared_per_sm:
        pytest.skip("staged rows need sm_90's bulk copies")
    hidden = 128 * 16 // np.dtype(DTYPES[dtype_name]).itemsize
    rs = cp.random.RandomState(_seed("pairs of 128", dtype_name))
    plans, failures = [], []
    with _cache.forced_backward_plan(record=plans):      # no override: the heuristic's plans
        for rows, (mode, wk, wo) in ((d.sm_count * 12, ("llama", "float32", 0.0)),
                                     (d.sm_count * 24 - 1, ("fp32", "same", 1.0)),
                                     (d.sm_count * 52 - 1, ("llama", "same", 0.0))):
            for op in OPS:
                msg = run_call(Data(rs, op, dtype_name, (rows, hidden), mode, wk, wo), "2d")
                if msg:
                    failures.append(f"[{op} rows={rows} {mode} {wk}+{wo}] {msg}")
    assert {(p.variant, p.threads_per_row, p.vecs_per_thread, p.rows_per_step) for p in plans} == \
        {("staged", 128, 1, 2)}, plans
    assert {(p.rows_per_block, p.stages) for p in plans} >= {(3, 3), (6, 4), (13, 6)}, plans
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("op", OPS)
def test_row_kernel_gives_the_register_kernels_bits(op, dtype_name):
    """With no more rows than SMs a block takes one row in the row kernel, which writes its
    dy * xhat from registers as its partials (or as dweight, one block); the register
    kernel sums the same rows in shared memory first. Planned as for half the SMs, the
    same 64 rows go to the register kernel at the same geometry (a row a block, 64 blocks):
    dx and dweight are identical bit for bit (and 1 row: dweight written directly)."""
    d = _driver.device(cp.cuda.Device().id)
    hidden = 512 * (16 // np.dtype(DTYPES[dtype_name]).itemsize)        # 512 vectors: 512 threads
    for rows in (64, 1):
        data = Data(cp.random.RandomState(_seed("row bits", op, dtype_name, rows)), op, dtype_name, (rows, hidden),
                    "llama", "float32", 0.0)
        results, plans = [], []
        saved = d.sm_count
        try:
            for sms in (saved, max(rows // 2, 1) if rows > 1 else None):
                if sms is None:       # one row is the row kernel on any device: dweight direct
                    break
                d.sm_count = sms
                with _cache.forced_backward_plan(record=plans):
                    if op == "rms_norm":
                        results.append(rn.rms_norm_backward(data.dy, data.x, data.w, EPS, casting_mode="llama"))
                    else:
                        dres = data.dres if op == "fused_dres" else None
                        results.append(rn.fused_add_rms_norm_backward(data.dy, dres, data.x, data.w, EPS,
                                                                      casting_mode="llama"))
        finally:
            d.sm_count = saved
        assert compare("dx", results[0][0], data.ref[0], data.ref[2]) is None
        assert compare("dweight", results[0][1], data.ref[1], data.ref[3]) is None
        if rows == 1:
            assert [p.variant for p in plans] == ["row"] and plans[0].grid == 1, plans
            continue
        assert [p.variant for p in plans] == ["row", "registers"], plans
        assert all(p.grid == rows and p.rows_per_block == 1 for p in plans), plans
        for name, a, b in (("dx", results[0][0], results[1][0]), ("dweight", results[0][1], results[1][1])):
            msg = G.same_bits(a, b)
            assert msg is None, f"{name}: row kernel against register kernel: {msg}"


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("op", ("rms_norm", "fused_dres"))
def test_row_kernel_flags_compiled_in(op, dtype_name):
    """The row kernel has its flags compiled in, with two promises where they hold: rows of
    one stride (n_inner 1) and a weight aligned to its vectors. Every call below is checked
    against the float64 reference, and the calls that differ only where the data sits (a
    weight one element off its vectors, rows as the query heads of a wider buffer) or in
    whether dweight is wanted give the same bits as the plain call; the launcher compiled
    the flags each case should get."""
    hidden = 512 * (16 // np.dtype(DTYPES[dtype_name]).itemsize)
    fused = op != "rms_norm"
    for rows, mode in ((1, "llama"), (5, "fp32")):
        rs = cp.random.RandomState(_seed("row flags", op, dtype_name, rows))
        data = Data(rs, op, dtype_name, (rows, hidden), mode, "same", 1.0)
        arrays = dict(dy=data.dy, d_residual_out=data.dres, x=data.x)

        def call(weight_grad=True, heads=False, weight=data.w, arrays=arrays):
            if heads:                 # the same rows as heads 1 and 3 of (rows, 4, hidden): n_inner 2
                arrays = {k: None if a is None else place("qkv", cp.stack([a, a], axis=1), a.dtype)
                          for k, a in arrays.items()}
            spec = _pipeline.REGISTRY["fused_add_rms_norm_backward" if fused else "rms_norm_backward"]
            b = (arrays["dy"], arrays["x"], arrays["d_residual_out"], weight)
            dx, dw = _pipeline.call(spec, b, (EPS, 1.0, mode, weight_grad))
            return dx.reshape(rows, -1, hidden)[:, -1], dw

        _cache.clear()
        plain = call()
        assert compare("dx", plain[0], data.ref[0], data.ref[2]) is None
        assert compare("dweight", plain[1], data.ref[1], data.ref[3]) is None
        w_off = cp.empty(hidden + 1, data.w.dtype)
        w_off[1:] = data.w
        for kwargs in (dict(weight_grad=False), dict(weight=w_off[1:])):
            dx, dw = call(**kwargs)
            assert G.same_bits(dx, plain[0]) is None, kwargs
            assert (dw is None) if kwargs.get("weight_grad") is False else G.same_bits(dw, plain[1]) is None, kwargs
        dx, dw = call(heads=True)         # every row twice: dweight doubles (added in another order)
        assert G.same_bits(dx, plain[0]) is None
        assert compare("dweight", dw, 2 * data.ref[1], 2 * data.ref[3]) is None
        flags = {k[2] for launcher in backward_launchers() for k in launcher._row_kernels}
        base = (_abi.LLAMA if mode == "llama" else 0) | _abi.HAS_WEIGHT | (_abi.ADD_GRAD if fused else 0)
        grad = _abi.WEIGHT_GRAD | (_abi.DIRECT_WEIGHT if rows == 1 else 0)    # one block: dweight direct
        unit, vectors = _abi.UNIT_ROWS, _abi.WEIGHT_VECTORS
        # the heads of one row are rows of one stride (a leading axis of 1 is dropped); of 5, n_inner is 2
        heads = base | _abi.WEIGHT_GRAD | vectors | (unit if rows == 1 else 0)
        assert flags == {base | grad | unit | vectors,                          # plain
                         (base & ~_abi.LLAMA) | unit | vectors,           # no dweight: llama dropped
                         base | grad | unit,                                   # the weight off its vectors
                         heads}, sorted(flags)


def backward_launchers():
    """The BackwardLaunchers the signature cache holds (its entries are their bound __call__)."""
    return [entry.__self__ for entry in _cache.launches.values()
            if isinstance(getattr(entry, "__self__", None), backward_launch.BackwardLauncher)]


def test_no_rows():
    x = cp.zeros((0, 4096), cp.float16)
    w = cp.ones(4096, cp.float32)
    dx, dw = rn.rms_norm_backward(x, x, w)
    assert dx.shape == (0, 4096) and dw.dtype == np.float32 and not bool(dw.any())
    d, dw = rn.fused_add_rms_norm_backward(x, None, x, None)
    assert d.shape == (0, 4096) and dw is None


def test_fast_path_follows_each_calls_alignment():
    """Calls of one signature (shape, strides, dtypes) take the remembered launcher; one whose
    rows sit an element off the 16-byte grid, or whose dy is, still gets right results (the
    vector width and edges are worked out per call)."""
    _cache.clear()
    rs = cp.random.RandomState(_seed("fast path", 1))
    rows, hidden = 64, 4096
    data = Data(rs, "rms_norm", "bfloat16", (rows, hidden), "fp32", "same", 0.0)
    base = rn.rms_norm_backward(data.dy, data.x, data.w, EPS)
    assert compare("dx", base[0], data.ref[0], data.ref[2]) is None
    assert len(backward_launchers()) == 1
    for shift_x, shift_dy in ((1, 1), (0, 1), (1, 0)):
        x, dy = place("offset" if shift_x else "2d", data.x, data.x.dtype), place(
            "offset" if shift_dy else "2d", data.dy, data.dy.dtype)
        dx, dw = rn.rms_norm_backward(dy, x, data.w, EPS)
        assert compare("dx", dx, data.ref[0], data.ref[2]) is None, (shift_x, shift_dy)
        assert compare("dweight", dw, data.ref[1], data.ref[3]) is None, (shift_x, shift_dy)
    assert len(backward_launchers()) == 1      # one signature throughout


# -- determinism --------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(16384, 4096), (4096, 4095), (4096, 512), (33, 65536), (5000, 100)], ids=str)
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_same_inputs_give_the_same_bits(shape, dtype_name):
    """Two calls on the same inputs: identical dx and dweight bits (no float atomics; the
    reduction order is the plan's); the second call's outputs come from pool blocks that
    held NaN, so an unwritten element shows."""
    rs = cp.random.RandomState(_seed("determinism", shape, dtype_name))
    data = Data(rs, "fused_dres", dtype_name, shape, "llama", "float32", 0.0)
    first = rn.fused_add_rms_norm_backward(data.dy, data.dres, data.x, data.w, EPS, casting_mode="llama")
    kept = [clone(a) for a in first]
    assert compare("dx", first[0], data.ref[0], data.ref[2]) is None
    assert compare("dweight", first[1], data.ref[1], data.ref[3]) is None
    del first
    for a in kept:                   # hand the freed blocks back poisoned
        b = cp.empty_like(a)
        G.poison(b)
        del b
    second = rn.fused_add_rms_norm_backward(data.dy, data.dres, data.x, data.w, EPS, casting_mode="llama")
    for name, a, b in (("dx", second[0], kept[0]), ("dweight", second[1], kept[1])):
        msg = G.same_bits(a, b)
        assert msg is None, f"{name} differs between two calls: {msg}"


# -- torch --------------------------------------------------------------------------------------

def _torch_data(shape, dtype, seed, scale=1.0):
    import torch
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(shape, generator=gen, device="cuda") * scale).to(dtype)


def _f64_forward(x, w, eps, offset, mode, dtype):
    """The contract's forward in float64 for torch's autograd: llama mode rounds xhat to the
    dtype with a straight-through gradient (the rounding's derivative is taken as one, as
    the backward contract does)."""
    xhat = x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    if w is None:
        return xhat
    if mode == "llama":
        xhat = xhat + (xhat.to(dtype).double() - xhat).detach()
    return xhat * (w + offset)


def _torch_spacing(a, dtype_name):
    import torch
    _, e = torch.frexp(a)
    return torch.clamp(torch.exp2(e.double() - 1 - MANTISSA[dtype_name]), min=MIN_SPACING[dtype_name])


def _assert_grad(name, got, want, dtype_name, scale, extra=0.0):
    """got within half a spacing of the dtype plus float32 noise times scale (float64
    tensors), plus ``extra``."""
    g = got.double()
    tol = 0.5 * _torch_spacing(want, dtype_name) + 3e-5 * scale + extra
    bad = ~((g - want).abs() <= tol)
    assert not bool(bad.any()), (f"{name}: {int(bad.sum())} of {g.numel()} off; worst "
                                 f"{float(((g - want).abs() / tol).max()):.3g}x the tolerance")


@requires_torch_gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("weight_kind", ["same", "float32"])
def test_torch_autograd_matches_float64(dtype_name, mode, weight_kind):
    """Module-style calls through autograd (rms_norm then the fused op, both outputs used)
    against torch's float64 autograd of the contract's formula."""
    import torch
    dtype = getattr(torch, dtype_name)
    wdtype = dtype if weight_kind == "same" else torch.float32
    rows, hidden, eps, offset = 257, 1000, 1e-6, 0.5
    x0 = _torch_data((rows, hidden), dtype, 1, 3.0)
    r0 = _torch_data((rows, hidden), dtype, 2)
    w0 = (_torch_data((hidden,), torch.float32, 3, 0.3) + 0.5).to(wdtype)
    dy, ds = _torch_data((rows, hidden), dtype, 4), _torch_data((rows, hidden), dtype, 5)

    x, r, w = (t.clone().requires_grad_(True) for t in (x0, r0, w0))
    y, s = rn.fused_add_rms_norm(x, r, w, eps, weight_offset=offset, casting_mode=mode)
    assert y.grad_fn is not None and s.grad_fn is not None
    torch.autograd.backward([y, s], [dy, ds])
    s_got = s.detach()

    x64, r64, w64 = (t.double().requires_grad_(True) for t in (x0, r0, w0))
    s64 = (x64 + r64)
    s64 = s64 + (s64.to(dtype).double() - s64).detach()      # the rounded sum, gradient one
    y64 = _f64_forward(s64, w64, eps, offset, mode, dtype)
    torch.autograd.backward([y64, s64], [dy.double(), ds.double()])
    assert torch.equal(s_got, (x0 + r0))
    scale_x = (dy.double().abs() * (w0.double() + offset).abs()).mean() * 4 + ds.double().abs()
    _assert_grad("d_input (x)", x.grad, x64.grad, dtype_name, scale_x)
    assert torch.equal(x.grad, r.grad), "x and residual must get the same gradient"
    xhat = s64.detach() * (s64.detach().pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    scale_w = (dy.double().abs() * xhat.abs()).sum(0)
    flip = 0.0          # llama: an xhat at a rounding midpoint may round the other way, once per column
    if mode == "llama" and dtype_name != "float32":
        flip = (dy.double().abs() * _torch_spacing(xhat, dtype_name)).max(0).values
    _assert_grad("dweight", w.grad, w64.grad, "float32" if wdtype == torch.float32 else dtype_name, scale_w, flip)


@requires_torch_gpu
def test_torch_module_trains_and_compiles_to_the_eager_gradients():
    """RMSNorm / FusedAddRMSNorm in a small block: torch.compile(fullgraph=True) of forward +
    backward gives the eager gradients (the same ops run in both)."""
    import torch

    import cupy_rmsnorm.torch as rnt
    torch.manual_seed(0)
    hidden = 512

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = rnt.RMSNorm(hidden, casting_mode="llama", dtype=torch.bfloat16, device="cuda")
            self.fused = rnt.FusedAddRMSNorm(hidden, dtype=torch.bfloat16, device="cuda")
            self.proj = torch.nn.Linear(hidden, hidden, device="cuda", dtype=torch.bfloat16)

        def forward(self, x, r):
            y, s = self.fused(self.proj(x), r)
            return self.norm(y).float().square().mean() + s.float().mean()

    block = Block()
    with torch.no_grad():
        block.norm.weight.normal_(1.0, 0.2)
        block.fused.weight.normal_(1.0, 0.2)
    x0, r0 = _torch_data((64, hidden), torch.bfloat16, 6), _torch_data((64, hidden), torch.bfloat16, 7)
    grads = []
    torch._dynamo.reset()
    for fn in (block, torch.compile(block, fullgraph=True)):
        block.zero_grad(set_to_none=True)
        x, r = x0.clone().requires_grad_(True), r0.clone().requires_grad_(True)
        fn(x, r).backward()
        grads.append([x.grad, r.grad, block.norm.weight.grad, block.fused.weight.grad, block.proj.weight.grad])
    for name, eager, compiled in zip(("x", "residual", "norm.weight", "fused.weight", "proj.weight"), *grads):
        assert compiled is not None and eager is not None, name
        torch.testing.assert_close(compiled.float(), eager.float(), rtol=1.6e-2, atol=1e-5, msg=name)


@requires_torch_gpu
def test_opcheck_with_grad():
    import torch

    import cupy_rmsnorm.torch  # noqa: F401 - registers the ops (an xdist worker may run this test first)
    OPS_ = torch.ops.cupy_rmsnorm
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = _torch_data((5, 4096), dtype, 8).requires_grad_(True)
        r = _torch_data((5, 4096), dtype, 9).requires_grad_(True)
        w = (1 + 0.1 * _torch_data((4096,), dtype, 10)).requires_grad_(True)
        wf = (1 + 0.1 * _torch_data((4095,), torch.float32, 11)).requires_grad_(True)
        dy = _torch_data((5, 4096), dtype, 12)
        torch.library.opcheck(OPS_.rms_norm.default, (x, w, 1e-6, 0.0, "llama"))
        torch.library.opcheck(OPS_.rms_norm.default, (x[:, :4095], wf, 1e-6, 1.0, "fp32"))
        torch.library.opcheck(OPS_.fused_add_rms_norm.default, (x, r, w, 1e-6, 0.0, "fp32"))
        torch.library.opcheck(OPS_.fused_add_rms_norm.default, (x, r, None, 1e-6, 0.0, "fp32"))
        torch.library.opcheck(OPS_.rms_norm_backward.default, (dy, x.detach(), w.detach(), 1e-6, 0.0, "fp32", True))
        torch.library.opcheck(OPS_.fused_add_rms_norm_backward.default,
                              (dy, dy, x.detach(), w.detach(), 1e-6, 0.0, "llama", True))


@requires_torch_gpu
def test_torch_backward_functions_run_on_torchs_stream_zero_copy():
    """rn.rms_norm_backward on torch tensors: torch tensors back, on x's device, from torch's
    current stream (a side stream's producer is waited for)."""
    import torch
    x = _torch_data((64, 4096), torch.bfloat16, 13)
    dy_src = _torch_data((64, 4096), torch.bfloat16, 14)
    w = 1 + 0.1 * _torch_data((4096,), torch.bfloat16, 15)
    want = rn.rms_norm_backward(dy_src, x, w)
    side = torch.cuda.Stream()
    dy = torch.zeros_like(dy_src)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
        dy.copy_(dy_src)
        got = rn.rms_norm_backward(dy, x, w)
    torch.cuda.synchronize()
    for a, b in zip(got, want):
        assert type(a) is torch.Tensor and a.device == x.device
        assert torch.equal(a, b)
