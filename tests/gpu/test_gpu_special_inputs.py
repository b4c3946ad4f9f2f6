"""Particular inputs on the GPU, against the float64 reference (tests/gpu_reference.py):
non-finite values, float16 inputs whose squares overflow, eps, one-dimensional input,
grids split into rows of blocks, a first call from a fresh thread, and more than 2**31
elements.

Needs a CUDA GPU; skipped, with the reason shown, everywhere else.
"""

import pytest
from helpers import DTYPE_NAMES, DTYPES, EPS, FUSED, MODES, OPS, gpu_missing, requires_gpu, seed

import cupy_rmsnorm as rn
from cupy_rmsnorm import _cache, _plan

if gpu_missing() is None:
    import cupy as cp
    import gpu_reference as G

pytestmark = [requires_gpu, pytest.mark.usefixtures("free_gpu_memory")]


def _check_call(op, x, res, w, dtype_name, mode="fp32", eps=EPS, weight_offset=0.0):
    """An out-of-place call into poisoned outputs, checked against the reference (NaN
    and Inf where the reference has them). Returns (what went wrong or None, out)."""
    res = res if op == FUSED else None
    out = G.poisoned_like(x)
    res_out = G.poisoned_like(x) if op == FUSED else None
    y, s = G.call(op, x, res, w, mode, out, res_out, eps, weight_offset)
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
    rs = cp.random.RandomState(seed("nonfinite", op, dtype_name))
    rows = 9
    bad_rows = {2, 6} | ({4} if op == FUSED else set())
    good = cp.asarray(sorted(set(range(rows)) - bad_rows))
    for hidden in (256, 4096, 65536):
        xf = G.normal(rs, (rows, hidden), 2.0)
        xf[2, 5] = cp.nan
        xf[6, hidden - 1] = cp.inf
        rf = G.normal(rs, (rows, hidden), 2.0)
        rf[4, 0] = -cp.inf
        x, res = G.from_float32(xf, dtype), G.from_float32(rf, dtype)
        w = G.random_weight(rs, "same", 0.0, hidden, dtype)
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
    rs = cp.random.RandomState(seed("fp16x100", op))
    for hidden in (256, 4096, 5120, 65536):
        x = G.from_float32(G.normal(rs, (33, hidden), 100.0), dtype)
        res = G.from_float32(G.normal(rs, (33, hidden), 100.0), dtype)
        assert G.count_nonfinite(x) == 0 and G.count_nonfinite(res) == 0
        for wkind, mode in ((None, "fp32"), ("same", "llama"), ("float32", "fp32")):
            w = G.random_weight(rs, wkind, 0.0, hidden, dtype)
            msg, y = _check_call(op, x, res, w, "float16", mode)
            assert G.count_nonfinite(y) == 0, f"hidden={hidden} {mode}: non-finite output"
            assert msg is None, f"hidden={hidden} {mode}: {msg}"


@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
@pytest.mark.parametrize("op", OPS)
def test_eps_is_applied(op, dtype_name):
    """Values ~1e-2 with eps 1e-2 (eps dominates the mean of squares) and eps 0."""
    dtype = DTYPES[dtype_name]
    rs = cp.random.RandomState(seed("eps", op, dtype_name))
    for hidden in (7, 4096, 65536):
        x = G.from_float32(G.normal(rs, (5, hidden), 1e-2), dtype)
        res = G.from_float32(G.normal(rs, (5, hidden), 1e-2), dtype)
        w = G.random_weight(rs, "same", 0.0, hidden, dtype)
        for eps in (1e-2, 0.0):
            msg, _ = _check_call(op, x, res, w, dtype_name, "fp32", eps=eps)
            assert msg is None, f"hidden={hidden} eps={eps}: {msg}"


