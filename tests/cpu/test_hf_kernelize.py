"""cupy_rmsnorm.hf with Hugging Face's kernels (0.11 on; the layer classes and the mapping) on
real transformers models built small and random on the CPU (nothing downloaded): a Llama (the
"RMSNorm" layer), a Qwen3-Next (its gated norms: "RMSNormGated") and a Qwen3.5 ("RMSNormZeroCentered"
and "RMSNormGated"), kernelized in each mode. CPU tensors run the library's NumPy reference, so
the logits must be patch_hf_rmsnorm's bit for bit (same numerics on the same modules) and within
HF's own floor of the original modules. Skips without torch, transformers or kernels; kernels up
to 0.10 is test_hf_kernelize_legacy.py's."""

import copy
import importlib.metadata
import inspect
import logging
import sys
import warnings

import pytest
from helpers import EPS, TOL, tiny_llama

torch = pytest.importorskip("torch", reason="HF kernelize tests: torch is not installed")
pytest.importorskip("transformers", reason="HF kernelize tests: transformers is not installed")
kernels = pytest.importorskip("kernels", reason="HF kernelize tests: kernels is not installed (pip install kernels)")

import cupy_rmsnorm.hf as rnhf  # noqa: E402
import cupy_rmsnorm.torch as rnt  # noqa: E402
from transformers.utils import is_kernels_available  # noqa: E402

KERNELS = importlib.metadata.version("kernels")   # kernels 0.9 has no __version__

if not is_kernels_available():   # then transformers marks no module for kernels
    pytest.skip(f"transformers {__import__('transformers').__version__} does not take kernels {KERNELS}",
                allow_module_level=True)
from torch import nn  # noqa: E402

if rnhf._kernels_version() < (0, 11):
    pytest.skip(f"kernels {KERNELS} takes the old repositories: test_hf_kernelize_legacy.py",
                allow_module_level=True)

VOCAB, BATCH, SEQ = 100, 2, 8
MODES = ("inference", "training", "compile")
# Hybrid models (linear and full attention): 64 wide, 16-channel heads, one layer of each kind.
HYBRID = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=EPS,
              linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              layer_types=["linear_attention", "full_attention"])


def _random_norm_weights(model):
    """Every norm's weight drawn around its start (one, or zero for (1 + weight) norms): the
    probe then sees which rounding and offset each module uses."""
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__.endswith(("RMSNorm", "RMSNormGated")):
                start = float(m.weight.detach().float().mean().round())
                m.weight.copy_(start + 0.3 * torch.randn(m.weight.shape[0]))
    return model


def _llama():
    # bfloat16: Llama's rounding before the weight multiply matters there
    return tiny_llama(2, 64, VOCAB, device="cpu", dtype="bfloat16")


def _qwen3_next():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    torch.manual_seed(0)
    config = Qwen3NextConfig(**HYBRID, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=32)
    return _random_norm_weights(Qwen3NextForCausalLM(config).eval())


def _qwen3_5():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    torch.manual_seed(0)
    return _random_norm_weights(Qwen3_5ForCausalLM(Qwen3_5TextConfig(**HYBRID)).eval())


# model -> (builder, {kernelized module class: (kernels' layer name, what the probe must find)}).
# The hybrids are float32: their linear attention's own float32 arithmetic is the floor there.
LLAMA_STYLE = dict(casting_mode="llama", weight_offset=0.0)
GATED = dict(LLAMA_STYLE, norm_before_gate=True, group_size=None, activation="silu")
MODELS = {
    "llama": (_llama, {"LlamaRMSNorm": ("RMSNorm", LLAMA_STYLE)}),
    "qwen3_next": (_qwen3_next, {"Qwen3NextRMSNormGated": ("RMSNormGated", GATED)}),
    "qwen3_5": (_qwen3_5, {"Qwen3_5RMSNorm": ("RMSNormZeroCentered", dict(casting_mode="fp32", weight_offset=1.0)),
                           "Qwen3_5RMSNormGated": ("RMSNormGated", GATED)}),
}


def _ids():
    return torch.randint(3, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _patched(model):
    """``model`` with the modules kernels swaps replaced by patch_hf_rmsnorm (Qwen3-Next's plain
    Qwen3NextRMSNorm is not marked for kernels: patch_hf_rmsnorm is given its gated norms' parents)."""
    if "Qwen3NextRMSNorm" in {type(m).__name__ for m in model.modules()}:
        parents = [m for m in model.modules() if type(getattr(m, "norm", None)).__name__ == "Qwen3NextRMSNormGated"]
        assert parents and all(rnt.patch_hf_rmsnorm(m) == 1 for m in parents)
    else:   # every norm of these models is marked for kernels
        marked = sum(hasattr(type(m), "kernel_layer_name") and "RMSNorm" in type(m).__name__ for m in model.modules())
        assert rnt.patch_hf_rmsnorm(model) == marked > 0
    return model


def _logits(model, ids, **kwargs):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False, **kwargs).logits


