"""``cupy_rmsnorm.torch.LayerNorm`` (a drop-in for ``torch.nn.LayerNorm`` over one trailing axis)
and the Hugging Face patch of a model's LayerNorm modules. Imports torch."""

import numbers

import torch
from torch import nn

from . import layer_norm


def _one_axis(normalized_shape):
    shape = (normalized_shape,) if isinstance(normalized_shape, numbers.Integral) else tuple(normalized_shape)
    if len(shape) != 1:
        raise ValueError(f"normalized_shape must be one trailing axis, got {shape}: the kernels normalize the last "
                         f"axis (torch.nn.LayerNorm for more)")
    return (int(shape[0]),)


class LayerNorm(nn.Module):
    """``torch.nn.LayerNorm`` over the last axis on the library's kernels (CUDA tensors) or its
    reference (CPU tensors): the same parameters, state_dict keys and initialization; float32
    statistics and one rounding, as ``F.layer_norm`` computes 16-bit inputs. Trainable (the
    registered op's backward: deterministic dweight and dbias)."""

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, device=None, dtype=None):
        super().__init__()
        self.normalized_shape = _one_axis(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        kwargs = dict(device=device, dtype=dtype)
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape, **kwargs))
            self.bias = nn.Parameter(torch.zeros(self.normalized_shape, **kwargs)) if bias else None
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def reset_parameters(self):
        if self.elementwise_affine:
            nn.init.ones_(self.weight)
            if self.bias is not None:
                nn.init.zeros_(self.bias)

    def forward(self, x):
        return layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


def patch_layer_norms(model):
    """Swap every ``torch.nn.LayerNorm`` of ``model`` over one trailing axis (vision towers,
    audio encoders) for a ``LayerNorm`` sharing its Parameters; returns how many. Others (more
    than one normalized axis) are left as they are."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.LayerNorm or len(child.normalized_shape) != 1:
                continue
            swapped = LayerNorm.__new__(LayerNorm)
            nn.Module.__init__(swapped)
            swapped.normalized_shape, swapped.eps = tuple(child.normalized_shape), child.eps
            swapped.elementwise_affine = child.elementwise_affine
            swapped.register_parameter("weight", child.weight)     # the very same Parameters
            swapped.register_parameter("bias", child.bias)
            swapped.train(child.training)
            setattr(parent, name, swapped)
            count += 1
    return count
