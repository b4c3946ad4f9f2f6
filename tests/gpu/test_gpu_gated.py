"""rms_norm_gated and its backward on the GPU, against a float64 PyTorch reference written
here from the formulas (not from the library's NumPy reference), through CuPy arrays and
torch tensors: every dtype x activation x order x group size x hidden size, the layouts the
gated norms meet (strided rows, a gate that is a view of a packed projection, per-head
views), weights of every kind, autograd, determinism and the Hugging Face modules."""

import itertools

import numpy as np
import pytest
from helpers import seed, torch_cuda_missing

reason = torch_cuda_missing()
pytestmark = pytest.mark.skipif(reason is not None, reason=f"gated GPU test: {reason}")
if reason is None:
    import cupy as cp
    import torch

    import cupy_rmsnorm as rn
    from cupy_rmsnorm.torch import RMSNormGated

DTYPES = ("float32", "float16", "bfloat16")
HIDDEN = (64, 128, 255, 1024, 2048, 4096, 8192)
LAYOUTS = ("contiguous", "strided x", "strided gate", "heads")
WEIGHTS = ("none", "x", "float32", "offset")
# |got - ref| <= RTOL * |ref| + ATOL * max|ref|: two units in the last place of the dtype (the
# float32 arithmetic's own noise, sigmoid's hardware exponential included, is far below)
RTOL = {"float32": 2e-5, "float16": 2 ** -9, "bfloat16": 2 ** -6}
ATOL = {"float32": 1e-6, "float16": 2 ** -11, "bfloat16": 2 ** -8}


def group_sizes(hidden):
    quarter = hidden // 4 if hidden % 4 == 0 else None
    return [g for g in dict.fromkeys((None, 64, 128, quarter)) if g is None or (g < hidden and hidden % g == 0)]


