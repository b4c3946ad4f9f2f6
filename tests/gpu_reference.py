"""Float64 references, bit-level checks, random inputs and calls on the GPU, for the GPU
suites (tests/gpu/) and the sanitizer grids (scripts/sanitize/); and the quantized forms'
comparisons with the NumPy reference (the bytes, the scales, their tolerances).

The reference follows the numerics contract of cupy_rmsnorm/_reference.py, computed in
float64 instead of float32: the fused op normalizes the residual sum *after* it was
rounded to the storage dtype (the caller passes that rounded sum in), ``casting_mode=
"llama"`` rounds ``x * inv_rms`` to the dtype before the weight multiply, and the final
rounding to the dtype is left to the comparison's tolerance (tests/helpers.py).

bfloat16 is converted through its bits (cupy_rmsnorm.bench.arrays), so nothing here leans
on CuPy's bfloat16 arithmetic; the only bfloat16 arithmetic CuPy is asked for is the
fused op's expected ``x + residual``, which the tests take from CuPy on purpose (the
"dtype add" the contract names).

Importing this module needs CuPy; the GPU tests import it only when a GPU is present.
"""

import math

import cupy as cp
import numpy as np
from helpers import (EPS, FLOAT32_RTOL, FUSED, MANTISSA_BITS, MIN_SPACING, NOISE_REL, REFERENCE_ATOL,
                     ULP_REL)

import cupy_rmsnorm as rn
from cupy_rmsnorm import _reference as R
from cupy_rmsnorm.bench.arrays import (BFLOAT16, NAN_BITS, UINT, bits, from_float32, poison,  # noqa: F401
                                       to_float32, to_float64)
from cupy_rmsnorm.ops.quant import reference as quant_reference


# elements where got is neither equal to ref nor within tol of it (NaN counts as bad)
_count_bad = cp.ReductionKernel(
    "float64 g, float64 r, float64 t", "int64 n",
    "(g == r || fabs(g - r) <= t) ? 0 : 1", "a + b", "n = a", "0", "test_count_bad",
    reduce_type="long long")


def name(dtype):
    return np.dtype(dtype).name


def round_to(a64, dtype):
    """float64 values rounded to ``dtype`` (through float32; the double rounding this
    implies is far below the comparison's tolerance), returned as float64."""
    dtype = np.dtype(dtype)
    if dtype == np.float32:
        return a64.astype(cp.float32).astype(cp.float64)
    return to_float64(from_float32(a64.astype(cp.float32), dtype))


def reference(s, weight=None, eps=1e-6, weight_offset=0.0, casting_mode="fp32"):
    """float64 rms_norm of ``s`` (rows, hidden) over its last axis, per the contract.

    ``s`` is x for rms_norm, the rounded ``x + residual`` for the fused op. The result
    is not rounded to s's dtype: the comparison's tolerance covers that last rounding.
    """
    v = to_float64(s)
    inv_rms = 1.0 / cp.sqrt(cp.mean(v * v, axis=-1, keepdims=True) + eps)
    normed = v * inv_rms
    if weight is None:
        return normed
    if casting_mode == "llama":
        normed = round_to(normed, s.dtype)
    return normed * (to_float64(weight) + weight_offset)


