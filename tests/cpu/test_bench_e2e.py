"""CPU tests of the whole-model benchmark (``python -m cupy_rmsnorm.bench e2e``): arguments,
the tables and files; with torch and transformers installed, the weight-sharing copies, Liger's patch
and a tiny eager run of the hf variant on the CPU."""

import csv
import importlib.util
import json
import os
import re
import sys
import types

import pytest

from cupy_rmsnorm.bench import cli, common, e2e, report, serving

HAVE_TORCH = importlib.util.find_spec("torch") is not None
HAVE_TRANSFORMERS = HAVE_TORCH and importlib.util.find_spec("transformers") is not None
requires_transformers = pytest.mark.skipif(not HAVE_TRANSFORMERS,
                                           reason="needs torch and transformers (not installed)")
TINY = ["--layers", "2", "--hidden", "64", "--intermediate", "128", "--heads", "4", "--kv-heads", "2",
        "--agree-tokens", "16",
        "--step-modes", "eager", "--step-batches", "2", "--context", "8", "--prefill", "16", "--replays", "1"]


# -- arguments ------------------------------------------------------------------------------------
def parse_args(argv):
    return cli.parse_args(["e2e"] + list(argv))


def test_defaults_are_an_8_layer_llama_in_bf16():
    args = parse_args([])
    assert (args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads) == (8, 4096, 14336, 32, 8)
    assert args.dtype == "bfloat16" and args.repeats == 5
    assert args.variants == ["hf", "ours", "ours_fused", "liger"]       # kernelized, hf_kernels: when named
    assert args.step_modes == ["eager", "compiled"] and args.step_batches == [1, 64]
    assert (args.context, args.prefill, args.replays) == (512, 2048, 50)
    assert args.budget_s is None and args.device == "cuda"
    config = e2e.model_config(args)
    assert config["num_hidden_layers"] == 8 and config["num_key_value_heads"] == 8
    assert config["max_position_embeddings"] >= max(512 + 1, 2048)


def test_quick_and_the_serving_flags():
    quick = parse_args(["--quick"])
    assert (quick.step_modes, quick.step_batches, quick.prefill, quick.replays) == (["eager"], [1], 512, 10)
    args = parse_args(["--step-modes", "compiled", "--step-batches", "8,1,8", "--context", "4000", "--prefill", "3000"])
    assert args.step_modes == ["compiled"] and args.step_batches == [8, 1]
    assert e2e.model_config(args)["max_position_embeddings"] == 4001


def test_flags_choose_variants_modes_sizes():
    args = parse_args(["--variants", "liger,ours,liger", "--dtype", "fp16", "--layers", "2", "--repeats", "3",
                       "--budget-s", "300", "--out", "o", "--name", "run"])
    assert args.variants == ["hf", "liger", "ours"]      # hf joins as the reference, duplicates go
    assert args.dtype == "float16"
    assert (args.layers, args.repeats, args.budget_s) == (2, 3, 300.0)
    assert (args.out, args.name) == ("o", "run")
    assert parse_args([]).name == "e2e"


