"""The one call flow every op runs, over the op's ``OpSpec``:

caller's arrays -> interop (one kind for all, its device and stream) -> the op's checks
(arguments and scalars, once) -> the op's layout (shapes, dtypes, strides, overlap; nothing
launched or written on error) -> the NumPy reference, or the op's launcher (plan, compile,
launch on the caller's stream) -> remembered for the call's signature.

A call whose signature (everything but the arrays' addresses, ``_interop.signature_of``) was
seen before takes the fast path: the launch entry remembered for it (``_cache``) reads the
pointers and launches. Everything particular to an op lives in its family's module under
``ops/``, which builds its specs and registers them here (``register``); the package's
``__init__`` exports the public functions of the registered specs.

The torch layer is no part of this flow: each family binds its registered ops to its specs
(``OpSpec.traced``) when ``_interop.TorchKind`` binds, at the first torch tensor (or at import
when torch is already loaded); calls made while torch.compile traces, and eager calls that
autograd must record, go to ``spec.traced``.
"""

import sys
from typing import Any, Callable, Literal, NamedTuple, Optional

from . import _cache, _interop
from ._interop import CupyKind, DlpackKind, NumpyKind, TorchCpuKind, TorchKind


Array = Any
"""A CuPy array, a NumPy array, a PyTorch tensor or a CUDA array with ``__dlpack__``."""
CastingMode = Literal["fp32", "llama"]


class OpSpec:
    """What the pipeline needs of one op. The hooks (each the family's):

    - ``check(arrays, *args) -> options``: the scalar and option arguments checked once (the
      arrays named; nothing about them read yet);
    - ``layout(call, options) -> (arrays, layout, copied)``: the arrays' checks on their Meta
      records and their layout (``call``: a ``Resolved``); ``copied``: an input was copied;
    - ``reference(arrays, options, layout) -> result``: the NumPy path;
    - ``launcher(layout, options, kind) -> (entry, first)``: the launch entry remembered for
      the signature (called with the arrays; returns None when its cheap checks cannot settle
      a call) and the call of the full path's first launch;
    - ``traced(arrays, options, differentiable) -> result``: set by the torch layer: the call
      through the registered ops (``differentiable``: an eager call autograd records).

    ``arrays``: the NamedTuple of the op's arrays; ``outputs``: positions of caller-given
    outputs; ``anchor``: the array the others must match (its kind, its name in messages);
    ``required``: {name: what it must be} of arrays that may not be None; ``autograd``:
    whether torch calls that autograd must record go to ``traced``; ``names``: the arrays'
    names in messages (default the NamedTuple's fields); ``public``: the public function.
    """

    def __init__(self, name, arrays, *, check, layout, reference, launcher, outputs=(), anchor=0, required=None,
                 autograd=False, public=None, names=None):
        self.name, self.arrays, self.names = name, arrays, tuple(names or arrays._fields)
        self.check, self.layout, self.reference, self.launcher = check, layout, reference, launcher
        self.outputs, self.anchor, self.required, self.autograd = tuple(outputs), anchor, dict(required or {}), autograd
        self.public = public          # the public function running this spec
        self.traced: Optional[Callable] = None

    def __repr__(self):
        return f"OpSpec({self.name!r})"


REGISTRY = {}   # name -> OpSpec, in the order the families register them


def register(*specs):
    """Add a family's specs (the family's module calls this at import)."""
    for spec in specs:
        if spec.name in REGISTRY:
            raise ValueError(f"an op named {spec.name!r} is registered already")
        REGISTRY[spec.name] = spec
    return specs[0] if len(specs) == 1 else specs


# -- the fast path ----------------------------------------------------------------------------------
# Inline here: a repeated call's Python is a few microseconds, and every frame costs tens of ns.
# The signature function of the anchor's type is looked up (_interop.signature_of finds and
# records it for a new type), then compared with the last hit's before the cache's dict.
_signatures_get = _interop.SIGNATURES.get
_launches_get = _cache.launches.get


