"""The LayerNorm family on the GPU against its NumPy reference (the kernels compute the same
float32 steps in the same order: the forward and dx give the reference's bits, the sums over
rows within float32 rounding of theirs), through CuPy arrays and torch tensors: every dtype x
hidden size x parameters x form, strided rows and per-head views, the modulation's shapes,
autograd, torch.compile and CUDA graphs."""

import itertools

import numpy as np
import pytest
from helpers import seed, torch_cuda_missing

reason = torch_cuda_missing()
pytestmark = pytest.mark.skipif(reason is not None, reason=f"LayerNorm GPU test: {reason}")
if reason is None:
    import cupy as cp
    import ml_dtypes
    import torch

    import cupy_rmsnorm as rn
    from cupy_rmsnorm.torch import LayerNorm

DTYPES = ("float32", "float16", "bfloat16")
HIDDEN = (64, 255, 768, 1152, 1280, 4096, 8192)
PARAMS = ("none", "weight", "same", "float32", "mixed")
MODULATIONS = ("(B,1,D)", "(B,S,D)", "(D,)")


def np_dtype(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def host(shape, dtype, rs, scale=1.0, offset=0.0):
    return (rs.standard_normal(shape).astype(np.float32) * scale + offset).astype(np_dtype(dtype))


def params_for(kind, dtype, hidden, rs):
    if kind == "none":
        return None, None
    pdtype = {"weight": dtype, "same": dtype, "float32": "float32", "mixed": dtype}[kind]
    w = host((hidden,), pdtype, rs, 0.2, 1.0)
    b = None if kind == "weight" else host((hidden,), "float32" if kind == "mixed" else pdtype, rs, 0.1)
    return w, b


def torch_view(a):
    if a is None:
        return None
    if a.dtype == np_dtype("bfloat16"):
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16).cuda()
    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


def torch_bits(t):
    t = t.detach().contiguous().cpu()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().view(np.uint8)


def column_close(got, want, terms):
    """A sum over rows within float32 rounding of the reference's (another fixed order)."""
    got = got.detach().float().cpu().numpy() if hasattr(got, "detach") else np.asarray(got, np.float32)
    want = np.asarray(want, np.float32)
    tol = 1e-5 * np.asarray(terms, np.float32) + np.abs(want) * 2 ** -7 + 1e-6
    bad = ~(np.abs(got - want) <= tol)
    return None if not bad.any() else f"{int(bad.sum())} of {want.size} off, max {np.abs(got - want).max()}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN)
def test_forward_gives_the_reference_bits(dtype, hidden):
    """Every parameter kind and form, contiguous and strided rows, through torch CUDA tensors."""
    rs = np.random.default_rng(seed("ln forward", dtype, hidden))
    problems = []
    for kind, layout in itertools.product(PARAMS, ("contiguous", "strided")):
        x_full = host((4, 3, 2 * hidden), dtype, rs, 2.0, 0.5)
        x = x_full[..., :hidden] if layout == "strided" else np.ascontiguousarray(x_full[..., :hidden])
        r = host((4, 3, hidden), dtype, rs)
        w, b = params_for(kind, dtype, hidden, rs)
        tx = torch_view(x_full)[..., :hidden] if layout == "strided" else torch_view(x)
        tw, tb, tr = torch_view(w), torch_view(b), torch_view(r)
        got = rn.layer_norm(tx, tw, tb)
        want = rn.layer_norm(x, w, b)
        if not np.array_equal(torch_bits(got), np.ascontiguousarray(want).view(np.uint8)):
            problems.append(f"layer_norm {kind} {layout}")
        y, s = rn.fused_add_layer_norm(tx, tr, tw, tb)
        wy, ws = rn.fused_add_layer_norm(x, r, w, b)
        if not (np.array_equal(torch_bits(y), np.ascontiguousarray(wy).view(np.uint8))
                and np.array_equal(torch_bits(s), np.ascontiguousarray(ws).view(np.uint8))):
            problems.append(f"fused {kind} {layout}")
        for shape in MODULATIONS:
            mshape = {"(B,1,D)": (4, 1, hidden), "(B,S,D)": (4, 3, hidden), "(D,)": (hidden,)}[shape]
            shift, scale = host(mshape, dtype, rs, 0.3), host(mshape, dtype, rs, 0.3)
            got = rn.layer_norm_modulate(tx, torch_view(shift), torch_view(scale), weight=tw, bias=tb)
            want = rn.layer_norm_modulate(x, shift, scale, weight=w, bias=b)
            if not np.array_equal(torch_bits(got), np.ascontiguousarray(want).view(np.uint8)):
                problems.append(f"modulate {shape} {kind} {layout}")
    assert not problems, problems


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN)
def test_backward_against_the_reference(dtype, hidden):
    rs = np.random.default_rng(seed("ln backward", dtype, hidden))
    problems = []
    for kind, rows in itertools.product(("none", "same", "float32"), (1, 37, 1000)):
        x = host((rows, hidden), dtype, rs, 2.0, 0.5)
        dy = host((rows, hidden), dtype, rs)
        w, b = params_for(kind, dtype, hidden, rs)
        got = rn.layer_norm_backward(torch_view(dy), torch_view(x), torch_view(w), torch_view(b))
        want = rn.layer_norm_backward(dy, x, w, b)
        if not np.array_equal(torch_bits(got[0]), np.ascontiguousarray(want[0]).view(np.uint8)):
            problems.append(f"dx {kind} {rows}")
        terms = np.abs(dy.astype(np.float32)).sum(0)
        for name, g, wv in zip(("dweight", "dbias"), got[1:], want[1:]):
            if (g is None) != (wv is None) or (g is not None and column_close(g, wv.astype(np.float32), terms * 8)):
                problems.append(f"{name} {kind} {rows}")
        again = rn.layer_norm_backward(torch_view(dy), torch_view(x), torch_view(w), torch_view(b))
        if not all(a is None or torch.equal(a, c) for a, c in zip(got, again)):
            problems.append(f"not deterministic {kind} {rows}")
    for shape in MODULATIONS:
        x = host((3, 5, hidden), dtype, rs)
        dy = host((3, 5, hidden), dtype, rs)
        mshape = {"(B,1,D)": (3, 1, hidden), "(B,S,D)": (3, 5, hidden), "(D,)": (hidden,)}[shape]
        shift, scale = host(mshape, dtype, rs, 0.3), host(mshape, dtype, rs, 0.3)
        w, b = params_for("same", dtype, hidden, rs)
        got = rn.layer_norm_modulate_backward(torch_view(dy), torch_view(x), torch_view(shift), torch_view(scale),
                                              weight=torch_view(w), bias=torch_view(b))
        want = rn.layer_norm_modulate_backward(dy, x, shift, scale, weight=w, bias=b)
        if not np.array_equal(torch_bits(got[0]), np.ascontiguousarray(want[0]).view(np.uint8)):
            problems.append(f"modulate dx {shape}")
        terms = np.abs(dy.astype(np.float32)).reshape(-1, hidden).sum(0) * 16
        for name, g, wv in zip(("dshift", "dscale", "dweight", "dbias"), got[1:], want[1:]):
            if tuple(g.shape) != tuple(wv.shape) or column_close(g, wv.astype(np.float32), terms):
                problems.append(f"modulate {name} {shape}")
    assert not problems, problems


