"""What every family's torch registration shares (imported only once torch is: by the
families' ``_bind_torch``, which ``_interop.TorchKind.bind`` runs at the first torch tensor).

Each family registers its ops with ``torch.library.custom_op`` (one node per call for
torch.compile), a fake implementation (outputs of the right shape and dtype after the real
path's checks, no data: dynamo traces the call as one node, inductor schedules around it and
CUDA graphs capture it) and ``torch.library.register_autograd``; in eager mode the public
functions keep the direct path (the dispatcher costs microseconds a call), and an eager call
that autograd must record runs an ``autograd.Function`` with the same gradients around the
direct paths.
"""

import torch

from ._interop import Meta, TorchKind

Tensor = torch.Tensor
# is_dynamo_compiling: a plain `return False` in eager (cheaper than is_compiling)
is_compiling = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)


def fake_meta(t):
    """The Meta record of a (fake) tensor, with no address: the real path's checks run on it."""
    if t is None:
        return None
    name = TorchKind._dtype_map().get(t.dtype) or str(t.dtype).replace("torch.", "")
    return Meta(0, tuple(t.shape), tuple(t.stride()), name, t.element_size(), 0)


def dtype_arg(dtype):
    """A torch dtype (or None) as the call flow's dtype name."""
    return None if dtype is None else str(dtype).replace("torch.", "")


def no_weight_grad(x):
    """The empty tensor an op returns for a gradient it does not compute (an op's outputs are tensors)."""
    return x.new_empty(0)
