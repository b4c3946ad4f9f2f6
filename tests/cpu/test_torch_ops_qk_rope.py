"""QK norm + RoPE's registered torch ops and the Hugging Face patch on the CPU: the schemas, the
fake implementations (shapes, dtypes, the real path's checks), public calls traced as one op
under torch.compile(fullgraph=True), autograd through the ops (CPU kernels registered for the
test run the library's NumPy path) against float64 autograd, a compiled forward + backward with
one backward op, torch.library.opcheck, and ``fuse_qk_rope``'s detection and rewrite of a tiny
random Qwen3 / Qwen3-MoE built on the CPU (patch_hf_rmsnorm itself needs CUDA: the norms are
swapped here as it swaps them). The GPU side is tests/gpu/test_torch_qk_rope_gpu.py."""

import importlib.util
import warnings

import pytest
from helpers import cpu_kernels_of_the_ops, op_calls, tiny_qwen3, trace_graphs
from helpers import cpu_tensor_to_numpy as to_numpy
from helpers import numpy_to_cpu_tensor as to_torch

torch = pytest.importorskip("torch", reason="torch op tests: torch is not installed")

import cupy_rmsnorm as rn  # noqa: E402
import cupy_rmsnorm.torch as rnt  # noqa: E402
from cupy_rmsnorm.bench.serving import cache_keyword  # noqa: E402
from cupy_rmsnorm.torch import _fuse_qk_rope, _fuse_residuals, _qk_rope_rewrite  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

OPS = torch.ops.cupy_rmsnorm
ARGS = ("Tensor? q_weight, Tensor? k_weight, Tensor? cos, Tensor? sin, Tensor? positions, Tensor? cos_sin_cache, "
        "float eps, float weight_offset, str casting_mode, SymInt? rotary_dim, bool is_neox")
SCHEMAS = {
    "qk_norm_rope": f"cupy_rmsnorm::qk_norm_rope(Tensor q, Tensor k, {ARGS}) -> (Tensor, Tensor)",
    "qk_norm_rope_inplace": f"cupy_rmsnorm::qk_norm_rope_inplace(Tensor(a0!) q, Tensor(a1!) k, {ARGS}) -> ()",
    "qk_norm_rope_backward": f"cupy_rmsnorm::qk_norm_rope_backward(Tensor dq_out, Tensor dk_out, Tensor q, Tensor k, "
                             f"{ARGS}, bool weight_grad) -> (Tensor, Tensor, Tensor, Tensor)",
}
requires_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                           reason="Qwen3 patch check: transformers is not installed")
if importlib.util.find_spec("transformers") is not None:
    from typing import Callable
    # what the module defining an attention class of the older form holds (fuse_qk_rope reads them there)
    from transformers.models.qwen3.modeling_qwen3 import (  # noqa: F401, E402
        ALL_ATTENTION_FUNCTIONS, Qwen3Attention, apply_rotary_pos_emb, eager_attention_forward, rotate_half)

    class OlderQwen3Attention(Qwen3Attention):
        """Qwen3's attention as transformers wrote it before 5.24: the cache is passed as
        past_key_values and updated without the call's keyword arguments."""

        def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
            input_shape = hidden_states.shape[:-1]
            hidden_shape = (*input_shape, -1, self.head_dim)

            query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
            key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
            value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

            cos, sin = position_embeddings
            query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

            if past_key_values is not None:
                key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

            attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
                self.config._attn_implementation, eager_attention_forward
            )

            attn_output, attn_weights = attention_interface(
                self,
                query_states,
                key_states,
                value_states,
                attention_mask,
                dropout=0.0 if not self.training else self.attention_dropout,
                scaling=self.scaling,
                sliding_window=self.sliding_window,
                **kwargs,
            )

            attn_output = attn_output.reshape(*input_shape, -1).contiguous()
            attn_output = self.o_proj(attn_output)
            return attn_output, attn_weights
T, HQ, HK, D = 5, 4, 2, 32


CALLS = []      # which CPU kernels ran


