"""Array kinds: recognise the caller's arrays, read their metadata, allocate like them,
find the stream to launch on, and hand results back as the caller's type.

PyTorch is imported only when a torch tensor arrives (its type is recognised by its
module name); CuPy is imported lazily too, so NumPy-only code runs without a GPU.
"""

import sys
from typing import NamedTuple

import numpy as np

DTYPE_NAMES = ("float32", "float16", "bfloat16")


class Meta(NamedTuple):
    """What the validation and the launcher need of one array."""
    ptr: int
    shape: tuple
    strides: tuple      # in elements; None when a stride is not a whole number of elements
    dtype: str          # "float32" | "float16" | "bfloat16" | anything else, rejected later
    itemsize: int
    device: int         # CUDA device index; -1 on the host


def _dtype_name(dtype):
    name = getattr(dtype, "name", None) or str(dtype)
    return name


def _elem_strides(strides_bytes, itemsize):
    if any(s % itemsize for s in strides_bytes):
        return None
    return tuple(s // itemsize for s in strides_bytes)


def is_torch_tensor(obj):
    mod = type(obj).__module__
    return mod.startswith("torch") and "torch" in sys.modules and isinstance(obj, sys.modules["torch"].Tensor)


class NumpyKind:
    name = "numpy"

    @staticmethod
    def meta(a):
        return Meta(a.__array_interface__["data"][0], a.shape, _elem_strides(a.strides, a.itemsize),
                    _dtype_name(a.dtype), a.itemsize, -1)


class CupyKind:
    name = "cupy"

    @staticmethod
    def ptr(a):
        return a.data.ptr

    @staticmethod
    def arg(a):
        """The kernel argument for an array: CuPy passes its own arrays' pointers fastest."""
        return 0 if a is None else a

    @staticmethod
    def grad_enabled():
        return False

    @staticmethod
    def launch(device, fn, grid, block, args):
        """Launch on CuPy's current stream of ``device``."""
        import cupy
        if cupy.cuda.runtime.getDevice() == device:
            fn((grid,), (block,), args)
        else:
            with cupy.cuda.Device(device):
                fn((grid,), (block,), args)

    @staticmethod
    def meta(a):
        return Meta(a.data.ptr, a.shape, _elem_strides(a.strides, a.itemsize),
                    _dtype_name(a.dtype), a.itemsize, a.data.device_id)

    @staticmethod
    def empty(shape, like):
        import cupy
        dev = like.data.device_id
        if dev == cupy.cuda.runtime.getDevice():
            return cupy.empty(shape, dtype=like.dtype)
        with cupy.cuda.Device(dev):  # CuPy allocates on the current device
            return cupy.empty(shape, dtype=like.dtype)

    @staticmethod
    def contiguous(a):
        import cupy
        with cupy.cuda.Device(a.data.device_id):
            return cupy.ascontiguousarray(a)


class _StreamHandle:
    """A raw stream pointer in the CUDA stream protocol, for cupy.cuda.Stream.from_external."""
    __slots__ = ("ptr",)

    def __init__(self, ptr):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


class TorchKind:
    name = "torch"
    _streams = {}        # (device, raw stream pointer) -> cupy Stream wrapping it
    _dtypes = None

    @staticmethod
    def ptr(t):
        return t.data_ptr()

    @staticmethod
    def arg(t):
        return 0 if t is None else t.data_ptr()

    @staticmethod
    def grad_enabled():
        import torch
        return torch.is_grad_enabled()

    @classmethod
    def launch(cls, device, fn, grid, block, args):
        """Launch on torch's current stream of ``device``."""
        import cupy
        if cupy.cuda.runtime.getDevice() == device:
            fn((grid,), (block,), args, stream=cls.stream(device))
        else:
            with cupy.cuda.Device(device):
                fn((grid,), (block,), args, stream=cls.stream(device))

    @classmethod
    def _dtype_map(cls):
        if cls._dtypes is None:
            import torch
            cls._dtypes = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
        return cls._dtypes

    @classmethod
    def meta(cls, t):
        dt = t.dtype
        name = cls._dtype_map().get(dt) or str(dt).replace("torch.", "")
        dev = t.device
        return Meta(t.data_ptr(), tuple(t.shape), tuple(t.stride()), name, t.element_size(),
                    dev.index if dev.type == "cuda" else -1)

    @staticmethod
    def empty(shape, like):
        import torch
        return torch.empty(shape, dtype=like.dtype, device=like.device)

    @staticmethod
    def contiguous(t):
        return t.contiguous()

    @classmethod
    def stream(cls, device):
        """torch's current stream on ``device``, wrapped once for CuPy's launcher."""
        import torch
        try:
            ptr = torch._C._cuda_getCurrentRawStream(device)   # the cheap way, no Stream object
        except AttributeError:  # pragma: no cover - older or newer torch
            ptr = torch.cuda.current_stream(device).cuda_stream
        key = (device, ptr)
        s = cls._streams.get(key)
        if s is None:
            import cupy
            with cupy.cuda.Device(device):
                s = cls._streams[key] = cupy.cuda.Stream.from_external(_StreamHandle(ptr))
        return s


def kind_of(obj, arg="x"):
    """The kind of ``obj`` (NumpyKind, CupyKind, TorchKind) or "dlpack"; TypeError otherwise."""
    if isinstance(obj, np.ndarray):
        return NumpyKind
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(obj, cupy.ndarray):
        return CupyKind
    if type(obj).__module__.startswith("torch"):
        import torch
        if isinstance(obj, torch.Tensor):
            return TorchKind
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        return "dlpack"
    raise TypeError(f"{arg} must be a CuPy array, a NumPy array, a PyTorch tensor or a CUDA "
                    f"array with __dlpack__, not {type(obj).__module__}.{type(obj).__name__}")


def from_dlpack(obj, arg):
    """A CuPy view of a foreign CUDA array (zero copy)."""
    dev_type, _ = obj.__dlpack_device__()
    if int(dev_type) not in (2, 13):  # kDLCUDA, kDLCUDAManaged
        raise ValueError(f"{arg} lives on a non-CUDA device (DLPack device type {int(dev_type)}); "
                         f"pass a CUDA array or a NumPy array")
    import cupy
    return cupy.from_dlpack(obj)


def _cupy_signature(a):
    return (type(a), a.shape, a.strides, a.dtype, a.data.device_id)


def _torch_signature(t):
    return (type(t), t.shape, t.stride(), t.dtype, t.device, t.requires_grad)


_SIGNATURES = {}   # array type -> function giving what a Launcher depends on


def signature(fused, arrays, eps, weight_offset, casting_mode):
    """A hashable key of everything but the pointers, or None (then no fast path)."""
    x = arrays["x"]
    sig_of = _SIGNATURES.get(type(x))
    if sig_of is None:
        cupy = sys.modules.get("cupy")
        if cupy is not None and type(x) is cupy.ndarray:
            sig_of = _SIGNATURES[cupy.ndarray] = _cupy_signature
        elif is_torch_tensor(x) and type(x) is sys.modules["torch"].Tensor:
            sig_of = _SIGNATURES[type(x)] = _torch_signature
        else:
            return None
    try:
        key = (fused, eps, weight_offset, casting_mode) + tuple(
            (k, sig_of(a)) for k, a in arrays.items())
        hash(key)
    except (AttributeError, TypeError):  # another kind of array in the mix: the full path says what
        return None
    return key
