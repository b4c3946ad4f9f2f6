"""Array kinds: recognise the caller's arrays, read their metadata, allocate like them,
find the stream to launch on, and hand results back as the caller's type.

PyTorch is imported only when a torch tensor arrives (its type is recognised by its
module name); CuPy is imported lazily too, so NumPy-only code runs without a GPU.
"""

import sys
from typing import NamedTuple

import ml_dtypes
import numpy as np


class Meta(NamedTuple):
    """What the validation and the launcher need of one array."""
    ptr: int
    shape: tuple
    strides: tuple      # in elements; None when a stride is not a whole number of elements
    dtype: str          # "float32" | "float16" | "bfloat16" | anything else, rejected later
    itemsize: int
    device: int         # CUDA device index; -1 on the host
    writeable: bool = True


def _dtype_name(dtype):
    name = getattr(dtype, "name", None) or str(dtype)
    return name


def _elem_strides(strides_bytes, itemsize):
    if any(s % itemsize for s in strides_bytes):
        return None
    return tuple(s // itemsize for s in strides_bytes)


class _PlainKind:
    """Arrays with no autograd and no lazy bits (NumPy, CuPy)."""

    @staticmethod
    def resolve(a, arg):
        return a


class NumpyKind(_PlainKind):
    """NumPy arrays: the reference runs on the CPU."""
    name = "numpy"

    @staticmethod
    def meta(a):
        return Meta(a.__array_interface__["data"][0], a.shape, _elem_strides(a.strides, a.itemsize),
                    _dtype_name(a.dtype), a.itemsize, -1, bool(a.flags.writeable))

    @staticmethod
    def contiguous(a):
        return np.ascontiguousarray(a)

    @staticmethod
    def broadcast_to(a, shape):
        """A zero-copy view of ``a`` broadcast to ``shape`` (steps of 0 on the new axes)."""
        return np.broadcast_to(a, shape)

    @staticmethod
    def native(a):
        """``a`` in its machine's byte order (a copy only when it is not already)."""
        return a if a.dtype.isnative else a.astype(a.dtype.newbyteorder("="))


class CupyKind(_PlainKind):
    """CuPy arrays: launched on CuPy's current stream. The Launcher has made the arrays'
    device current before empty() and stream() are called."""
    name = "cupy"

    @staticmethod
    def meta(a):
        # CuPy 14 has no read-only arrays; a later CuPy's flags.writeable is honoured
        return Meta(a.data.ptr, a.shape, _elem_strides(a.strides, a.itemsize),
                    _dtype_name(a.dtype), a.itemsize, a.data.device_id,
                    bool(getattr(a.flags, "writeable", True)))

    @staticmethod
    def ptr(a):
        return a.data.ptr

    @staticmethod
    def empty_getter(x_row_strides, n_inner, hidden):
        """A function making a fresh contiguous output like x (on the current device)."""
        cupy = _cupy()
        return lambda like: cupy.empty(like.shape, dtype=like.dtype)

    @staticmethod
    def empty_of(like, shape, dtype_name=None):
        """A fresh array of ``shape`` (``like``'s dtype, or ``dtype_name``) on the current device."""
        return _cupy().empty(shape, dtype=like.dtype if dtype_name is None else np.dtype(dtype_name))

    @staticmethod
    def zeros_like(a):
        return _cupy().zeros(a.shape, dtype=a.dtype)

    @staticmethod
    def quant_storage(quant_dtype):
        """The dtype of a fresh quantized output: CuPy has no FP8 dtype, so FP8 bytes come as uint8."""
        return "int8" if quant_dtype == "int8" else "uint8"

    @staticmethod
    def contiguous(a):
        cupy = _cupy()
        with cupy.cuda.Device(a.data.device_id):
            return cupy.ascontiguousarray(a)

    @staticmethod
    def broadcast_to(a, shape):
        return _cupy().broadcast_to(a, shape)

    @staticmethod
    def as_dtype(a, dtype_name):
        """A contiguous copy of ``a`` in another dtype (on a's device)."""
        cupy = _cupy()
        with cupy.cuda.Device(a.data.device_id):
            return a.astype(np.dtype(ml_dtypes.bfloat16) if dtype_name == "bfloat16" else dtype_name, order="C")

    @staticmethod
    def stream(device):
        return _cupy().cuda.get_current_stream().ptr



class TorchKind:
    """PyTorch tensors: launched on torch's current stream of the tensors' device (so work
    under ``torch.cuda.stream(s)`` is ordered), outputs from torch's caching allocator."""
    name = "torch"
    _dtypes = None
    compiling = None     # torch.compiler.is_dynamo_compiling once bound: the pipeline's tracing check
    _bindings = []       # what binds with torch: each family's registration of its torch ops

    @classmethod
    def add_binding(cls, bind):
        """Call ``bind()`` when torch binds (at once if it has): a family registers its torch
        ops this way, so the call flow never imports them."""
        cls._bindings.append(bind)
        if cls.compiling is not None:
            bind()

    @classmethod
    def bind(cls):
        """Once torch is imported (idempotent): the hot-path functions become torch's C
        functions themselves (no Python wrapper call per use), and the families' torch ops
        are registered."""
        if cls.compiling is not None:
            return
        import torch
        cls.ptr = staticmethod(torch.Tensor.data_ptr)
        raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)   # absent in CPU builds
        if raw_stream is not None:
            cls.stream = staticmethod(raw_stream)
        cls.grad_enabled = staticmethod(torch.is_grad_enabled)
        cls.inference_mode = staticmethod(torch.is_inference_mode_enabled)
        # is_dynamo_compiling: a plain `return False` in eager (cheaper than is_compiling)
        cls.compiling = staticmethod(getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling))
        try:
            for bind in cls._bindings:
                bind()
        except BaseException:
            cls.compiling = None
            raise

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
                    dev.index if dev.type == "cuda" else -1, cls.writeable(t))

    @staticmethod
    def writeable(t):
        """Whether ``t`` can be written now: an inference tensor only in inference mode
        (torch's own rule). _torch_signature writes this out inline."""
        return not t.is_inference() or TorchKind.inference_mode()

    @staticmethod
    def resolve(t, arg):
        """``t`` as plain strided memory: TypeError for a sparse (or other non-strided)
        tensor; a tensor with the lazy negation or conjugation bit comes back resolved (a
        copy), since its memory holds the values without the sign."""
        torch = sys.modules["torch"]
        if t.layout != torch.strided:
            raise TypeError(f"{arg} is a {t.layout} tensor; pass a dense (strided) tensor, "
                            f"e.g. {arg}.to_dense()")
        if t.is_neg() or t.is_conj():
            return t.resolve_conj().resolve_neg()
        return t

    @staticmethod
    def ptr(t):
        return t.data_ptr()

    @staticmethod
    def empty_getter(x_row_strides, n_inner, hidden):
        """A function making a fresh contiguous output like x. When x's rows are contiguous,
        torch's default (preserve x's layout) is contiguous already, and cheaper to ask for."""
        torch = sys.modules["torch"]
        outer, inner = x_row_strides
        if (n_inner == 1 or inner == hidden) and outer in (0, hidden * n_inner):
            return torch.empty_like
        return lambda like: torch.empty_like(like, memory_format=torch.contiguous_format)

    @staticmethod
    def empty_of(like, shape, dtype_name=None):
        """A fresh tensor of ``shape`` (``like``'s dtype, or ``dtype_name``) on like's device."""
        torch = sys.modules["torch"]
        dtype = like.dtype if dtype_name is None else getattr(torch, dtype_name)
        return torch.empty(shape, dtype=dtype, device=like.device)

    @staticmethod
    def zeros_like(t):
        return sys.modules["torch"].zeros(t.shape, dtype=t.dtype, device=t.device)

    @staticmethod
    def quant_storage(quant_dtype):
        """The dtype of a fresh quantized output: torch's own (torch.float8_e4m3fn, ...)."""
        return quant_dtype

    @staticmethod
    def grad_enabled():
        return sys.modules["torch"].is_grad_enabled()

    @staticmethod
    def inference_mode():
        return sys.modules["torch"].is_inference_mode_enabled()

    @staticmethod
    def contiguous(t):
        return t.contiguous()

    @staticmethod
    def broadcast_to(t, shape):
        return t.expand(shape)

    @staticmethod
    def as_dtype(t, dtype_name):
        """A contiguous copy of ``t`` in another dtype."""
        torch = sys.modules["torch"]
        return t.to(getattr(torch, dtype_name), memory_format=torch.contiguous_format)

    @staticmethod
    def stream(device):
        return sys.modules["torch"]._C._cuda_getCurrentRawStream(device)



