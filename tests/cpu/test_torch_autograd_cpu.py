"""Autograd through the registered ops, on the CPU: the ops get CPU kernels for the test
(the library's NumPy path: the reference), so the registration itself is what is tested:
setup_context, the backward ops and their fake implementations, the routing of eager calls
that need autograd, the modules, torch.compile of forward + backward (one backward op in the
backward graph), and torch.library.opcheck. Skips where torch is missing."""

import pytest
from helpers import cpu_kernels_of_the_ops, cpu_tensor_to_numpy as to_numpy, numpy_to_cpu_tensor as to_torch

torch = pytest.importorskip("torch", reason="torch autograd tests: torch is not installed")

import cupy_rmsnorm as rn  # noqa: E402
import cupy_rmsnorm.torch as rnt  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

OPS = torch.ops.cupy_rmsnorm
SCHEMAS = {
    "rms_norm_backward": "cupy_rmsnorm::rms_norm_backward(Tensor dy, Tensor x, Tensor? weight, float eps, "
                         "float weight_offset, str casting_mode, bool weight_grad) -> (Tensor, Tensor)",
    "fused_add_rms_norm_backward": "cupy_rmsnorm::fused_add_rms_norm_backward(Tensor dy, Tensor? d_residual_out, "
                                   "Tensor residual_out, Tensor? weight, float eps, float weight_offset, "
                                   "str casting_mode, bool weight_grad) -> (Tensor, Tensor)",
}


CALLS = []      # which CPU kernels ran


@pytest.fixture(scope="module", autouse=True)
def cpu_kernels():
    """CPU kernels of the four ops that run the library's NumPy path."""

    def rms(x, w, eps, off, mode):
        CALLS.append("rms_norm")
        return to_torch(rn.rms_norm(to_numpy(x), to_numpy(w), eps, weight_offset=off, casting_mode=mode))

    def fused(x, r, w, eps, off, mode):
        CALLS.append("fused_add_rms_norm")
        y, s = rn.fused_add_rms_norm(to_numpy(x), to_numpy(r), to_numpy(w), eps, weight_offset=off,
                                     casting_mode=mode)
        return to_torch(y), to_torch(s)

    def rms_bwd(dy, x, w, eps, off, mode, weight_grad):
        CALLS.append("rms_norm_backward")
        dx, dw = rn.rms_norm_backward(to_numpy(dy), to_numpy(x), to_numpy(w), eps, weight_offset=off,
                                      casting_mode=mode)
        return to_torch(dx), (to_torch(dw) if w is not None and weight_grad else x.new_empty(0))

    def fused_bwd(dy, dres, s, w, eps, off, mode, weight_grad):
        CALLS.append("fused_add_rms_norm_backward")
        dx, dw = rn.fused_add_rms_norm_backward(to_numpy(dy), to_numpy(dres), to_numpy(s), to_numpy(w), eps,
                                                weight_offset=off, casting_mode=mode)
        return to_torch(dx), (to_torch(dw) if w is not None and weight_grad else s.new_empty(0))

    with cpu_kernels_of_the_ops({"rms_norm": rms, "fused_add_rms_norm": fused, "rms_norm_backward": rms_bwd,
                                 "fused_add_rms_norm_backward": fused_bwd}):
        yield


