"""CPU tests of the whole-model benchmark (``python -m cupy_rmsnorm.bench e2e``): arguments,
the interleaved order, the statistics, the measuring loop with a fake clock, the tables
and files; with torch and transformers installed, the weight-sharing copies, Liger's patch
and a tiny eager run of the hf variant on the CPU."""

import csv
import importlib.util
import json
import os
import sys
import types

import pytest

from cupy_rmsnorm.bench import cli, common, e2e, serving

HAVE_TORCH = importlib.util.find_spec("torch") is not None
HAVE_TRANSFORMERS = HAVE_TORCH and importlib.util.find_spec("transformers") is not None
requires_transformers = pytest.mark.skipif(not HAVE_TRANSFORMERS,
                                           reason="needs torch and transformers (not installed)")
TINY = ["--layers", "2", "--hidden", "64", "--intermediate", "128", "--heads", "4", "--kv-heads", "2",
        "--vocab", "256", "--prompt", "8", "--new-tokens", "4", "--agree-tokens", "16",
        "--step-modes", "eager", "--step-batches", "2", "--context", "8", "--prefill", "16", "--replays", "1"]


# -- arguments ------------------------------------------------------------------------------------
def parse_args(argv):
    return cli.parse_args(["e2e"] + list(argv))


def test_defaults_are_an_8_layer_llama_in_bf16():
    args = parse_args([])
    assert (args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads, args.vocab) == \
        (8, 4096, 14336, 32, 8, 32000)
    assert args.dtype == "bfloat16" and args.batch == 1
    assert (args.prompt, args.new_tokens, args.repeats) == (128, 64, 5)
    assert args.variants == ["hf", "ours", "ours_fused", "liger"]
    assert args.modes == ["eager"]                     # generate: the secondary measure
    assert args.step_modes == ["eager", "compiled"] and args.step_batches == [1, 64]
    assert (args.context, args.prefill, args.replays) == (512, 2048, 50)
    assert not args.no_fullgraph and args.budget_s is None and args.device == "cuda"
    config = e2e.model_config(args)
    assert config["num_hidden_layers"] == 8 and config["num_key_value_heads"] == 8
    assert config["max_position_embeddings"] >= max(128 + 64, 512 + 1, 2048)


def test_quick_and_the_serving_flags():
    quick = parse_args(["--quick"])
    assert (quick.step_modes, quick.step_batches, quick.prefill, quick.replays) == (["eager"], [1], 512, 10)
    args = parse_args(["--step-modes", "compiled", "--step-batches", "8,1,8", "--context", "4000", "--prefill", "3000"])
    assert args.step_modes == ["compiled"] and args.step_batches == [8, 1]
    assert e2e.model_config(args)["max_position_embeddings"] == 4001


def test_flags_choose_variants_modes_sizes():
    args = parse_args(["--variants", "liger,ours,liger", "--modes", "eager", "--dtype", "fp16",
                           "--layers", "2", "--new-tokens", "9", "--repeats", "3", "--budget-s", "300",
                           "--no-fullgraph", "--out", "o", "--name", "run"])
    assert args.variants == ["hf", "liger", "ours"]      # hf joins as the reference, duplicates go
    assert args.modes == ["eager"] and args.dtype == "float16"
    assert (args.layers, args.new_tokens, args.repeats, args.budget_s) == (2, 9, 3, 300.0)
    assert args.no_fullgraph and (args.out, args.name) == ("o", "run")
    assert parse_args([]).name == "e2e"


