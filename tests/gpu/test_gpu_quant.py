"""GPU tests of the quantized forms (rms_norm_quant, fused_add_rms_norm_quant) against the NumPy
reference (cupy_rmsnorm/_reference.py), bit for bit where the contract is exact.

Needs a CUDA GPU (on the H200: ``python3 -m pytest -n 8 tests/gpu/test_gpu_quant.py``); skipped,
with the reason shown, everywhere else.

Where the contract is exact, and where it is not:
- y (float32, before the final rounding) is computed on both sides with the same operations,
  but inv_rms is not: the kernel sums in its own order and uses rsqrtf, the reference 1 / sqrt.
  Rows whose mean square is exactly 1 with eps = 0 (every |x| = 1; for the fused op x and
  residual that add up to +-1) make inv_rms exactly 1 on both sides, hence y = +-(w + offset)
  exactly: there the scales and every quantized byte must be equal (test_exact). The weights
  spread over many binades, so the quantized values cover the whole FP8 range.
- Elsewhere (test_random) y may differ by a few float32 ulps: scales agree within FLOAT32_REL,
  and each byte equals the reference quantization of the reference y by the kernel's own scale
  unless that value lies within NEAR_TIE (relative) of a rounding boundary, where either
  neighbour is allowed (one FP8 step); such bytes must be rare (MAX_NEAR_TIES; these limits and
  the comparisons are in tests/gpu_reference.py).
Every call also checks residual_out bit for bit, that nothing outside the output views was
written (their buffers are poisoned), and the returned types; layouts: 2d, 3d, strided rows,
a flat buffer sliced at element offset 1, two heads of a (tokens, 4, head_dim) buffer; outputs
fresh, or given (q at x's alignment, at another one, uint8 or the FP8 dtype; scales_out).
"""

import functools
import math
import zlib

import ml_dtypes
import numpy as np
import pytest
from helpers import DTYPE_NAMES, DTYPES, gpu_missing, requires_gpu, requires_torch_gpu

import cupy_rmsnorm as rn
from cupy_rmsnorm import _abi, _cache, _reference as R
from cupy_rmsnorm.ops.quant import launch as quant_launch
from cupy_rmsnorm.ops.quant import reference as quant_reference

if gpu_missing() is None:
    import cupy as cp
    from gpu_reference import compare_q, compare_scales, q_bits, to_device, to_host, tolerances

pytestmark = [requires_gpu, pytest.mark.usefixtures("free_gpu_memory")]

OPS = ("rms_norm_quant", "fused_add_rms_norm_quant")
FORMS = ("static", "per_token", "per_group")
QUANT = ("float8_e4m3fn", "float8_e5m2", "int8")
# warp groups (tail only, head and tail), blocks (both widths), streamed rows or clusters
HIDDEN = {"static": (1, 7, 4095, 4096, 33001), "per_token": (1, 7, 4095, 4096, 33001),
          "per_group": (128, 384, 4096, 7168, 65536)}
ROWS = (1, 300)
LAYOUTS = ("2d", "3d", "strided", "offset", "heads")
LEAD = {"2d": 1, "3d": 2, "strided": 1, "offset": 1, "heads": 2}
MAX_ELEMENTS = 2 ** 22        # rows are capped to this many elements per array
BIG_ELEMENTS = 2 ** 20        # past this, two layouts per shape (rotating)


def _seed(*parts):
    return zlib.crc32("-".join(map(str, parts)).encode())


# -- arrays in layouts -----------------------------------------------------------------------------

def _view(buf, layout, rows, hidden):
    """The (rows, hidden) array of ``layout`` inside ``buf`` (3d / heads: (rows / 2, 2, hidden))."""
    if layout in ("2d", "3d"):
        return buf
    if layout == "strided":                   # rows start 3 elements into a wider buffer
        return buf[:, 3:]
    if layout == "offset":                    # a flat buffer sliced at element offset 1
        return buf[1:].reshape(rows, hidden)
    return buf[:, 2:]                         # heads 2 and 3 of (tokens, 4 heads, head_dim)


