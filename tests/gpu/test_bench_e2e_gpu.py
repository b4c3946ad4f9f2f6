"""``python -m cupy_rmsnorm.bench e2e`` once on a GPU, at its smallest: the decode step of each
variant captured in a CUDA graph (eager and compiled) and its prefill timed, the agreement
check on the logits and on every norm's output."""

import importlib.util
import json

import pytest
from helpers import requires_torch_gpu

from cupy_rmsnorm.bench import cli, serving

requires_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                           reason="needs transformers")
TINY = ["--layers", "2", "--hidden", "256", "--intermediate", "512", "--heads", "4", "--kv-heads", "2",
        "--agree-tokens", "256",
        "--variants", "ours,ours_fused", "--step-modes", "eager,compiled", "--step-batches", "1,8",
        "--context", "32", "--prefill", "128", "--replays", "5", "--repeats", "2"]


@requires_torch_gpu
@requires_transformers
def test_e2e_serving_measures_and_agreement(tmp_path):
    assert cli.main(["e2e", "--out", str(tmp_path)] + TINY) == 0
    payload = json.loads((tmp_path / "e2e.json").read_text())
    assert not payload["errors"], payload["errors"]
    steps = {(r["measure"], r["mode"], r["batch"], r["variant"]): r for r in payload["serving"]["results"]}
    want = {(m, mode, b, v) for m, mode, b in serving.measures(["eager", "compiled"], [1, 8], 128)
            for v in ("hf", "ours", "ours_fused")}
    assert set(steps) == want
    assert all(r["us"]["n"] == 2 and r["us"]["min"] > 0 and r["vs_hf_compiled"] for r in steps.values()
               if r["measure"] == "decode")
    for name in ("ours", "ours_fused"):
        a = payload["agreement"][name]
        # the norm's arithmetic differs from HF's in the variance's last bits only: few outputs, 1-2 ulps
        assert a["norm_outputs_differing"] < 0.01 and a["norm_max_ulps"] <= 2, a
        assert a["top1_agree"] > 0.9
    floor = payload["agreement_floor"]
    assert floor["reimplementation_max_abs_diff"] == 0.0 and floor["norm_max_ulps"] <= 2


@requires_torch_gpu
@requires_transformers
def test_a_replayed_decode_step_gives_the_direct_steps_logits():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=128)).to(torch.bfloat16).eval()
    step = serving.DecodeStep(model, batch=4, context=32).capture()
    with torch.no_grad():
        direct = step().clone()
    step.graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(step.logits, direct)
    assert step.time_us(3) > 0