class _TensorMemory:
    """A CPU tensor's memory under NumPy's array interface, for a zero-copy view that holds the
    tensor (its memory lives as long as the view). ``Tensor.numpy()`` would also mark the
    storage unresizable for good, and FSDP2 frees its unsharded parameters by resizing theirs."""
    __slots__ = ("tensor", "__array_interface__")

    def __init__(self, t, dtype_name):
        size = t.element_size()
        self.tensor = t
        self.__array_interface__ = dict(version=3, shape=tuple(t.shape), typestr=np.dtype(dtype_name).str,
                                        strides=tuple(s * size for s in t.stride()), data=(t.data_ptr(), False))


class TorchCpuKind:
    """torch CPU tensors: the reference runs on zero-copy NumPy views of them (bfloat16 through
    an int16 view as ml_dtypes.bfloat16), and its results come back as tensors sharing the
    NumPy arrays' memory (the given outputs as the caller's tensors). No view outlives the
    call, so storage a caller resizes later (FSDP2's parameters) is not pinned."""
    name = "torch (CPU)"
    _views = {"bfloat16": ("int16", ml_dtypes.bfloat16), "float8_e4m3fn": ("uint8", ml_dtypes.float8_e4m3fn),
              "float8_e5m2": ("uint8", ml_dtypes.float8_e5m2)}

    @classmethod
    def view(cls, t):
        """A NumPy view of CPU tensor ``t`` (lazy negation or conjugation resolved by a copy)."""
        torch = sys.modules["torch"]
        t = t.detach()
        if t.is_neg() or t.is_conj():
            t = t.resolve_conj().resolve_neg()
        name = str(t.dtype).replace("torch.", "")
        if name in cls._views:
            storage, dtype = cls._views[name]
            return np.asarray(_TensorMemory(t.view(getattr(torch, storage)), storage)).view(dtype)
        return np.asarray(_TensorMemory(t, name))

    @classmethod
    def tensor(cls, a):
        """NumPy array ``a`` as a CPU tensor sharing its memory."""
        torch = sys.modules["torch"]
        name = a.dtype.name
        if name in cls._views:
            storage, _ = cls._views[name]
            return torch.from_numpy(a.view(storage)).view(getattr(torch, name))
        return torch.from_numpy(a)

    @classmethod
    def tensors(cls, result, given):
        """``result`` (an array or a tuple of arrays and None) as tensors: a given output's view
        as the caller's tensor (``given``: [(view, tensor)])."""
        if isinstance(result, tuple):
            return tuple(cls.tensors(r, given) for r in result)
        if result is None:
            return None
        for view, t in given:
            if result is view:
                return t
        return cls.tensor(result)


