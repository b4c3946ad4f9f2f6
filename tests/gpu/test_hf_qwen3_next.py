"""patch_hf_rmsnorm on a small randomly initialized transformers Qwen3-Next model (Gated
DeltaNet layers with their gated norms, a full-attention layer, MoE), on the GPU: every
norm is replaced (the gated ones by RMSNormGated, reproducing HF's roundings), the logits
stay within the bfloat16 floor of HF's (the distance between HF's bfloat16 and float32
models), and a few AdamW steps give the same loss curve. ``pytest -rP`` prints the figures."""

import copy
import importlib.util
import traceback

import pytest
from helpers import torch_cuda_missing

reason = torch_cuda_missing() or (None if importlib.util.find_spec("transformers") else "transformers is not installed")
pytestmark = pytest.mark.skipif(reason is not None, reason=f"HF Qwen3-Next check: {reason}")

LAYERS, HIDDEN, VOCAB, BATCH, TOKENS, STEPS = 4, 256, 1000, 2, 32, 8


def tiny_qwen3_next(dtype):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3NextConfig
    torch.manual_seed(0)
    config = Qwen3NextConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=512, num_hidden_layers=LAYERS,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_key_head_dim=64,
                             linear_value_head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                             moe_intermediate_size=128, shared_expert_intermediate_size=128, num_experts=4,
                             num_experts_per_tok=2, max_position_embeddings=256, rms_norm_eps=1e-6)
    model = AutoModelForCausalLM.from_config(config).to(device="cuda", dtype=dtype)
    with torch.no_grad():        # weights away from their initial ones and zeros, where roundings show
        for m in model.modules():
            if type(m).__name__.endswith(("RMSNorm", "RMSNormGated")):
                m.weight.copy_(m.weight + 0.2 * torch.randn_like(m.weight))
    return model.eval()


def norms(model):
    return {name: m for name, m in model.named_modules() if type(m).__name__.endswith(("RMSNorm", "RMSNormGated"))}


def test_patched_qwen3_next_matches_logits_within_the_bf16_floor(record_property):
    import torch

    import cupy_rmsnorm.torch as rnt
    model = tiny_qwen3_next(torch.bfloat16)
    reference32 = copy.deepcopy(model).float()
    originals = norms(model)
    gated = {n for n, m in originals.items() if type(m).__name__.endswith("RMSNormGated")}
    assert gated, "the model has gated norms"
    prompt = torch.randint(3, VOCAB, (BATCH, TOKENS), generator=torch.Generator(device="cuda").manual_seed(1),
                           device="cuda")
    with torch.no_grad():
        hf = model(input_ids=prompt).logits.float()
        hf32 = reference32(input_ids=prompt).logits.float()
    replaced = rnt.patch_hf_rmsnorm(model)
    assert replaced == len(originals)
    for name, old in originals.items():
        new = model.get_submodule(name)
        assert isinstance(new, rnt.RMSNormGated if name in gated else rnt.RMSNorm), name
        assert new.weight is old.weight
        if name in gated:
            assert new.norm_before_gate and new.activation == "silu" and new.casting_mode == "llama", name
    with torch.no_grad():
        ours = model(input_ids=prompt).logits.float()
    floor = (hf - hf32).abs().max().item()
    diff = (ours - hf).abs().max().item()
    print(f"max |dlogit| ours vs HF bf16 {diff:.4f}; HF bf16 vs HF float32 (the floor) {floor:.4f}; "
          f"{(ours == hf).float().mean().item():.2%} identical")
    record_property("max_dlogit", diff)
    record_property("bf16_floor", floor)
    assert diff <= floor, "the patched model drifts further from HF than bfloat16 itself does"
    assert (ours.argmax(-1) == hf.argmax(-1)).float().mean().item() >= 0.95


def test_training_steps_give_the_same_loss_curve(record_property):
    import torch

    import cupy_rmsnorm.torch as rnt
    hf_model = tiny_qwen3_next(torch.bfloat16).train()
    our_model = copy.deepcopy(hf_model)
    assert rnt.patch_hf_rmsnorm(our_model) == len(norms(hf_model))
    gen = torch.Generator(device="cuda").manual_seed(2)
    batches = [torch.randint(3, VOCAB, (BATCH, TOKENS), generator=gen, device="cuda") for _ in range(STEPS)]
    curves = []
    for model in (hf_model, our_model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for tokens in batches:
            loss = model(input_ids=tokens, labels=tokens).loss
            try:
                loss.backward()
            except RuntimeError as e:      # transformers runs flash-linear-attention's kernels when installed
                if "/fla/" not in traceback.extract_tb(e.__traceback__)[-1].filename:
                    raise
                pytest.skip(f"flash-linear-attention's backward refuses this machine: {e}")
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        curves.append(losses)
    hf_losses, our_losses = curves
    worst = max(abs(a - b) / abs(b) for a, b in zip(our_losses, hf_losses))
    print("HF  ", " ".join(f"{v:.4f}" for v in hf_losses))
    print("ours", " ".join(f"{v:.4f}" for v in our_losses))
    record_property("loss_max_relative_difference", worst)
    assert hf_losses[-1] < hf_losses[0]           # the steps train
    assert worst <= 0.02, "loss curves differ by more than 2% at some step"