def test_rows_are_batch_invariant():
    rs = np.random.default_rng(seed("ln invariance"))
    x = host((513, 1152), "bfloat16", rs)
    w, b = params_for("same", "bfloat16", 1152, rs)
    whole = rn.layer_norm(torch_view(x), torch_view(w), torch_view(b))
    for rows in (1, 7, 64):
        part = rn.layer_norm(torch_view(x[:rows]), torch_view(w), torch_view(b))
        assert torch.equal(part, whole[:rows])


def test_autograd_compile_and_cuda_graphs():
    torch.manual_seed(0)
    norm = LayerNorm(768, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(64, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    shift = torch.randn(4, 1, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    scale = torch.randn(4, 1, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def block(x, shift, scale):
        return rn.layer_norm_modulate(norm(x).view(4, 16, 768), shift, scale, eps=1e-6)

    eager = block(x, shift, scale)
    eager.float().square().sum().backward()
    grads = [t.grad.clone() for t in (x, shift, scale, norm.weight, norm.bias)]
    for t in (x, shift, scale, norm.weight, norm.bias):
        t.grad = None
    compiled = torch.compile(block, fullgraph=True)(x, shift, scale)
    compiled.float().square().sum().backward()
    assert torch.equal(compiled, eager)
    for g, t in zip(grads, (x, shift, scale, norm.weight, norm.bias)):
        assert torch.equal(g, t.grad)
    static = torch.randn(64, 768, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            norm(static)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            out = norm(static)
        static.copy_(x.detach())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, norm(x.detach()))


def test_errors_before_anything_is_written():
    x = torch.randn(4, 64, device="cuda")
    with pytest.raises(ValueError, match="^shift must broadcast to x's shape"):
        rn.layer_norm_modulate(x, torch.zeros(3, 64, device="cuda"), torch.zeros(3, 64, device="cuda"))
    with pytest.raises(ValueError, match="^out partially overlaps x"):
        buf = torch.randn(4, 128, device="cuda")
        rn.layer_norm(buf[:, :64], out=buf[:, 32:96])
    with pytest.raises(ValueError, match="at most 16384 elements"):
        rn.layer_norm(torch.randn(2, 32768, device="cuda"))


def test_cupy_arrays_give_the_torch_bits():
    rs = np.random.default_rng(seed("ln cupy"))
    x, w, b = host((33, 1280), "float16", rs), host((1280,), "float32", rs), host((1280,), "float32", rs)
    got = rn.layer_norm(cp.asarray(x), cp.asarray(w), cp.asarray(b))
    assert isinstance(got, cp.ndarray)
    assert np.array_equal(got.get().view(np.uint8), torch_bits(rn.layer_norm(torch_view(x), torch_view(w),
                                                                             torch_view(b))))