def _cupy():
    return sys.modules["cupy"] if "cupy" in sys.modules else __import__("cupy")


class DlpackKind:
    """Any other CUDA array with ``__dlpack__``: the call runs on zero-copy CuPy views of
    them (on CuPy's current stream) and returns CuPy arrays."""
    name = "DLPack"

    @staticmethod
    def to_cupy(obj, arg):
        """A CuPy view of a foreign CUDA array (zero copy)."""
        device = obj.__dlpack_device__()
        try:
            dev_type, _ = device
            dev_type = int(dev_type)
        except (TypeError, ValueError):
            raise TypeError(f"{arg}.__dlpack_device__() must return (device type, device id), "
                            f"got {device!r}") from None
        if dev_type not in (2, 13):  # kDLCUDA, kDLCUDAManaged
            raise ValueError(f"{arg} lives on a non-CUDA device (DLPack device type {int(dev_type)}); "
                             f"pass a CUDA array or a NumPy array")
        require_cupy()
        return sys.modules["cupy"].from_dlpack(obj)


def require_cupy():
    """ImportError saying what to install when GPU arrays arrive without CuPy."""
    if sys.modules.get("cupy") is not None:
        return
    try:
        import cupy  # noqa: F401
    except ImportError as e:
        raise ImportError("cupy_rmsnorm runs GPU arrays through CuPy, which is not installed "
                          f"({e}): pip install 'cupy-rmsnorm[cuda12]' (CUDA 12) or "
                          "'cupy-rmsnorm[cuda13]' (CUDA 13)") from None


def kind_of(obj, arg="x"):
    """The kind of ``obj`` (NumpyKind, CupyKind, TorchKind, DlpackKind); TypeError otherwise."""
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
        return DlpackKind
    raise TypeError(f"{arg} must be a CuPy array, a NumPy array, a PyTorch tensor or a CUDA "
                    f"array with __dlpack__, not {type(obj).__module__}.{type(obj).__name__}")


