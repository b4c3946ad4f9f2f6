"""The registered torch ops on the CPU, wherever torch is installed: schemas, fake
implementations and tracing. The GPU side (opcheck, torch.compile, CUDA graphs and a
compiled HF Llama) is in tests/gpu/test_torch_ops_gpu.py. Skips with the reason where
torch (or transformers) is missing."""

import importlib.util

import pytest
from helpers import tiny_llama
from helpers import op_calls as _op_calls
from helpers import trace_graphs as _trace

torch = pytest.importorskip("torch", reason="torch op tests: torch is not installed")

import cupy_rmsnorm as rn  # noqa: E402
import cupy_rmsnorm.torch as rnt  # noqa: E402
from cupy_rmsnorm import _interop, _pipeline  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

OPS = torch.ops.cupy_rmsnorm
SCHEMAS = {
    "rms_norm": "cupy_rmsnorm::rms_norm(Tensor x, Tensor? weight, float eps, float weight_offset, "
                "str casting_mode, ScalarType? out_dtype=None) -> Tensor",
    "fused_add_rms_norm": "cupy_rmsnorm::fused_add_rms_norm(Tensor x, Tensor residual, Tensor? weight, "
                          "float eps, float weight_offset, str casting_mode, ScalarType? out_dtype=None) "
                          "-> (Tensor, Tensor)",
    "rms_norm_gated": "cupy_rmsnorm::rms_norm_gated(Tensor x, Tensor gate, Tensor? weight, float eps, "
                      "float weight_offset, str casting_mode, SymInt? group_size, bool norm_before_gate, "
                      "str activation, ScalarType? out_dtype) -> Tensor",
    "rms_norm_gated_backward": "cupy_rmsnorm::rms_norm_gated_backward(Tensor dy, Tensor x, Tensor gate, "
                               "Tensor? weight, float eps, float weight_offset, str casting_mode, SymInt? group_size, "
                               "bool norm_before_gate, str activation, bool weight_grad) -> (Tensor, Tensor, Tensor)",
    "fused_add_rms_norm_inplace": "cupy_rmsnorm::fused_add_rms_norm_inplace(Tensor(a0!) x, Tensor(a1!) residual, "
                                  "Tensor? weight, float eps, float weight_offset, str casting_mode) -> ()",
}
requires_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                           reason="HF Llama check: transformers is not installed")


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schema(name):
    assert str(getattr(OPS, name).default._schema) == SCHEMAS[name]


def test_importing_the_torch_module_routes_traced_calls():
    assert _interop.TorchKind.compiling is not None
    assert all(spec.traced is not None for spec in _pipeline.REGISTRY.values())


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
        with pytest.raises(TypeError, match=r"^residual must have dtype float16 \(x's dtype or float32\)"):
            OPS.fused_add_rms_norm(x, torch.empty(2, 64, dtype=torch.bfloat16), None, 1e-6, 0.0, "fp32")
        y, s = OPS.fused_add_rms_norm(x, torch.empty(2, 64), None, 1e-6, 0.0, "fp32", torch.bfloat16)
        assert y.dtype == torch.bfloat16 and s.dtype == torch.float32      # a float32 residual stream
        gate = torch.empty(2, 64, dtype=torch.float16)
        assert OPS.rms_norm_gated(x, gate, None, 1e-6, 0.0, "fp32", 32, True, "silu", None).dtype == torch.float16
        with pytest.raises(ValueError, match=r"^group_size=48 needs a hidden size"):
            OPS.rms_norm_gated(x, gate, None, 1e-6, 0.0, "fp32", 48, True, "silu", None)
        with pytest.raises(TypeError, match=r"^x must be float32, float16 or bfloat16"):
            OPS.rms_norm(torch.empty(2, 64, dtype=torch.float64), None, 1e-6, 0.0, "fp32")


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
    weights), as patch_hf_rmsnorm leaves them (built here with fixed numerics, no probing)."""
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


def test_modules_of_several_eps_compile_in_one_process():
    """The same forward compiled for several eps: dynamo then takes eps as symbolic (automatic
    dynamic), which the scalar checks must trace (math.isfinite does not)."""
    torch._dynamo.reset()
    x = torch.randn(4, 64)
    for module in (rnt.RMSNorm(64, eps=1e-6), rnt.RMSNorm(64, eps=1e-5), rnt.RMSNorm(64, eps=1e-4),
                   rnt.LayerNorm(64, eps=1e-5), rnt.LayerNorm(64, eps=1e-6), rnt.LayerNorm(64, eps=1e-3)):
        with torch.no_grad():
            module.weight.normal_()
        expected = module(x)
        assert torch.equal(torch.compile(module, fullgraph=True)(x), expected)
    with pytest.raises(Exception, match="eps must be finite"):
        torch.compile(rnt.RMSNorm(64, eps=-1.0), fullgraph=True)(x)


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