def call(spec, arrays, args):
    """Run ``spec`` on ``arrays`` (a plain tuple in the spec's order: naming them costs a
    NamedTuple's construction on every call; the full path names them) with ``args`` (the
    op's other arguments, a tuple in the order its ``check`` takes them)."""
    compiling = TorchKind.compiling
    if compiling is not None:
        if compiling():
            return spec.traced(*checked(spec, arrays, args), False)
    elif sys.modules.get("torch") is not None:
        _refuse_unregistered_trace()
    signature = _signatures_get(type(arrays[0]), _interop.signature_of)(spec, arrays, args)
    last_signature, launch = _cache.last_hit
    try:
        if signature != last_signature:
            launch = _launches_get(signature)
            if launch is not None:
                _cache.last_hit = signature, launch
    except Exception:       # an odd part (an eps that cannot be hashed or compared): no fast path
        launch = None
    if launch is not None:
        result = launch(arrays)
        if result is not None:
            return result
    return full(spec, arrays, args, signature)


def checked(spec, arrays, args):
    """(the named arrays, the checked options): TypeError for a required array that is None,
    then the op's checks of its scalars and options."""
    arrays = spec.arrays._make(arrays)
    for name, what in spec.required.items():
        if getattr(arrays, name) is None:
            raise TypeError(f"{name} must be {what}, got None")
    return arrays, spec.check(arrays, *args)


def full(spec, arrays, args, signature=None):
    """The full path: validate everything, then run (and remember a launch entry)."""
    arrays, options = checked(spec, arrays, args)
    kind, arrays, cacheable = array_kind(arrays, spec.names, spec.anchor)
    if kind in (TorchKind, TorchCpuKind):
        if spec.autograd and _interop.autograd_records(arrays):
            # the registered op, with its autograd; remembered like an eager call's launcher (the
            # signature holds whether autograd records, and the checked options are the call's)
            traced, make = spec.traced, spec.arrays._make

            def recorded(arrays):
                return traced(make(arrays), options, True)
            _cache.remember(signature, recorded)
            return recorded(arrays)
        if _interop.dispatches_itself(arrays):     # a DTensor: its dispatch runs the op on each shard
            return spec.traced(arrays, options, False)
    if kind is TorchCpuKind:     # the reference on NumPy views, tensors back
        views = cpu_views(arrays, spec.names, spec.outputs, spec.anchor)
        call = prepare(NumpyKind, views, spec.names, spec.outputs, False)
        laid_out, layout, _ = spec.layout(call, options)
        result = spec.reference(laid_out, options, layout)
        return TorchCpuKind.tensors(result, [(views[k], arrays[k]) for k in spec.outputs if arrays[k] is not None])
    call = prepare(kind, arrays, spec.names, spec.outputs, cacheable)
    arrays, layout, copied = spec.layout(call, options)
    if call.kind is NumpyKind:
        return spec.reference(arrays, options, layout)
    entry, first = spec.launcher(layout, options, call.kind)
    if call.cacheable and not copied:
        _cache.remember(signature, entry)
    return first(arrays)


def _refuse_unregistered_trace():
    """torch was imported after this library and no tensor has reached it yet, so the torch
    ops are not registered; registering them now would happen inside dynamo's trace, which
    cannot import them. Say so, rather than let dynamo trip over this module's Python."""
    if sys.modules["torch"].compiler.is_dynamo_compiling():
        raise RuntimeError("torch.compile is tracing a cupy_rmsnorm call before the library's torch ops were "
                           "registered (torch was imported after cupy_rmsnorm, and no tensor has been passed "
                           "yet): import cupy_rmsnorm.torch before compiling")


# -- the full path's first step: one kind for all arrays -----------------------------------------

class Resolved(NamedTuple):
    """A call's arrays as its kind runs them. ``arrays``: the caller's (DLPack producers as
    zero-copy CuPy views); ``resolved``: what the kernel reads (torch tensors with the lazy
    negation bit resolved by a copy); ``metas``: their Meta records; ``copied``: an input was
    copied; ``cacheable``: the call may leave its launcher in the signature cache (not for
    DLPack producers, whose signature is CuPy's views')."""
    kind: type
    arrays: tuple
    resolved: tuple
    metas: tuple
    copied: bool
    cacheable: bool


