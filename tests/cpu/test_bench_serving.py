"""The serving measures of ``e2e`` on the CPU: what is measured, the interleaved rounds, the
summary and its ratios, and the decode step's static cache (the capture and the GPU timing
need a GPU)."""

import importlib.util

import pytest

from cupy_rmsnorm.bench import serving

requires_transformers = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None,
    reason="needs torch and transformers (not installed)")


def test_measures_are_each_step_form_and_batch_then_the_prefill():
    assert serving.measures(["eager", "compiled"], [1, 64], 2048) == [
        ("decode", "eager", 1), ("decode", "eager", 64), ("decode", "compiled", 1), ("decode", "compiled", 64),
        ("prefill", "eager", 1)]


def test_rounds_interleave_and_a_failing_timer_drops_out():
    calls = []

    def timer(name, fail_at=None):
        def run():
            calls.append(name)
            if len([c for c in calls if c == name]) == fail_at:
                raise RuntimeError("capture broke")
            return 10.0
        return run
    timers = {("decode", "eager", 1, "hf"): timer("a"), ("decode", "eager", 1, "ours"): timer("b", fail_at=2)}
    samples, errors, notes = serving.interleaved_rounds(timers, 3, log=lambda m: None)
    assert calls == ["a", "b", "a", "b", "a"]
    assert [s["round"] for s in samples] == [0, 0, 1, 2] and not notes
    assert errors == [{"where": "decode eager 1 ours round 1", "error": "capture broke"}]


def test_the_budget_stops_the_rounds():
    clock = iter([0.0, 12.0]).__next__          # round 1 would end at 24 s, past the deadline
    samples, _, notes = serving.interleaved_rounds({("prefill", "eager", 1, "hf"): lambda: 1.0}, 3,
                                                   log=lambda m: None, deadline=20.0, clock=clock)
    assert len(samples) == 1 and notes == ["serving: the time budget stopped the rounds after 1 of 3"]


def test_summary_ratios_to_hf_in_the_same_form_and_to_hf_compiled():
    samples = [{"key": ["decode", mode, 1, variant], "round": r, "us": us * (1 + r / 10)}
               for r in range(3)
               for mode, variant, us in (("eager", "hf", 100.0), ("eager", "ours", 80.0),
                                         ("compiled", "hf", 50.0), ("compiled", "ours", 40.0))]
    rows = serving.summarize(samples)
    assert [(r["mode"], r["variant"]) for r in rows] == [("eager", "hf"), ("eager", "ours"),
                                                         ("compiled", "hf"), ("compiled", "ours")]
    eager_ours, compiled_ours = rows[1], rows[3]
    assert {k: eager_ours["us"][k] for k in ("median", "min", "max", "n")} == {"median": 88.0, "min": 80.0, "max": 96.0,
                                                                         "n": 3}
    assert eager_ours["vs_hf"] == pytest.approx(0.8) and eager_ours["vs_hf_compiled"] == pytest.approx(1.6)
    assert compiled_ours["vs_hf"] == pytest.approx(0.8) and compiled_ours["vs_hf_compiled"] == pytest.approx(0.8)


@requires_transformers
def test_the_decode_step_writes_one_cache_slot_and_repeats_itself():
    """Every call after the first (the warm-up's, which sizes the cache) gives the same
    logits: the step sets the cache's write position back, so a replay repeats the same work."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=64)).eval()
    assert serving.cache_keyword(model) in ("cache", "past_key_values")
    step = serving.DecodeStep(model, batch=2, context=8).capture()
    with torch.no_grad():
        first, second = step(), step()
    assert first.shape == (2, 1, 100) and torch.equal(first, second) and torch.equal(first, step.logits)
    for layer in getattr(step.cache, "layers", ()):
        keys = layer.keys
        assert keys.shape[2] == 9 and not keys[:, :, :8].any() and keys[:, :, 8].any()
    assert step.time_us(2) > 0