BUFFER_SHAPES = {"2d": lambda r, h: (r, h), "3d": lambda r, h: (r // 2, 2, h), "strided": lambda r, h: (r, h + 3),
                 "offset": lambda r, h: (r * h + 1,), "heads": lambda r, h: (r // 2, 4, h)}


class Placed:
    """``host`` (rows, hidden) on the device as a view of ``layout`` in a buffer of its own,
    the rest of which holds the bits ``fill``."""

    def __init__(self, layout, host, fill=0):
        rows, hidden = host.shape
        self.layout, self.dims = layout, (rows, hidden)
        buf = np.empty(BUFFER_SHAPES[layout](rows, hidden), host.dtype)
        buf.view(f"u{host.itemsize}")[...] = fill
        view = _view(buf, layout, rows, hidden)
        view[...] = host.reshape(view.shape)
        self.host_buf, self.buf = buf, to_device(buf)
        self.view = _view(self.buf, layout, rows, hidden)

    def untouched_outside(self):
        """True when the buffer outside the view still holds what it held."""
        mask = np.ones(self.host_buf.shape, bool)
        _view(mask, self.layout, *self.dims)[...] = False
        u = f"u{self.host_buf.itemsize}"
        return bool(np.array_equal(to_host(self.buf).view(u)[mask], self.host_buf.view(u)[mask]))


# -- inputs -----------------------------------------------------------------------------------

def exact_inputs(rng, fused, shape, dtype):
    """x (and residual) whose rows (or sums) are +-1: inv_rms is exactly 1 with eps = 0."""
    sign = np.where(rng.random(shape) < 0.5, -1.0, 1.0).astype(np.float32)
    if not fused:
        return sign.astype(dtype), None
    a = rng.integers(0, 256, shape).astype(np.float32) / 256
    return (sign * a).astype(dtype), (sign * (1 - a)).astype(dtype)


def random_inputs(rng, fused, shape, dtype):
    x = (rng.standard_normal(shape) * 2).astype(dtype)
    return x, ((rng.standard_normal(shape) * 2).astype(dtype) if fused else None)


@functools.lru_cache(maxsize=None)
def kernel_inv_rms_of_one():
    """inv_rms as the kernels compute it for a mean square of exactly 1 and eps 0: rsqrtf(1),
    read back through the float32 rms_norm of a row of ones (1.0 if the hardware is exact there)."""
    v = float(rn.rms_norm(cp.ones((1, 4096), cp.float32), eps=0.0)[0, 0])
    print(f"kernel rsqrtf(1.0) = {v!r}")
    return v


def y_with(s, weight, weight_offset, mode, inv_rms):
    """The contract's y for rows whose inv_rms is ``inv_rms`` (the exact rows)."""
    n = s.astype(np.float32) * np.float32(inv_rms)
    if mode == "llama":
        n = n.astype(s.dtype).astype(np.float32)
    return n if weight is None else n * (weight.astype(np.float32) + np.float32(weight_offset))


def weight_of(rng, kind, hidden, dtype, exact):
    """None, or a weight of x's dtype or float32 spread over binades (exact) or around one."""
    if kind is None:
        return None
    w = rng.standard_normal(hidden) * (np.exp2(rng.integers(-6, 7, hidden)) if exact else 0.3) + (0 if exact else 1)
    return w.astype(dtype if kind == "same" else np.float32)


# -- one call ---------------------------------------------------------------------------------

def run(op, dtype_name, form, quant_dtype, hidden, rows, layout, mode, wkind, woff, given, exact, seed):
    """One call on fresh inputs; None if every check passes, else why not."""
    dtype = DTYPES[dtype_name]
    fused = op == OPS[1]
    rng = np.random.default_rng(seed)
    rows = rows * LEAD[layout] if LEAD[layout] > 1 else rows
    host_shape = (rows, hidden) if LEAD[layout] == 1 else (rows // 2, 2, hidden)
    make = exact_inputs if exact else random_inputs
    x_h, r_h = make(rng, fused, host_shape, dtype)
    w_h = weight_of(rng, wkind, hidden, dtype, exact)
    eps = 0.0 if exact else 1e-6
    scale_h = np.array([np.float32(3.0 / quant_reference.quant_max(quant_dtype))], np.float32) if form == "static" else None
    ref_kw = dict(scale=scale_h, group_size=128 if form == "per_group" else None, quant_dtype=quant_dtype)
    if fused:
        _, want_s, want_scales = rn.fused_add_rms_norm_quant_reference(x_h, r_h, w_h, eps, woff, mode, **ref_kw)
    else:
        (_, want_scales), want_s = rn.rms_norm_quant_reference(x_h, w_h, eps, woff, mode, **ref_kw), None
    s_h = want_s if fused else x_h
    y = R._normalized(s_h, w_h, eps, woff, mode)
    if exact:                 # the reference's y, or (should rsqrtf(1) not be 1) the kernel's
        inv = kernel_inv_rms_of_one()
        assert inv != 1.0 or np.array_equal(y, y_with(s_h, w_h, woff, mode, 1.0))
        y = y_with(s_h, w_h, woff, mode, inv)
        if form == "per_token":
            want_scales = quant_reference.dynamic_scales(y, quant_dtype)
        elif form == "per_group":
            want_scales = quant_reference.dynamic_scales(y.reshape(y.shape[:-1] + (hidden // 128, 128)), quant_dtype)[..., 0]

    x = Placed(layout, x_h.reshape(rows, hidden))
    res = Placed(layout, r_h.reshape(rows, hidden)) if fused else None
    w = to_device(w_h) if w_h is not None else None
    scale = cp.asarray(scale_h) if scale_h is not None else None
    kw = dict(scale=scale, group_size=ref_kw["group_size"], quant_dtype=quant_dtype, weight_offset=woff,
              casting_mode=mode)
    out = scales_out = res_out = None
    q_store = "int8" if quant_dtype == "int8" else "uint8"
    if given:                 # q at x's alignment (offset: the same element offset) or apart from it
        q_layout = layout if layout in ("2d", "3d", "offset", "heads") else "2d"
        out = Placed(q_layout, np.zeros((rows, hidden), q_store), 0xA5)
        kw["out"] = out.view
        if form != "static":      # row-major, rows padded: another layout than the fresh ones
            shp = want_scales.shape
            scales_out = Placed("strided", np.zeros((math.prod(shp[:-1]), shp[-1]), np.float32), 0x7FC00001)
            kw["scales_out"] = scales_out.view.reshape(shp)
        if fused:
            res_out = res                              # in place
            kw["residual_out"] = res.view
    if fused:
        q, s, scales = rn.fused_add_rms_norm_quant(x.view, res.view, w, eps, **kw)
    else:
        q, scales = rn.rms_norm_quant(x.view, w, eps, **kw)
    # types, identities, nothing written outside
    if not isinstance(q, cp.ndarray) or q.dtype != np.dtype(q_store) or q.shape != x.view.shape:
        return f"q: {type(q).__name__} {q.dtype} {q.shape}"
    if given and q is not out.view:
        return "q is not the given out"
    if form == "static" and scales is not scale:
        return "static: scales is not the given scale"
    if scales_out is not None and scales is not kw["scales_out"]:
        return "scales is not the given scales_out"
    for name, p in (("out", out), ("scales_out", scales_out), ("residual", res_out)):
        if p is not None and not p.untouched_outside():
            return f"{name}: written outside its view"
    if not x.untouched_outside():
        return "x's buffer changed"
    if fused:
        if (res_out is not None) != (s is res.view):
            return "residual_out is not what was asked"
        got_s = to_host(cp.ascontiguousarray(s)).reshape(want_s.shape)
        if not np.array_equal(got_s.view(f"u{got_s.itemsize}"), want_s.view(f"u{want_s.itemsize}")):
            return "residual_out differs from round(x + residual)"
    msg = None
    near, rel = tolerances(mode, dtype_name)
    if form != "static":
        if scales.shape != want_scales.shape or scales.dtype != np.float32:
            return f"scales: {scales.dtype} {scales.shape}, want {want_scales.shape}"
        msg = compare_scales(scales, want_scales, exact, rel)
    if msg:
        return msg
    got_scales = scale_h if form == "static" else cp.asnumpy(cp.ascontiguousarray(scales))
    if form == "per_group":
        yg = y.reshape(y.shape[:-1] + (hidden // 128, 128))
        got = q_bits(q).reshape(yg.shape)
        return compare_q(got, yg, got_scales[..., None], quant_dtype, exact, near)
    return compare_q(q_bits(q).reshape(y.shape), y, got_scales.reshape(()) if form == "static" else got_scales,
                     quant_dtype, exact, near)


def _cases(op, form):
    """(hidden, rows, layout, rotation index) of one item; big shapes run two layouts, rotating."""
    n = 0
    for hidden in HIDDEN[form]:
        for rows in ROWS:
            rows_c = max(1, min(rows, MAX_ELEMENTS // (2 * hidden)))
            layouts = LAYOUTS if rows_c * hidden <= BIG_ELEMENTS else [LAYOUTS[(n + k) % 5] for k in (0, 2)]
            for layout in layouts:
                n += 1
                yield hidden, rows_c, layout, n


WEIGHTS = ((None, 0.0), ("same", 0.0), ("float32", 1.0), ("same", 1.0), ("float32", 0.0))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("op", OPS)
def test_exact(op, dtype, form):
    """Rows of mean square 1, eps 0: every byte and scale as the reference (e4m3; the other
    quant dtypes in test_quant_dtypes)."""
    failures = []
    for hidden, rows, layout, n in _cases(op, form):
        wkind, woff = WEIGHTS[n % 5] if n % 5 else ("same", 0.0)       # y = +-1 without a weight: boring
        mode = ("fp32", "llama")[n % 2]
        given = n % 3 == 0
        msg = run(op, dtype, form, "float8_e4m3fn", hidden, rows, layout, mode, wkind, woff, given, True,
                  _seed(op, dtype, form, hidden, rows, layout))
        if msg:
            failures.append(f"{hidden=} {rows=} {layout} {mode} w={wkind}+{woff} given={given}: {msg}")
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("op", OPS)
def test_random(op, dtype, form):
    """Random rows: scales within float32 rounding, bytes exact but at near ties (one step)."""
    failures = []
    for hidden, rows, layout, n in _cases(op, form):
        if n % 2:
            continue
        wkind, woff = WEIGHTS[n % 5]
        mode = ("llama", "fp32")[n % 2 == 0 and n % 4 == 0]
        msg = run(op, dtype, form, QUANT[n % 3], hidden, rows, layout, mode, wkind, woff, n % 4 == 0, False,
                  _seed("random", op, dtype, form, hidden, rows, layout))
        if msg:
            failures.append(f"{hidden=} {rows=} {layout} {QUANT[n % 3]} {mode} w={wkind}+{woff}: {msg}")
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("quant_dtype", QUANT)
@pytest.mark.parametrize("form", FORMS)
def test_quant_dtypes(form, quant_dtype):
    """e5m2 and int8 (and e4m3) bit for bit on exact rows, both ops, a few shapes."""
    failures = []
    for op in OPS:
        for hidden, rows, layout in ((HIDDEN[form][2], 300, "2d"), (4096, 5, "offset"), (HIDDEN[form][-1], 1, "heads")):
            for given in (False, True):
                msg = run(op, "bfloat16", form, quant_dtype, hidden, rows, layout, "llama", "same", 0.0, given, True,
                          _seed("dtypes", op, form, quant_dtype, hidden, given))
                if msg:
                    failures.append(f"{op} {hidden=} {rows=} {layout} given={given}: {msg}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("form", FORMS)
def test_streamed_rows(form):
    """Rows too long for registers among many rows (the streamed plans), both ops, exact rows."""
    failures = []
    for op in OPS:
        for layout in ("2d", "offset"):
            msg = run(op, "bfloat16", form, "float8_e4m3fn", 33024, 260, layout, "fp32", "float32", 0.0,
                      layout == "offset", True, _seed("streamed", op, form, layout))
            if msg:
                failures.append(f"{op} {layout}: {msg}")
    assert not failures, "\n".join(failures)


# -- special values -------------------------------------------------------------------------------

@pytest.mark.parametrize("form", FORMS)
def test_nan_inf_and_zero_rows_stay_in_their_row(form):
    rows, hidden = 6, 4096
    x_h = (np.random.default_rng(3).standard_normal((rows, hidden)) + 0.2).astype(ml_dtypes.bfloat16)
    x_h[1, 17] = np.nan
    x_h[2, 5] = np.inf
    x_h[3] = 0
    kw = dict(scale=np.array([0.01], np.float32) if form == "static" else None,
              group_size=128 if form == "per_group" else None)
    want_q, want_scales = rn.rms_norm_quant_reference(x_h, None, **kw)
    dkw = dict(kw, scale=cp.asarray(kw["scale"]) if kw["scale"] is not None else None)
    q, scales = rn.rms_norm_quant(to_device(x_h), None, **dkw)
    got = q_bits(q).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert np.isnan(got[1]).all()
    assert np.isnan(got[2, 5]) and (np.delete(got[2], 5) == 0).all()
    assert (got[3] == 0).all()
    assert np.isfinite(got[[0, 4, 5]]).all()
    if form != "static":
        s = cp.asnumpy(cp.ascontiguousarray(scales))
        assert np.isfinite(s).all() and (s[1:4] == quant_reference.min_scale("float8_e4m3fn")).all()
        assert compare_scales(scales, want_scales, False) is None


def test_static_scale_saturates():
    x_h = (np.random.default_rng(4).standard_normal((64, 1000)) * 3).astype(np.float16)
    scale = np.array([1.0 / 448], np.float32)                  # |y| > 1 saturates
    q, _ = rn.rms_norm_quant(to_device(x_h), None, scale=cp.asarray(scale))
    got = q_bits(q).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    y = R._normalized(x_h, None, 1e-6, 0.0, "fp32")
    assert (np.abs(got[np.abs(y) > 1.1]) == 448).all() and (np.abs(got) <= 448).all()


def test_static_scale_is_read_on_the_device_at_each_call():
    """The scale lives in device memory: a CUDA graph captured once sees each new value."""
    x = to_device((np.random.default_rng(5).standard_normal((8, 512))).astype(np.float16))
    scale = cp.asarray(np.array([0.05], np.float32))
    out = cp.empty((8, 512), cp.uint8)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        rn.rms_norm_quant(x, None, scale=scale, out=out)           # compile, warm the fast path
        stream.begin_capture()
        rn.rms_norm_quant(x, None, scale=scale, out=out)
        graph = stream.end_capture()
    for s in (0.05, 0.01, 0.2):
        with stream:
            scale[...] = s
        graph.launch(stream)
        stream.synchronize()
        want, _ = rn.rms_norm_quant_reference(to_host(x), None, scale=np.array([s], np.float32))
        assert np.array_equal(cp.asnumpy(out), want.view(np.uint8)), s


def test_same_bits_every_call_and_on_the_fast_path():
    x = to_device((np.random.default_rng(6).standard_normal((300, 4096))).astype(ml_dtypes.bfloat16))
    for kw in ({}, {"group_size": 128}):
        runs = [rn.rms_norm_quant(x, None, **kw) for _ in range(3)]
        for q, s in runs[1:]:
            assert cp.array_equal(q, runs[0][0]) and cp.array_equal(s, runs[0][1])


@pytest.mark.parametrize("form", FORMS)
def test_32_bit_offsets_give_the_same_bits(form):
    """Contiguous rows, more blocks than SMs: the plan takes 32-bit offsets (LaunchPlan.flat; not
    the fused per-token form); forced to the 64-bit arithmetic, the same call writes the same
    bytes. Per-head rows (n_inner 2) do not take them."""
    from cupy_rmsnorm import _launcher
    rng = np.random.default_rng(7)
    x = to_device(rng.standard_normal((1024, 4096)).astype(ml_dtypes.bfloat16))
    r = to_device(rng.standard_normal((1024, 4096)).astype(ml_dtypes.bfloat16))
    w = to_device((1 + 0.1 * rng.standard_normal(4096)).astype(ml_dtypes.bfloat16))
    heads = to_device(rng.standard_normal((512, 4, 4096)).astype(ml_dtypes.bfloat16))[:, 1:3]
    kw = {"static": {"scale": cp.full((1,), 0.02, cp.float32)}, "per_token": {}, "per_group": {"group_size": 128}}[form]
    calls = ((lambda: rn.rms_norm_quant(x, w, **kw), True),
             (lambda: rn.fused_add_rms_norm_quant(x, r, w, **kw), form != "per_token"),
             (lambda: rn.rms_norm_quant(heads, w, **kw), False))
    for call, flat in calls:
        plans, forced = [], []
        with _cache.forced_plan(record=plans):
            default = [cp.asnumpy(o).view(np.uint8) for o in call()]
        with _cache.forced_plan(record=forced, flat=False):
            wide = [cp.asnumpy(o).view(np.uint8) for o in call()]
        assert [p.flat for p in plans] == [flat] and [p.flat for p in forced] == [False]
        assert len(default) == len(wide) and all(np.array_equal(a, b) for a, b in zip(default, wide))


# The kernel's scale arithmetic (kernels/rms_norm.cu: dynamic_scale, inverse_of_scale) against
# the float32 divisions the reference does, for every float32 that can reach it: amax (already
# clamped to scale_ub) from +0 to +inf. The division is compiled here as nvcc's correctly rounded
# one (NVRTC's default -prec-div=true).
_SCALE_CHECK = r"""
template <int QTYPE>
__global__ void check_scales(unsigned first, unsigned count, unsigned long long* wrong, unsigned* first_wrong) {
    constexpr float qmax = rmsnorm::QuantMax<QTYPE>::value;
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += gridDim.x * blockDim.x) {
        const float amax = __uint_as_float(first + i);
        const float want = fmaxf(amax / qmax, 1.0f / (qmax * rmsnorm::kMinScaleDivisor));
        const float s = rmsnorm::dynamic_scale<QTYPE>(amax, __int_as_float(0x7f800000));
        const float inv = rmsnorm::inverse_of_scale(s);
        if (__float_as_uint(s) != __float_as_uint(want) || __float_as_uint(inv) != __float_as_uint(1.0f / want)) {
            atomicAdd(wrong, 1ull);
            atomicMin(first_wrong, first + i);
        }
    }
}
"""


@pytest.mark.parametrize("quant_dtype", QUANT)
def test_scales_and_their_inverses_are_the_correctly_rounded_divisions(quant_dtype):
    from cupy_backends.cuda.libs import nvrtc

    from cupy_rmsnorm import _compile
    name = f"check_scales<{quant_launch.QUANT_TYPES[quant_dtype]}>"
    module = cp.RawModule(code=_compile.kernel_source() + _SCALE_CHECK,
                          options=_compile.nvrtc_options(nvrtc.getVersion()[0]), name_expressions=[name])
    wrong = cp.zeros(1, cp.uint64)
    first_wrong = cp.full(1, 0xFFFFFFFF, cp.uint32)
    count = 0x7F800000 + 1                      # +0 .. +inf, every bit pattern
    module.get_function(name)((4096,), (256,), (np.uint32(0), np.uint32(count), wrong, first_wrong))
    assert int(wrong[0]) == 0, f"{int(wrong[0])} wrong, the first at amax bits {int(first_wrong[0]):#010x}"


# -- torch -----------------------------------------------------------------------------------

def _torch_inputs(shape, dtype, seed=0):
    import torch
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)


@requires_torch_gpu
def test_torch_outputs_are_fp8_tensors_zero_copy_on_the_current_stream():
    import torch
    x = _torch_inputs((64, 4096), torch.bfloat16)
    w = 1 + 0.1 * _torch_inputs((4096,), torch.bfloat16, 1)
    out = torch.empty(64, 4096, dtype=torch.float8_e4m3fn, device="cuda")
    scales_out = torch.empty(64, 1, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())        # the inputs were made on the default stream
    with torch.cuda.stream(side):
        q, s = rn.rms_norm_quant(x, w, out=out, scales_out=scales_out)
    side.synchronize()
    assert q is out and s is scales_out and q.dtype == torch.float8_e4m3fn
    want_q, want_s = rn.rms_norm_quant_reference(x.float().cpu().numpy().astype(ml_dtypes.bfloat16),
                                                 w.float().cpu().numpy().astype(ml_dtypes.bfloat16))
    assert compare_scales(cp.from_dlpack(s), want_s, False) is None
    q2, s2 = rn.rms_norm_quant(x, w, group_size=128)
    assert q2.dtype == torch.float8_e4m3fn and s2.shape == (64, 32) and s2.stride() == (1, 64)
    r = _torch_inputs((64, 4096), torch.bfloat16, 2)
    r0 = r.clone()
    q3, s3, scales3 = rn.fused_add_rms_norm_quant(x, r, w, scale=torch.full((1,), 0.02, device="cuda"),
                                                  residual_out=r)
    assert s3 is r and torch.equal(r, (x.float() + r0.float()).to(torch.bfloat16))
    q4, s4 = rn.rms_norm_quant(x, w, quant_dtype=torch.float8_e5m2)
    assert q4.dtype == torch.float8_e5m2
    q5, _ = rn.rms_norm_quant(x, w, quant_dtype="int8")
    assert q5.dtype == torch.int8


def _torch_samples():
    import torch
    for dtype in (torch.float16, torch.bfloat16):
        x = _torch_inputs((5, 4096), dtype)
        r = _torch_inputs((5, 4096), dtype, 1)
        w = 1 + 0.1 * _torch_inputs((4096,), dtype, 2)
        scale = torch.full((1,), 0.03, device="cuda")
        yield x, r, w, None, 128, None, "float8_e4m3fn"
        yield x[:, :3968], r[:, 128:], w[:3968].float(), None, None, 5.0, "float8_e5m2"   # strided rows
        yield x, r, None, scale, None, None, "int8"


@requires_torch_gpu
def test_opcheck():
    import torch

    import cupy_rmsnorm.torch  # noqa: F401 - registers the ops (an xdist worker may run this test first)
    ops = torch.ops.cupy_rmsnorm
    for x, r, w, scale, group, ub, qd in _torch_samples():
        args = (w, scale, 1e-6, 0.0, "llama", group, ub, qd)
        torch.library.opcheck(ops.rms_norm_quant.default, (x,) + args)
        torch.library.opcheck(ops.fused_add_rms_norm_quant.default, (x, r) + args)
        torch.library.opcheck(ops.fused_add_rms_norm_quant_inplace.default, (x, r.clone()) + args)


@requires_torch_gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_matches_eager(mode):
    """torch.compile(fullgraph=True) of a step with the quant ops (CUDA graphs with
    reduce-overhead): the eager bits, with a static scale changed between replays."""
    import torch

    import cupy_rmsnorm.torch  # noqa: F401 - registers the torch ops before compiling (torch came later)
    torch._dynamo.reset()
    w = 1 + 0.1 * _torch_inputs((4096,), torch.bfloat16, 7)
    scale = torch.full((1,), 0.02, device="cuda")

    def step(x, r):
        h = x * 2
        q, s, scales = rn.fused_add_rms_norm_quant(h, r, w, group_size=128)
        q2, _ = rn.rms_norm_quant(s + 1, w, scale=scale)
        return q, s, scales, q2

    compiled = torch.compile(step, fullgraph=True, mode=mode, dynamic=False)
    for seed in range(4):
        scale.fill_(0.02 * (seed + 1))
        x, r = _torch_inputs((16, 4096), torch.bfloat16, seed), _torch_inputs((16, 4096), torch.bfloat16, 10 + seed)
        got, want = compiled(x, r), step(x, r)
        for g, e in zip(got, want):
            assert g.dtype == e.dtype and g.shape == e.shape
            assert torch.equal(g.view(torch.uint8) if g.element_size() == 1 else g,
                               e.view(torch.uint8) if e.element_size() == 1 else e)