def _cupy_key(a):
    return (a.shape, a.strides, a.dtype, a.data.device_id)


def _cupy_signature(spec, arrays, args):
    ndarray = sys.modules["cupy"].ndarray
    key = [ndarray, spec, args]
    for a in arrays:
        if a is None:
            key.append(None)
        elif type(a) is ndarray:
            key.append(_cupy_key(a))
        else:                  # another kind of array in the mix: the full path says what
            return None
    return tuple(key)


# What a launcher depends on of a tensor, besides shape, strides, dtype and device: is_neg
# (its memory lacks the sign: resolved on the full path) and, for outputs, whether it can be
# written now (an inference tensor only in inference mode). Of the call, whether autograd must
# record it (grad mode on and a tensor requiring grad: then the full path routes it). With
# these in the signature a launcher needs no check of its own per call. Reading them is a good
# part of a torch call's host cost, so the forward's five arrays (x, residual, weight, out,
# residual_out) are written out inline, without a call per tensor (a CPU test checks the two
# forms against each other).
def _torch_input_key(t):
    return (t.shape, t.stride(), t.dtype, t.get_device(), t.is_neg())


def _torch_output_key(t):
    return (t.shape, t.stride(), t.dtype, t.get_device(), t.is_neg(), TorchKind.writeable(t))


def any_requires_grad(arrays):
    """Whether a tensor among ``arrays`` (None where absent) requires grad."""
    for t in arrays:
        if t is not None and t.requires_grad:
            return True
    return False


def autograd_records(arrays):
    """Whether autograd must record a torch call of ``arrays``: grad mode is on and a tensor
    requires grad. _torch_signature writes this out inline."""
    return TorchKind.grad_enabled() and any_requires_grad(arrays)


def dispatches_itself(arrays):
    """Whether a tensor among ``arrays`` is a subclass with its own dispatch (a DTensor, say):
    it has no memory of its own to read, and runs the registered ops itself."""
    plain = sys.modules["torch"].Tensor.__torch_dispatch__
    return any(t is not None and type(t).__torch_dispatch__ is not plain for t in arrays)


FORWARD_OUTPUTS = (3, 4)     # out and residual_out among the forward's five arrays


def _torch_signature(spec, arrays, args):
    try:    # anything but a tensor (a CuPy array in the mix, say) fails an attribute here
        if spec.outputs is FORWARD_OUTPUTS:
            x, r, w, o, ro = arrays
            return (TorchKind, spec, args,
                    TorchKind.grad_enabled() and any_requires_grad(arrays),       # autograd_records, inline
                    x.shape, x.stride(), x.dtype, x.get_device(), x.is_neg(),
                    None if r is None else (r.shape, r.stride(), r.dtype, r.get_device(), r.is_neg()),
                    None if w is None else (w.shape, w.stride(), w.dtype, w.get_device(), w.is_neg()),
                    None if o is None else (o.shape, o.stride(), o.dtype, o.get_device(), o.is_neg(),
                                            not o.is_inference() or TorchKind.inference_mode()),   # writeable
                    None if ro is None else (ro.shape, ro.stride(), ro.dtype, ro.get_device(), ro.is_neg(),
                                             not ro.is_inference() or TorchKind.inference_mode()))
        outputs = spec.outputs
        return (TorchKind, spec, args, autograd_records(arrays)) + tuple(
            None if t is None else _torch_output_key(t) if k in outputs else _torch_input_key(t)
            for k, t in enumerate(arrays))
    except (AttributeError, TypeError, RuntimeError):   # RuntimeError: a sparse tensor's strides
        return None


SIGNATURES = {}   # type of a call's first array -> its kind's signature function


def signature_of(spec, arrays, args):
    """A key of everything about a call of ``spec`` but the pointers, or None (then no fast
    path). It may be unhashable (an odd eps, say): the caller treats that like None. Records
    the signature function of a new type of ``arrays[0]`` in SIGNATURES."""
    sig = SIGNATURES.get(type(arrays[0]))
    if sig is None:
        cupy, torch = sys.modules.get("cupy"), sys.modules.get("torch")
        if cupy is not None and type(arrays[0]) is cupy.ndarray:
            sig = SIGNATURES[cupy.ndarray] = _cupy_signature
        elif torch is not None and type(arrays[0]) is torch.Tensor:   # weights may be nn.Parameter
            sig = SIGNATURES[torch.Tensor] = _torch_signature
        else:
            return None
    return sig(spec, arrays, args)