@pytest.fixture(scope="module", autouse=True)
def cpu_kernels():
    """CPU kernels of the three ops that run the library's NumPy path (the reference)."""
    def angles(cos, sin, positions, cache):
        return dict(cos=to_numpy(cos), sin=to_numpy(sin), positions=to_numpy(positions),
                    cos_sin_cache=to_numpy(cache))

    def forward(q, k, qw, kw, cos, sin, positions, cache, eps, off, mode, rotary_dim, is_neox):
        CALLS.append("qk_norm_rope")
        q_out, k_out = rn.qk_norm_rope(to_numpy(q), to_numpy(k), to_numpy(qw), to_numpy(kw), eps,
                                       rotary_dim=rotary_dim, is_neox=is_neox, weight_offset=off, casting_mode=mode,
                                       **angles(cos, sin, positions, cache))
        return to_torch(q_out), to_torch(k_out)

    def in_place(q, k, *args):
        CALLS.append("qk_norm_rope_inplace")
        q_out, k_out = forward(q, k, *args)
        CALLS.pop()
        q.copy_(q_out)
        k.copy_(k_out)

    def backward(dq_out, dk_out, q, k, qw, kw, cos, sin, positions, cache, eps, off, mode, rotary_dim, is_neox,
                 weight_grad):
        CALLS.append("qk_norm_rope_backward")
        dq, dk, dqw, dkw = rn.qk_norm_rope_backward(to_numpy(dq_out), to_numpy(dk_out), to_numpy(q), to_numpy(k),
                                                    to_numpy(qw), to_numpy(kw), eps, rotary_dim=rotary_dim,
                                                    is_neox=is_neox, weight_offset=off, casting_mode=mode,
                                                    **angles(cos, sin, positions, cache))
        if qw is None or not weight_grad:
            return to_torch(dq), to_torch(dk), q.new_empty(0), q.new_empty(0)
        return to_torch(dq), to_torch(dk), to_torch(dqw), to_torch(dkw)

    with cpu_kernels_of_the_ops({"qk_norm_rope": forward, "qk_norm_rope_inplace": in_place,
                                 "qk_norm_rope_backward": backward}):
        yield


def hf_angles(tokens, rotary_dim, base=10000.0, dtype=torch.float32):
    """transformers' (tokens, rotary_dim) cos and sin, the halves duplicated (NeoX)."""
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    freqs = torch.arange(tokens, dtype=torch.float64)[:, None] * inv_freq
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def inputs(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, HQ, D, generator=gen).to(dtype)
    k = torch.randn(T, HK, D, generator=gen).to(dtype)
    qw = (1 + 0.2 * torch.randn(D, generator=gen)).to(dtype)
    kw = (1 + 0.2 * torch.randn(D, generator=gen)).to(dtype)
    return q, k, qw, kw


def leaf(t):
    return t.detach().clone().requires_grad_(True)