def f64_rms_norm(x, w, eps, off):
    """The contract's fp32-mode formula in float64, for torch's autograd."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * (w + off)


def leaf(t):
    return t.detach().clone().requires_grad_(True)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_backward_schemas(name):
    assert str(getattr(OPS, name).default._schema) == SCHEMAS[name]


@pytest.mark.parametrize("weight", ["none", "same", "float32"])
def test_rms_norm_gradients_match_float64_autograd(weight):
    torch.manual_seed(0)
    x = torch.randn(6, 40)
    w = None if weight == "none" else (torch.rand(40) + 0.5).to(torch.float32)
    dy = torch.randn(6, 40)
    xg, wg = leaf(x), (None if w is None else leaf(w))
    y = rn.rms_norm(xg, wg, 1e-5, weight_offset=0.25 if w is not None else 0.0)
    assert y.grad_fn is not None, "the call was not recorded by autograd"
    y.backward(dy)
    x64, w64 = leaf(x.double()), (None if w is None else leaf(w.double()))
    f64_rms_norm(x64, w64, 1e-5, 0.25 if w is not None else 0.0).backward(dy.double())
    torch.testing.assert_close(xg.grad.double(), x64.grad, rtol=1e-5, atol=1e-6)
    if w is not None:
        assert wg.grad.dtype == w.dtype
        torch.testing.assert_close(wg.grad.double(), w64.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("use", ["both", "normed only", "sum only"])
def test_fused_gradients_reach_both_inputs(use):
    torch.manual_seed(1)
    x, r, w = torch.randn(5, 24), torch.randn(5, 24), torch.rand(24) + 0.5
    dy, ds = torch.randn(5, 24), torch.randn(5, 24)
    xg, rg, wg = leaf(x), leaf(r), leaf(w)
    y, s = rn.fused_add_rms_norm(xg, rg, wg, 1e-6)
    loss = {"both": (y * dy).sum() + (s * ds).sum(), "normed only": (y * dy).sum(), "sum only": (s * ds).sum()}[use]
    loss.backward()
    x64, r64, w64 = leaf(x.double()), leaf(r.double()), leaf(w.double())
    s64 = x64 + r64
    y64 = f64_rms_norm(s64, w64, 1e-6, 0.0)
    {"both": (y64 * dy).sum() + (s64 * ds).sum(), "normed only": (y64 * dy).sum(),
     "sum only": (s64 * ds).sum()}[use].backward()
    torch.testing.assert_close(xg.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rg.grad.double(), r64.grad, rtol=1e-5, atol=1e-5)
    want_w = w64.grad if w64.grad is not None else torch.zeros_like(w64)   # float64: y unused, no grad
    torch.testing.assert_close(wg.grad.double(), want_w, rtol=1e-5, atol=1e-5)


def test_only_calls_that_need_autograd_go_through_the_op():
    x, w = torch.randn(3, 16), torch.rand(16, requires_grad=True)
    CALLS.clear()
    y = rn.rms_norm(x, w)
    assert CALLS == ["rms_norm"] and y.requires_grad
    CALLS.clear()
    with torch.no_grad():                   # the direct path: the reference on the CPU, no op
        direct = rn.rms_norm(x, w)
    assert torch.equal(rn.rms_norm(x, w.detach()), direct) and CALLS == [] and not direct.requires_grad


def test_in_place_fused_form_is_forward_only():
    x, r, w = torch.randn(2, 8), torch.randn(2, 8), torch.rand(8, requires_grad=True)
    with pytest.raises(RuntimeError, match="forward-only"):
        rn.fused_add_rms_norm(x, r, w, out=x, residual_out=r)


def test_weight_grad_is_skipped_when_the_weight_needs_none():
    x, w = torch.randn(3, 16, requires_grad=True), torch.rand(16)
    CALLS.clear()
    rn.rms_norm(x, w).sum().backward()
    assert CALLS == ["rms_norm", "rms_norm_backward"] and x.grad is not None and w.grad is None


def test_modules_train():
    torch.manual_seed(2)
    norm = rnt.RMSNorm(32, 1e-6, casting_mode="llama")
    fused = rnt.FusedAddRMSNorm(32, 1e-6, weight_offset=1.0)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.2)
        fused.weight.normal_(0.0, 0.2)
    opt = torch.optim.SGD(list(norm.parameters()) + list(fused.parameters()), lr=0.1)
    x, r = torch.randn(4, 32, requires_grad=True), torch.randn(4, 32)
    y, s = fused(x, r)
    loss = norm(y).square().mean() + s.mean()
    loss.backward()
    assert norm.weight.grad is not None and fused.weight.grad is not None and x.grad is not None
    before = norm.weight.detach().clone()
    opt.step()
    assert not torch.equal(before, norm.weight)


def test_compiled_forward_and_backward_match_eager_with_one_backward_op():
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    graphs = {"forward": [], "backward": []}

    def recorder(kind):
        def compile_graph(gm, example_inputs):
            graphs[kind].append(gm)
            return make_boxed_func(gm.forward)
        return compile_graph

    backend = aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward"))
    torch.manual_seed(3)
    norm = rnt.RMSNorm(48, 1e-6)
    fused = rnt.FusedAddRMSNorm(48, 1e-6)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3)

    def step(x, r):
        y, s = fused(x * 2, r)
        return (norm(y) * s).sum()

    x, r = torch.randn(4, 48), torch.randn(4, 48)
    grads = []
    for run in (step, torch.compile(step, fullgraph=True, backend=backend)):
        for p in (norm.weight, fused.weight):
            p.grad = None
        xg, rg = leaf(x), leaf(r)
        run(xg, rg).backward()
        grads.append([t.grad.clone() for t in (xg, rg, norm.weight, fused.weight)])
    for eager, compiled in zip(*grads):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
    targets = [str(n.target) for g in graphs["backward"] for n in g.graph.nodes if n.op == "call_function"]
    mine = [t for t in targets if "cupy_rmsnorm" in t]
    assert sorted(mine) == ["cupy_rmsnorm.fused_add_rms_norm_backward.default",
                            "cupy_rmsnorm.rms_norm_backward.default"], targets


def test_fake_backward_ops_give_shapes_and_dtypes():
    with FakeTensorMode():
        x = torch.empty(3, 5, 64, dtype=torch.bfloat16)[:, 1:]
        w = torch.empty(64, dtype=torch.float32)
        dx, dw = OPS.rms_norm_backward(x, x, w, 1e-6, 0.0, "llama", True)
        assert dx.shape == x.shape and dx.dtype == x.dtype and dx.is_contiguous()
        assert dw.shape == (64,) and dw.dtype == torch.float32
        dx, dw = OPS.fused_add_rms_norm_backward(x, None, x, None, 1e-6, 0.0, "fp32", True)
        assert dx.shape == x.shape and dw.shape == (0,)
        _, dw = OPS.rms_norm_backward(x, x, w, 1e-6, 0.0, "fp32", False)
        assert dw.shape == (0,)
        with pytest.raises(ValueError, match=r"^dy must have x's shape"):
            OPS.rms_norm_backward(x[:, :2], x, w, 1e-6, 0.0, "fp32", True)
        with pytest.raises(TypeError, match=r"^d_residual_out must have residual_out's dtype"):
            OPS.fused_add_rms_norm_backward(x, x.float(), x, w, 1e-6, 0.0, "fp32", True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_on_cpu(dtype):
    torch.manual_seed(4)
    x = torch.randn(5, 33).to(dtype).requires_grad_()
    r = torch.randn(5, 33).to(dtype).requires_grad_()
    w = (torch.rand(33) + 0.5).to(dtype).requires_grad_()
    wf = (torch.rand(33) + 0.5).requires_grad_()
    dy = torch.randn(5, 33).to(dtype)
    torch.library.opcheck(OPS.rms_norm.default, (x, w, 1e-6, 0.0, "llama"))
    torch.library.opcheck(OPS.rms_norm.default, (x, None, 1e-6, 0.0, "fp32"))
    torch.library.opcheck(OPS.fused_add_rms_norm.default, (x, r, wf, 1e-6, 1.0, "fp32"))
    torch.library.opcheck(OPS.rms_norm_backward.default, (dy, x.detach(), w.detach(), 1e-6, 0.0, "fp32", True))
    torch.library.opcheck(OPS.fused_add_rms_norm_backward.default,
                          (dy, dy, x.detach(), None, 1e-6, 0.0, "fp32", False))
