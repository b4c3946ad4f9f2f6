"""Mixed precision on the GPU: an output dtype of its own (out_dtype), a float32 residual
stream beside 16-bit activations, weights of any dtype (a bf16 weight with fp16 x), Gemma's
offset on a float32 weight; forward, quantized and backward (autograd), against float64
PyTorch written here from the formulas, over every layout the kernels take (odd offsets:
rows with a scalar head and tail)."""

import itertools

import pytest
from helpers import seed, torch_cuda_missing

reason = torch_cuda_missing()
pytestmark = pytest.mark.skipif(reason is not None, reason=f"mixed precision GPU test: {reason}")
if reason is None:
    import torch

    import cupy_rmsnorm as rn

DTYPES = ("float32", "float16", "bfloat16")
RTOL = {"float32": 2e-5, "float16": 2 ** -9, "bfloat16": 2 ** -6}     # two ulps
ATOL = {"float32": 1e-6, "float16": 2 ** -11, "bfloat16": 2 ** -8}


def close(got, ref, dtype):
    got, ref = got.double(), ref.double()
    tol = RTOL[dtype] * ref.abs() + ATOL[dtype] * max(float(ref.abs().max()), 1e-30)
    bad = ~((got - ref).abs() <= tol)
    if not bool(bad.any()):
        return None
    i = int(bad.flatten().nonzero()[0])
    return f"{int(bad.sum())} of {got.numel()} off; first at {i}: got {float(got.flatten()[i])}, want {float(ref.flatten()[i])}"


def normalized64(s, weight, offset, eps=1e-6):
    s = s.double()
    n = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    return n if weight is None else n * (weight.double() + offset)


def tensors(rows, hidden, dtype, case, shift=0):
    """A (rows, hidden) tensor of dtype whose rows start ``shift`` elements past a 16-byte
    boundary (shift 1: every row has a scalar head)."""
    gen = torch.Generator(device="cuda").manual_seed(seed(*case))
    base = torch.randn(rows, hidden + 16, generator=gen, device="cuda").to(getattr(torch, dtype))
    return base[:, shift:shift + hidden]


def weight_of(kind, hidden, case):
    if kind is None:
        return None, 0.0
    gen = torch.Generator(device="cuda").manual_seed(seed(*case, "w"))
    offset = 1.0 if kind == "offset" else 0.0
    dtype = torch.float32 if kind == "offset" else getattr(torch, kind)
    return (0.2 * torch.randn(hidden, generator=gen, device="cuda") + (0.0 if offset else 1.0)).to(dtype), offset


CASES = list(itertools.product(DTYPES, DTYPES, (None, "bfloat16", "float16", "float32", "offset")))


@pytest.mark.parametrize("x_dtype,out_dtype,weight_kind", CASES)
@pytest.mark.parametrize("shape,shift", [((3, 4096), 0), ((300, 1000), 1), ((7, 255), 1)])
def test_rms_norm_out_dtype_and_any_weight(x_dtype, out_dtype, weight_kind, shape, shift, free_gpu_memory):
    case = ("mixed rms", x_dtype, out_dtype, weight_kind, shape, shift)
    x = tensors(*shape, x_dtype, case, shift)
    w, offset = weight_of(weight_kind, shape[1], case)
    with torch.inference_mode():
        y = rn.rms_norm(x, w, weight_offset=offset, out_dtype=getattr(torch, out_dtype))
    assert y.dtype == getattr(torch, out_dtype)
    assert close(y, normalized64(x, w, offset), out_dtype if out_dtype != "float32" else x_dtype) is None
    if w is not None:     # llama: x * inv_rms rounded to the output dtype first
        y = rn.rms_norm(x, w, weight_offset=offset, out_dtype=out_dtype, casting_mode="llama")
        n = normalized64(x, None, 0.0).to(getattr(torch, out_dtype)).double()
        assert close(y, n * (w.double() + offset), out_dtype if out_dtype != "float32" else x_dtype) is None