def f64_qk_norm_rope(q, k, qw, kw, cos, sin, eps, off):
    """The fp32-mode contract in float64 with transformers' rotate_half, for torch's autograd."""
    def one(x, w):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (w + off)
        r = cos.shape[-1]
        rot, rest = y[..., :r], y[..., r:]
        half = torch.cat([-rot[..., r // 2:], rot[..., :r // 2]], -1)
        return torch.cat([rot * cos[:, None] + half * sin[:, None], rest], -1)
    return one(q, qw), one(k, kw)


# -- schemas and fakes ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schema(name):
    assert str(getattr(OPS, name).default._schema) == SCHEMAS[name]


def test_fake_implementations_give_shapes_and_dtypes():
    with FakeTensorMode():
        qkv = torch.empty(3, 7, (HQ + 2 * HK) * D, dtype=torch.bfloat16)
        q = qkv[..., :HQ * D].view(3, 7, HQ, D)            # per-head views of a packed projection
        k = qkv[..., HQ * D:(HQ + HK) * D].view(3, 7, HK, D)
        w = torch.empty(D, dtype=torch.float32)
        cos = torch.empty(3, 7, D)
        q_out, k_out = OPS.qk_norm_rope(q, k, w, w, cos, cos, None, None, 1e-6, 0.0, "llama", None, True)
        assert q_out.shape == q.shape and k_out.shape == k.shape and q_out.dtype == k_out.dtype == torch.bfloat16
        assert q_out.is_contiguous() and k_out.is_contiguous()
        cache, pos = torch.empty(64, D // 2), torch.empty(3, 7, dtype=torch.int64)
        q_out, _ = OPS.qk_norm_rope(q, k, None, None, None, None, pos, cache, 1e-6, 0.0, "fp32", D // 2, False)
        assert q_out.shape == q.shape
        assert OPS.qk_norm_rope_inplace(q, k, w, w, cos, cos, None, None, 1e-6, 0.0, "fp32", None, True) is None
        dq, dk, dqw, dkw = OPS.qk_norm_rope_backward(q, k, q, k, w, w, cos, cos, None, None, 1e-6, 0.0, "fp32", None,
                                                     True, True)
        assert dq.shape == q.shape and dk.shape == k.shape and dq.is_contiguous()
        assert dqw.shape == dkw.shape == (D,) and dqw.dtype == torch.float32
        _, _, dqw, dkw = OPS.qk_norm_rope_backward(q, k, q, k, w, w, cos, cos, None, None, 1e-6, 0.0, "fp32", None,
                                                   True, False)
        assert dqw.shape == dkw.shape == (0,)


def test_fake_implementations_check_like_the_real_path():
    with FakeTensorMode():
        q, k = torch.empty(T, HQ, D, dtype=torch.float16), torch.empty(T, HK, D, dtype=torch.float16)
        cos = torch.empty(T, D)
        args = (1e-6, 0.0, "fp32", None, True)
        with pytest.raises(TypeError, match=r"^k must have q's dtype float16"):
            OPS.qk_norm_rope(q, k.float(), None, None, cos, cos, None, None, *args)
        with pytest.raises(ValueError, match=r"^q_weight must have shape \(32,\)"):
            OPS.qk_norm_rope(q, k, q[0, 0, :16], k[0, 0, :16], cos, cos, None, None, *args)
        with pytest.raises(ValueError, match=r"^pass cos and sin, or positions and cos_sin_cache, not both"):
            OPS.qk_norm_rope(q, k, None, None, cos, cos, torch.empty(T, dtype=torch.int32), cos, *args)
        with pytest.raises(ValueError, match=r"^rotary_dim 64 is more than head_dim 32"):
            OPS.qk_norm_rope(q, k, None, None, torch.empty(T, 64), torch.empty(T, 64), None, None,
                             1e-6, 0.0, "fp32", 64, True)
        with pytest.raises(ValueError, match=r"^dk_out must have k's shape"):
            OPS.qk_norm_rope_backward(q, q, q, k, None, None, cos, cos, None, None, *args, True)


# -- public calls under torch.compile ---------------------------------------------------------------

@pytest.mark.parametrize("case", ["out of place", "in place", "out=", "cache", "backward"])
def test_public_functions_trace_as_one_op(case):
    q, k, qw, kw = inputs()
    cos, sin = hf_angles(T, D)

    def fn(q, k, qw, kw, cos, sin):
        if case == "out of place":
            q_out, k_out = rn.qk_norm_rope(q, k, qw, kw, cos=cos, sin=sin, casting_mode="llama")
            return q_out * 2, k_out
        if case == "in place":
            return rn.qk_norm_rope(q, k, qw, kw, cos=cos, sin=sin, out_q=q, out_k=k)
        if case == "out=":
            return rn.qk_norm_rope(q, k, qw, kw, cos=cos, sin=sin, out_q=torch.empty_like(q),
                                   out_k=torch.empty_like(k))
        if case == "cache":
            cache = torch.cat([cos[:, :D // 2], sin[:, :D // 2]], -1)
            return rn.qk_norm_rope(q, k, qw, kw, positions=torch.arange(T), cos_sin_cache=cache)
        return rn.qk_norm_rope_backward(q, k, q, k, qw, kw, cos=cos, sin=sin)

    with torch.no_grad():
        calls = op_calls(trace_graphs(fn, q, k, qw, kw, cos, sin))
    want = {"in place": "qk_norm_rope_inplace", "backward": "qk_norm_rope_backward"}.get(case, "qk_norm_rope")
    assert calls == [f"cupy_rmsnorm.{want}.default"], calls


def test_traced_arguments_are_checked_at_trace_time():
    q, k, qw, kw = inputs()
    cos, sin = hf_angles(T, D)
    with pytest.raises(Exception, match="is_neox must be a bool"):
        trace_graphs(lambda q, k: rn.qk_norm_rope(q, k, qw, kw, cos=cos, sin=sin, is_neox=1), q, k)


# -- autograd ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("weights", ["none", "same", "float32"])
def test_gradients_match_float64_autograd(weights):
    q, k, qw, kw = inputs(seed=1)
    if weights == "none":
        qw = kw = None
    off = 0.0 if qw is None else 0.25
    cos, sin = hf_angles(T, D // 2)                 # partial rotary: half of each head turns
    dq_out, dk_out = torch.randn(T, HQ, D), torch.randn(T, HK, D)
    qg, kg = leaf(q), leaf(k)
    qwg, kwg = (None, None) if qw is None else (leaf(qw), leaf(kw))
    CALLS.clear()
    q_out, k_out = rn.qk_norm_rope(qg, kg, qwg, kwg, 1e-5, cos=cos, sin=sin, weight_offset=off)
    assert q_out.grad_fn is not None, "the call was not recorded by autograd"
    ((q_out * dq_out).sum() + (k_out * dk_out).sum()).backward()
    assert CALLS == ["qk_norm_rope", "qk_norm_rope_backward"]
    q64, k64 = leaf(q.double()), leaf(k.double())
    qw64, kw64 = (None, None) if qw is None else (leaf(qw.double()), leaf(kw.double()))
    r64 = f64_qk_norm_rope(q64, k64, 0.0 if qw64 is None else qw64, 0.0 if kw64 is None else kw64, cos.double(),
                           sin.double(), 1e-5, 1.0 if qw is None else off)
    torch.testing.assert_close(q_out.double(), r64[0].detach(), rtol=1e-5, atol=1e-6)
    ((r64[0] * dq_out.double()).sum() + (r64[1] * dk_out.double()).sum()).backward()
    torch.testing.assert_close(qg.grad.double(), q64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kg.grad.double(), k64.grad, rtol=1e-5, atol=1e-5)
    if qw is not None:
        assert qwg.grad.dtype == qw.dtype
        torch.testing.assert_close(qwg.grad.double(), qw64.grad, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(kwg.grad.double(), kw64.grad, rtol=1e-5, atol=1e-4)


def test_one_output_used_and_weights_without_grad():
    q, k, qw, kw = inputs(seed=2)
    cos, sin = hf_angles(T, D)
    qg = leaf(q)
    q_out, _ = rn.qk_norm_rope(qg, k, qw, kw, cos=cos, sin=sin)
    q_out.sum().backward()                 # k's output unused: its gradient is zero
    assert qg.grad is not None and qg.grad.shape == q.shape


def test_in_place_is_forward_only_and_the_angles_get_no_gradient():
    q, k, qw, kw = inputs()
    cos, sin = hf_angles(T, D)
    with pytest.raises(RuntimeError, match="forward-only"):
        rn.qk_norm_rope(q, k, leaf(qw), kw, cos=cos, sin=sin, out_q=q, out_k=k)
    with pytest.raises(ValueError, match=r"^cos requires grad, and qk_norm_rope has no gradient for the angles"):
        rn.qk_norm_rope(leaf(q), k, qw, kw, cos=leaf(cos), sin=sin)


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
    q, k, qw, kw = inputs(seed=3)
    cos, sin = hf_angles(T, D)

    def step(q, k, qw, kw):
        q_out, k_out = rn.qk_norm_rope(q * 2, k, qw, kw, cos=cos, sin=sin, casting_mode="llama")
        return (q_out.square().sum(-1) * k_out.sum((-1, -2))[:, None]).sum()

    grads = []
    torch._dynamo.reset()
    for run in (step, torch.compile(step, fullgraph=True, backend=backend)):
        leaves = [leaf(t) for t in (q, k, qw, kw)]
        run(*leaves).backward()
        grads.append([t.grad for t in leaves])
    for eager, compiled in zip(*grads):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
    ours = [str(n.target) for g in graphs["backward"] for n in g.graph.nodes
            if n.op == "call_function" and "cupy_rmsnorm" in str(n.target)]
    assert ours == ["cupy_rmsnorm.qk_norm_rope_backward.default"], ours


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_on_cpu(dtype):
    q, k, qw, kw = inputs(dtype, seed=4)
    cos, sin = hf_angles(T, D)
    q, k, qw, kw = (t.requires_grad_() for t in (q, k, qw, kw))
    args = (qw, kw, cos, sin, None, None, 1e-6, 0.0, "llama", None, True)
    torch.library.opcheck(OPS.qk_norm_rope.default, (q, k) + args)
    cache = torch.cat([cos[:, :D // 2], sin[:, :D // 2]], -1)
    torch.library.opcheck(OPS.qk_norm_rope.default,
                          (q, k, None, None, None, None, torch.arange(T), cache, 1e-6, 0.0, "fp32", None, False))
    detached = [t.detach().clone() for t in (q, k)]
    torch.library.opcheck(OPS.qk_norm_rope_inplace.default, tuple(detached) + (qw.detach(), kw.detach()) + args[2:])
    dq_out, dk_out = torch.randn(T, HQ, D).to(dtype), torch.randn(T, HK, D).to(dtype)
    torch.library.opcheck(OPS.qk_norm_rope_backward.default,
                          (dq_out, dk_out, q.detach(), k.detach(), qw.detach(), kw.detach()) + args[2:] + (True,))


# -- the Hugging Face patch: fuse_qk_rope -----------------------------------------------------------

def swap_norms(model, only=None):
    """Replace the model's Qwen3 RMSNorm modules (``only``: those whose name ends so) by this
    library's, sharing the weights, as patch_hf_rmsnorm leaves them (built here with fixed numerics)."""
    for name, module in list(model.named_modules()):
        if type(module).__name__.endswith("RMSNorm") and (only is None or name.endswith(only)):
            new = rnt.RMSNorm(module.weight.shape[0], module.variance_epsilon, casting_mode="llama", device="meta")
            new.weight = module.weight
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, new)
    return model


def cpu_qwen3(moe=False, layers=2, only=None):
    return swap_norms(tiny_qwen3(layers, hidden=64, vocab=100, head_dim=D, moe=moe, device="cpu", dtype="float32"),
                      only)


@requires_transformers
@pytest.mark.parametrize("moe", [False, True], ids=["qwen3", "qwen3_moe"])
def test_fuse_qk_rope_rewrites_each_attention_module(moe):
    model = cpu_qwen3(moe, layers=3)
    keys = list(model.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _fuse_qk_rope(model) == 3
    assert _fuse_qk_rope(model) == 0          # a second patch rewrites nothing
    assert list(model.state_dict()) == keys
    attn = model.model.layers[0].self_attn
    assert type(attn).__name__ == ("Qwen3MoeAttention" if moe else "Qwen3Attention")
    assert "forward" in vars(attn) and type(attn).forward is not attn.forward.__func__
    interfaces, eager, sliding, update_takes_kwargs = attn._cupy_rmsnorm_qk_rope
    assert callable(eager) and hasattr(interfaces, "get_interface") and sliding
    # transformers 5.24 on names the cache `cache` and passes the call's keywords to its update
    assert update_takes_kwargs is (cache_keyword(model) == "cache")
    with torch.no_grad():
        calls = op_calls(trace_graphs(lambda ids: model(input_ids=ids, use_cache=False).logits,
                                      torch.randint(3, 100, (2, 8))))
    plain, fused = "cupy_rmsnorm.rms_norm.default", "cupy_rmsnorm.qk_norm_rope.default"
    assert calls == [plain, fused, plain] * 3 + [plain], calls


@requires_transformers
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_rewritten_attention_traces_with_a_cache(cache):
    """The cache update as transformers writes it: prefill into a DynamicCache or a StaticCache
    traced whole (fullgraph), one qk_norm_rope per layer."""
    from transformers import DynamicCache, StaticCache
    model = cpu_qwen3(layers=2, only=("q_norm", "k_norm"))
    assert _fuse_qk_rope(model) == 2
    ids = torch.randint(3, 100, (1, 6))
    made = DynamicCache(config=model.config) if cache == "dynamic" else StaticCache(config=model.config,
                                                                                    max_cache_len=16)

    def run(ids):
        return model(input_ids=ids, use_cache=True, **{cache_keyword(model): made}).logits

    with torch.no_grad():
        calls = op_calls(trace_graphs(run, ids))
    assert calls == ["cupy_rmsnorm.qk_norm_rope.default"] * 2, calls


@requires_transformers
@pytest.mark.parametrize("moe", [False, True], ids=["qwen3", "qwen3_moe"])
def test_rewritten_model_matches_hugging_face(moe):
    """Eager, through the ops' CPU kernels (autograd records, so the registered op runs): float32
    logits within float32 noise of HF's own model, with and without a cache, and the same with
    fuse_residual too; gradients reach q_norm's and k_norm's weights."""
    from transformers import DynamicCache
    hf = tiny_qwen3(2, hidden=64, vocab=100, head_dim=D, moe=moe, device="cpu", dtype="float32")
    ours = swap_norms(tiny_qwen3(2, hidden=64, vocab=100, head_dim=D, moe=moe, device="cpu", dtype="float32"),
                      ("q_norm", "k_norm"))
    assert _fuse_qk_rope(ours) == 2
    ids = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(5))
    CALLS.clear()
    got = ours(input_ids=ids, use_cache=False).logits
    assert CALLS == ["qk_norm_rope"] * 2
    with torch.no_grad():
        want = hf(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got.detach(), want, rtol=1e-4, atol=1e-4)
    got.square().mean().backward()
    attn = ours.model.layers[0].self_attn
    assert attn.q_norm.weight.grad is not None and attn.k_norm.weight.grad is not None
    ours.zero_grad(set_to_none=True)
    hf_cache, our_cache = DynamicCache(config=hf.config), DynamicCache(config=ours.config)
    for step in (ids[:, :5], ids[:, 5:6], ids[:, 6:7]):          # prefill, then two decode steps
        with torch.no_grad():
            want = hf(input_ids=step, use_cache=True, **{cache_keyword(hf): hf_cache}).logits
        got = ours(input_ids=step, use_cache=True, **{cache_keyword(ours): our_cache}).logits
        torch.testing.assert_close(got.detach(), want, rtol=1e-4, atol=1e-4)


@requires_transformers
def test_the_older_form_of_the_attention_is_rewritten_too():
    """transformers before 5.24 (the cache as past_key_values, updated without the keyword
    arguments): rewritten, and a prefill then two decode steps through the cache give the
    outputs of the module's own forward."""
    from transformers import DynamicCache
    hf = tiny_qwen3(1, hidden=64, vocab=100, head_dim=D, device="cpu", dtype="float32")
    ours = swap_norms(tiny_qwen3(1, hidden=64, vocab=100, head_dim=D, device="cpu", dtype="float32"),
                      ("q_norm", "k_norm"))
    for model in (hf, ours):
        model.model.layers[0].self_attn.__class__ = OlderQwen3Attention
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _fuse_qk_rope(ours) == 1
    assert ours.model.layers[0].self_attn._cupy_rmsnorm_qk_rope[3] is False
    hidden = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(6))
    angles = hf.model.rotary_emb(hidden, torch.arange(7)[None].expand(2, 7))
    hf_cache, our_cache = DynamicCache(config=hf.config), DynamicCache(config=ours.config)
    CALLS.clear()
    for span in (slice(0, 5), slice(5, 6), slice(6, 7)):        # prefill, then two decode steps
        step = (hidden[:, span], tuple(a[:, span] for a in angles), None)
        with torch.no_grad():
            want = hf.model.layers[0].self_attn(*step, past_key_values=hf_cache)[0]
        got = ours.model.layers[0].self_attn(*step, past_key_values=our_cache)[0]   # recorded: the op runs
        torch.testing.assert_close(got.detach(), want, rtol=1e-4, atol=1e-4)
    assert our_cache.get_seq_length() == 7 and CALLS == ["qk_norm_rope"] * 3


@requires_transformers
def test_fuse_qk_rope_and_fuse_residual_together():
    model = cpu_qwen3(layers=2)
    assert _fuse_residuals(model) == 2 and _fuse_qk_rope(model) == 2
    with torch.no_grad():
        calls = op_calls(trace_graphs(lambda ids: model(input_ids=ids, use_cache=False).logits,
                                      torch.randint(3, 100, (1, 8))))
    plain, fused, qk = ("cupy_rmsnorm.rms_norm.default", "cupy_rmsnorm.fused_add_rms_norm.default",
                        "cupy_rmsnorm.qk_norm_rope.default")
    assert calls == [plain, qk, fused, fused, qk, fused, fused], calls


@requires_transformers
def test_other_structures_are_left_alone_with_a_warning():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

    # HF's own norms (patch_hf_rmsnorm did not replace them): nothing to fuse with
    model = tiny_qwen3(1, hidden=64, vocab=100, head_dim=D, device="cpu", dtype="float32")
    with pytest.warns(UserWarning, match=r"left model\.layers\.0\.self_attn \(Qwen3Attention\) as it is: .*"
                                         r"not both cupy_rmsnorm RMSNorm"):
        assert _fuse_qk_rope(model) == 0
    assert "forward" not in vars(model.model.layers[0].self_attn)

    class Rewritten(Qwen3Attention):    # the same children, another forward
        def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
            return super().forward(hidden_states, position_embeddings, attention_mask, **kwargs)

    model = cpu_qwen3(layers=1)
    attn = model.model.layers[0].self_attn
    attn.__class__ = Rewritten
    with pytest.warns(UserWarning, match="its forward is not written as Qwen3's"):
        assert _fuse_qk_rope(model) == 0
    attn.__class__ = Qwen3Attention
    attn.k_norm.casting_mode = "fp32"
    assert "differ in eps, weight offset, casting mode" in _qk_rope_rewrite(attn)


@requires_transformers
def test_models_without_qk_norm_are_untouched_silently():
    from helpers import tiny_llama
    model = tiny_llama(1, 64, vocab=100, device="cpu", dtype="float32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _fuse_qk_rope(model) == 0


def test_the_call_signature_tells_angles_that_need_a_gradient_apart():
    """A call repeated with only sin (or positions, or the cache) requiring grad must not reuse
    the cached call that skipped the check that angles need none."""
    from cupy_rmsnorm import _interop, _pipeline
    q, k, w = torch.randn(3, 2, 8), torch.randn(3, 1, 8), torch.ones(8)
    cos, sin = torch.randn(3, 8), torch.randn(3, 8)

    def sig(sin):
        arrays = (q, k, w, w, cos, sin, None, None, None, None)
        return _interop.signature_of(_pipeline.REGISTRY["qk_norm_rope"], arrays, (1e-6, 0.0, "fp32", 8, True))
    assert sig(sin) == sig(sin.clone()) and sig(sin) is not None
    assert sig(sin) != sig(sin.clone().requires_grad_())
    with torch.no_grad():
        assert sig(sin) == sig(sin.clone().requires_grad_())        # nothing records: the same call
