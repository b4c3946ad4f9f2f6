"""Bad or unusual inputs on the GPU (the CPU ones are in tests/cpu/test_bad_inputs.py):
read-only torch outputs, inference tensors, lazy negation, sparse tensors, a hidden size
past int32. Each is refused with an error that names the argument, before anything is
written, or computed exactly as the contract says."""

import pytest
from helpers import requires_gpu, requires_torch_gpu

import cupy_rmsnorm as rn


# -- GPU: read-only outputs, inference tensors, lazy negation, sparse tensors --------------------

@requires_torch_gpu
def test_inference_tensor_out_outside_inference_mode():
    import torch
    x = torch.randn(4, 64, device="cuda")
    with torch.inference_mode():
        out = torch.full_like(x, 7.0)
        rn.rms_norm(x, out=out)                    # fine inside inference mode (remembered)
    with pytest.raises(ValueError, match=r"^out is read-only"):
        rn.rms_norm(x, out=out)                    # the remembered launcher must not write it
    with torch.inference_mode():
        out2 = torch.full_like(x, 7.0)
    with pytest.raises(ValueError, match=r"^out is read-only"):
        rn.rms_norm(x, out=out2)
    torch.cuda.synchronize()
    assert bool((out2 == 7.0).all())


@requires_torch_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_negative_bit_inputs_are_read_with_their_sign(dtype):
    import torch
    dt = getattr(torch, dtype)
    x = torch.randn(8, 256, device="cuda").to(dt)
    w = (1 + 0.1 * torch.randn(256, device="cuda")).to(dt)
    want = rn.rms_norm((-x).contiguous(), w)
    neg = torch._neg_view(x)
    assert neg.is_neg()
    for _ in range(2):                              # the full path, then the remembered signature
        got = rn.rms_norm(neg, w)
        assert torch.equal(got, want)
    got = rn.rms_norm(x, torch._neg_view(w))
    assert torch.equal(got, rn.rms_norm(x, (-w).contiguous()))
    z = torch.complex(torch.randn(4, 64, device="cuda"), torch.randn(4, 64, device="cuda"))
    imag = z.conj().imag                            # a float view with the negation bit
    assert torch.equal(rn.rms_norm(imag), rn.rms_norm(imag.resolve_neg()))


@requires_torch_gpu
def test_negative_bit_output_is_refused():
    import torch
    x = torch.randn(4, 64, device="cuda")
    out = torch._neg_view(torch.zeros_like(x))
    with pytest.raises(ValueError, match=r"^out has torch's lazy negation"):
        rn.rms_norm(x, out=out)


@requires_torch_gpu
def test_sparse_tensor_is_a_type_error():
    import torch
    x = torch.randn(4, 64, device="cuda").to_sparse()
    with pytest.raises(TypeError, match=r"^x is a torch.sparse_coo tensor"):
        rn.rms_norm(x)


@requires_gpu
def test_gpu_hidden_size_past_int32_is_refused_before_allocating():
    import cupy as cp
    x = cp.lib.stride_tricks.as_strided(cp.zeros(1, cp.float16), (1, 2 ** 31), (0, 0))
    with pytest.raises(ValueError, match=r"^x has hidden size 2147483648"):
        rn.rms_norm(x)