@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
@pytest.mark.parametrize("op", OPS)
def test_one_dimensional_input(op, dtype_name):
    dtype = DTYPES[dtype_name]
    rs = cp.random.RandomState(seed("1d", op, dtype_name))
    for hidden in (7, 4096):
        x = G.from_float32(G.normal(rs, (hidden,), 3.0), dtype)
        res = G.from_float32(G.normal(rs, (hidden,), 3.0), dtype)
        w = G.random_weight(rs, "float32", 1.0, hidden, dtype)
        y, s = G.call(op, x, res, w, "llama", weight_offset=1.0)
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
    with _cache.forced_plan(record=plans):       # the heuristic's plans, recorded
        _split_grid_calls(op, dtype_name, dtype, plans)


def _split_grid_calls(op, dtype_name, dtype, plans):
    rs = cp.random.RandomState(seed("split", op, dtype_name))
    clusters = 0
    for rows, hidden in ((300, 7), (200, 256), (21, 4096), (5, 65536), (37, 16384), (3, 262144)):
        x = G.from_float32(G.normal(rs, (rows, hidden), 3.0), dtype)
        res = G.from_float32(G.normal(rs, (rows, hidden), 3.0), dtype)
        for wkind, mode in (("same", "fp32"), ("float32", "llama")):
            w = G.random_weight(rs, wkind, 0.0, hidden, dtype)
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
    rs = cp.random.RandomState(seed("thread"))
    x = G.from_float32(G.normal(rs, (64, 4096), 3.0), DTYPES["bfloat16"])
    w = G.random_weight(rs, "same", 0.0, 4096, DTYPES["bfloat16"])
    out = G.poisoned_like(x)
    rn.rms_norm(x, w, out=out)                     # compiled and cached here
    cp.cuda.Device().synchronize()
    _cache.clear()                        # the thread's call plans anew
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

def test_more_than_2_31_elements_bfloat16():
    """131073 x 16384 bf16 (2**31 + 16384 elements, 4.3 GB per array): rms_norm out of
    place, then the fused op in place, each checked on a sample of rows (the first, those
    around 2**31 / 2 elements, the last, whose elements all sit past 2**31, and random
    ones) against the reference of those rows, and for finiteness everywhere."""
    dtype_name, dtype = "bfloat16", DTYPES["bfloat16"]
    rows, hidden = 131073, 16384
    assert rows * hidden > 2 ** 31
    rs = cp.random.RandomState(seed("2^31"))
    sample = sorted({0, 1, 65535, 65536, rows - 2, rows - 1}
                    | set(cp.asnumpy(rs.randint(0, rows, 58)).tolist()))
    idx = cp.asarray(sample)
    w = G.random_weight(rs, "same", 0.0, hidden, dtype)
    x = out = y = s = res = None
    try:
        x = cp.empty((rows, hidden), dtype)
        G.fill_random(x, rs)
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
        G.fill_random(res, rs)
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


@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
@pytest.mark.parametrize("hidden", [4096, 4095])
def test_zero_offset_keeps_negative_zero_weights(dtype_name, hidden):
    """weight_offset=0 multiplies by the weight as is (_reference.offset_weight): where the
    weight is -0, y (and the FP8 byte) is a zero of the sign opposite to x's, as HF's
    weight * x gives; vector weights (4096) and element-wise ones (4095) alike."""
    dtype = DTYPES[dtype_name]
    rs = cp.random.RandomState(seed("negzero", dtype_name, hidden))
    x = G.from_float32(G.normal(rs, (8, hidden), 1.0), dtype)
    wf = cp.ones(hidden, cp.float32)
    wf[::3] = -0.0
    w = G.from_float32(wf, dtype)
    neg = cp.signbit(x.astype(cp.float32)[:, ::3])
    for y in (rn.rms_norm(x, w, EPS), rn.fused_add_rms_norm(x, cp.zeros_like(x), w, EPS)[0]):
        zeros = y.astype(cp.float32)[:, ::3]
        assert bool((zeros == 0).all())
        assert bool((cp.signbit(zeros) == ~neg).all())
    q, _ = rn.rms_norm_quant(x, w, EPS, scale=cp.ones(1, cp.float32))
    qb = q.view(cp.uint8)[:, ::3]
    assert bool((qb == cp.where(neg, 0, 0x80).astype(cp.uint8)).all())
