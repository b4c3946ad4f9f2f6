"""Arrays through their bits (bfloat16 <-> float32, so nothing leans on CuPy bfloat16 arithmetic),
the NaN poison, torch views; shared by the benchmark and the GPU tests.
"""

import functools

import ml_dtypes
import numpy as np

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
UINT = {2: np.dtype(np.uint16), 4: np.dtype(np.uint32)}
# quiet NaN bit patterns, written into outputs before a call so that unwritten elements show
NAN_BITS = {"float32": 0x7FC00000, "float16": 0x7E00, "bfloat16": 0x7FC0}


def bits(a):
    """``a`` (CuPy or NumPy) as unsigned integers of its item size (same shape and strides, no copy)."""
    return a.view(UINT[a.itemsize])


def poison(a):
    """Fill ``a`` with quiet NaNs (through its bits, for every dtype)."""
    bits(a).fill(NAN_BITS[a.dtype.name])


@functools.lru_cache(maxsize=None)
def _kernels():
    """bfloat16 -> float32 / float64 (exact), float32 -> bfloat16 (nearest even): one elementwise kernel each."""
    import cupy
    to_f32 = cupy.ElementwiseKernel(
        "uint16 u", "float32 f", "f = __uint_as_float(((unsigned int)u) << 16)", "cupy_rmsnorm_bf16_to_f32")
    to_f64 = cupy.ElementwiseKernel(
        "uint16 u", "float64 f", "f = (double)__uint_as_float(((unsigned int)u) << 16)", "cupy_rmsnorm_bf16_to_f64")
    from_f32 = cupy.ElementwiseKernel(
        "float32 f", "uint16 u",
        """unsigned int b = __float_as_uint(f);
        u = (b & 0x7fffffffu) > 0x7f800000u ? (unsigned short)0x7fc0
            : (unsigned short)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);""",
        "cupy_rmsnorm_f32_to_bf16")
    return to_f32, to_f64, from_f32


def to_float32(a):
    """A float32 copy of a float32 / float16 / bfloat16 CuPy array (exact, contiguous)."""
    import cupy
    if a.dtype == BFLOAT16:
        return _kernels()[0](bits(a))
    return a.astype(cupy.float32)


def to_float64(a):
    """A float64 copy of a CuPy array (exact, contiguous)."""
    import cupy
    if a.dtype == BFLOAT16:
        return _kernels()[1](bits(a))
    return a.astype(cupy.float64)


def from_float32(a32, dtype):
    """A CuPy array rounded to ``dtype`` (a dtype or its name) to nearest even, as the kernels round (contiguous)."""
    import cupy
    dtype = np.dtype(dtype)     # "bfloat16" too: ml_dtypes registers the name
    if a32.dtype != cupy.float32:
        a32 = a32.astype(cupy.float32)
    if dtype != BFLOAT16:
        return a32.astype(dtype)
    return _kernels()[2](a32).view(BFLOAT16)


def to_torch(a):
    """A torch view of a CuPy array (16-bit types as int16, whatever either side's DLPack bfloat16 support)."""
    import cupy
    import torch
    if a.dtype.itemsize == 2:
        torch_dtype = torch.bfloat16 if a.dtype == BFLOAT16 else torch.float16
        return torch.from_dlpack(a.view(cupy.int16)).view(torch_dtype)
    return torch.from_dlpack(a)


def to_cupy(t):
    """A CuPy view of a torch CUDA tensor (16-bit types as int16; a non-contiguous one copied first)."""
    import cupy
    import torch
    t = t.contiguous()
    if t.element_size() == 2:
        return cupy.from_dlpack(t.view(torch.int16)).view(np.dtype(str(t.dtype).replace("torch.", "")))
    return cupy.from_dlpack(t)
