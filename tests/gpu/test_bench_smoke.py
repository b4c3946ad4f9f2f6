"""Each sub-command of ``python -m cupy_rmsnorm.bench`` once on a GPU, at its smallest: it
measures, writes its report with the commit it measured, and ``--replot`` reads that back
(gated's own, larger, is tests/gpu/test_bench_gated_gpu.py)."""

import importlib.util
import json

import pytest
from helpers import requires_gpu, requires_torch_gpu

from cupy_rmsnorm.bench import cli, common

TINY = {
    "forward": ["--shapes", "1,64x4096", "--dtypes", "bf16", "--modes", "graph,cold", "--repeats", "2",
                "--peers", "copy,ours_ip,F.rms_norm", "--no-first-call"],
    "backward": ["--shapes", "64x4096", "--dtypes", "bf16", "--repeats", "2"],
    "quant": ["--shapes", "64x4096", "--cases", "static,fused per_group", "--repeats", "2", "--flashinfer", "none"],
    "train": ["--steps", "3", "--layers", "1", "--hidden", "256", "--batch", "2", "--seq", "64"],
    "qk_rope": ["--tokens", "64", "--heads", "32/8x128", "--repeats", "2", "--peers", "torch_compile,copy"],
}


def run_and_replot(command, tmp_path, capsys):
    assert cli.main([command, "--quick", "--no-chart", "--out", str(tmp_path)] + TINY[command]) == 0
    payload = json.loads((tmp_path / f"{command}.json").read_text())
    meta = payload["meta"]
    assert meta["command"] == command and meta["device"]["gpu"] and meta["date"]
    assert meta["commit"] == common.git_state(common.library_root())[0]
    errors = [e for e in payload["errors"] if not e.get("skipped")]    # skipped: an op a form does not offer
    assert payload["results"] and not errors, errors
    capsys.readouterr()
    assert cli.main([command, "--replot", str(tmp_path / f"{command}.json"), "--out", str(tmp_path / "re"),
                     "--no-chart"]) == 0
    assert (tmp_path / "re" / f"{command}.md").read_text() == (tmp_path / f"{command}.md").read_text()
    return payload


@requires_gpu
def test_forward(tmp_path, capsys):
    payload = run_and_replot("forward", tmp_path, capsys)
    impls = {r["impl"] for r in payload["results"]}
    assert {"ours", "ours_ip", "copy"} <= impls
    assert all(r["us"] > 0 for r in payload["results"])


@requires_torch_gpu
def test_backward(tmp_path, capsys):
    payload = run_and_replot("backward", tmp_path, capsys)
    assert {(r["phase"], r["mode"]) for r in payload["results"]} == {
        (p, m) for p in ("backward", "forward+backward") for m in ("graph", "cold")}
    for r in payload["results"]:
        assert r["us"]["ours"] > 0 and r["us"]["copy"] > 0 and r["agree_dx"] < 1e-2


@requires_torch_gpu
def test_quant(tmp_path, capsys):
    payload = run_and_replot("quant", tmp_path, capsys)
    assert [r["case"] for r in payload["results"]] == ["static", "fused per_group"]
    assert all(r["us"]["ours"] > 0 and r["agree"] > 0.99 for r in payload["results"])
    assert payload["skipped"] == {"flashinfer": "--flashinfer none"}


@requires_torch_gpu
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_train(tmp_path, capsys):
    payload = run_and_replot("train", tmp_path, capsys)
    assert [r["variant"] for r in payload["results"]] == ["hf", "ours"]
    assert payload["meta"]["norms_replaced"] == 3 and payload["max_abs_loss_diff"] < 0.05


@requires_torch_gpu
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the torch_compile peer needs Triton")
def test_qk_rope(tmp_path, capsys):
    payload = run_and_replot("qk_rope", tmp_path, capsys)
    assert [(r["op"], r["mode"]) for r in payload["results"]] == [("fwd", "graph"), ("fwd", "cold"),
                                                                  ("fwdbwd", "graph"), ("fwdbwd", "cold")]
    for r in payload["results"]:
        for impl in ("ours", "torch_compile", "copy"):
            assert r["us"][impl] is not None and 0 < r["us"][impl] < float("inf"), (impl, r)
        # against the float64 reference, relative to its largest magnitude: the bfloat16 tolerances of
        # tests/gpu/test_gpu_qk_rope.py (llama mode: one unit of the element plus two of the head's
        # largest) and tests/gpu/test_torch_qk_rope_gpu.py (gradients: 2**-6 of the largest)
        assert r["err"]["ours"] <= (3 * 2.0 ** -7 if r["op"] == "fwd" else 2.0 ** -6), r
