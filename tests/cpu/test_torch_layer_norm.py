"""The LayerNorm family through torch on the CPU: tensors give the NumPy path's bits, the ops'
autograd against float64, torch.compile (fullgraph), the drop-in module and the Hugging Face
patch of vision and audio encoders."""

import pytest

torch = pytest.importorskip("torch", reason="LayerNorm torch tests: torch is not installed")
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from helpers import cpu_tensor_to_numpy  # noqa: E402

import cupy_rmsnorm as rn  # noqa: E402
import cupy_rmsnorm.torch as rnt  # noqa: E402

F = torch.nn.functional
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _randn(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _equal(t, a):
    """A CPU tensor and a NumPy array hold the same bits."""
    return np.array_equal(cpu_tensor_to_numpy(t).view(np.uint8), np.ascontiguousarray(a).view(np.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("params", ["none", "same", "float32"])
def test_cpu_tensors_give_the_numpy_bits(dtype, params):
    x = _randn(4, 6, 96, dtype=dtype)[:, 1:5]                   # strided rows
    r = _randn(4, 4, 96, dtype=dtype, seed=1)
    pdtype = dtype if params == "same" else torch.float32
    w = None if params == "none" else _randn(96, dtype=pdtype, seed=2)
    b = None if params == "none" else _randn(96, dtype=pdtype, seed=3)
    shift, scale = _randn(4, 1, 96, dtype=dtype, seed=4), _randn(4, 1, 96, dtype=dtype, seed=5)
    n = cpu_tensor_to_numpy
    assert _equal(rn.layer_norm(x, w, b), rn.layer_norm(n(x), n(w), n(b)))
    y, s = rn.fused_add_layer_norm(x, r, w, b)
    y_np, s_np = rn.fused_add_layer_norm(n(x), n(r), n(w), n(b))
    assert _equal(y, y_np) and _equal(s, s_np)
    got = rn.layer_norm_modulate(x, shift, scale, weight=w, bias=b)
    assert _equal(got, rn.layer_norm_modulate(n(x), n(shift), n(scale), weight=n(w), bias=n(b)))
    dy = _randn(4, 4, 96, dtype=dtype, seed=6)
    for a, c in zip(rn.layer_norm_modulate_backward(dy, x, shift, scale, weight=w, bias=b),
                    rn.layer_norm_modulate_backward(n(dy), n(x), n(shift), n(scale), weight=n(w), bias=n(b))):
        assert (a is None) == (c is None) and (a is None or _equal(a, c))


def test_in_place_forms_write_the_callers_tensors():
    x, r, w = _randn(3, 64, dtype=torch.bfloat16), _randn(3, 64, dtype=torch.bfloat16, seed=1), _randn(64, seed=2)
    want_y, want_s = rn.fused_add_layer_norm(x, r, w)
    got = rn.fused_add_layer_norm(x, r, w, out=x, residual_out=r)
    assert got[0] is x and got[1] is r and torch.equal(x, want_y) and torch.equal(r, want_s)
    x2, shift, scale = _randn(2, 3, 64), _randn(2, 1, 64, seed=3), _randn(2, 1, 64, seed=4)
    want = rn.layer_norm_modulate(x2, shift, scale)
    assert rn.layer_norm_modulate(x2, shift, scale, out=x2) is x2 and torch.equal(x2, want)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
@pytest.mark.parametrize("hidden", (64, 255, 768, 1152, 1280))
def test_within_one_unit_of_torch_layer_norm(dtype, hidden):
    """16-bit inputs: float32 statistics and one rounding, as F.layer_norm; the summation order
    differs, so an element may round the other way: within one unit, and mostly equal."""
    x = _randn(64, hidden, dtype=dtype) * 3 + 1
    w, b = _randn(hidden, dtype=dtype, seed=1), _randn(hidden, dtype=dtype, seed=2)
    ours = rn.layer_norm(x, w, b).float()
    theirs = F.layer_norm(x, (hidden,), w, b, 1e-5).float()
    unit = torch.finfo(dtype).eps * torch.maximum(ours.abs(), theirs.abs()).clamp_min(torch.finfo(dtype).tiny)
    assert ((ours - theirs).abs() <= unit).all()
    assert (ours == theirs).float().mean() > 0.97


def _float64_layer_norm(x, w, b, eps):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    y = (x - mean) / torch.sqrt(var + eps)
    return y * (1 if w is None else w) + (0 if b is None else b)


@pytest.mark.parametrize("form", ["plain", "fused", "modulate"])
def test_gradients_match_float64_autograd(form):
    x = _randn(4, 5, 96, seed=1).requires_grad_()
    r = _randn(4, 5, 96, seed=2).requires_grad_()
    w, b = (_randn(96, seed=3) + 1).requires_grad_(), _randn(96, seed=4).requires_grad_()
    shift, scale = _randn(4, 1, 96, seed=5).requires_grad_(), _randn(4, 1, 96, seed=6).requires_grad_()
    dy = _randn(4, 5, 96, seed=7)
    leaves = {"plain": (x, w, b), "fused": (x, r, w, b), "modulate": (x, shift, scale, w, b)}[form]
    if form == "plain":
        y = rn.layer_norm(x, w, b)
    elif form == "fused":
        y, s = rn.fused_add_layer_norm(x, r, w, b)
        y = y + 0.5 * s
    else:
        y = rn.layer_norm_modulate(x, shift, scale, eps=1e-5, weight=w, bias=b)
    (y * dy).sum().backward()
    twins = [t.detach().double().requires_grad_() for t in leaves]
    if form == "plain":
        z = _float64_layer_norm(twins[0], twins[1], twins[2], 1e-5)
    elif form == "fused":
        summed = twins[0] + twins[1]
        z = _float64_layer_norm(summed, twins[2], twins[3], 1e-5) + 0.5 * summed
    else:
        z = _float64_layer_norm(twins[0], twins[3], twins[4], 1e-5) * (1 + twins[2]) + twins[1]
    (z * dy.double()).sum().backward()
    for ours, theirs in zip(leaves, twins):
        torch.testing.assert_close(ours.grad.double(), theirs.grad, rtol=1e-4, atol=1e-4)


def test_backward_bits_are_the_same_every_run():
    x, dy, w, b = _randn(257, 384), _randn(257, 384, seed=1), _randn(384, seed=2), _randn(384, seed=3)
    first = rn.layer_norm_backward(dy, x, w, b)
    again = rn.layer_norm_backward(dy, x, w, b)
    assert all(torch.equal(a, c) for a, c in zip(first, again))


def test_compiled_module_and_modulate_match_eager():
    norm = rnt.LayerNorm(128, dtype=torch.bfloat16)
    x, shift, scale = (_randn(6, 128, dtype=torch.bfloat16), _randn(2, 1, 128, dtype=torch.bfloat16, seed=1),
                       _randn(2, 1, 128, dtype=torch.bfloat16, seed=2))

    def block(x, shift, scale):
        return rn.layer_norm_modulate(norm(x).view(2, 3, 128), shift, scale) * 2

    with torch.no_grad():
        got = torch.compile(block, fullgraph=True)(x, shift, scale)
    assert torch.equal(got, block(x, shift, scale))


def test_module_is_a_drop_in_for_torch_layer_norm():
    theirs = torch.nn.LayerNorm(48, eps=1e-6)
    with torch.no_grad():
        theirs.weight.normal_()
        theirs.bias.normal_()
    ours = rnt.LayerNorm(48, eps=1e-6)
    assert list(ours.state_dict()) == list(theirs.state_dict()) == ["weight", "bias"]
    ours.load_state_dict(theirs.state_dict())
    x = _randn(5, 48)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
    assert list(rnt.LayerNorm(48, bias=False).state_dict()) == ["weight"]
    assert list(rnt.LayerNorm(48, elementwise_affine=False).state_dict()) == []
    with pytest.raises(ValueError, match="normalized_shape must be one trailing axis"):
        rnt.LayerNorm((4, 48))
    ours(x).square().sum().backward()
    assert ours.weight.grad is not None and ours.bias.grad is not None


def _patched_twins(model):
    import copy
    patched = copy.deepcopy(model)
    n = rnt.patch_hf_rmsnorm(patched, layer_norm=True)
    assert n == sum(type(m) is torch.nn.LayerNorm for m in model.modules()) > 0
    assert not any(type(m) is torch.nn.LayerNorm for m in patched.modules())
    return patched


def test_siglip_vision_tower_patched():
    transformers = pytest.importorskip("transformers", reason="SigLIP check: transformers is not installed")
    config = transformers.SiglipVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, image_size=32, patch_size=8)
    torch.manual_seed(0)
    model = transformers.SiglipVisionModel(config).eval()
    patched = _patched_twins(model)
    pixels = _randn(2, 3, 32, 32)
    with torch.no_grad():
        before, after = model(pixel_values=pixels).last_hidden_state, patched(pixel_values=pixels).last_hidden_state
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    for m in (model, patched):                 # a training step: the same norms get gradients
        m.train()
        m(pixel_values=pixels).last_hidden_state.square().mean().backward()
    hf = [m for m in model.modules() if type(m) is torch.nn.LayerNorm]
    ours = [m for m in patched.modules() if isinstance(m, rnt.LayerNorm)]
    assert [m.weight.grad is None for m in hf] == [m.weight.grad is None for m in ours]
    for a, c in zip(hf, ours):
        if a.weight.grad is not None:
            torch.testing.assert_close(c.weight.grad, a.weight.grad, rtol=1e-3, atol=1e-5)
            torch.testing.assert_close(c.bias.grad, a.bias.grad, rtol=1e-3, atol=1e-5)


def test_whisper_encoder_patched_in_bfloat16():
    transformers = pytest.importorskip("transformers", reason="Whisper check: transformers is not installed")
    config = transformers.WhisperConfig(d_model=64, encoder_layers=2, encoder_attention_heads=4, decoder_layers=1,
                                        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                                        num_mel_bins=16, max_source_positions=32, vocab_size=100, pad_token_id=0,
                                        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    torch.manual_seed(0)
    encoder = transformers.WhisperModel(config).get_encoder().eval()
    reference = encoder.float()
    features = _randn(1, 16, 64)
    with torch.no_grad():
        exact = reference(features).last_hidden_state
    model = encoder.to(torch.bfloat16)
    patched = _patched_twins(model)
    with torch.no_grad():
        hf = model(features.bfloat16()).last_hidden_state.float()
        ours = patched(features.bfloat16()).last_hidden_state.float()
    # within bfloat16's own distance from the float32 model
    floor = (hf - exact).abs().max().item()
    assert (ours - exact).abs().max().item() <= 2 * floor + 1e-2


def test_references_are_public():
    for name in ("layer_norm_reference", "fused_add_layer_norm_reference", "layer_norm_modulate_reference",
                 "layer_norm_backward_reference", "fused_add_layer_norm_backward_reference",
                 "layer_norm_modulate_backward_reference"):
        assert callable(getattr(rn, name))
    assert np.dtype(ml_dtypes.bfloat16)