@pytest.mark.parametrize("argv, needle", [
    (["--hidden", "100", "--heads", "32"], "not a multiple of --heads"),
    (["--heads", "32", "--kv-heads", "5"], "not a multiple of --kv-heads"),
    (["--variants", "flashinfer"], "unknown variant"),
    (["--step-modes", "graph"], "unknown step mode"),
    (["--step-batches", "1,0"], "expected a positive integer"),
    (["--dtype", "int8"], "unknown dtype"),
    (["--repeats", "0"], "positive integer"),
    (["--hf-kernels-repo", "."], "for the hf_kernels variant"),
    (["--variants", "hf_kernels", "--hf-kernels-repo", "/nonexistent/liger-kernels"], "not a directory"),
])
def test_bad_arguments_are_usage_errors(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_spread():
    s = report.spread([5.0, 1.0, 3.0, 2.0, 4.0])
    assert s == {"median": 3.0, "min": 1.0, "max": 5.0, "q1": 2.0, "q3": 4.0, "n": 5}
    assert report.spread([2.5]) == {"median": 2.5, "min": 2.5, "max": 2.5, "q1": 2.5, "q3": 2.5, "n": 1}
    assert report.spread([1.0, None, 3.0])["median"] == 2.0
    assert report.spread([]) is None


def test_budget():
    assert e2e.fits_budget(100, 75, None) and e2e.fits_budget(100, 75, 175) and not e2e.fits_budget(101, 75, 175)


# -- tables and files -------------------------------------------------------------------------------------
def _payload():
    meta = {"command": "e2e", "commit": "abc", "dirty": False, "config": e2e.model_config(parse_args(TINY)),
            "dtype": "bfloat16", "repeats": 2, "device": {"gpu": "Fake GPU"}}
    return {"meta": meta, "skipped": {"liger": "liger_kernel is not importable"},
            "errors": [{"where": "serving decode compiled 1 ours", "error": "Unsupported: graph break"}],
            "notes": ["serving: a note"],
            "agreement": {"ours": {"max_abs_diff": 0.0625, "mean_abs_diff": 0.001, "top1_agree": 0.9921875,
                                   "reference_max_abs_logit": 3.0, "top1_vs_fp32": 0.96875,
                                   "max_abs_vs_fp32": 0.125},
                          "hf": {"top1_vs_fp32": 0.953125, "max_abs_vs_fp32": 0.25}}}


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


def test_the_csv_holds_the_serving_records_and_the_floor_joins_the_agreement(tmp_path):
    payload = _serving_payload()
    steps = e2e.serving_records(payload)
    assert [(r["variant"], r["us"], r["vs_hf"]) for r in steps] == [("hf", 100.5, 1.0),
                                                                    ("ours", 90.5, pytest.approx(90.5 / 100.5))]
    assert [row[0] for row in e2e.agreement_rows(payload)] == ["ours", "hf", "floor: hf, mean in float64"]
    common.write_report(e2e, payload, str(tmp_path), "e2e")
    with open(tmp_path / "e2e.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["measure"], r["variant"], r["us"]) for r in rows] == [("decode", "hf", "100.5"),
                                                                     ("decode", "ours", "90.5")]
    text = e2e.format_report(payload)
    assert "skipped liger: liger_kernel is not importable" in text and "note: serving: a note" in text


def test_nothing_measured_writes_no_markdown(tmp_path):
    payload = _payload()
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
    before = modeling_llama.LlamaRMSNorm
    assert e2e.apply_liger_rms_norm(twin, LLAMA) == 2 * 2 + 1
    assert modeling_llama.LlamaRMSNorm is before                    # the class-level swap undone
    assert not any(m._get_name() == "LigerRMSNorm" for m in model.modules())
    assert twin.model.norm.weight is model.model.norm.weight


@requires_transformers
def test_a_tiny_eager_run_on_the_cpu(tmp_path):
    rc = cli.main(["e2e"] + TINY + ["--device", "cpu", "--repeats", "2", "--out", str(tmp_path)])
    assert rc == 0
    payload = json.loads((tmp_path / "e2e.json").read_text())
    assert set(payload["skipped"]) == {"ours", "ours_fused", "liger"} and not payload["errors"]
    steps = payload["serving"]["results"]            # the serving measures, smoked on the host clock
    assert [(r["measure"], r["mode"], r["batch"], r["variant"], r["us"]["n"]) for r in steps] == \
        [("decode", "eager", 2, "hf", 2), ("prefill", "eager", 1, "hf", 2)]
    assert all(r["us"]["min"] > 0 and r["vs_hf"] == 1.0 and r["vs_hf_compiled"] is None for r in steps)
    assert payload["meta"]["versions"]["transformers"] and payload["meta"]["config"]["num_hidden_layers"] == 2


@requires_transformers
def test_the_cpu_run_checks_hf_against_float32_and_survives_without_it(tmp_path, monkeypatch):
    """The float32 check: hf's top-1 agreement with the float32 model is a fraction, its max
    difference positive (bfloat16 is not float32); a float32 copy that fails (no memory) is
    a note, and the run goes on."""
    argv = TINY + ["--device", "cpu", "--repeats", "1", "--out", str(tmp_path)]
    assert cli.main(["e2e"] + argv) == 0
    hf = json.loads((tmp_path / "e2e.json").read_text())["agreement"]["hf"]
    assert 0.0 <= hf["top1_vs_fp32"] <= 1.0 and hf["max_abs_vs_fp32"] > 0.0

    def no_memory(model, ids):
        raise MemoryError("no room for a float32 copy")
    monkeypatch.setattr(e2e, "float32_logits", no_memory)
    assert cli.main(["e2e"] + argv) == 0
    payload = json.loads((tmp_path / "e2e.json").read_text())
    assert payload["agreement"] == {} and payload["serving"]["results"]
    assert payload["notes"][0] == "no agreement with the float32 model: MemoryError: no room for a float32 copy"
    assert all(n.startswith("the agreement check is blind at this size") for n in payload["notes"][1:])


@requires_transformers
def test_the_agreement_floor_reimplements_hf_bit_for_bit(tmp_path):
    """The floor's copy of LlamaRMSNorm with a float32 mean gives hf's logits exactly (so
    the float64 copy differs from hf in the variance's rounding only); it is checked against
    float32 too."""
    argv = TINY + ["--device", "cpu", "--repeats", "1", "--out", str(tmp_path)]
    assert cli.main(["e2e"] + argv) == 0
    payload = json.loads((tmp_path / "e2e.json").read_text())
    floor = payload["agreement_floor"]
    assert floor["reimplementation_max_abs_diff"] == 0.0
    assert 0.0 <= floor["top1_agree"] <= 1.0 and 0.0 <= floor["top1_vs_fp32"] <= 1.0


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
        return e2e.agreement(model, ids, reference, calls)
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


# -- the kernels variants: kernelized (cupy_rmsnorm.hf.kernelize), hf_kernels (transformers' mapping) -----------
def test_the_kernels_variants_parse_and_need_cuda():
    assert parse_args(["--variants", "kernelized,hf_kernels"]).variants == ["hf", "kernelized", "hf_kernels"]
    assert parse_args(["--model", "qwen3", "--variants", "hf_kernels,ours_qk"]).variants == \
        ["hf", "hf_kernels", "ours_qk"]
    assert {"kernelized", "hf_kernels"} <= set(e2e.VARIANT_TITLES) and set(e2e.VARIANT_TITLES) == set(e2e.VARIANTS)
    for name in ("kernelized", "hf_kernels"):
        with pytest.raises(e2e.Skipped, match="needs CUDA"):
            e2e.make_variant(name, Tree(), "cpu", LLAMA)


def _kernels_or_skip():
    if not HAVE_TRANSFORMERS or importlib.util.find_spec("kernels") is None:
        pytest.skip("needs torch, transformers and kernels (not installed)")
    from transformers.utils import is_kernels_available
    if not is_kernels_available():
        pytest.skip("this transformers does not take the installed kernels")
    import kernels
    return kernels


def test_without_kernels_both_variants_are_skipped_with_the_install_hint(monkeypatch):
    if not HAVE_TRANSFORMERS:
        pytest.skip("needs torch and transformers (not installed)")
    monkeypatch.setitem(sys.modules, "kernels", None)
    for name in ("kernelized", "hf_kernels"):
        with pytest.raises(e2e.Skipped, match=r"kernels package is not importable .*pip install kernels"):
            e2e.make_variant(name, Tree(), "cuda", LLAMA)


def test_kernelized_swaps_every_norm_to_our_layers_with_patch_hf_rmsnorms_logits():
    _kernels_or_skip()
    import torch

    from cupy_rmsnorm.torch import patch_hf_rmsnorm
    model = _tiny_model()
    ids = e2e.token_ids(parse_args(TINY + ["--device", "cpu"]), 2, 8, offset=2)
    ours = e2e.shared_weight_copy(model)
    assert e2e.kernelize_ours(ours) == 2 * 2 + 1
    assert set(e2e.kernelized_modules(ours)) == {p for p, m in model.named_modules() if e2e.is_hf_norm(m)}
    assert not e2e.kernelized_modules(model)          # the base model keeps its norms
    patched = e2e.shared_weight_copy(model)
    assert patch_hf_rmsnorm(patched) == 5
    assert torch.equal(e2e.logits_of(ours, ids), e2e.logits_of(patched, ids))


class _Repository:
    """A stand-in for a kernels LayerRepository: ``load`` raises ``error`` or returns ``layer``."""

    def __init__(self, layer=None, error=None):
        self.layer_name, self.repo_id, self._version = "LigerRMSNorm", "kernels-community/liger-kernels", 4
        self.layer, self.error = layer, error

    def load(self):
        if self.error is not None:
            raise self.error
        return self.layer


def _as_if_on_an_h100(monkeypatch):
    """kernels picks a CUDA repository by the device's capability: an H100's, on any machine."""
    import torch
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


def test_hf_kernels_is_skipped_with_the_error_when_the_hub_is_out_of_reach(monkeypatch):
    _kernels_or_skip()
    _as_if_on_an_h100(monkeypatch)
    offline = _Repository(error=OSError("We couldn't connect to the Hub"))
    monkeypatch.setattr(e2e, "hf_kernel_entry", lambda: {"cuda": offline})
    model = _tiny_model()
    with pytest.raises(e2e.Skipped, match=r"RMSNorm kernel \(kernels-community/liger-kernels LigerRMSNorm "
                                          r"\(version 4\)\) could not be loaded: OSError: We couldn't connect"):
        e2e.kernelize_hf_default(model, "cuda")
    assert not e2e.kernelized_modules(model)


def test_hf_kernels_takes_transformers_rmsnorm_entry_alone_and_swaps_only_the_norms(monkeypatch):
    _kernels_or_skip()
    _as_if_on_an_h100(monkeypatch)
    from torch import nn

    class LigerRMSNorm(nn.Module):           # a stateless layer, as the Hub's
        def forward(self, hidden_states):
            return type(self).forward(self, hidden_states)
    monkeypatch.setattr(e2e, "hf_kernel_entry", lambda: {"cuda": _Repository(layer=LigerRMSNorm)})
    model = _tiny_model()
    assert e2e.kernelize_hf_default(model, "cuda") == 2 * 2 + 1
    swapped = e2e.kernelized_modules(model)
    assert all(m.forward.__func__ is LigerRMSNorm.forward for m in swapped.values())
    assert set(swapped) == {p for p, m in model.named_modules() if e2e.is_hf_norm(m)}   # not SiLU, not rotary
    attention = model.model.layers[0].self_attn      # its apply_rotary_pos_emb wrapper kept as it was
    assert all(getattr(f.__dict__.get("forward"), "__func__", type(f).forward) is type(f).forward
               for f in getattr(attention, "_kernel_funcs", {}).values())


def test_transformers_own_rmsnorm_entry_is_named_and_fails_as_a_skip_without_cuda():
    _kernels_or_skip()
    import torch
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the Hub kernel may load here")
    entry = e2e.hf_kernel_entry()
    assert "cuda" in entry and "LigerRMSNorm" in e2e.hf_kernel_repository(entry, "cuda")
    assert e2e.hf_kernel_repository(entry, "cpu") == "no cpu repository"
    with pytest.raises(e2e.Skipped, match=r"could not be loaded"):
        e2e.kernelize_hf_default(_tiny_model(), "cuda")


def test_the_report_counts_the_replaced_norms():
    payload = _serving_payload()
    payload["meta"].update(replaced_norms={"hf": 0, "ours": 5, "hf_kernels": 5},
                           hf_kernels_layer="kernels-community/liger-kernels LigerRMSNorm (version 4)")
    text = e2e.format_report(payload)
    assert ("norm modules replaced: ours 5, hf_kernels 5 (hf_kernels: kernels-community/liger-kernels "
            "LigerRMSNorm (version 4))") in text


@requires_transformers
def test_a_cpu_run_naming_the_kernels_variants_skips_them_as_ours(tmp_path):
    argv = TINY + ["--device", "cpu", "--repeats", "1", "--variants", "kernelized,hf_kernels", "--out", str(tmp_path)]
    assert cli.main(["e2e"] + argv) == 0
    payload = json.loads((tmp_path / "e2e.json").read_text())
    assert payload["skipped"] == {"kernelized": "needs CUDA (--device cpu)", "hf_kernels": "needs CUDA (--device cpu)"}
    assert set(payload["meta"]["variants"]) == {"hf", "kernelized", "hf_kernels"} and not payload["errors"]


# -- --hf-kernels-repo: the hf_kernels layer from a local kernel repository instead of the Hub ---------------
LOCAL_LAYER = '''
import torch


class {layer}(torch.nn.Module):                 # stateless, as the Hub's: HF's norm arithmetic, in torch
    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states):
        dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(dtype)
'''


def _local_kernel_repository(root, layer):
    """A kernel repository directory as ``hf download`` gives one (build/<variant>/metadata.json and the
    package), its layer ``layer`` torch-only; metadata.json with the fields kernels 0.16 and 0.19 require.
    Returns (its path, the kernel's module name)."""
    variant = root / "build" / "torch-universal"
    (variant / "e2e_test_norms").mkdir(parents=True)
    (variant / "e2e_test_norms" / "__init__.py").write_text("from . import layers\n")
    (variant / "e2e_test_norms" / "layers.py").write_text(LOCAL_LAYER.format(layer=layer))
    module_id = f"_e2e_test_norms_{root.parent.name}_{layer}".replace("-", "_")   # kernels caches kernels by id
    (variant / "metadata.json").write_text(json.dumps({
        "id": module_id, "name": "e2e-test-norms", "version": 1, "license": "Apache-2.0", "python-depends": [],
        "backend": {"type": "cuda"}}))
    return str(root), module_id


def test_hf_kernels_repo_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "liger").mkdir()
    assert parse_args(["--variants", "hf_kernels", "--hf-kernels-repo", "liger"]).hf_kernels_repo == \
        str(tmp_path / "liger")
    assert parse_args([]).hf_kernels_repo is None


