"""The registered torch ops: schemas, fake implementations and tracing (CPU, wherever
torch is installed), then opcheck, torch.compile, CUDA graphs and a compiled HF Llama on
the GPU. Skips with the reason where torch (or a GPU, or transformers) is missing."""

import importlib.util

import pytest
from helpers import requires_torch_gpu, tiny_llama

torch = pytest.importorskip("torch", reason="torch op tests: torch is not installed")

import cupy_rmsnorm as rn  # noqa: E402
import cupy_rmsnorm.torch as rnt  # noqa: E402
from cupy_rmsnorm import _api  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

OPS = torch.ops.cupy_rmsnorm
SCHEMAS = {
    "rms_norm": "cupy_rmsnorm::rms_norm(Tensor x, Tensor? weight, float eps, float weight_offset, "
                "str casting_mode) -> Tensor",
    "fused_add_rms_norm": "cupy_rmsnorm::fused_add_rms_norm(Tensor x, Tensor residual, Tensor? weight, "
                          "float eps, float weight_offset, str casting_mode) -> (Tensor, Tensor)",
    "fused_add_rms_norm_inplace": "cupy_rmsnorm::fused_add_rms_norm_inplace(Tensor(a0!) x, Tensor(a1!) residual, "
                                  "Tensor? weight, float eps, float weight_offset, str casting_mode) -> ()",
}
requires_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                           reason="HF Llama check: transformers is not installed")


# -- CPU: schema, fake implementations, tracing ---------------------------------------------

@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schema(name):
    assert str(getattr(OPS, name).default._schema) == SCHEMAS[name]


def test_importing_the_torch_module_routes_traced_calls():
    assert _api._compiling is not None


def test_fake_implementations_give_shapes_and_dtypes():
    with FakeTensorMode():
        x = torch.empty(3, 5, 64, dtype=torch.bfloat16)[:, 1:]     # strided rows
        r = torch.empty(3, 4, 64, dtype=torch.bfloat16)
        w = torch.empty(64, dtype=torch.float32)
        y = OPS.rms_norm(x, w, 1e-6, 0.0, "llama")
        assert y.shape == x.shape and y.dtype == x.dtype and y.is_contiguous()
        y, s = OPS.fused_add_rms_norm(x, r, None, 1e-6, 0.0, "fp32")
        assert y.shape == s.shape == x.shape and y.dtype == s.dtype == torch.bfloat16
        assert OPS.fused_add_rms_norm_inplace(x, r, w, 1e-6, 1.0, "fp32") is None


def test_fake_implementations_check_like_the_real_path():
    with FakeTensorMode():
        x = torch.empty(2, 64, dtype=torch.float16)
        with pytest.raises(ValueError, match=r"^weight must have shape \(64,\)"):
            OPS.rms_norm(x, torch.empty(32, dtype=torch.float16), 1e-6, 0.0, "fp32")
        with pytest.raises(TypeError, match=r"^residual must have x's dtype"):
            OPS.fused_add_rms_norm(x, torch.empty(2, 64), None, 1e-6, 0.0, "fp32")
        with pytest.raises(TypeError, match=r"^x must be float32, float16 or bfloat16"):
            OPS.rms_norm(torch.empty(2, 64, dtype=torch.float64), None, 1e-6, 0.0, "fp32")