def _floor(dtype):
    # HF's own: a few units in the last place of the logits' dtype (the sum order of the mean)
    return dict(rtol=TOL[str(dtype).replace("torch.", "")][0], atol=2e-2 if dtype == torch.bfloat16 else 1e-5)


def _kernelized(model):
    """{module path: (module, layer name or None)} of the modules kernelize swapped: kernels' own
    record where it keeps one (get_kernelized_layers, which kernels 0.16 lacks: then the modules
    whose own forward is one of this library's layers', and no layer name)."""
    record = getattr(kernels, "get_kernelized_layers", None)
    if record is None:
        ours = {layer.forward for layer in (rnhf.RMSNorm, rnhf.RMSNormGated, rnhf.RMSNormZeroCentered)}
        return {name: (m, None) for name, m in model.named_modules()
                if getattr(m.__dict__.get("forward"), "__func__", None) in ours}
    layers = record(model).layers
    for entry in layers.values():
        assert entry.repo.load() is getattr(rnhf, entry.repo.layer_name)
    return {name: (entry.module, entry.repo.layer_name) for name, entry in layers.items()}


def _check_kernelized(model, expected):
    """The swaps: every module of the expected classes, to this library's layer, with the
    numerics the probe must find."""
    layers = _kernelized(model)
    want = {name for name, m in model.named_modules() if type(m).__name__ in expected}
    assert set(layers) == want and want
    for name, (module, recorded) in layers.items():
        layer_name, numerics = expected[type(module).__name__]
        assert recorded in (layer_name, None), name
        assert module.forward.__func__ is getattr(rnhf, layer_name).forward, name
        dtype, eps, found = module.__dict__[rnhf._FOUND]
        assert (dtype, eps) == (module.weight.dtype, EPS) and found == numerics, name


# -- the mapping and the layers -------------------------------------------------------------------------

def test_the_mapping_names_the_three_layers_on_both_devices():
    mapping = rnhf.kernel_mapping()
    assert set(mapping) == {"RMSNorm", "RMSNormGated", "RMSNormZeroCentered"}
    for name, by_device in mapping.items():
        assert set(by_device) == {"cuda", "cpu"}
        for repo in by_device.values():
            assert repo.layer_name == name and repo.load() is getattr(rnhf, name)
            assert hash(repo) == hash(rnhf.kernel_mapping()[name]["cpu"]) and repo == rnhf.kernel_mapping()[name]["cuda"]
    assert {d for by_device in rnhf.kernel_mapping("cpu").values() for d in by_device} == {"cpu"}
    assert {d for by_device in rnhf.kernel_mapping("cuda").values() for d in by_device} == {"cuda"}


def test_a_bad_device_is_named():
    with pytest.raises(ValueError, match=r"^device must be 'cuda', 'cpu' or None, got 'mps'"):
        rnhf.kernel_mapping("mps")
    with pytest.raises(TypeError, match=r"^device must be 'cuda', 'cpu' or None, got int"):
        rnhf.kernel_mapping(0)
    with pytest.raises(TypeError, match=r"^device must be .*, got list"):
        rnhf.kernelize(nn.Linear(2, 2), device=["cpu"])


@pytest.mark.parametrize("name", ["RMSNorm", "RMSNormGated", "RMSNormZeroCentered"])
def test_the_layers_keep_kernels_contract(name):
    layer = getattr(rnhf, name)
    assert issubclass(layer, nn.Module) and layer.__init__ is nn.Module.__init__
    extra = {m for m, _ in inspect.getmembers(layer)} - {m for m, _ in inspect.getmembers(nn.Module)}
    assert extra == {"can_torch_compile", "has_backward"}
    assert layer.can_torch_compile is True and layer.has_backward is True


def test_a_bad_mode_is_named():
    with pytest.raises(ValueError, match=r"^mode must be one of 'inference', 'training', 'compile', "
                                         r"'training\+compile', got 'eval'"):
        rnhf.kernelize(nn.Linear(2, 2), mode="eval")
    with pytest.raises(TypeError, match=r"^mode must be one of .*, got Mode"):
        rnhf.kernelize(nn.Linear(2, 2), mode=kernels.Mode.INFERENCE)