def tolerance_array(ref, dtype_name, casting_mode="fp32", ulps=None):
    """The allowed |got - ref| per element of the float64 reference.

    - float32 outputs: FLOAT32_RTOL relative (float32 noise is all there is).
    - fp32 mode (one rounding at the end): half the dtype's spacing at ref, plus the
      float32 noise. Tight on purpose: rounding twice (x * inv_rms first, as llama
      mode does) is up to a whole ulp off and fails here.
    - llama mode: ``x * inv_rms`` is rounded first, and where it lies within float32
      noise of a rounding midpoint the kernel and the float64 reference round it to
      neighbouring values: ``ulps`` (default 2) ulps relative are allowed.
    ``ulps`` given: that many ulps relative, whatever the mode (for peer comparisons).
    """
    mag = cp.abs(ref)
    if dtype_name == "float32":
        return REFERENCE_ATOL[dtype_name] + FLOAT32_RTOL * mag
    if ulps is None and casting_mode == "fp32":
        _, exponent = cp.frexp(ref)          # |ref| = m * 2**exponent, 0.5 <= m < 1
        spacing = cp.exp2(exponent.astype(cp.float64) - 1 - MANTISSA_BITS[dtype_name])
        return 0.5 * cp.maximum(spacing, MIN_SPACING[dtype_name]) + NOISE_REL * mag + REFERENCE_ATOL[dtype_name]
    return REFERENCE_ATOL[dtype_name] + (2 if ulps is None else ulps) * ULP_REL[dtype_name] * mag


def count_bad(got, ref, tol):
    """How many elements of ``got`` (reshaped to ref's shape) miss ``ref`` by more than
    ``tol`` (a NaN in ``got`` always counts), as a 0-d device array: one reduction and
    no synchronization, the fast path of the grid."""
    return _count_bad(to_float64(got).reshape(ref.shape), ref, tol)


def compare(got, ref, dtype_name, casting_mode="fp32", row0=0, ulps=None):
    """None when ``got`` (any dtype, reshaped to ref's (rows, hidden)) matches the float64
    ``ref`` within ``tolerance_array``, else why not.

    A NaN in ``got`` where ``ref`` is finite fails (an element left unwritten after
    poisoning shows up so); NaN against NaN and equal infinities pass. ``row0`` is the
    first row's index in the caller's numbering, for the message.
    """
    tol = tolerance_array(ref, dtype_name, casting_mode, ulps)
    g = to_float64(got).reshape(ref.shape)
    err = cp.abs(g - ref)
    ok = (err <= tol) | (g == ref) | (cp.isnan(g) & cp.isnan(ref))
    if bool(ok.all()):
        return None
    bad = cp.argwhere(~ok)
    n_bad = int(bad.shape[0])
    r, c = (int(i) for i in bad[0])
    unwritten = int(cp.count_nonzero(cp.isnan(g) & ~cp.isnan(ref)))
    worst = float(cp.nanmax(cp.where(ok, 0.0, err / tol)))
    return (f"{n_bad} of {g.size} elements off (first at row {row0 + r}, col {c}: got "
            f"{float(g[r, c])!r}, want {float(ref[r, c])!r}, allowed +-{float(tol[r, c]):.3g}; "
            f"worst {worst:.3g}x the tolerance; {unwritten} NaN where the reference is finite)")


def same_bits(got, want):
    """None when two arrays of one dtype hold identical bits, else a message."""
    g, w = bits(got), bits(want)
    if g.shape != w.shape:
        return f"shape {g.shape} != {w.shape}"
    diff = g != w
    if not bool(diff.any()):
        return None
    first = tuple(int(i) for i in cp.argwhere(diff)[0])
    return (f"{int(cp.count_nonzero(diff))} of {g.size} elements differ in their bits "
            f"(first at {first}: got {float(to_float64(got[first]))!r}, "
            f"want {float(to_float64(want[first]))!r})")


def nan_equal_bits(got, want):
    """Like ``same_bits``, but any NaN matches any NaN (payloads may differ)."""
    both_nan = cp.isnan(to_float64(got)) & cp.isnan(to_float64(want))
    ok = (bits(got) == bits(want)) | both_nan
    if bool(ok.all()):
        return None
    first = tuple(int(i) for i in cp.argwhere(~ok)[0])
    return f"{int(cp.count_nonzero(~ok))} elements differ (first at {first})"


def count_not_poison(a):
    """Elements of ``a`` whose bits are not the poison NaN (any layout), as a 0-d device array."""
    return cp.count_nonzero(bits(a) != UINT[a.itemsize].type(NAN_BITS[name(a.dtype)]))


