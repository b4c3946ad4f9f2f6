"""Float64 references and bit-level helpers on the GPU, for tests/test_gpu_correctness.py.

The reference follows the numerics contract of cupy_rmsnorm/_reference.py, computed in
float64 instead of float32: the fused op normalizes the residual sum *after* it was
rounded to the storage dtype (the caller passes that rounded sum in), ``casting_mode=
"llama"`` rounds ``x * inv_rms`` to the dtype before the weight multiply, and the final
rounding to the dtype is left to the comparison's tolerance.

bfloat16 is converted through its bits (a bfloat16 is the top half of a float32) by
small elementwise kernels, so nothing here leans on CuPy's bfloat16 arithmetic; the only
bfloat16 arithmetic CuPy is asked for is the fused op's expected ``x + residual``, which
the tests take from CuPy on purpose (the "dtype add" the contract names).

Importing this module needs CuPy; the GPU tests import it only when a GPU is present.
"""

import cupy as cp
import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
_UINT = {2: cp.uint16, 4: cp.uint32}
# quiet NaN bit patterns, used to poison outputs before a call
NAN_BITS = {"float32": 0x7FC00000, "float16": 0x7E00, "bfloat16": 0x7FC0}
MANTISSA_BITS = {"float32": 23, "float16": 10, "bfloat16": 7}
# the smallest spacing of each 16-bit dtype (float16 subnormals; bfloat16's never matter)
MIN_SPACING = {"float16": 2.0 ** -24, "bfloat16": 2.0 ** -133}
# the spacing of the dtype's numbers relative to a value at the bottom of its binade,
# so |a - b| <= ULP_REL * |b| allows (at least) one ulp
ULP_REL = {k: 2.0 ** -p for k, p in MANTISSA_BITS.items()}
# absolute slack near zero (float16 subnormals are spaced 2**-24 apart)
ATOL = {"float32": 1e-12, "float16": 4 * 2.0 ** -24, "bfloat16": 1e-12}
# The kernel's float32 arithmetic (the sum of squares over up to 262144 terms in its own
# order, rsqrtf, the products) is typically ~1e-6 relative off the float64 value. For
# float32 outputs that is the whole tolerance; for 16-bit outputs it is the slack on top
# of the rounding.
FLOAT32_RTOL = 1e-5
NOISE_REL = 1e-5


def name(dtype):
    return np.dtype(dtype).name


def bits(a):
    """``a`` as unsigned integers of its item size (same shape and strides, no copy)."""
    return a.view(_UINT[a.itemsize])


def poison(buf):
    """Fill a whole buffer with quiet NaNs (through its bits, for every dtype)."""
    bits(buf).fill(NAN_BITS[name(buf.dtype)])


# bfloat16 <-> float conversions through the bits: one elementwise kernel each, exact
# (bfloat16 -> float) or round-to-nearest-even with NaN kept NaN (float -> bfloat16)
_bf16_to_f32 = cp.ElementwiseKernel(
    "uint16 u", "float32 f", "f = __uint_as_float(((unsigned int)u) << 16)", "test_bf16_to_f32")
_bf16_to_f64 = cp.ElementwiseKernel(
    "uint16 u", "float64 f", "f = (double)__uint_as_float(((unsigned int)u) << 16)", "test_bf16_to_f64")
_f32_to_bf16 = cp.ElementwiseKernel(
    "float32 f", "uint16 u",
    """unsigned int b = __float_as_uint(f);
    u = (b & 0x7fffffffu) > 0x7f800000u ? (unsigned short)0x7fc0
        : (unsigned short)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);""",
    "test_f32_to_bf16")
# elements where got is neither equal to ref nor within tol of it (NaN counts as bad)
_count_bad = cp.ReductionKernel(
    "float64 g, float64 r, float64 t", "int64 n",
    "(g == r || fabs(g - r) <= t) ? 0 : 1", "a + b", "n = a", "0", "test_count_bad",
    reduce_type="long long")


def to_float32(a):
    """float32 copy of a float32 / float16 / bfloat16 array (exact), contiguous."""
    if a.dtype == BF16:
        return _bf16_to_f32(bits(a))
    return a.astype(cp.float32)


def to_float64(a):
    """float64 copy (exact), contiguous."""
    if a.dtype == BF16:
        return _bf16_to_f64(bits(a))
    return a.astype(cp.float64)


def from_float32(a32, dtype):
    """Round a float32 array to ``dtype`` to nearest even, as the kernels do (contiguous)."""
    dtype = np.dtype(dtype)
    if a32.dtype != cp.float32:
        a32 = a32.astype(cp.float32)
    if dtype != BF16:
        return a32.astype(dtype)
    return _f32_to_bf16(a32).view(BF16)


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
        return ATOL[dtype_name] + FLOAT32_RTOL * mag
    if ulps is None and casting_mode == "fp32":
        _, exponent = cp.frexp(ref)          # |ref| = m * 2**exponent, 0.5 <= m < 1
        spacing = cp.exp2(exponent.astype(cp.float64) - 1 - MANTISSA_BITS[dtype_name])
        return 0.5 * cp.maximum(spacing, MIN_SPACING[dtype_name]) + NOISE_REL * mag + ATOL[dtype_name]
    return ATOL[dtype_name] + (2 if ulps is None else ulps) * ULP_REL[dtype_name] * mag


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
    return cp.count_nonzero(bits(a) != _UINT[a.itemsize](NAN_BITS[name(a.dtype)]))


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
        total += int(cp.count_nonzero((u & _UINT[a.itemsize](exp_mask)) == exp_mask))
    return total
