"""This library's norms as layers for Hugging Face's ``kernels`` package: transformers marks its
norm modules with ``@use_kernel_forward_from_hub("RMSNorm")`` (LlamaRMSNorm and the 130-odd
classes copied from it), ``"RMSNormGated"`` (Qwen3-Next's and Qwen3.5's gated norms, Kimi-Linear's,
...) and ``"RMSNormZeroCentered"`` (Qwen3.5's ``(1 + weight)`` norms), and ``kernels.kernelize``
swaps the forward of each for the layer a mapping names.

    import cupy_rmsnorm.hf as rnhf
    model = rnhf.kernelize(model, mode="inference")     # or "training", "compile"
    # or by hand: with kernels.use_kernel_mapping(rnhf.kernel_mapping()): kernels.kernelize(...)

Each layer reproduces the module it replaces as ``patch_hf_rmsnorm`` does (same numerics, found the
same way, so the same logits bit for bit): the module's own forward and this library's candidate
formulas run once on a small random probe and the matching one is kept (``casting_mode="llama"``
for Llama-style roundings, ``"fp32"`` for one rounding, ``weight_offset=1.0`` for ``(1 + weight)``;
for gated modules also the order of norm and gate, and the module's ``group_size`` and
``activation``). The probe runs in ``kernelize`` here, or on a module's first eager call after a
plain ``kernels.kernelize``; a module that matches no formula keeps its own forward (with a
warning). CUDA tensors run the library's kernels, CPU tensors its NumPy reference; eager, autograd
(the library's backward) and ``torch.compile(fullgraph=True)`` (one registered op per norm).

Importing this submodule imports torch (not ``kernels``: only ``kernel_mapping`` and ``kernelize``
need it).
"""

import contextlib
import importlib.metadata
import logging
import warnings
from types import SimpleNamespace

import torch
from torch import nn

from .ops.forward import rms_norm
from .ops.gated import rms_norm_gated
from .torch import _eps_of, _matching_numerics

__all__ = ["RMSNorm", "RMSNormGated", "RMSNormZeroCentered", "kernel_mapping", "kernelize"]

# Where a kernelized module keeps what its probe found: (weight dtype, eps, keyword arguments of
# rms_norm / rms_norm_gated, or None for "keep the module's own forward"). An instance attribute of
# the adopting module: the layer classes may hold nothing but forward (kernels' contract).
_FOUND = "_cupy_rmsnorm_hf"


def _probe(module, gated):
    """What ``module`` is replaced by (see _FOUND), found once per weight dtype and stored on it."""
    weight = module._parameters.get("weight")
    eps = _eps_of(module)
    numerics = None
    if isinstance(weight, nn.Parameter) and weight.dim() == 1 and eps is not None:
        # the class's forward: the instance's is this library's now
        numerics = _matching_numerics(module, weight, eps, gated, forward=type(module).forward.__get__(module))
    if numerics is None:
        warnings.warn(f"cupy_rmsnorm.hf: {type(module).__name__} keeps its own forward: it matches none of "
                      f"cupy_rmsnorm's formulas (or has no 1-D weight and eps)", stacklevel=3)
    found = (None if weight is None else weight.dtype, eps, numerics)
    module.__dict__[_FOUND] = found
    return found


def _found(module, gated):
    found = module.__dict__.get(_FOUND)
    weight = module._parameters.get("weight")
    if found is not None and (weight is None or found[0] == weight.dtype):
        return found
    if torch.compiler.is_compiling():
        # the probe compares tensors' values: it cannot be traced, so it must run before
        raise RuntimeError(f"cupy_rmsnorm.hf: {type(module).__name__} was kernelized but its numerics are not known "
                           f"yet for this weight dtype; use cupy_rmsnorm.hf.kernelize (it finds them), or run the "
                           f"model once eagerly, before torch.compile")
    return _probe(module, gated)


def _forward(module, hidden_states):
    _, eps, numerics = _found(module, False)
    if numerics is None:
        return type(module).forward(module, hidden_states)
    return rms_norm(hidden_states, module.weight, eps, **numerics)