def count_differing_bits(a, b):
    """Elements whose bits differ between two arrays of one shape, as a 0-d device array."""
    return cp.count_nonzero(bits(a) != bits(b))


def take_rows(a2d, rows):
    """Rows ``rows`` (a CuPy int array) of a 2-D array, gathered through its bits."""
    return bits(a2d)[rows].view(a2d.dtype)


def count_nonfinite(a, chunk_rows=4096):
    """Number of NaN / Inf elements of a (rows, hidden) array, a few rows at a time."""
    exp_mask = {"float32": 0x7F800000, "float16": 0x7C00, "bfloat16": 0x7F80}[name(a.dtype)]
    total = 0
    for i in range(0, a.shape[0], chunk_rows):
        u = bits(a[i:i + chunk_rows])
        total += int(cp.count_nonzero((u & UINT[a.itemsize].type(exp_mask)) == exp_mask))
    return total


# -- NumPy <-> CuPy, bit for bit ---------------------------------------------------------------

def to_device(a):
    """A NumPy array on the GPU, bit for bit (bfloat16 through its bits)."""
    if a.dtype == BFLOAT16:
        return cp.asarray(a.view(np.uint16)).view(BFLOAT16)
    return cp.asarray(a)


def to_host(a):
    """A CuPy array on the host, bit for bit (bfloat16 through its bits)."""
    if a.dtype == BFLOAT16:
        return cp.asnumpy(a.view(cp.uint16)).view(BFLOAT16)
    return cp.asnumpy(a)


# -- random inputs -------------------------------------------------------------------------------

def normal(rs, shape, scale=1.0):
    """Fresh float32 normal values (CuPy's generator is not asked for zero elements)."""
    if math.prod(shape) == 0:
        return cp.zeros(shape, cp.float32)
    return rs.standard_normal(shape, dtype=cp.float32) * scale


def random_weight(rs, kind, weight_offset, hidden, dtype):
    """None (kind None), or a weight of x's dtype (kind "same") or float32 around one
    (around zero with a weight_offset)."""
    if kind is None:
        return None
    w = normal(rs, (hidden,), 0.5) + (0.0 if weight_offset else 1.0)
    return from_float32(w, dtype if kind == "same" else np.float32)


def fill_random(a, rs, scale=2.0, chunk_rows=8192):
    """Normal values into a (rows, hidden) array, a few rows at a time."""
    for i in range(0, a.shape[0], chunk_rows):
        part = a[i:i + chunk_rows]
        bits(part)[...] = bits(from_float32(normal(rs, part.shape, scale), a.dtype))


def poisoned_like(a):
    """A new array of a's shape and dtype full of the NaN poison."""
    b = cp.empty(a.shape, a.dtype)
    poison(b)
    return b


# -- calls ---------------------------------------------------------------------------------------

def call(op, x, res, w, mode="fp32", out=None, res_out=None, eps=EPS, weight_offset=0.0):
    """One call of ``op``; returns (out, residual_out), residual_out None for rms_norm."""
    if op == FUSED:
        return rn.fused_add_rms_norm(x, res, w, eps, out=out, residual_out=res_out,
                                     weight_offset=weight_offset, casting_mode=mode)
    return rn.rms_norm(x, w, eps, out=out, weight_offset=weight_offset, casting_mode=mode), None


# -- the quantized forms: comparisons with the NumPy reference ---------------------------------

FLOAT32_REL = 2.0 ** -19      # scales: a few float32 ulps
NEAR_TIE = 2.0 ** -17         # y * inv this close (relative) to a rounding boundary: either side
# llama mode rounds x * inv_rms to the dtype before the weight: where that value sits at a
# rounding midpoint, the GPU's rsqrtf and the reference's 1 / sqrt may round it apart, which
# moves y (and a row's amax, so its scale) by one step of the dtype
LLAMA_NEAR = {"float32": 2.0 ** -23, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}
MAX_NEAR_TIES = {"int8": 1e-2}   # of the bytes (int8's steps are coarse: more values lie near one)
MAX_NEAR_TIES_FP8 = 1e-3