@pytest.mark.parametrize("x_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("out_dtype", [None, "bfloat16", "float32"])
@pytest.mark.parametrize("shape,shift", [((1, 4096), 0), ((4096, 4096), 0), ((33, 1000), 1), ((5, 64), 1)])
def test_float32_residual_stream(x_dtype, out_dtype, shape, shift, free_gpu_memory):
    """residual_out = x + residual in float32 (bit for bit torch's float32 add), normalized from
    that float32 value; in place on the residual too."""
    case = ("stream", x_dtype, out_dtype, shape, shift)
    x = tensors(*shape, x_dtype, case, shift)
    r = tensors(*shape, "float32", case + ("r",), shift)
    w, _ = weight_of("bfloat16", shape[1], case)
    with torch.inference_mode():
        y, s = rn.fused_add_rms_norm(x, r, w, out_dtype=out_dtype)
    assert s.dtype == torch.float32 and y.dtype == (getattr(torch, out_dtype) if out_dtype else x.dtype)
    assert torch.equal(s, x.float() + r)
    assert close(y, normalized64(s, w, 0.0), out_dtype or x_dtype) is None
    r2 = r.clone()
    with torch.inference_mode():
        y2, s2 = rn.fused_add_rms_norm(x, r2, w, residual_out=r2, out_dtype=out_dtype)
    assert s2 is r2 and torch.equal(s2, s) and torch.equal(y2, y)


@pytest.mark.parametrize("group_size", [None, 128])
def test_quantized_with_a_float32_residual_stream(group_size, free_gpu_memory):
    case = ("stream quant", group_size)
    x = tensors(64, 4096, "bfloat16", case)
    r = tensors(64, 4096, "float32", case + ("r",))
    w, _ = weight_of("float32", 4096, case)
    q, s, scales = rn.fused_add_rms_norm_quant(x, r, w, group_size=group_size)
    assert s.dtype == torch.float32 and torch.equal(s, x.float() + r)
    q2, scales2 = rn.rms_norm_quant(s, w, group_size=group_size)        # the same row, normalized from s
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(scales, scales2)


@pytest.mark.parametrize("x_dtype,out_dtype", [("bfloat16", "float32"), ("float32", "bfloat16"),
                                               ("float16", "bfloat16")])
@pytest.mark.parametrize("casting_mode", ["fp32", "llama"])
def test_backward_of_an_out_dtype(x_dtype, out_dtype, casting_mode, free_gpu_memory):
    case = ("mixed backward", x_dtype, out_dtype, casting_mode)
    x = tensors(96, 1024, x_dtype, case).clone().requires_grad_()
    w, _ = weight_of("float32", 1024, case)
    w.requires_grad_()
    y = rn.rms_norm(x, w, casting_mode=casting_mode, out_dtype=getattr(torch, out_dtype))
    dy = torch.randn(y.shape, device="cuda").to(y.dtype)
    dx, dw = torch.autograd.grad(y, [x, w], dy)
    assert dx.dtype == x.dtype and dw.dtype == w.dtype
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    n = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    gx, gw = torch.autograd.grad(n * wd, [xd, wd], dy.double())
    assert close(dx, gx, x_dtype) is None
    assert close(dw, gw, "float32" if casting_mode == "fp32" else out_dtype) is None
    # the same through the function, and deterministic
    dx2, dw2 = rn.rms_norm_backward(dy, x.detach(), w.detach(), casting_mode=casting_mode)
    assert torch.equal(dx2, dx) and torch.equal(dw2, dw)


def test_training_through_a_float32_residual_stream(free_gpu_memory):
    case = ("stream backward",)
    x = tensors(64, 2048, "bfloat16", case).clone().requires_grad_()
    r = tensors(64, 2048, "float32", case + ("r",)).clone().requires_grad_()
    w, _ = weight_of("bfloat16", 2048, case)
    w.requires_grad_()
    y, s = rn.fused_add_rms_norm(x, r, w)
    loss = y.float().square().sum() + 0.5 * s.square().sum()
    gx, gr, gw = torch.autograd.grad(loss, [x, r, w])
    assert gx.dtype == torch.bfloat16 and gr.dtype == torch.float32 and gw.dtype == torch.bfloat16
    xd, rd, wd = (t.detach().double().requires_grad_() for t in (x, r, w))
    sd = xd + rd
    yd = normalized64(sd, wd, 0.0)
    ex, er, ew = torch.autograd.grad(yd.square().sum() + 0.5 * sd.square().sum(), [xd, rd, wd])
    assert close(gr, er, "bfloat16") is None and close(gx, ex, "bfloat16") is None
    assert close(gw, ew, "bfloat16") is None


def test_compile_keeps_the_dtypes(free_gpu_memory):
    x = torch.randn(16, 512, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(16, 512, device="cuda", dtype=torch.float32)
    w = torch.ones(512, device="cuda", dtype=torch.float32)

    def f(x, r, w):
        y, s = rn.fused_add_rms_norm(x, r, w, out_dtype=torch.bfloat16)
        return rn.rms_norm(y, w, out_dtype=torch.float32), s

    got = torch.compile(f, fullgraph=True)(x, r, w)
    want = f(x, r, w)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