def _gated_forward(module, hidden_states, gate):
    if gate is None:    # the module's own answer (HF's gated norms need a gate; Mamba2's skips it)
        return type(module).forward(module, hidden_states, gate)
    _, eps, numerics = _found(module, True)
    if numerics is None:
        return type(module).forward(module, hidden_states, gate)
    return rms_norm_gated(hidden_states, gate, module.weight, eps, **numerics)


# The layers: kernels swaps in ``forward`` alone (bound to the adopting module), so each is stateless
# and holds nothing else; the work is in module-level functions.

class RMSNorm(nn.Module):
    """``kernels`` layer for transformers' ``"RMSNorm"`` modules (LlamaRMSNorm and its copies:
    ``weight * round(x * inv_rms)``, ``casting_mode="llama"``); reads the module's ``weight`` and
    ``variance_epsilon`` (or ``eps``)."""

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states):
        return _forward(self, hidden_states)


class RMSNormZeroCentered(nn.Module):
    """``kernels`` layer for transformers' ``"RMSNormZeroCentered"`` modules (Qwen3.5's:
    ``round(x * inv_rms * (1 + weight))``, ``weight_offset=1.0``, ``casting_mode="fp32"``)."""

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states):
        return _forward(self, hidden_states)


class RMSNormGated(nn.Module):
    """``kernels`` layer for transformers' ``"RMSNormGated"`` modules (Qwen3-Next's and Qwen3.5's
    norm-then-gate with Llama's roundings, Kimi-Linear's and others' in float32 with a sigmoid gate):
    ``rms_norm_gated`` with the module's ``weight``, eps, ``activation`` and ``group_size``; without a
    gate the module's own forward runs."""

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states, gate=None):
        return _gated_forward(self, hidden_states, gate)


_LAYERS = {"RMSNorm": RMSNorm, "RMSNormGated": RMSNormGated, "RMSNormZeroCentered": RMSNormZeroCentered}
_DEVICES = ("cuda", "cpu")
_MODES = ("inference", "training", "compile", "training+compile")


def _kernels_version():
    """The installed kernels' (major, minor), or None."""
    try:
        version = importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int(part) for part in (version.split(".") + ["0"])[:2] if part.isdigit())


def _require_kernels():
    try:
        import kernels
    except ImportError as e:
        raise ImportError("cupy_rmsnorm.hf needs Hugging Face's kernels package for the mapping and kernelize "
                          "(pip install kernels, or pip install 'cupy-rmsnorm[hf]')") from e
    return kernels


class _Repository:
    """A layer repository for kernels' mapping: the layer ``layer_name`` of this module, nothing
    downloaded. ``load()`` returns the layer class (kernels 0.11 on) or, with ``modules=True``, a
    namespace whose ``layers`` holds it (what kernels up to 0.10 take)."""

    def __init__(self, layer_name, modules=False):
        self.layer_name = layer_name
        self._modules = modules

    def load(self):
        layer = _LAYERS[self.layer_name]
        return SimpleNamespace(layers=SimpleNamespace(**{self.layer_name: layer})) if self._modules else layer

    def __eq__(self, other):
        return isinstance(other, _Repository) and (self.layer_name, self._modules) == (other.layer_name,
                                                                                       other._modules)

    def __hash__(self):
        return hash((_Repository, self.layer_name, self._modules))

    def __repr__(self):
        return f"cupy_rmsnorm.hf layer `{self.layer_name}`"


def kernel_mapping(device=None):
    """The mapping for ``kernels.use_kernel_mapping`` / ``register_kernel_mapping``: each of the
    layer names ``"RMSNorm"``, ``"RMSNormGated"`` and ``"RMSNormZeroCentered"`` to this module's
    layer, on ``device`` (``"cuda"`` or ``"cpu"``; None: both), for every mode (kernels' FALLBACK
    entry: the layers compile and train).

    kernels 0.11 on takes repositories whose ``load()`` returns the layer class, and maps CPU
    layers; kernels up to 0.10 (what transformers 4.x allows) takes ``load()`` returning a module
    with ``layers``, and no CPU entries: there, ``device=None`` maps CUDA alone and ``"cpu"`` is a
    ValueError. Needs kernels installed (an ImportError says how).
    """
    _require_kernels()
    modern = _kernels_version() >= (0, 11)
    if device is None:
        devices = _DEVICES if modern else ("cuda",)
    elif not isinstance(device, str):
        raise TypeError(f"device must be 'cuda', 'cpu' or None, got {type(device).__name__}")
    elif device not in _DEVICES:
        raise ValueError(f"device must be 'cuda', 'cpu' or None, got {device!r}")
    elif device == "cpu" and not modern:
        raise ValueError(f"device='cpu': kernels {importlib.metadata.version('kernels')} maps no CPU layers "
                         f"(kernels 0.11 on does)")
    else:
        devices = (device,)
    return {name: {d: _Repository(name, modules=not modern) for d in devices} for name in _LAYERS}