def array_kind(arrays, names, anchor=0):
    """The one kind of a call's ``arrays`` (a NamedTuple, None where absent): (kind, the arrays
    as that kind takes them, whether the call may be cached). TypeError when an array is of no
    known kind or of another kind than ``arrays[anchor]`` (``names``: the arguments' names).
    DLPack producers become zero-copy CuPy views (and the call is not cached: its signature
    would be CuPy's views'); the first torch tensor binds the torch layer."""
    kind = _interop.kind_of(arrays[anchor], names[anchor])
    for name, a in zip(names, arrays):
        if a is not None and _interop.kind_of(a, name) is not kind:
            raise TypeError(f"{name} must be the same kind of array as {names[anchor]} ({kind.name}), "
                            f"got {type(a).__module__}.{type(a).__name__}")
    if kind is NumpyKind:
        return kind, arrays, True
    if kind is TorchKind:
        TorchKind.bind()
        if arrays[anchor].device.type == "cpu":
            return TorchCpuKind, arrays, False
        return kind, arrays, True
    if kind is DlpackKind:     # the device check before the CuPy check: a CPU producer gets the device error
        return CupyKind, type(arrays)(*(None if a is None else kind.to_cupy(a, n) for n, a in zip(names, arrays))), False
    _interop.require_cupy()
    return kind, arrays, True


def prepare(kind, arrays, names, outputs=(), cacheable=True):
    """``Resolved`` for arrays of one ``kind`` (array_kind's): torch tensors must be on CUDA
    (ValueError), ``outputs`` (positions) plain memory, inputs with the lazy negation bit are
    resolved by a copy; NumPy inputs of another byte order are made native (the reference
    reads values)."""
    make = type(arrays)
    resolved = arrays
    if kind is TorchKind:
        _check_torch(arrays, names, outputs)
        resolved = make(*(None if a is None else kind.resolve(a, n) for n, a in zip(names, arrays)))
    elif kind is NumpyKind:
        resolved = make(*(a if a is None or k in outputs else kind.native(a) for k, a in enumerate(arrays)))
    metas = make(*(None if a is None else kind.meta(a) for a in resolved))
    copied = any(a is not b for a, b in zip(arrays, resolved))
    return Resolved(kind, arrays, resolved, metas, copied, cacheable)


def resolve(arrays, names, anchor=0, outputs=()):
    """``prepare(*array_kind(...))``."""
    kind, arrays, cacheable = array_kind(arrays, names, anchor)
    return prepare(kind, arrays, names, outputs, cacheable)


def cpu_views(arrays, names, outputs, anchor):
    """NumPy views of a call's CPU tensors (the same kind of NamedTuple): every tensor on the
    CPU (ValueError naming the one that is not), outputs plain memory."""
    for k, (name, t) in enumerate(zip(names, arrays)):
        if t is None:
            continue
        if t.device.type != "cpu":
            raise ValueError(f"{name} is a torch tensor on {t.device}, and {names[anchor]} is on the CPU; "
                             f"pass tensors of one device")
        if k in outputs and (t.is_neg() or t.is_conj()):
            raise ValueError(f"{name} has torch's lazy negation (or conjugation) bit set, so its memory holds the "
                             f"values without the sign; pass a plain tensor ({name}.resolve_neg() makes one)")
    return type(arrays)(*(None if t is None else TorchCpuKind.view(t) for t in arrays))


def _check_torch(arrays, names, outputs):
    """Torch tensors must be on a CUDA device; outputs must be plain memory."""
    torch = sys.modules["torch"]
    for k, (name, t) in enumerate(zip(names, arrays)):
        if t is None:
            continue
        if t.device.type != "cuda":
            raise ValueError(f"{name} is a torch tensor on {t.device}; pass tensors of one device (CUDA, or the CPU "
                             f"for the reference)")
        if k in outputs and t.layout == torch.strided and (t.is_neg() or t.is_conj()):
            raise ValueError(f"{name} has torch's lazy negation (or conjugation) bit set, so its memory "
                             f"holds the values without the sign; pass a plain tensor "
                             f"({name}.resolve_neg() makes one)")


def store(dest, value):
    """``value`` into ``dest`` (None: ``value`` itself): by value, any byte order; a uint8
    ``dest`` of quantized values takes their bits."""
    if dest is None:
        return value
    bits = dest.dtype != value.dtype and dest.dtype.kind == "u" and value.dtype.itemsize == 1
    (dest.view(value.dtype) if bits else dest)[...] = value
    return dest