def qdtype(quant_dtype):
    return quant_reference.QUANT_DTYPES[quant_dtype][0]


def q_bits(q):
    """A device q (uint8 / int8 / torch FP8) as host uint8."""
    if not isinstance(q, cp.ndarray):          # torch
        import torch
        q = cp.from_dlpack(q.contiguous().view(torch.uint8))
    return cp.asnumpy(cp.ascontiguousarray(q)).view(np.uint8)


def boundaries_apart(v, quant_dtype, near=NEAR_TIE):
    """Where v (float32 values about to be quantized) lies ``near`` (relative) or more from a
    rounding boundary: quantizing v (1 -+ near) gives the same code."""
    lo = quant_reference.quantize(v * np.float32(1 - near), np.float32(1), quant_dtype)
    hi = quant_reference.quantize(v * np.float32(1 + near), np.float32(1), quant_dtype)
    return lo.view(np.uint8) == hi.view(np.uint8)


def compare_q(got_bits, y, scales, quant_dtype, exact, near=NEAR_TIE):
    """None if the bytes ``got_bits`` are the quantization of ``y`` by ``scales`` (the kernel's;
    broadcast), exactly or (``exact`` False) but for near ties (``near``, relative) within one
    step; else why not."""
    want = quant_reference.quantize(y, scales, quant_dtype)
    want_bits = want.view(np.uint8)
    got = got_bits.view(qdtype(quant_dtype)).astype(np.float32)
    same = (got_bits == want_bits) | (np.isnan(got) & np.isnan(want.astype(np.float32)))
    if exact:
        bad = ~same
    else:
        with np.errstate(all="ignore"):
            v = np.clip(y * (np.float32(1) / np.asarray(scales, np.float32)), -1e38, 1e38).astype(np.float32)
        apart = boundaries_apart(v, quant_dtype, near)
        step = np.abs(got_bits.view(np.int8 if quant_dtype == "int8" else np.uint8).astype(np.int16)
                      - want_bits.view(np.int8 if quant_dtype == "int8" else np.uint8).astype(np.int16))
        near = ~same & ~apart
        bad = (~same & apart) | (near & (step > 1))
        cap = MAX_NEAR_TIES.get(quant_dtype, MAX_NEAR_TIES_FP8)
        if near.mean() > cap:
            return f"{int(near.sum())} of {near.size} bytes at near ties (more than {cap:g})"
    if bad.any():
        i = tuple(int(k) for k in np.argwhere(bad)[0])
        return (f"{int(bad.sum())} of {bad.size} bytes off (first at {i}: got {got_bits[i]:#04x} "
                f"({got[i]!r}), want {want_bits[i]:#04x}; y {y[i]!r})")
    return None


def compare_scales(got, want, exact, rel=FLOAT32_REL):
    got = cp.asnumpy(cp.ascontiguousarray(got)) if isinstance(got, cp.ndarray) else np.asarray(got)
    if got.shape != want.shape:
        return f"scales shape {got.shape} != {want.shape}"
    ok = got == want if exact else np.abs(got - want) <= rel * np.abs(want)
    if not ok.all():
        i = tuple(int(k) for k in np.argwhere(~ok)[0])
        return f"{int((~ok).sum())} scales off (first at {i}: got {got[i]!r}, want {want[i]!r})"
    return None


def tolerances(mode, dtype_name):
    """(near-tie window for the bytes, relative tolerance of the scales) of a random call."""
    if mode == "llama":
        return max(NEAR_TIE, LLAMA_NEAR[dtype_name]), max(FLOAT32_REL, LLAMA_NEAR[dtype_name])
    return NEAR_TIE, FLOAT32_REL