def _trace(fn, *args):
    """Compile ``fn`` with fullgraph=True (a graph break fails) and a backend that records
    the graph and runs it on fake tensors (no GPU needed); returns the graphs."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)

        def run(*inputs):
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                return gm(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in inputs])
        return run

    torch._dynamo.reset()
    torch.compile(fn, fullgraph=True, backend=backend)(*args)
    return graphs


def _op_calls(graphs):
    return [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"
            and "cupy_rmsnorm" in str(n.target)]


@pytest.mark.parametrize("case", ["rms", "rms out=", "fused", "fused in place", "fused out="])
def test_public_functions_trace_as_one_op(case):
    x, r, w = torch.randn(4, 64), torch.randn(4, 64), torch.randn(64)

    def fn(x, r, w):
        if case == "rms":
            return rn.rms_norm(x, w, 1e-5, casting_mode="llama") * 2
        if case == "rms out=":
            return rn.rms_norm(x, w, out=torch.empty_like(x))
        if case == "fused":
            return rn.fused_add_rms_norm(x, r, w, weight_offset=1.0)
        if case == "fused in place":
            return rn.fused_add_rms_norm(x, r, w, out=x, residual_out=r)
        return rn.fused_add_rms_norm(x, r, w, out=torch.empty_like(x), residual_out=torch.empty_like(r))

    calls = _op_calls(_trace(fn, x, r, w))
    want = {"rms": "rms_norm", "rms out=": "rms_norm", "fused": "fused_add_rms_norm",
            "fused in place": "fused_add_rms_norm_inplace", "fused out=": "fused_add_rms_norm"}[case]
    assert calls == [f"cupy_rmsnorm.{want}.default"], calls


def test_modules_trace_as_one_op_each():
    norm = rnt.RMSNorm(64, casting_mode="llama")
    fused = rnt.FusedAddRMSNorm(64)

    def fn(x, r):
        y, s = fused(x, r)
        return norm(y), norm.add_and_norm(y, s)

    with torch.no_grad():
        calls = _op_calls(_trace(fn, torch.randn(2, 64), torch.randn(2, 64)))
    assert calls == ["cupy_rmsnorm.fused_add_rms_norm.default", "cupy_rmsnorm.rms_norm.default",
                     "cupy_rmsnorm.fused_add_rms_norm.default"], calls


def _cpu_llama_with_our_norms(layers=2, hidden=64):
    """A tiny HF Llama on the CPU whose norms are this library's modules (sharing the
    weights), as patch_hf_rmsnorm leaves them; patch_hf_rmsnorm itself needs a GPU."""
    model = tiny_llama(layers, hidden, vocab=100, device="cpu", dtype="float32", random_norm_weights=False)
    for name, module in list(model.named_modules()):
        if type(module).__name__ == "LlamaRMSNorm":
            new = rnt.RMSNorm(hidden, 1e-6, casting_mode="llama", device="meta")
            new.weight = module.weight
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, new)
    return model


@requires_transformers
def test_fused_residuals_chain_each_layer_to_the_next_norm():
    """fuse_residual: both residual adds of every layer run inside the following norm's op
    (the MLP add of the last layer inside the final norm's), so a whole-model trace has one
    plain norm (the first layer's input norm) and two fused ops a layer, no graph break; the
    chain registers no module and leaves the state_dict as it was."""
    from cupy_rmsnorm.torch import _fuse_residuals
    model = _cpu_llama_with_our_norms(layers=3)
    keys = list(model.state_dict())
    assert _fuse_residuals(model) == 3
    assert _fuse_residuals(model) == 0          # a second patch rewrites nothing
    assert list(model.state_dict()) == keys
    layers = model.model.layers
    assert [layer._cupy_rmsnorm_next[0] for layer in layers] == [
        layers[1].input_layernorm, layers[2].input_layernorm, model.model.norm]
    with torch.no_grad():
        calls = _op_calls(_trace(lambda ids: model(input_ids=ids, use_cache=False).logits,
                                 torch.randint(3, 100, (1, 8))))
    assert calls == ["cupy_rmsnorm.rms_norm.default"] + ["cupy_rmsnorm.fused_add_rms_norm.default"] * 6, calls
    assert all(norm._cupy_rmsnorm_handoff == [None] for norm in (layers[1].input_layernorm, model.model.norm))


@requires_transformers
def test_checkpointed_layers_keep_their_mlp_add():
    """A layer under gradient checkpointing (training) hands nothing over: checkpoint runs its
    forward again in the backward and needs the next layer's recomputation to match."""
    from cupy_rmsnorm.torch import _fuse_residuals
    model = _cpu_llama_with_our_norms(layers=2)
    _fuse_residuals(model)
    model.train()
    for layer in model.model.layers:     # HF's switch, with a checkpoint that simply calls
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = lambda f, *args: f(*args)
    with torch.no_grad():
        calls = _op_calls(_trace(lambda ids: model(input_ids=ids, use_cache=False).logits,
                                 torch.randint(3, 100, (1, 8))))
    plain, fused = "cupy_rmsnorm.rms_norm.default", "cupy_rmsnorm.fused_add_rms_norm.default"
    assert calls == [plain, fused, plain, fused, plain], calls


@requires_transformers
def test_a_handed_over_norm_takes_only_its_own_input():
    """The handed-over result is taken only for the very tensor the layer returned; another
    input is normalized itself, and the slot is emptied when read."""
    from cupy_rmsnorm.torch import _fuse_residuals
    model = _cpu_llama_with_our_norms(layers=1)
    _fuse_residuals(model)
    norm = model.model.norm
    summed, handed = torch.randn(2, 64), torch.randn(2, 64)
    norm._cupy_rmsnorm_handoff[0] = (summed, handed)
    assert norm(summed) is handed and norm._cupy_rmsnorm_handoff == [None]
    norm._cupy_rmsnorm_handoff[0] = (summed, handed)
    with torch.no_grad():
        calls = _op_calls(_trace(lambda x: norm(x), summed.clone()))
    assert calls == ["cupy_rmsnorm.rms_norm.default"] and norm._cupy_rmsnorm_handoff == [None]


def test_traced_scalars_are_checked_at_trace_time():
    with pytest.raises(Exception, match="eps must be finite"):
        _trace(lambda x: rn.rms_norm(x, eps=-1.0), torch.randn(2, 8))


# -- GPU ---------------------------------------------------------------------------------------

def _inputs(shape, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)


def _samples():
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = _inputs((5, 4096), dtype)
        r = _inputs((5, 4096), dtype, 1)
        w = 1 + 0.1 * _inputs((4096,), dtype, 2)
        yield x, r, w, "llama"
        yield x[:, :4000], r[:, 96:], w[:4000].float(), "fp32"      # strided rows, float32 weight
        yield _inputs((3, 7, 255), dtype, 3), _inputs((3, 7, 255), dtype, 4), None, "fp32"


@requires_torch_gpu
def test_opcheck():
    for x, r, w, mode in _samples():
        torch.library.opcheck(OPS.rms_norm.default, (x, w, 1e-6, 0.0, mode))
        torch.library.opcheck(OPS.fused_add_rms_norm.default, (x, r, w, 1e-6, 0.0, mode))
        torch.library.opcheck(OPS.fused_add_rms_norm_inplace.default,
                              (x.clone(), r.clone(), w, 1e-6, 1.0 if w is not None else 0.0, mode))


@requires_torch_gpu
def test_ops_give_the_direct_paths_bits():
    for x, r, w, mode in _samples():
        assert torch.equal(OPS.rms_norm(x, w, 1e-6, 0.0, mode), rn.rms_norm(x, w, casting_mode=mode))
        y, s = OPS.fused_add_rms_norm(x, r, w, 1e-6, 0.0, mode)
        y0, s0 = rn.fused_add_rms_norm(x, r, w, casting_mode=mode)
        assert torch.equal(y, y0) and torch.equal(s, s0)
        xi, ri = x.clone(), r.clone()
        OPS.fused_add_rms_norm_inplace(xi, ri, w, 1e-6, 0.0, mode)
        assert torch.equal(xi, y0) and torch.equal(ri, s0)


@requires_torch_gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_functions_match_eager(mode):
    """inductor around the ops (and CUDA graphs with reduce-overhead): the same bits as
    the eager calls, for new inputs on every replay."""
    torch._dynamo.reset()
    w = 1 + 0.1 * _inputs((4096,), torch.bfloat16, 7)

    def step(x, r):
        h = x * 2                                   # inductor's own kernel before the op
        y, s = rn.fused_add_rms_norm(h, r, w, casting_mode="llama")
        return rn.rms_norm(y + 1, w), s

    compiled = torch.compile(step, fullgraph=True, mode=mode, dynamic=False)
    for seed in range(4):
        x, r = _inputs((16, 4096), torch.bfloat16, seed), _inputs((16, 4096), torch.bfloat16, 10 + seed)
        got = compiled(x, r)
        want = step(x, r)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@requires_torch_gpu
def test_compiled_in_place_fused_mutates_its_inputs():
    torch._dynamo.reset()
    w = 1 + 0.1 * _inputs((1024,), torch.float16, 7)

    def step(x, r):
        rn.fused_add_rms_norm(x, r, w, out=x, residual_out=r)
        return x + 0, r

    x, r = _inputs((8, 1024), torch.float16), _inputs((8, 1024), torch.float16, 1)
    want_y, want_s = rn.fused_add_rms_norm(x, r, w)
    xc, rc = x.clone(), r.clone()
    got, _ = torch.compile(step, fullgraph=True)(xc, rc)
    assert torch.equal(got, want_y) and torch.equal(xc, want_y) and torch.equal(rc, want_s)


def _tiny_llama(layers=2, hidden=256):
    return tiny_llama(layers, hidden)


@requires_torch_gpu
@requires_transformers
def test_patched_llama_compiles_with_no_graph_break_from_the_norms():
    import copy
    hf = _tiny_llama()
    ids = torch.randint(3, 1000, (2, 24), device="cuda")
    patched = copy.deepcopy(hf)
    assert rnt.patch_hf_rmsnorm(patched) == 2 * 2 + 1
    fused = copy.deepcopy(hf)
    rnt.patch_hf_rmsnorm(fused, fuse_residual=True)
    assert all(getattr(layer, "_cupy_rmsnorm_fused", False) for layer in fused.model.layers)
    torch._dynamo.reset()
    with torch.no_grad():
        norm_explain = torch._dynamo.explain(patched.model.norm)(torch.randn(2, 256, device="cuda",
                                                                              dtype=torch.bfloat16))
        assert norm_explain.graph_break_count == 0
        compiled = torch.compile(patched.model.norm, fullgraph=True)
        h = _inputs((2, 256), torch.bfloat16)
        assert torch.equal(compiled(h), patched.model.norm(h))
        breaks = {}
        for name, model in (("hf", hf), ("ours", patched), ("ours_fused", fused)):
            torch._dynamo.reset()
            breaks[name] = torch._dynamo.explain(model)(ids).graph_break_count
        print("graph breaks (whole model forward):", breaks)
        assert breaks["ours"] <= breaks["hf"] and breaks["ours_fused"] <= breaks["hf"], breaks
        eager = patched(ids).logits
        eager_fused = fused(ids).logits
        assert torch.equal(eager, eager_fused)      # the fused pair gives the very same bits
        for model in (patched, fused):
            torch._dynamo.reset()
            got = torch.compile(model, fullgraph=True)(ids).logits
            torch.testing.assert_close(got.float(), eager.float(), rtol=1.6e-2, atol=2e-2)


@requires_torch_gpu
@requires_transformers
@pytest.mark.parametrize("checkpointing", [False, True])
def test_fused_residual_model_trains_to_the_plain_patchs_gradients(checkpointing):
    """fuse_residual in training, with and without gradient checkpointing: the loss and
    every parameter's gradient match the plain patch's (the same ops, fused; the fused op
    rounds the sum as the pair does, so up to float32 reassociation in the backward)."""
    import copy
    base = _tiny_llama().float()
    plain, fused = copy.deepcopy(base), copy.deepcopy(base)
    rnt.patch_hf_rmsnorm(plain)
    rnt.patch_hf_rmsnorm(fused, fuse_residual=True)
    ids = torch.randint(3, 1000, (2, 24), device="cuda")
    grads = []
    for model in (plain, fused):
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_p, g_p), (loss_f, g_f) = grads
    torch.testing.assert_close(loss_f, loss_p, rtol=1e-5, atol=1e-5)
    assert g_p.keys() == g_f.keys() and all(g is not None for g in g_f.values())
    for name in g_p:
        torch.testing.assert_close(g_f[name], g_p[name], rtol=1e-4, atol=1e-5, msg=name)


@requires_torch_gpu
@requires_transformers
@pytest.mark.parametrize("fuse_residual", [False, True])
def test_patched_llama_generates_with_the_static_cache(fuse_residual):
    """generate(cache_implementation="static") compiles the forward with CUDA graphs: it
    runs, and gives the eager patched model's greedy tokens."""
    model = _tiny_llama()
    rnt.patch_hf_rmsnorm(model, fuse_residual=fuse_residual)
    ids = torch.randint(3, 1000, (1, 16), device="cuda")
    kwargs = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False)
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model.generate(ids, **kwargs)
        static = model.generate(ids, cache_implementation="static", **kwargs)
    assert static.shape == eager.shape
    assert (static == eager).float().mean() >= 0.9, (static, eager)   # near ties may flip


def test_compiling_before_the_ops_are_registered_says_what_to_do():
    """torch imported after cupy_rmsnorm and compiled before any tensor reached it: a
    RuntimeError naming the fix, not dynamo tripping over the library's Python."""
    import subprocess
    import sys
    code = ("import cupy_rmsnorm as rn\nimport torch\n"
            "f = torch.compile(lambda x: rn.rms_norm(x * 2), fullgraph=True)\n"
            "f(torch.ones(2, 8))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    assert "import cupy_rmsnorm.torch before compiling" in done.stderr, done.stderr[-2000:]