@pytest.mark.parametrize("argv, needle", [
    (["--new-tokens", "1"], "at least 2"),
    (["--hidden", "100", "--heads", "32"], "not a multiple of --heads"),
    (["--heads", "32", "--kv-heads", "5"], "not a multiple of --kv-heads"),
    (["--variants", "flashinfer"], "unknown variant"),
    (["--modes", "graph"], "unknown mode"),
    (["--step-modes", "graph"], "unknown step mode"),
    (["--step-batches", "1,0"], "expected a positive integer"),
    (["--dtype", "int8"], "unknown dtype"),
    (["--repeats", "0"], "positive integer"),
])
def test_bad_arguments_are_usage_errors(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


# -- order and statistics ---------------------------------------------------------------------------
def test_interleaved_order_visits_every_variant_each_round():
    assert e2e.interleaved_order(["a", "b", "c"], 2) == [(0, "a"), (0, "b"), (0, "c"), (1, "a"), (1, "b"), (1, "c")]
    assert e2e.interleaved_order(["a"], 0) == []


def test_decode_time_is_the_difference_over_the_extra_tokens():
    assert e2e.decode_ms_per_token(0.010, 0.640, 64) == pytest.approx(10.0)
    assert e2e.decode_ms_per_token(0.5, 0.5, 2) == 0.0


def test_spread():
    s = common.spread([5.0, 1.0, 3.0, 2.0, 4.0])
    assert s == {"median": 3.0, "min": 1.0, "max": 5.0, "q1": 2.0, "q3": 4.0, "n": 5}
    assert common.spread([2.5]) == {"median": 2.5, "min": 2.5, "max": 2.5, "q1": 2.5, "q3": 2.5, "n": 1}
    assert common.spread([1.0, None, 3.0])["median"] == 2.0
    assert common.spread([]) is None


def _timings(mode, variant, pairs):
    """Timing records of (T(1), T(N)) seconds per round, N = 5."""
    out = []
    for rnd, (one, many) in enumerate(pairs):
        out += [{"mode": mode, "variant": variant, "round": rnd, "new_tokens": 1, "seconds": one},
                {"mode": mode, "variant": variant, "round": rnd, "new_tokens": 5, "seconds": many}]
    return out


def test_summarize_pairs_each_round_and_compares_with_hf():
    timings = (_timings("compiled", "ours", [(0.010, 0.018), (0.012, 0.020), (0.011, 0.023)])
               + _timings("eager", "ours", [(0.020, 0.060)])
               + _timings("eager", "hf", [(0.020, 0.100), (0.030, 0.090)])
               + _timings("compiled", "hf", [(0.010, 0.026), (0.010, 0.030), (0.010, 0.034)]))
    rows = e2e.summarize(timings, new_tokens=5, batch=2)
    assert [(r["mode"], r["variant"]) for r in rows] == [("eager", "hf"), ("eager", "ours"),
                                                        ("compiled", "hf"), ("compiled", "ours")]
    hf_eager, ours_eager, hf_compiled, ours_compiled = rows
    assert hf_eager["decode_ms"]["median"] == pytest.approx(17.5)     # rounds: 20 and 15 ms per token
    assert hf_eager["prefill_ms"]["median"] == pytest.approx(25.0)
    assert ours_eager["decode_vs_hf"] == pytest.approx(10.0 / 17.5)
    assert ours_compiled["decode_ms"]["median"] == pytest.approx(2.0)  # rounds: 2, 2, 3 ms per token
    assert ours_compiled["decode_ms"]["max"] == pytest.approx(3.0)
    assert ours_compiled["decode_vs_hf"] == pytest.approx(2.0 / 5.0)
    assert ours_compiled["prefill_vs_hf"] == pytest.approx(1.1)
    assert ours_compiled["tokens_per_s"] == pytest.approx(2 * 1000 / 2.0)
    assert hf_compiled["decode_vs_hf"] == 1.0


def test_a_round_missing_its_long_call_has_a_prefill_but_no_decode():
    timings = _timings("eager", "hf", [(0.02, 0.1)]) + [
        {"mode": "eager", "variant": "hf", "round": 1, "new_tokens": 1, "seconds": 0.04}]
    (row,) = e2e.summarize(timings, new_tokens=5, batch=1)
    assert row["prefill_ms"]["n"] == 2 and row["decode_ms"]["n"] == 1


def test_counter_delta_and_budget():
    assert e2e.counter_delta({"stats.unique_graphs": 2, "a": 1}, {"stats.unique_graphs": 3, "a": 1, "b": 4}) == \
        {"stats.unique_graphs": 1, "b": 4}
    assert e2e.graph_count_of({"stats.unique_graphs": 3}) == 3 and e2e.graph_count_of({}) == 0
    assert e2e.fits_budget(100, 75, None) and e2e.fits_budget(100, 75, 175) and not e2e.fits_budget(101, 75, 175)


# -- the measuring loop, with fakes --------------------------------------------------------------------
class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_measure_rounds_interleaves_and_drops_a_failing_variant():
    calls, logged = [], []

    def time_generate(variant, n):
        calls.append((variant, n))
        if variant == "b" and len([c for c in calls if c[0] == "b"]) == 4:   # b's second round, long call
            raise RuntimeError("out of memory")
        return 0.001 * n

    timings, errors, notes = e2e.measure_rounds("eager", ["a", "b", "c"], 3, 8, time_generate, logged.append)
    assert calls[:6] == [("a", 1), ("a", 8), ("b", 1), ("b", 8), ("c", 1), ("c", 8)]
    assert [c[0] for c in calls[6:]] == ["a", "a", "b", "b", "c", "c", "a", "a", "c", "c"]
    assert [e["where"] for e in errors] == ["eager b round 1"] and "out of memory" in errors[0]["error"]
    assert not notes and any("out of memory" in m for m in logged)
    per_variant = {v: sorted({t["round"] for t in timings if t["variant"] == v}) for v in "abc"}
    assert per_variant == {"a": [0, 1, 2], "b": [0], "c": [0, 1, 2]}   # b's broken round left out whole
    assert all(t["seconds"] == 0.001 * t["new_tokens"] for t in timings)


def test_measure_rounds_stops_before_a_round_past_the_deadline():
    clock = FakeClock()

    def time_generate(variant, n):
        clock.t += 10.0
        return 0.5

    timings, errors, notes = e2e.measure_rounds("compiled", ["a", "b"], 5, 4, time_generate, lambda m: None,
                                                clock=clock, deadline=95.0)
    # each round takes 40 s: rounds at 0 and 40 end by 80; a third would end at 120
    assert sorted({t["round"] for t in timings}) == [0, 1] and not errors
    assert notes == ["compiled: the time budget stopped the rounds after 2 of 5"]


# -- tables and files -------------------------------------------------------------------------------------
def _payload():
    timings = (_timings("eager", "hf", [(0.020, 0.100), (0.030, 0.090)])
               + _timings("eager", "ours", [(0.020, 0.060), (0.020, 0.064)])
               + _timings("compiled", "hf", [(0.010, 0.026)])
               + _timings("compiled", "ours", [(0.010, 0.018)]))
    meta = {"command": "e2e", "commit": "abc", "dirty": False, "config": e2e.model_config(parse_args(TINY)),
            "dtype": "bfloat16", "batch": 1, "prompt": 8, "new_tokens": 5, "repeats": 2, "device": {"gpu": "Fake GPU"}}
    return {"meta": meta, "skipped": {"liger": "liger_kernel is not importable"},
            "errors": [{"where": "compiled ours fullgraph compile", "error": "Unsupported: graph break"}],
            "notes": ["compiled: 1 graphs were compiled during the timed rounds"],
            "agreement": {"ours": {"max_abs_diff": 0.0625, "mean_abs_diff": 0.001, "top1_agree": 0.9921875,
                                   "reference_max_abs_logit": 3.0, "top1_vs_fp32": 0.96875,
                                   "max_abs_vs_fp32": 0.125},
                          "hf": {"top1_vs_fp32": 0.953125, "max_abs_vs_fp32": 0.25}},
            "graph_breaks": {"hf": {"graph_count": 1, "graph_break_count": 0},
                             "ours": {"graph_count": 18, "graph_break_count": 17}},
            "compile": {"compiled hf": {"fullgraph": True}, "compiled ours": {"fullgraph": False}},
            "timings": timings, "results": e2e.summarize(timings, 5, 1)}


def test_the_generate_records_carry_times_agreement_and_graph_breaks(tmp_path):
    payload = _payload()
    records = {(r["mode"], r["variant"]): r for r in e2e.generate_records(payload)}
    assert list(records) == [("eager", "hf"), ("eager", "ours"), ("compiled", "hf"), ("compiled", "ours")]
    ours, hf = records[("eager", "ours")], records[("eager", "hf")]
    assert (ours["top1_agree"], ours["max_abs_logit_diff"], ours["top1_vs_fp32"]) == (0.9921875, 0.0625, 0.96875)
    assert hf["top1_agree"] is None and hf["top1_vs_fp32"] == 0.953125       # hf: only against float32
    assert ours["graph_breaks"] is None                                      # no breaks in eager
    compiled = records[("compiled", "ours")]
    assert compiled["graph_breaks"] == 17 and compiled["timed_fullgraph"] is False
    assert compiled["decode_vs_hf"] == pytest.approx(0.5) and compiled["decode_ms_per_token"] == pytest.approx(2.0)
    text = e2e.format_report(payload)
    assert "17*" in text and e2e.BREAKS_FOOTNOTE in text                     # timed with breaks allowed
    assert "skipped liger: liger_kernel is not importable" in text and "note: compiled: 1 graphs" in text
    written = common.write_report(e2e, payload, str(tmp_path), "h200")
    assert [os.path.basename(p) for p in written] == ["h200.json", "h200.csv", "h200.md"]
    with open(tmp_path / "h200.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["mode"], r["variant"]) for r in rows] == list(records)
    assert rows[3]["graph_breaks"] == "17" and rows[3]["timed_fullgraph"] == "False" and rows[0]["graph_breaks"] == ""


def _serving_payload():
    payload = _payload()
    payload["meta"].update(context=512, prefill=2048, replays=50)
    samples = [{"key": ["decode", "eager", 1, v], "round": r, "us": us} for r in range(2)
               for v, us in (("hf", 100.0 + r), ("ours", 90.0 + r))]
    payload["serving"] = {"samples": samples, "results": serving.summarize(samples)}
    payload["agreement"]["ours"].update(logits_differing=0.25, norm_outputs_differing=0.0012, norm_max_ulps=1.0)
    payload["agreement_floor"] = {"max_abs_diff": 0.0, "logits_differing": 0.0, "top1_agree": 1.0,
                                  "norm_outputs_differing": 0.0, "norm_max_ulps": 0.0,
                                  "reimplementation_max_abs_diff": 0.0}
    return payload


def test_the_serving_records_come_first_in_the_csv_and_the_floor_joins_the_agreement(tmp_path):
    payload = _serving_payload()
    steps = e2e.serving_records(payload)
    assert [(r["variant"], r["us"], r["vs_hf"]) for r in steps] == [("hf", 100.5, 1.0),
                                                                    ("ours", 90.5, pytest.approx(90.5 / 100.5))]
    assert [row[0] for row in e2e.agreement_rows(payload)] == ["ours", "hf", "floor: hf, mean in float64"]
    common.write_report(e2e, payload, str(tmp_path), "e2e")
    with open(tmp_path / "e2e.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["measure"], r["variant"]) for r in rows] == [("decode", "hf"), ("decode", "ours")] + \
        [("generate", v) for v in ("hf", "ours", "hf", "ours")]
    assert rows[1]["decode_ms_per_token"] == "" and rows[2]["us"] == ""


def test_nothing_measured_writes_no_markdown(tmp_path):
    payload = dict(_payload(), timings=[], results=[])
    assert [os.path.basename(p) for p in common.write_report(e2e, payload, str(tmp_path), "e2e")] == \
        ["e2e.json", "e2e.csv"]


# -- variants ------------------------------------------------------------------------------------------------
LLAMA = e2e.FAMILIES["llama"]


class Tree:
    """Stands in for a model: parameters and buffers, and children to patch."""

    def __init__(self):
        self.weight = object()
        self.child = types.SimpleNamespace(name="LlamaRMSNorm")

    def parameters(self):
        return [self.weight]

    def buffers(self):
        return []

    def modules(self):
        return [self.child]


def test_ours_fused_without_the_keyword_is_skipped(monkeypatch):
    def old_patch(model):     # an older patch_hf_rmsnorm: no fuse_residual
        return 3
    monkeypatch.setitem(sys.modules, "cupy_rmsnorm.torch", types.SimpleNamespace(patch_hf_rmsnorm=old_patch))
    base = Tree()
    with pytest.raises(e2e.Skipped, match="no fuse_residual keyword"):
        e2e.make_variant("ours_fused", base, "cuda", LLAMA)
    model, replaced = e2e.make_variant("ours", base, "cuda", LLAMA)
    assert replaced == 3 and model is not base and model.weight is base.weight   # weights shared, tree copied
    assert model.child is not base.child
    assert e2e.make_variant("hf", base, "cuda", LLAMA) == (base, 0)
    with pytest.raises(e2e.Skipped, match="needs CUDA"):
        e2e.make_variant("ours", base, "cpu", LLAMA)


def test_another_type_error_of_the_fused_patch_is_an_error(monkeypatch):
    def broken(model, fuse_residual=False):
        raise TypeError("unsupported operand")
    monkeypatch.setitem(sys.modules, "cupy_rmsnorm.torch", types.SimpleNamespace(patch_hf_rmsnorm=broken))
    with pytest.raises(TypeError, match="unsupported operand"):
        e2e.make_variant("ours_fused", Tree(), "cuda", LLAMA)


def test_ours_qk_passes_fuse_qk_rope_and_needs_qwen3(monkeypatch):
    seen = []

    def patch(model, **keywords):
        seen.append(keywords)
        model.child._cupy_rmsnorm_qk_rope = ("rewritten",)
        return 5
    monkeypatch.setitem(sys.modules, "cupy_rmsnorm.torch", types.SimpleNamespace(patch_hf_rmsnorm=patch))
    with pytest.raises(e2e.Skipped, match="no per-head q_norm"):
        e2e.make_variant("ours_qk", Tree(), "cuda", LLAMA)
    model, replaced = e2e.make_variant("ours_qk", Tree(), "cuda", e2e.FAMILIES["qwen3"])
    assert replaced == 5 and seen == [{"fuse_qk_rope": True}]


def test_compile_variants_pick_the_compiled_steps():
    assert parse_args([]).compile_variants is None
    assert parse_args(["--compile-variants", "hf,ours_fused"]).compile_variants == ["hf", "ours_fused"]
    with pytest.raises(SystemExit):
        parse_args(["--compile-variants", "vllm"])


def test_qwen3_defaults():
    args = parse_args(["--model", "qwen3"])
    assert args.variants == ["hf", "ours", "ours_fused", "ours_qk", "liger"] and args.intermediate == 12288
    assert parse_args([]).intermediate == 14336
    assert parse_args(["--model", "qwen3", "--intermediate", "64"]).intermediate == 64


def _tiny_model():
    return e2e.build_model(parse_args(TINY + ["--device", "cpu"]))


@requires_transformers
def test_built_model_has_random_norm_weights_and_a_float32_rope():
    import torch
    model = _tiny_model()
    assert model.dtype == torch.bfloat16 and model.model.rotary_emb.inv_freq.dtype == torch.float32
    norm = model.model.layers[0].input_layernorm.weight
    assert norm.dtype == torch.bfloat16 and float(norm.detach().float().std()) > 0.05


@requires_transformers
def test_built_qwen3_has_per_head_norms_with_random_weights():
    model = e2e.build_model(parse_args(TINY + ["--device", "cpu", "--model", "qwen3"]))
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert sum(e2e.is_hf_norm(m) for m in model.modules()) == 2 * 4 + 1     # q_norm and k_norm in each layer
    attn = model.model.layers[0].self_attn
    assert attn.q_norm.weight.shape[0] == attn.head_dim == 64 // 4
    assert float(attn.k_norm.weight.detach().float().std()) > 0.05


@requires_transformers
def test_shared_weight_copy_shares_weights_not_modules():
    model = _tiny_model()
    twin = e2e.shared_weight_copy(model)
    assert twin is not model and twin.model.layers[0] is not model.model.layers[0]
    assert all(a is b for a, b in zip(twin.parameters(), model.parameters()))
    twin.model.layers[0].input_layernorm = None
    assert model.model.layers[0].input_layernorm is not None


@requires_transformers
def test_a_class_level_patch_shows_in_the_fingerprint(monkeypatch):
    from transformers.models.llama import modeling_llama
    before = e2e.modeling_fingerprint(LLAMA)
    assert e2e.modeling_fingerprint(LLAMA) == before and "LlamaDecoderLayer" in before
    monkeypatch.setattr(modeling_llama.LlamaDecoderLayer, "forward", lambda self, *args, **kwargs: None)
    after = e2e.modeling_fingerprint(LLAMA)
    assert [k for k in before if before[k] != after[k]] == ["LlamaDecoderLayer"]


@requires_transformers
def test_liger_patches_the_copy_only():
    if importlib.util.find_spec("liger_kernel") is None:
        pytest.skip("liger-kernel is not installed")
    try:
        import liger_kernel.transformers  # noqa: F401
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"liger_kernel.transformers does not import: {e}")
    from transformers.models.llama import modeling_llama
    model = _tiny_model()
    twin = e2e.shared_weight_copy(model)
    before, fingerprint = modeling_llama.LlamaRMSNorm, e2e.modeling_fingerprint(LLAMA)
    assert e2e.apply_liger_rms_norm(twin, LLAMA) == 2 * 2 + 1
    assert modeling_llama.LlamaRMSNorm is before                    # the class-level swap undone
    assert e2e.modeling_fingerprint(LLAMA) == fingerprint
    assert not any(m._get_name() == "LigerRMSNorm" for m in model.modules())
    assert twin.model.norm.weight is model.model.norm.weight


@requires_transformers
def test_a_tiny_eager_run_on_the_cpu(tmp_path):
    rc = cli.main(["e2e"] + TINY + ["--device", "cpu", "--modes", "eager", "--repeats", "2", "--out", str(tmp_path)])
    assert rc == 0
    payload = json.loads((tmp_path / "e2e.json").read_text())
    assert set(payload["skipped"]) == {"ours", "ours_fused", "liger"} and not payload["errors"]
    assert len(payload["timings"]) == 2 * 2 and all(t["seconds"] > 0 for t in payload["timings"])
    steps = payload["serving"]["results"]            # the serving measures, smoked on the host clock
    assert [(r["measure"], r["mode"], r["batch"], r["variant"], r["us"]["n"]) for r in steps] == \
        [("decode", "eager", 2, "hf", 2), ("prefill", "eager", 1, "hf", 2)]
    assert all(r["us"]["min"] > 0 and r["vs_hf"] == 1.0 and r["vs_hf_compiled"] is None for r in steps)
    (row,) = payload["results"]
    assert row["decode_vs_hf"] == 1.0 and row["decode_ms"]["n"] == 2
    assert payload["meta"]["versions"]["transformers"] and payload["meta"]["config"]["num_hidden_layers"] == 2


@requires_transformers
def test_the_cpu_run_checks_hf_against_float32_and_survives_without_it(tmp_path, monkeypatch):
    """The float32 check: hf's top-1 agreement with the float32 model is a fraction, its max
    difference positive (bfloat16 is not float32); a float32 copy that fails (no memory) is
    a note, and the run goes on."""
    argv = TINY + ["--device", "cpu", "--modes", "eager", "--repeats", "1", "--out", str(tmp_path)]
    assert cli.main(["e2e"] + argv) == 0
    hf = json.loads((tmp_path / "e2e.json").read_text())["agreement"]["hf"]
    assert 0.0 <= hf["top1_vs_fp32"] <= 1.0 and hf["max_abs_vs_fp32"] > 0.0

    def no_memory(model, ids):
        raise MemoryError("no room for a float32 copy")
    monkeypatch.setattr(e2e, "float32_logits", no_memory)
    assert cli.main(["e2e"] + argv) == 0
    payload = json.loads((tmp_path / "e2e.json").read_text())
    assert payload["agreement"] == {} and payload["results"]
    assert payload["notes"][0] == "no agreement with the float32 model: MemoryError: no room for a float32 copy"
    assert all(n.startswith("the agreement check is blind at this size") for n in payload["notes"][1:])


@requires_transformers
def test_the_agreement_floor_reimplements_hf_bit_for_bit(tmp_path):
    """The floor's copy of LlamaRMSNorm with a float32 mean gives hf's logits exactly (so
    the float64 copy differs from hf in the variance's rounding only); it is checked against
    float32 too."""
    argv = TINY + ["--device", "cpu", "--modes", "eager", "--repeats", "1", "--agree-batch", "2",
                   "--out", str(tmp_path)]
    assert cli.main(["e2e"] + argv) == 0
    payload = json.loads((tmp_path / "e2e.json").read_text())
    floor = payload["agreement_floor"]
    assert floor["reimplementation_max_abs_diff"] == 0.0
    assert 0.0 <= floor["top1_agree"] <= 1.0 and 0.0 <= floor["top1_vs_fp32"] <= 1.0
    assert payload["meta"]["agree_batch"] == 2


@requires_transformers
def test_the_agreement_check_tells_variants_apart():
    """hf's arithmetic reimplemented agrees to the bit; the same model with one norm's eps
    changed differs, in its logits and in that norm's outputs, and the check says so."""
    import torch
    args = parse_args(TINY + ["--device", "cpu"])
    base = e2e.build_model(args)
    ids = e2e.token_ids(args, 2, 16, offset=2)
    reference = e2e.logits_of(base, ids)
    calls = e2e.norm_calls(base, ids)
    assert [path for path, _, _ in calls] == [f"model.layers.{i}.{n}" for i in range(2)
                                              for n in ("input_layernorm", "post_attention_layernorm")] + ["model.norm"]

    def check(model):
        found = e2e.agreement(e2e.logits_of(model, ids), reference)
        found.update(e2e.norm_agreement(model, calls))
        return found
    same = check(e2e.with_norm_mean_in(base, torch.float32))
    assert same["max_abs_diff"] == same["logits_differing"] == 0.0 and same["top1_agree"] == 1.0
    assert same["norm_outputs_differing"] == same["norm_max_ulps"] == 0.0
    changed = e2e.with_norm_mean_in(base, torch.float32)
    changed.model.layers[1].post_attention_layernorm.variance_epsilon = 0.05
    other = check(changed)
    assert other["max_abs_diff"] > 0.0 and other["logits_differing"] > 0.5
    assert 0.0 < other["norm_outputs_differing"] <= 1 / 5 and other["norm_max_ulps"] >= 1.0  # one norm of five


def test_ulps_count_units_in_the_last_place_of_the_reference():
    torch = pytest.importorskip("torch")
    ref = torch.tensor([1.0, 1.0, -3.0, 0.0, 1e-40], dtype=torch.bfloat16)
    got = torch.tensor([1.0, 1.0 + 2 ** -7, -3.0 - 2 ** -6, 0.0, 1e-40], dtype=torch.bfloat16)
    assert e2e.ulps(got, ref).tolist() == [0.0, 1.0, 1.0, 0.0, 0.0]


def test_a_norm_with_the_mean_in_float64_differs_from_float32_in_the_variance_only():
    torch = pytest.importorskip("torch")
    module = types.SimpleNamespace(weight=torch.tensor([1.5, -0.5, 2.0], dtype=torch.bfloat16),
                                   variance_epsilon=1e-6)
    h = torch.tensor([[3.0, -1.0, 0.25]], dtype=torch.bfloat16)
    want = module.weight * (h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)
    assert torch.equal(e2e._hf_norm_with_mean_in(torch.float32, module, h), want)
    var64 = h.double().pow(2).mean(-1, keepdim=True).float()
    want64 = module.weight * (h.float() * torch.rsqrt(var64 + 1e-6)).to(h.dtype)
    assert torch.equal(e2e._hf_norm_with_mean_in(torch.float64, module, h), want64)


class Unsupported(Exception):
    """Dynamo's graph-break error under fullgraph=True, as far as the benchmark can tell."""


Unsupported.__module__ = "torch._dynamo.exc"


class FakeGenerate:
    """Compiles (one Dynamo graph) on a variant's first call; ``breaks`` fail as one graph."""

    def __init__(self, variants, breaks=(), broken=()):
        self.full = {v: True for v in variants}
        self.breaks, self.broken = set(breaks), set(broken)
        self.graphs, self.calls, self.compiled = 0, [], set()

    def fullgraph(self, variant):
        return self.full[variant]

    def allow_graph_breaks(self, variant):
        self.full[variant] = False

    def __call__(self, variant, n):
        self.calls.append((variant, n, self.full[variant]))
        if variant in self.broken:
            raise RuntimeError("CUDA error: an illegal memory access")
        if variant in self.breaks and self.full[variant]:
            raise RuntimeError("generate failed") from Unsupported("call to a C function")
        if variant not in self.compiled:
            self.compiled.add(variant)
            self.graphs += 1
        return 0.01


def test_warm_up_compiles_again_with_breaks_allowed_after_the_others(monkeypatch):
    models = {"hf": None, "ours": None, "ours_fused": None, "liger": None}
    generate = FakeGenerate(models, breaks={"ours"}, broken={"liger"})
    monkeypatch.setattr(e2e, "dynamo_counters", lambda: {"stats.unique_graphs": generate.graphs})
    monkeypatch.setattr(e2e, "log", lambda msg: None)
    args = parse_args(["--new-tokens", "6"])
    payload = {"compile": {}, "errors": [], "skipped": {}}
    ready = e2e.warm_up("compiled", models, generate, args, payload, elapsed=lambda: 0.0)
    assert ready == ["hf", "ours", "ours_fused"]                   # in the variants' order
    # ours breaks the graph: compiled again, after the others; liger's error is no graph break
    assert [c[0] for c in generate.calls] == ["hf"] * 3 + ["ours", "ours_fused", "ours_fused", "ours_fused",
                                                           "liger", "ours", "ours", "ours"]
    assert [c[1] for c in generate.calls[:3]] == [6, 1, 6]          # N first: it sizes the static cache
    assert payload["compile"]["compiled ours"]["fullgraph"] is False
    assert payload["compile"]["compiled hf"] == {"warmup_s": pytest.approx(0.0, abs=1.0), "fullgraph": True,
                                                 "graphs": 1, "counters": {"stats.unique_graphs": 1}}
    assert [e["where"] for e in payload["errors"]] == ["compiled ours fullgraph compile",
                                                       "compiled liger warm-up"]
    assert "call to a C function" not in payload["errors"][0]["error"]   # the outer error, as raised
    assert e2e.is_dynamo_error(RuntimeError("x")) is False


def test_warm_up_that_compiles_nothing_is_not_timed(monkeypatch):
    generate = FakeGenerate({"hf": None})
    monkeypatch.setattr(e2e, "dynamo_counters", dict)     # no graph, ever
    monkeypatch.setattr(e2e, "log", lambda msg: None)
    payload = {"compile": {}, "errors": [], "skipped": {}}
    args = parse_args([])
    assert e2e.warm_up("compiled", {"hf": None}, generate, args, payload, elapsed=lambda: 0.0) == []
    assert "compiled nothing" in payload["errors"][0]["error"]
    assert e2e.warm_up("eager", {"hf": None}, generate, args, payload, elapsed=lambda: 0.0) == ["hf"]


def test_warm_up_skips_a_compile_past_the_budget(monkeypatch):
    generate = FakeGenerate({"hf": None})
    monkeypatch.setattr(e2e, "log", lambda msg: None)
    payload = {"compile": {}, "errors": [], "skipped": {}}
    args = parse_args(["--budget-s", "100"])
    assert e2e.warm_up("compiled", {"hf": None}, generate, args, payload, elapsed=lambda: 30.0) == []
    assert not generate.calls and "time budget (100 s)" in payload["skipped"]["compiled hf"]
