"""cupy_rmsnorm.hf.kernelize on CUDA, under torch.compile(fullgraph=True): small random transformers
models (nothing downloaded) in bfloat16, kernelized in each mode, give the logits of a
``patch_hf_rmsnorm``'d copy of the same model compiled the same way, bit for bit, and in the
training modes the same loss and norm-weight gradients. Every norm module that transformers marks
for kernels must have been swapped to this library's layer (counted), so that no check passes on
the model's own norms.

Models: a Llama ("RMSNorm"), a Qwen3-Next of one linear-attention (Gated DeltaNet) and one
full-attention layer ("RMSNormGated"; its plain ``(1 + weight)`` Qwen3NextRMSNorm is not marked for
kernels by transformers 5.17 to 5.25, so kernelize leaves it to the module, and the reference
patches the gated norms alone) and, where transformers has it, a Qwen3.5 of the same shape
("RMSNormZeroCentered" and "RMSNormGated"). Skips with the reason without CUDA, transformers, the
kernels package (in the version window this transformers takes) or a model class.
``pytest -rP`` prints what was swapped.
"""

import copy
import importlib.metadata
import importlib.util

import pytest
from helpers import EPS, tiny_llama, torch_cuda_missing

DEVICE = "cuda"
VOCAB, BATCH, SEQ = 128, 2, 8
MODES = ("inference", "compile", "training", "training+compile")
TRAINING = {"training", "training+compile"}
# one layer of each kind: 64 wide, 16-channel heads (the CPU test's hybrid shape)
HYBRID = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 64,
          "rms_norm_eps": EPS, "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
          "linear_num_value_heads": 4, "layer_types": ["linear_attention", "full_attention"]}
LAYER_NAMES = ("RMSNorm", "RMSNormGated", "RMSNormZeroCentered")


def _missing():
    reason = torch_cuda_missing()
    if reason:
        return reason
    for package, hint in (("transformers", "pip install transformers"), ("kernels", "pip install kernels")):
        if importlib.util.find_spec(package) is None:
            return f"{package} is not installed ({hint})"
    import transformers
    from transformers.utils import is_kernels_available
    if not is_kernels_available():      # then transformers marks no module for kernels
        return (f"transformers {transformers.__version__} does not take kernels "
                f"{importlib.metadata.version('kernels')} (it accepts a version window of its own)")
    return None


reason = _missing()
pytestmark = pytest.mark.skipif(reason is not None, reason=f"HF kernelize GPU check: {reason}")


# -- the models ---------------------------------------------------------------------------------------
def _random_norm_weights(model):
    """Every norm's weight drawn around its start (one, or zero for (1 + weight) norms): the
    probe then has to find each module's rounding and offset."""
    import torch
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__.endswith(("RMSNorm", "RMSNormGated")):
                start = float(m.weight.detach().float().mean().round())
                m.weight.copy_(start + 0.3 * torch.randn_like(m.weight, dtype=torch.float32))
    return model


def _hybrid(config_name, model_name, **extra):
    import torch
    import transformers
    if not hasattr(transformers, config_name) or not hasattr(transformers, model_name):
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**HYBRID, **extra)
    model = getattr(transformers, model_name)(config).to(device=DEVICE, dtype=torch.bfloat16).eval()
    return _random_norm_weights(model)


def _llama():
    return tiny_llama(2, 64, VOCAB, device=DEVICE)       # bfloat16, norm weights drawn around one


def _qwen3_next():
    # dense MLPs (mlp_only_layers): the MoE's routing is not what is checked here
    return _hybrid("Qwen3NextConfig", "Qwen3NextForCausalLM", mlp_only_layers=[0, 1])


def _qwen3_5():
    return _hybrid("Qwen3_5TextConfig", "Qwen3_5ForCausalLM")


# model -> (builder, the kernels layer names its modules must carry, at least)
MODELS = {"llama": (_llama, {"RMSNorm"}), "qwen3_next": (_qwen3_next, {"RMSNormGated"}),
          "qwen3_5": (_qwen3_5, {"RMSNormZeroCentered", "RMSNormGated"})}


def _marked(model):
    """{path: kernels layer name} of the modules transformers marks with one of our layers' names."""
    return {path: type(m).kernel_layer_name for path, m in model.named_modules()
            if getattr(type(m), "kernel_layer_name", None) in LAYER_NAMES}


def _shared_weight_copy(model):
    """A copy of the module tree sharing every parameter and buffer with ``model``."""
    import itertools
    memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    return copy.deepcopy(model, memo)


