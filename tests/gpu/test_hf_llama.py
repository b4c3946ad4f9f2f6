"""patch_hf_rmsnorm on a real transformers LlamaForCausalLM, on the GPU.

A small randomly initialized model (nothing downloaded), bfloat16 on CUDA: the logits
with this library's norms must match the original LlamaRMSNorm modules within bfloat16
tolerance, and 32 greedily generated tokens must be identical. Skips with the reason
without a GPU, torch or transformers. ``pytest -rP tests/gpu/test_hf_llama.py`` shows the
measured differences.
"""

import importlib.util

import pytest

from helpers import EPS, TOL, requires_torch_gpu, tiny_llama

LAYERS, HIDDEN, HEADS, KV_HEADS, VOCAB = 4, 256, 4, 2, 1000
BATCH, PROMPT_LEN, NEW_TOKENS = 2, 16, 32
# Logits are bfloat16 (about 2^-8 relative) and of order one here; the patched norms
# round exactly like LlamaRMSNorm except for the float32 sum order, which flips a
# bfloat16 rounding now and then, so differences stay within a few bfloat16 ulps.
LOGITS_RTOL, LOGITS_ATOL = TOL["bfloat16"][0], 2e-2

requires_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                           reason="HF Llama check: transformers is not installed")
pytestmark = [requires_torch_gpu, requires_transformers]


def _tiny_llama():
    # random norm weights: the check then sees which rounding the patched modules use
    return tiny_llama(LAYERS, HIDDEN, VOCAB, HEADS, KV_HEADS)


def _first_divergence(a, b):
    """(batch row, step) of the first differing generated token, or None."""
    diff = (a != b).nonzero()
    if len(diff) == 0:
        return None
    step = int(diff[:, 1].min())
    row = int(diff[diff[:, 1] == step][0, 0])
    return row, step


def test_patched_llama_matches_logits_and_greedy_tokens(record_property):
    import torch

    import cupy_rmsnorm.torch as rnt

    model = _tiny_llama()
    gen = torch.Generator(device="cuda").manual_seed(1)
    prompt = torch.randint(3, VOCAB, (BATCH, PROMPT_LEN), generator=gen, device="cuda")
    mask = torch.ones_like(prompt)
    gen_kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS,
                      min_new_tokens=NEW_TOKENS, pad_token_id=0,
                      output_scores=True, return_dict_in_generate=True)

    originals = {name: m for name, m in model.named_modules() if type(m).__name__ == "LlamaRMSNorm"}
    assert len(originals) == 2 * LAYERS + 1
    with torch.no_grad():
        ref_logits = model(input_ids=prompt, attention_mask=mask).logits.float()
        ref = model.generate(prompt, **gen_kwargs)
    assert ref.sequences.shape == (BATCH, PROMPT_LEN + NEW_TOKENS)

    replaced = rnt.patch_hf_rmsnorm(model)
    assert replaced == 2 * LAYERS + 1
    for name, old in originals.items():
        new = model.get_submodule(name)
        assert isinstance(new, rnt.RMSNorm), f"{name} is still {type(new).__name__}"
        assert new.weight is old.weight, f"{name}: the weight Parameter was not shared"
        assert (new.casting_mode, new.weight_offset, new.eps) == ("llama", 0.0, EPS), name
    assert not any(type(m).__name__ == "LlamaRMSNorm" for m in model.modules())

    # Module by module, on the model's own activations' scale: bit-identical but for rare flips.
    with torch.no_grad():
        h = torch.randn(BATCH, PROMPT_LEN, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
        for name, old in originals.items():
            want, got = old(h), model.get_submodule(name)(h)
            assert got.dtype == want.dtype == torch.bfloat16
            differ = int((got != want).sum())
            assert differ <= max(2, want.numel() // 100), f"{name}: {differ} of {want.numel()} elements differ"

    with torch.no_grad():
        logits = model(input_ids=prompt, attention_mask=mask).logits.float()
        out = model.generate(prompt, **gen_kwargs)
    max_diff = (logits - ref_logits).abs().max().item()
    same = (logits == ref_logits).float().mean().item()
    print(f"logits: max abs diff {max_diff:.3e} (largest |logit| {ref_logits.abs().max().item():.3f}), "
          f"{same:.2%} bit-identical")
    record_property("logits_max_abs_diff", max_diff)
    record_property("logits_bit_identical_share", same)
    torch.testing.assert_close(logits, ref_logits, rtol=LOGITS_RTOL, atol=LOGITS_ATOL)

    where = _first_divergence(out.sequences, ref.sequences)
    if where is not None:
        row, pos = where
        step = pos - PROMPT_LEN
        top2 = ref.scores[step][row].float().topk(2).values
        pytest.fail(f"greedy tokens diverge at row {row}, generated token {step}: "
                    f"{out.sequences[row, pos].item()} vs {ref.sequences[row, pos].item()}; the original's "
                    f"top-two score gap there was {(top2[0] - top2[1]).item():.3e} (a near tie if ~1e-2 or less)")
    print(f"{NEW_TOKENS} greedy tokens identical for {BATCH} prompts")