def test_hf_kernels_loads_transformers_layer_from_the_local_repository(tmp_path, monkeypatch):
    _kernels_or_skip()
    _as_if_on_an_h100(monkeypatch)
    import torch
    entry = e2e.hf_kernel_entry()
    repos = entry.get("cuda")
    if repos is None:
        pytest.skip("transformers' RMSNorm entry has no cuda repository")
    by_mode = isinstance(repos, dict)             # kernels 0.11+: {mode: repository}; older: the repository
    layer = (next(iter(repos.values())) if by_mode else repos).layer_name
    path, module_id = _local_kernel_repository(tmp_path / "repo", layer)
    local = e2e.hf_kernel_local_entry(entry, "cuda", path)      # the entry's modes and layer name, the local path
    assert set(local) == {"cuda"} and isinstance(local["cuda"], dict) == by_mode
    assert not by_mode or set(local["cuda"]) == set(repos)
    for repo in (local["cuda"].values() if by_mode else [local["cuda"]]):
        assert repo.layer_name == layer and str(repo._repo_path) == path

    model = _tiny_model()
    ids = e2e.token_ids(parse_args(TINY + ["--device", "cpu"]), 2, 8, offset=2)
    local_model, replaced = e2e.make_variant("hf_kernels", model, "cuda", LLAMA, hf_kernels_repo=path)
    assert replaced == 2 * 2 + 1
    swapped = e2e.kernelized_modules(local_model)
    assert set(swapped) == {p for p, m in model.named_modules() if e2e.is_hf_norm(m)}   # the norms, all of them
    assert {m.forward.__func__.__module__ for m in swapped.values()} == {f"{module_id}.layers"}
    assert not e2e.kernelized_modules(model)
    assert torch.equal(e2e.logits_of(local_model, ids), e2e.logits_of(model, ids))   # HF's arithmetic, copied
    source = e2e.hf_kernel_source("cuda", path)
    assert source.startswith(f"the local copy {path}, in place of the Hub's ") and layer in source


