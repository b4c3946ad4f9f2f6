"""The registered torch ops on the GPU: opcheck, the direct paths' bits, torch.compile,
CUDA graphs and a compiled HF Llama. The CPU side (schemas, fake implementations,
tracing) is in tests/cpu/test_torch_ops.py. Skips with the reason where torch (or a GPU,
or transformers) is missing."""

import importlib.util

import pytest
from helpers import requires_torch_gpu, tiny_llama

torch = pytest.importorskip("torch", reason="torch op tests: torch is not installed")

import cupy_rmsnorm as rn  # noqa: E402
import cupy_rmsnorm.torch as rnt  # noqa: E402

OPS = torch.ops.cupy_rmsnorm
requires_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                           reason="HF Llama check: transformers is not installed")


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