def reference(x, gate, weight, eps, offset, group_size, norm_before_gate, activation):
    """The float64 gated RMSNorm (torch tensors in, float64 out)."""
    x, z = x.double(), gate.double()
    s = torch.sigmoid(z)
    act = z * s if activation == "silu" else s
    h = x if norm_before_gate else x * act
    g = group_size or h.shape[-1]
    hg = h.reshape(*h.shape[:-1], h.shape[-1] // g, g)
    n = (hg * torch.rsqrt(hg.pow(2).mean(-1, keepdim=True) + eps)).reshape(h.shape)
    if weight is not None:
        n = n * (weight.double() + offset)
    return n * act if norm_before_gate else n


def close(got, ref, dtype):
    """None when ``got`` matches the float64 ``ref`` within the dtype's tolerance."""
    got, ref = got.double(), ref.double()
    err = (got - ref).abs()
    tol = RTOL[dtype] * ref.abs() + ATOL[dtype] * max(float(ref.abs().max()), 1e-30)
    bad = ~(err <= tol)
    if not bool(bad.any()):
        return None
    i = int(bad.flatten().nonzero()[0])
    return (f"{int(bad.sum())} of {got.numel()} off; first at {i}: got {float(got.flatten()[i])}, "
            f"want {float(ref.flatten()[i])}")


def inputs(shape, dtype, layout, weight_kind, case):
    """x, gate (layout: strided rows, a gate view of a packed buffer, or per-head views of it),
    weight and offset, torch tensors on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(seed(*case))
    tdt = getattr(torch, dtype)
    rows, hidden = shape

    def randn(*s):
        return torch.randn(*s, generator=gen, device="cuda", dtype=torch.float32).to(tdt)

    if layout == "contiguous":
        x, gate = randn(rows, hidden), randn(rows, hidden)
    elif layout == "strided x":
        x, gate = randn(rows, hidden + 24)[:, 8:8 + hidden], randn(rows, hidden)
    elif layout == "strided gate":   # a view of a packed projection (T, 3 * hidden)
        packed = randn(rows, 3 * hidden)
        x, gate = randn(rows, hidden), packed[:, 2 * hidden:]
    else:                            # heads: (T, H, D) views of one packed buffer, D = hidden // 2
        d = hidden // 2 if hidden % 2 == 0 else hidden
        heads = hidden // d
        packed = randn(rows, 2 * heads * d)
        x = packed[:, :heads * d].view(rows, heads, d)
        gate = packed[:, heads * d:].view(rows, heads, d)
    h = x.shape[-1]
    offset = 1.0 if weight_kind == "offset" else 0.0
    weight = None
    if weight_kind != "none":
        wdt = torch.float32 if weight_kind in ("float32", "offset") else tdt
        weight = (0.1 * torch.randn(h, generator=gen, device="cuda") + (0.0 if offset else 1.0)).to(wdt)
    return x, gate, weight, offset


def grid():
    """dtype x activation x order x group size x hidden, with the layout and the weight kind
    taken in turn (all four of each meet every dtype)."""
    cases = []
    for i, (dtype, act, nbg, hidden) in enumerate(itertools.product(DTYPES, ("silu", "sigmoid"), (True, False),
                                                                    HIDDEN)):
        for j, g in enumerate(group_sizes(hidden)):
            layout = LAYOUTS[(i + j) % 4]
            if layout == "heads" and (g is not None or hidden % 2):
                layout = "contiguous"
            cases.append((dtype, act, nbg, hidden, g, layout, WEIGHTS[(i + 3 * j) % 4]))
    return cases


@pytest.mark.parametrize("dtype,activation,norm_before_gate,hidden,group_size,layout,weight_kind", grid())
def test_forward_and_backward_against_float64(dtype, activation, norm_before_gate, hidden, group_size, layout,
                                              weight_kind, free_gpu_memory):
    case = ("gated", dtype, activation, norm_before_gate, hidden, group_size, layout, weight_kind)
    rows = 37
    x, gate, weight, offset = inputs((rows, hidden), dtype, layout, weight_kind, case)
    kw = dict(group_size=group_size, norm_before_gate=norm_before_gate, activation=activation, weight_offset=offset)
    ref = reference(x, gate, weight, 1e-6, offset, group_size, norm_before_gate, activation)
    with torch.inference_mode():
        y = rn.rms_norm_gated(x, gate, weight, 1e-6, **kw)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert close(y, ref, dtype) is None
    # CuPy arrays through DLPack views: the same bits
    yc = rn.rms_norm_gated(cp.from_dlpack(x), cp.from_dlpack(gate),
                           None if weight is None else cp.from_dlpack(weight), 1e-6, **kw)
    assert torch.equal(torch.from_dlpack(yc), y)
    # backward against float64 autograd
    xd, gd = x.double().requires_grad_(), gate.double().requires_grad_()
    wd = None if weight is None else weight.double().requires_grad_()
    out64 = reference(xd, gd, wd, 1e-6, offset, group_size, norm_before_gate, activation)
    dy = torch.randn(out64.shape, generator=torch.Generator(device="cuda").manual_seed(seed(*case, "dy")),
                     device="cuda").to(x.dtype)
    grads = torch.autograd.grad(out64, [t for t in (xd, gd, wd) if t is not None], dy.double())
    dx, dgate, dweight = rn.rms_norm_gated_backward(dy, x, gate, weight, 1e-6, **kw)
    assert dx.dtype == x.dtype and dgate.dtype == gate.dtype
    assert close(dx, grads[0], dtype) is None
    assert close(dgate, grads[1], dtype) is None
    if weight is None:
        assert dweight is None
    else:
        assert dweight.dtype == weight.dtype
        assert close(dweight, grads[2], "float32" if weight.dtype == torch.float32 else dtype) is None
        again = rn.rms_norm_gated_backward(dy, x, gate, weight, 1e-6, **kw)[2]
        assert torch.equal(again, dweight)                    # deterministic: no float atomics


@pytest.mark.parametrize("rows", [1, 3, 130, 4099])
@pytest.mark.parametrize("hidden,group_size", [(128, None), (4096, 1024), (16384 * 2, None)])
def test_row_counts_and_long_groups(rows, hidden, group_size, free_gpu_memory):
    """One row to many blocks, and groups too long for registers (the streamed kernels)."""
    if hidden > 16384 and rows > 130:
        pytest.skip("one long-group case is enough")
    case = ("gated rows", rows, hidden, group_size)
    x, gate, weight, _ = inputs((rows, hidden), "bfloat16", "contiguous", "float32", case)
    ref = reference(x, gate, weight, 1e-6, 0.0, group_size, True, "silu")
    y = rn.rms_norm_gated(x, gate, weight, group_size=group_size)
    assert close(y, ref, "bfloat16") is None
    xd, gd, wd = (t.double().requires_grad_() for t in (x, gate, weight))
    dy = torch.randn_like(x)
    grads = torch.autograd.grad(reference(xd, gd, wd, 1e-6, 0.0, group_size, True, "silu"), [xd, gd, wd],
                                dy.double())
    dx, dgate, dweight = rn.rms_norm_gated_backward(dy, x, gate, weight, group_size=group_size)
    assert close(dx, grads[0], "bfloat16") is None and close(dgate, grads[1], "bfloat16") is None
    assert close(dweight, grads[2], "float32") is None


@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16", "float16"])
def test_out_dtype_and_given_out(out_dtype, free_gpu_memory):
    x, gate, weight, _ = inputs((64, 1024), "bfloat16", "strided gate", "x", ("gated out", out_dtype))
    ref = reference(x, gate, weight, 1e-6, 0.0, None, True, "silu")
    y = rn.rms_norm_gated(x, gate, weight, out_dtype=getattr(torch, out_dtype))
    assert y.dtype == getattr(torch, out_dtype)
    assert close(y, ref, out_dtype) is None
    out = torch.full_like(y, float("nan"))
    assert rn.rms_norm_gated(x, gate, weight, out=out, out_dtype=out_dtype) is out
    assert torch.equal(out, y)


def test_in_place_over_the_gate_or_x(free_gpu_memory):
    x, gate, weight, _ = inputs((64, 1024), "bfloat16", "strided gate", "x", ("gated in place",))
    want = rn.rms_norm_gated(x, gate, weight)
    z, x2 = gate.clone(), x.clone()
    assert rn.rms_norm_gated(x, z, weight, out=z) is z
    assert rn.rms_norm_gated(x2, gate, weight, out=x2) is x2
    assert torch.equal(z, want) and torch.equal(x2, want)



@pytest.mark.parametrize("kind", ["torch", "cupy"])
def test_repeated_calls_with_out(kind, free_gpu_memory):
    """Repeated calls with ``out`` take the cached launch, which checks the overlaps itself: the
    same bits each time, and an out over the weight is still refused."""
    x, gate, weight, _ = inputs((64, 1024), "bfloat16", "strided gate", "x", ("gated repeated", kind))
    want = rn.rms_norm_gated(x, gate, weight)
    buffer = torch.zeros(64 * 1024 + 1024, device="cuda", dtype=torch.bfloat16)
    out, clash = buffer[:64 * 1024].view(64, 1024), buffer[64 * 1024 - 512:64 * 1024 + 512]
    apart = torch.empty_like(clash)
    as_kind = (lambda t: t) if kind == "torch" else (lambda t: cp.from_dlpack(t))
    for _ in range(3):
        out.fill_(float("nan"))
        apart.copy_(weight)
        assert rn.rms_norm_gated(as_kind(x), as_kind(gate), as_kind(apart), out=as_kind(out)) is not None
        assert torch.equal(out, want)
    clash.copy_(weight)
    with pytest.raises(ValueError, match="overlap"):
        rn.rms_norm_gated(as_kind(x), as_kind(gate), as_kind(clash), out=as_kind(out))

def test_llama_mode_reproduces_hugging_face_qwen3_next():
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated
    torch.manual_seed(0)
    hf = Qwen3NextRMSNormGated(128, eps=1e-6).cuda().to(torch.bfloat16)
    with torch.no_grad():
        hf.weight.copy_(1 + 0.2 * torch.randn(128))
    x, gate = torch.randn(4096, 128, device="cuda").bfloat16(), torch.randn(4096, 128, device="cuda").bfloat16()
    ours = rn.rms_norm_gated(x, gate, hf.weight, hf.variance_epsilon, casting_mode="llama")
    want = hf(x, gate)
    ulp = (ours.float() - want.float()).abs() / want.float().abs().clamp_min(1e-30)
    assert float((ours != want).float().mean()) < 0.01, "llama mode: the same roundings as HF's module"
    assert float(ulp.max()) <= 2 ** -7, transformers.__version__


@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_module_trains_and_compiles(norm_before_gate, free_gpu_memory):
    torch.manual_seed(1)
    norm = RMSNormGated(256, group_size=64, norm_before_gate=norm_before_gate, dtype=torch.bfloat16,
                        device="cuda")
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(256))
    x = torch.randn(8, 16, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gate = torch.randn(8, 16, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    # a fixed random direction: the gradient of ||y||^2 nearly vanishes (a norm is scale-invariant)
    direction = torch.randn(8, 16, 256, device="cuda")
    y = norm(x, gate)
    (y.float() * direction).sum().backward()
    xd, gd, wd = (t.detach().double().requires_grad_() for t in (x, gate, norm.weight))
    ref = reference(xd, gd, wd, 1e-6, 0.0, 64, norm_before_gate, "silu")
    gx, gg, gw = torch.autograd.grad((ref * direction.double()).sum(), [xd, gd, wd])
    assert close(y, ref, "bfloat16") is None
    assert close(x.grad, gx, "bfloat16") is None and close(gate.grad, gg, "bfloat16") is None
    assert close(norm.weight.grad, gw.float(), "bfloat16") is None
    compiled = torch.compile(norm, fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(x, gate), norm(x, gate))


def test_registered_op_passes_opcheck():
    from torch.library import opcheck
    x = torch.randn(5, 128, device="cuda", dtype=torch.bfloat16)
    gate = torch.randn(5, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(128, device="cuda", dtype=torch.float32, requires_grad=True)
    opcheck(torch.ops.cupy_rmsnorm.rms_norm_gated.default,
            (x.requires_grad_(), gate.requires_grad_(), w, 1e-6, 0.0, "fp32", 64, True, "silu", None))


def test_bad_inputs_name_the_argument():
    x = torch.randn(4, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="group_size=96 needs a hidden size"):
        rn.rms_norm_gated(x, x, group_size=96)
    with pytest.raises(TypeError, match="gate must have x's dtype"):
        rn.rms_norm_gated(x, x.float())
    with pytest.raises(ValueError, match="activation"):
        rn.rms_norm_gated(x, x, activation="gelu")
    with pytest.raises(ValueError, match="out overlaps weight|partially overlaps"):
        buf = torch.empty(4 * 128 + 128, device="cuda", dtype=torch.bfloat16)
        rn.rms_norm_gated(x, x, buf[:128], out=buf[64:64 + 512].view(4, 128))
    assert np.isfinite(float(rn.rms_norm_gated(x, x).float().sum()))
