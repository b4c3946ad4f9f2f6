"""The two ops registered with ``torch.library``, so torch.compile sees one op per call.

    cupy_rmsnorm::rms_norm(Tensor x, Tensor? weight, float eps, float weight_offset,
                           str casting_mode) -> Tensor
    cupy_rmsnorm::fused_add_rms_norm(Tensor x, Tensor residual, Tensor? weight, float eps,
                                     float weight_offset, str casting_mode) -> (Tensor, Tensor)
    cupy_rmsnorm::fused_add_rms_norm_inplace(Tensor(a0!) x, Tensor(a1!) residual, Tensor? weight,
                                             float eps, float weight_offset, str casting_mode) -> ()
        (vLLM's in-place form: x becomes the normalized output, residual the sum)

Each has a fake implementation (outputs of the right shape and dtype, no data), so
dynamo traces a call as one node, inductor schedules around it and CUDA graphs capture
it. The real implementations are the library's direct path. In eager mode the public
functions keep that direct path (the dispatcher costs microseconds a call); while
torch.compile traces, ``cupy_rmsnorm.rms_norm`` / ``fused_add_rms_norm`` call these ops
instead (``call``). Importing this module imports torch; ``import cupy_rmsnorm`` does it
when torch is already loaded, or when the first torch tensor arrives.
"""

from typing import Optional

import torch

from . import _api, _interop
from ._layout import Arrays
from ._validate import check_arrays, check_scalars

Tensor = torch.Tensor


def _direct(fused, x, residual, weight, out, residual_out, eps, weight_offset, casting_mode):
    # the library's eager path: not tracing when the op itself runs, so _call goes direct
    return _api._call(fused, (x, residual, weight, out, residual_out), eps, weight_offset, casting_mode)


@torch.library.custom_op("cupy_rmsnorm::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Optional[Tensor], eps: float, weight_offset: float,
             casting_mode: str) -> Tensor:
    return _direct(False, x, None, weight, None, None, eps, weight_offset, casting_mode)


@torch.library.custom_op("cupy_rmsnorm::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float,
                       weight_offset: float, casting_mode: str) -> tuple[Tensor, Tensor]:
    return _direct(True, x, residual, weight, None, None, eps, weight_offset, casting_mode)


@torch.library.custom_op("cupy_rmsnorm::fused_add_rms_norm_inplace", mutates_args=("x", "residual"))
def fused_add_rms_norm_inplace(x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float,
                               weight_offset: float, casting_mode: str) -> None:
    _direct(True, x, residual, weight, x, residual, eps, weight_offset, casting_mode)


def _check_fake(x, residual, weight):
    """The shape and dtype checks of the real path, on fake tensors (no addresses)."""
    def meta(t):
        if t is None:
            return None
        name = _interop.TorchKind._dtype_map().get(t.dtype) or str(t.dtype).replace("torch.", "")
        return _interop.Meta(0, tuple(t.shape), tuple(t.stride()), name, t.element_size(), 0)
    check_arrays(Arrays(meta(x), meta(residual), meta(weight)))


@rms_norm.register_fake
def _(x, weight, eps, weight_offset, casting_mode):
    _check_fake(x, None, weight)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@fused_add_rms_norm.register_fake
def _(x, residual, weight, eps, weight_offset, casting_mode):
    _check_fake(x, residual, weight)
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format))


@fused_add_rms_norm_inplace.register_fake
def _(x, residual, weight, eps, weight_offset, casting_mode):
    _check_fake(x, residual, weight)


def call(fused, arrays, eps, weight_offset, casting_mode):
    """A public call while torch.compile traces: the registered ops, with any given
    outputs filled by a copy (the in-place fused form, ``out=x, residual_out=residual``,
    is its own op)."""
    x, residual, weight, out, residual_out = arrays
    if fused and residual is None:
        raise TypeError("residual must be an array of x's shape and dtype, got None")
    scalars = check_scalars(eps, weight_offset, casting_mode, weight is not None)
    args = (weight, scalars.eps, scalars.weight_offset, scalars.casting_mode)
    if not fused:
        y = rms_norm(x, *args)
        return y if out is None else out.copy_(y)
    if out is x and residual_out is residual:
        fused_add_rms_norm_inplace(x, residual, *args)
        return x, residual
    y, s = fused_add_rms_norm(x, residual, *args)
    return (y if out is None else out.copy_(y)), (s if residual_out is None else residual_out.copy_(s))