def test_without_kernels_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "kernels", None)     # import kernels now raises ImportError
    for call in (rnhf.kernel_mapping, lambda: rnhf.kernelize(nn.Linear(2, 2))):
        with pytest.raises(ImportError, match=r"pip install kernels"):
            call()


# -- models -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_kernelized_logits_are_the_patched_ones(model_name, mode):
    build, expected = MODELS[model_name]
    original = build()
    ids = _ids()
    reference = _logits(original, ids)
    patched = _logits(_patched(copy.deepcopy(original)), ids)
    model = copy.deepcopy(original)
    assert rnhf.kernelize(model, mode=mode) is model
    _check_kernelized(model, expected)
    logits = _logits(model, ids)
    assert torch.equal(logits, patched)
    torch.testing.assert_close(logits.float(), reference.float(), **_floor(reference.dtype))
    if mode == "compile":
        graphs = []

        def record(gm, example_inputs):   # the graph as dynamo traced it, run as it is
            graphs.append(gm)
            return gm.forward

        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend=record)
        assert torch.equal(_logits(compiled, ids), logits)
        ops = [str(n.target) for g in graphs for n in g.graph.nodes if "cupy_rmsnorm" in str(n.target)]
        # each swapped module is one registered op in the graph
        assert len(ops) == len(_kernelized(model)), ops


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_training_mode_trains_the_norm_weights(model_name):
    build, expected = MODELS[model_name]
    original = build()
    ids = _ids()
    grads = []
    for model in (rnhf.kernelize(copy.deepcopy(original), mode="training"), _patched(copy.deepcopy(original))):
        model.train()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    norms = [f"{name}.weight" for name, m in original.named_modules() if type(m).__name__ in expected]
    assert norms
    for name in norms:
        grad = grads[0][name]
        assert grad is not None and bool(torch.isfinite(grad).all()) and bool(grad.abs().sum() > 0), name
    for name, grad in grads[0].items():     # the library's backward in both: the same bits everywhere
        assert torch.equal(grad, grads[1][name]), name


def test_training_and_compile_together():
    original = _llama()
    ids = _ids()
    model = rnhf.kernelize(copy.deepcopy(original), mode="training+compile").train()
    grads = []
    for run in (model, torch.compile(model, fullgraph=True, backend="aot_eager")):
        model.zero_grad()
        run(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        grads.append(model.model.norm.weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-2, atol=1e-2)
    assert bool(grads[0].abs().sum() > 0)


def test_plain_kernels_kernelize_with_the_mapping_finds_the_numerics_on_the_first_call():
    original = _llama()
    ids = _ids()
    model = copy.deepcopy(original)
    with kernels.use_kernel_mapping(rnhf.kernel_mapping("cpu"), inherit_mapping=False):
        kernels.kernelize(model, mode=kernels.Mode.INFERENCE, device="cpu")
    assert rnhf._FOUND not in model.model.norm.__dict__
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"numerics are not known yet .* cupy_rmsnorm\.hf\.kernelize"):
        _logits(torch.compile(model, fullgraph=True, backend="eager"), ids)
    torch._dynamo.reset()
    assert torch.equal(_logits(model, ids), _logits(_patched(copy.deepcopy(original)), ids))
    assert model.model.norm.__dict__[rnhf._FOUND][2] == LLAMA_STYLE
    # a new weight dtype: found again
    model.to(torch.float32)
    assert torch.equal(_logits(model, ids), _logits(_patched(copy.deepcopy(original).to(torch.float32)), ids))
    assert model.model.norm.__dict__[rnhf._FOUND][0] == torch.float32


def test_a_module_of_another_formula_keeps_its_own_forward():
    from kernels import use_kernel_forward_from_hub

    @use_kernel_forward_from_hub("RMSNorm")
    class CenteredNorm(nn.Module):       # a layer norm that calls itself RMSNorm
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.rand(32) + 0.5)
            self.variance_epsilon = EPS

        def forward(self, hidden_states):
            h = hidden_states - hidden_states.mean(-1, keepdim=True)
            return self.weight * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)

    model = nn.Sequential(CenteredNorm())
    x = torch.randn(3, 32)
    want = model(x)
    with pytest.warns(UserWarning, match=r"CenteredNorm keeps its own forward: it matches none"):
        rnhf.kernelize(model)
    assert torch.equal(model(x), want)


def test_unmapped_layers_are_not_reported(caplog):
    with caplog.at_level(logging.INFO), warnings.catch_warnings():
        warnings.simplefilter("error")
        rnhf.kernelize(_llama())
    assert not [r for r in caplog.records if "No kernel mapping found" in r.getMessage()]