class _UnmappedFilter(logging.Filter):
    def filter(self, record):
        return not record.getMessage().lstrip().startswith(_UNMAPPED)


_UNMAPPED = "No kernel mapping found for layer"


@contextlib.contextmanager
def _unmapped_layers_quiet():
    """kernels' notes on the layers the mapping leaves out (rotary_pos_emb, SiLU, ...: every one
    but the norms, on purpose) silenced for the call: a logger warning from kernels 0.10 on, a
    Python warning before."""
    names = [name for name in logging.Logger.manager.loggerDict if name == "kernels" or name.startswith("kernels.")]
    quiet = _UnmappedFilter()
    for name in names:
        logging.getLogger(name).addFilter(quiet)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=rf"\s*{_UNMAPPED}")
            yield
    finally:
        for name in names:
            logging.getLogger(name).removeFilter(quiet)


def kernelize(model, mode="inference", device=None):
    """Swap the forward of every module of ``model`` that transformers marks ``"RMSNorm"``,
    ``"RMSNormGated"`` or ``"RMSNormZeroCentered"`` for this library's layer, through
    ``kernels.kernelize`` with ``kernel_mapping()`` alone (``inherit_mapping=False``: no Hub
    kernel is fetched for these or any other layer), then find each swapped module's numerics (so
    the first compiled call can trace it). Other modules keep their forward.

    Args:
        model: a transformers model (any ``nn.Module``).
        mode: ``"inference"``, ``"training"``, ``"compile"`` (inference under torch.compile:
            kernels' ``INFERENCE | TORCH_COMPILE``) or ``"training+compile"``
            (``TRAINING | TORCH_COMPILE``). The layers are the same in every mode (they train and
            compile); kernels records the mode.
        device: ``"cuda"``, ``"cpu"`` or None (kernels takes the device of the model's first
            parameter).

    Returns:
        ``model``, kernelized in place. Raises an ImportError naming the package without kernels.
    """
    if not isinstance(mode, str):
        raise TypeError(f"mode must be one of {', '.join(map(repr, _MODES))}, got {type(mode).__name__}")
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, _MODES))}, got {mode!r}")
    if device is not None and not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be 'cuda', 'cpu', a torch.device or None, got {type(device).__name__}")
    kernels = _require_kernels()
    if device is not None:
        kind = torch.device(device).type
    else:   # as kernels finds it, so that an unmapped device is an error here, not a silent no-op
        first = next(model.parameters(), None)
        if first is None:
            raise ValueError("device is None and the model has no parameters to take it from; pass device")
        kind = first.device.type
        if kind not in _DEVICES:
            raise ValueError(f"device is None and the model is on {kind}; cupy_rmsnorm runs on 'cuda' and 'cpu'")
    Mode = kernels.Mode
    modes = {"inference": Mode.INFERENCE, "training": Mode.TRAINING,
             "compile": Mode.INFERENCE | Mode.TORCH_COMPILE, "training+compile": Mode.TRAINING | Mode.TORCH_COMPILE}
    with kernels.use_kernel_mapping(kernel_mapping(kind), inherit_mapping=False), _unmapped_layers_quiet():
        kernels.kernelize(model, mode=modes[mode], device=device)
    ours = {layer.forward: layer is RMSNormGated for layer in _LAYERS.values()}
    for module in model.modules():
        bound = module.__dict__.get("forward")
        gated = ours.get(getattr(bound, "__func__", None))
        if gated is not None:
            _probe(module, gated)
    return model