def test_hf_kernels_from_a_local_repository_without_the_layer_is_skipped_with_the_path(tmp_path, monkeypatch):
    _kernels_or_skip()
    _as_if_on_an_h100(monkeypatch)
    path, _ = _local_kernel_repository(tmp_path / "repo", "SomeOtherNorm")
    model = _tiny_model()
    with pytest.raises(e2e.Skipped, match=re.escape(f"from the local copy {path}) could not be loaded")):
        e2e.kernelize_hf_default(model, "cuda", path)
    assert not e2e.kernelized_modules(model)


@requires_transformers
def test_a_cpu_run_records_the_local_repository(tmp_path):
    (tmp_path / "repo").mkdir()
    argv = TINY + ["--device", "cpu", "--repeats", "1", "--variants", "hf_kernels",
                   "--hf-kernels-repo", str(tmp_path / "repo"), "--out", str(tmp_path)]
    assert cli.main(["e2e"] + argv) == 0
    payload = json.loads((tmp_path / "e2e.json").read_text())
    assert payload["meta"]["hf_kernels_repo"] == str(tmp_path / "repo")
    assert payload["skipped"] == {"hf_kernels": "needs CUDA (--device cpu)"} and not payload["errors"]


def test_the_report_names_the_local_copy():
    payload = _serving_payload()
    payload["meta"].update(replaced_norms={"hf_kernels": 5}, hf_kernels_layer="the local copy /x/liger, in place "
                           "of the Hub's kernels-community/liger-kernels LigerRMSNorm (version 4)")
    assert "hf_kernels 5 (hf_kernels: the local copy /x/liger, in place of the Hub's" in e2e.format_report(payload)