def _patched(model, marked):
    """A weight-sharing copy with exactly the ``marked`` modules replaced by patch_hf_rmsnorm: the
    whole model where every candidate norm is marked, else each marked module's parent (which must
    hold no unmarked norm)."""
    import cupy_rmsnorm.torch as rnt
    model = _shared_weight_copy(model)
    norms = {path for path, m in model.named_modules() if type(m).__name__.endswith(("RMSNorm", "RMSNormGated"))}
    if norms == set(marked):
        assert rnt.patch_hf_rmsnorm(model) == len(marked)
        return model
    for path in marked:
        parent = model.get_submodule(path.rpartition(".")[0])
        inside = {f"{path.rpartition('.')[0]}.{p}" for p, m in parent.named_modules()
                  if type(m).__name__.endswith(("RMSNorm", "RMSNormGated"))}
        assert inside == {path}, f"{path}'s parent holds other norms: {sorted(inside)}"
        assert rnt.patch_hf_rmsnorm(parent) == 1, path
    return model


def _ours(model):
    """{path: layer class} of the modules whose forward is now one of cupy_rmsnorm.hf's layers'."""
    import cupy_rmsnorm.hf as rnhf
    layers = {getattr(rnhf, name).forward: getattr(rnhf, name) for name in LAYER_NAMES}
    found = {}
    for path, m in model.named_modules():
        bound = m.__dict__.get("forward")
        layer = layers.get(getattr(bound, "__func__", None))
        if layer is not None:
            found[path] = layer
    return found


def _ids():
    import torch
    return torch.randint(3, VOCAB, (BATCH, SEQ), generator=torch.Generator(device=DEVICE).manual_seed(1),
                         device=DEVICE)


def _eager_logits(model, ids):
    import torch
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def _run(model, ids, train):
    """(eager logits, compiled logits, {norm module path: its weight's gradient}) of ``model``: the
    compiled call in training mode with a loss and its gradients where ``train``."""
    import torch
    eager = _eager_logits(model, ids)
    compiled = torch.compile(model, fullgraph=True)
    return (eager, *_compiled_run(compiled, model, ids, train))


def _compiled_run(compiled, model, ids, train):
    import torch
    if not train:
        with torch.no_grad():
            return compiled(input_ids=ids, use_cache=False).logits, {}
    model.train()
    out = compiled(input_ids=ids, labels=ids, use_cache=False)
    weights = {path: m.weight for path, m in model.named_modules()
               if type(m).__name__.endswith(("RMSNorm", "RMSNormGated"))}
    grads = torch.autograd.grad(out.loss, list(weights.values()))     # no .grad: the weights are shared
    return out.logits.detach(), dict(zip(weights, grads))


_REFERENCE = {}


def _lift_recompile_limit():
    """Room for every copy's graphs (each copy is a Dynamo cache entry of the same code object)."""
    import torch._dynamo
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 64))
            break


def _reference(model_name, train):
    """(model, its marked modules, ids, the patched copy's compiled logits and gradients), once per
    model and train flag; Dynamo's cache is reset when the model changes (one entry per copy)."""
    import torch
    key = (model_name, train)
    if key not in _REFERENCE:
        if not any(k[0] == model_name for k in _REFERENCE):
            torch._dynamo.reset()
            _REFERENCE.clear()
            _lift_recompile_limit()
        build, layer_names = MODELS[model_name]
        model = build()
        marked = _marked(model)
        assert marked and layer_names <= set(marked.values()), \
            f"transformers marks {sorted(set(marked.values()))} in {model_name}, not {sorted(layer_names)}"
        ids = _ids()
        _REFERENCE[key] = (model, marked, ids, *_run(_patched(model, marked), ids, train))
    return _REFERENCE[key]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("model_name", list(MODELS))
def test_kernelized_and_compiled_gives_the_patched_models_bits(model_name, mode, record_property):
    import torch

    import cupy_rmsnorm.hf as rnhf
    train = mode in TRAINING
    model, marked, ids, want_eager, want_logits, want_grads = _reference(model_name, train)
    ours = _shared_weight_copy(model)
    assert rnhf.kernelize(ours, mode=mode) is ours
    swapped = _ours(ours)
    # every marked module swapped, to the layer of its name, numerics found; nothing else swapped
    assert set(swapped) == set(marked), (sorted(swapped), sorted(marked))
    for path, layer in swapped.items():
        assert layer is getattr(rnhf, marked[path]), path
        assert ours.get_submodule(path).__dict__[rnhf._FOUND][2] is not None, f"{path} kept its own forward"
    counts = {name: sum(v == name for v in marked.values()) for name in sorted(set(marked.values()))}
    print(f"{model_name} {mode}: swapped {len(swapped)} modules {counts}")
    record_property("swapped", len(swapped))

    eager, logits, grads = _run(ours, ids, train)
    assert logits.dtype == eager.dtype == torch.bfloat16
    assert torch.equal(eager, want_eager), "eager: the kernelized model's logits are not the patched one's"
    # the same registered op per norm in the same graph: Inductor makes the same code, so the same bits
    assert torch.equal(logits, want_logits), \
        f"max |dlogit| {(logits.float() - want_logits.float()).abs().max().item():.3g}"
    if train:
        assert set(grads) == set(want_grads) and grads
        for path, grad in grads.items():
            assert torch.equal(grad, want_grads[path]), path
        assert all(bool(grads[path].abs().sum() > 0) for path in marked), "a swapped norm's weight got no gradient"
