"""``python -m cupy_rmsnorm.bench layer_norm`` on the CPU: its arguments and shapes, the peers
chosen from what is importable, the bytes of the copy floor, the composites against the
library's reference (CPU torch), one shape's check-then-time loop with the GPU parts stood in
for, the report, --replot and the no-GPU path (the timing itself needs a GPU)."""

import contextlib
import csv
import json
import os

import numpy as np
import pytest

from cupy_rmsnorm.bench import cli, common, layer_norm, report, timing


# -- arguments and shapes ----------------------------------------------------------------------------
def test_defaults():
    args = cli.parse_args(["layer_norm"])
    assert args.shapes == [(t, d) for d in (768, 1152, 1280, 4096, 8192) for t in (1, 32, 256, 4096, 16384)]
    assert args.ops == ["fwd", "bwd", "fwdbwd", "fused", "modulate"] and args.modes == ["graph", "cold"]
    assert args.dtypes == ["bfloat16"] and args.peers == ["F.layer_norm", "torch.compile", "liger", "quack",
                                                          "flashinfer", "copy"]
    assert (args.repeats, args.out, args.name, args.replot, args.no_chart) == (7, "bench_results", "layer_norm",
                                                                                None, False)


def test_options_and_quick():
    args = cli.parse_args(["layer_norm", "--shapes", "1,8x768", "8x768", "--ops", "MODULATE,fwd", "--peers",
                           "liger,copy", "--dtypes", "fp16", "--modes", "cold", "--quick"])
    assert args.shapes == [(1, 768), (8, 768)] and args.ops == ["modulate", "fwd"]
    assert args.peers == ["liger", "copy"] and args.dtypes == ["float16"] and args.modes == ["cold"]
    assert args.repeats == 3                                                 # --quick where not given
    quick = cli.parse_args(["layer_norm", "--quick"])
    assert quick.shapes == layer_norm.QUICK["shapes"] and cli.parse_args(["layer_norm", "--peers", "none"]).peers == []


@pytest.mark.parametrize("argv, needle", [(["--ops", "bwd,ln"], "unknown op"), (["--peers", "apex"], "unknown peer"),
                                          (["--shapes", "8x0"], "positive"), (["--modes", "hot"], "unknown mode")])
def test_bad_command_lines_exit_2(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["layer_norm"] + argv)
    assert exc.value.code == common.EXIT_USAGE and needle in capsys.readouterr().err


def test_the_copy_floor_moves_the_passes_bytes():
    assert layer_norm.moved_bytes("fwd", 4096, 768, 2) == 2 * 4096 * 768 * 2           # x read, y written
    assert layer_norm.moved_bytes("bwd", 4096, 768, 2) == 3 * 4096 * 768 * 2           # dy, x read; dx written
    assert layer_norm.moved_bytes("fwdbwd", 16384, 8192, 4) == 5 * 16384 * 8192 * 4
    assert layer_norm.moved_bytes("fused", 1, 1152, 2) == 4 * 1152 * 2                 # x, residual; y, the sum
    assert layer_norm.moved_bytes("modulate", 32, 1280, 2) == 2 * 32 * 1280 * 2


# -- peers ----------------------------------------------------------------------------------------
def test_peers_chosen_from_what_imports(monkeypatch):
    present = {"triton", "liger_kernel"}
    monkeypatch.setattr(common.importlib.util, "find_spec",
                        lambda name: object() if name.split(".")[0] in present else None)
    monkeypatch.setattr(common.importlib, "import_module", lambda name: None)
    impls, missing = layer_norm.availability(["ours", *layer_norm.SELECTABLE])
    assert impls == ["ours", "F.layer_norm", "torch.compile", "liger", "copy"]
    assert missing == {"quack": "quack-kernels is not installed (pip install quack-kernels)",
                       "flashinfer": "flashinfer-python is not installed (pip install flashinfer-python)"}
    present.clear()
    impls, missing = layer_norm.availability(["ours", "torch.compile", "liger", "copy"])
    assert impls == ["ours", "copy"] and "Triton" in missing["torch.compile"] and "liger-kernel" in missing["liger"]

    def broken(name):
        raise ImportError("no CUTLASS DSL")
    present.add("quack")
    monkeypatch.setattr(common.importlib, "import_module", broken)
    assert layer_norm.availability(["quack"]) == ([], {"quack": "quack.layernorm does not import (ImportError: "
                                                                "no CUTLASS DSL)"})


def test_what_each_peer_computes():
    support = {(i, op): layer_norm.unsupported(i, op, "bfloat16") is None for i in layer_norm.IMPLS
               for op in layer_norm.OPS}
    assert all(support[i, op] for i in ("ours", "F.layer_norm", "torch.compile", "copy") for op in layer_norm.OPS)
    assert [op for op in layer_norm.OPS if support["liger", op]] == ["fwd", "bwd", "fwdbwd"]
    assert [op for op in layer_norm.OPS if support["quack", op]] == ["fwd"] == [
        op for op in layer_norm.OPS if support["flashinfer", op]]
    assert "bfloat16" in layer_norm.unsupported("flashinfer", "fwd", "float16")
    assert layer_norm.unsupported("quack", "fwd", "float32") is None


# -- the composites against the library's reference (CPU torch) ---------------------------------------
def test_make_inputs():
    torch = pytest.importorskip("torch")
    inputs = layer_norm.make_inputs(torch, (5, 64), torch.bfloat16, "cpu", seed=3)
    assert all(inputs[k].shape == (5, 64) and inputs[k].dtype == torch.bfloat16 for k in ("x", "residual", "dy"))
    assert inputs["shift"].shape == inputs["scale"].shape == (1, 64) and inputs["weight"].shape == (64,)
    assert inputs["weight32"].dtype == torch.float32 and torch.equal(inputs["weight32"], inputs["weight"].float())
    assert torch.equal(inputs["bias32"].bfloat16(), inputs["bias"])                # the same values, exactly


def test_the_composites_are_the_librarys_numerics():
    torch = pytest.importorskip("torch")
    from cupy_rmsnorm.ops.layer_norm import reference
    f32 = layer_norm.make_inputs(torch, (6, 96), torch.float32, "cpu", seed=1)
    x, w, b, shift, scale = (f32[k] for k in ("x", "weight", "bias", "shift", "scale"))
    y = layer_norm.composite("plain")(x, w, b)
    np.testing.assert_allclose(y.numpy(), reference.layer_norm_reference(x.numpy(), w.numpy(), b.numpy(),
                                                                          layer_norm.EPS), rtol=0, atol=2e-5)
    m = layer_norm.composite("modulate")(x, shift, scale)
    np.testing.assert_allclose(m.numpy(), reference.layer_norm_modulate_reference(
        x.numpy(), shift.numpy(), scale.numpy(), layer_norm.EPS), rtol=0, atol=2e-5)
    bf = layer_norm.make_inputs(torch, (6, 96), torch.bfloat16, "cpu", seed=2)
    y, s = layer_norm.composite("fused")(bf["x"], bf["residual"], bf["weight"], bf["bias"])
    want_y, want_s = reference.fused_add_layer_norm_reference(
        *(bf[k].float().numpy() for k in ("x", "residual", "weight", "bias")), layer_norm.EPS)
    # the sum rounded once to bfloat16, as the library rounds it: bit for bit
    assert torch.equal(s, (bf["x"].float() + bf["residual"].float()).bfloat16())
    assert float((y.float() - torch.from_numpy(want_y)).abs().max()) < 2e-2 * float(np.abs(want_y).max())


@pytest.mark.parametrize("op", layer_norm.OPS)
def test_each_torch_pass_agrees_with_ours_on_cpu_tensors(op):
    """Ours (the library's CPU path) and F.layer_norm's pass of each op, built as the run builds
    them: within the check's tolerance, every output of the same shape."""
    torch = pytest.importorskip("torch")
    inputs = layer_norm.make_inputs(torch, (8, 128), torch.bfloat16, "cpu", seed=5)
    want = layer_norm.build(torch, "ours", "bwd" if op == "fwdbwd" else op, inputs)()
    call = layer_norm.build(torch, "F.layer_norm", op, inputs)
    for _ in range(2):                                   # repeated calls: what a graph replays
        assert common.disagreement(call(), want) <= layer_norm.TOLERANCE
    if op == "fwdbwd":
        ours = layer_norm.build(torch, "ours", "fwdbwd", inputs)()
        assert [t.shape for t in ours] == [(8, 128), (128,), (128,)]
        assert common.disagreement(ours, want) <= layer_norm.TOLERANCE


def test_one_shape_checks_then_times(monkeypatch):
    """The measurement of one shape with the GPU parts stood in for (CPU inputs, a fake timer): a
    peer off by 10% is recorded as an error and never timed; the others are, in each mode."""
    torch = pytest.importorskip("torch")
    real_build, real_inputs = layer_norm.build, layer_norm.make_inputs

    def build(torch_, impl, op, inputs):
        if impl == "copy":
            return lambda: None
        if impl == "liger":                                  # a wrong peer: F.layer_norm's outputs 10% off
            call = real_build(torch_, "F.layer_norm", op, inputs)
            return lambda: tuple(t * 1.1 for t in call()) if op != "fwd" else call() * 1.1
        return real_build(torch_, impl, op, inputs)
    monkeypatch.setattr(layer_norm, "build", build)
    monkeypatch.setattr(layer_norm, "make_inputs", lambda t, shape, dtype, device, seed: real_inputs(t, shape, dtype,
                                                                                                     "cpu"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    timed = []

    class Runner:
        def context(self):
            return contextlib.nullcontext()

        def synchronize(self):
            pass
    monkeypatch.setattr(timing, "calls_for", lambda *a: 3)
    monkeypatch.setattr(timing, "timed_us", lambda runner, fn, mode, *a: timed.append(mode) or 2.0)
    args = cli.parse_args(["layer_norm", "--shapes", "4x64", "--ops", "fwd,fused"])
    payload = {"results": [], "errors": [], "skipped": {}}
    layer_norm.measure_shape(torch, args, payload, ["ours", "F.layer_norm", "liger", "copy"], {"torch": Runner()},
                             None, 1000.0, {}, (4, 64), "bfloat16")
    assert [(r["op"], r["mode"]) for r in payload["results"]] == [("fwd", "graph"), ("fwd", "cold"),
                                                                  ("fused", "graph"), ("fused", "cold")]
    fwd, fused = payload["results"][0], payload["results"][2]
    assert fwd["us"] == {"ours": 2.0, "F.layer_norm": 2.0, "liger": None, "copy": 2.0}
    assert fwd["err"]["liger"] == pytest.approx(0.1, rel=0.1) and fwd["err"]["F.layer_norm"] <= 1e-2
    assert fused["us"]["liger"] is None and "liger" not in fused["err"] and fused["bytes"] == 4 * 4 * 64 * 2
    assert payload["skipped"] == {"liger (Liger has no fused-add or modulated LayerNorm)": "1 cases"}
    assert [e["where"] for e in payload["errors"]] == ["liger fwd bfloat16 4x64"]
    assert len(timed) == (3 + 3) * 2                          # ours, F.layer_norm, copy x passes x modes


# -- the report --------------------------------------------------------------------------------------
def record(op="fwd", mode="graph", tokens=4096, hidden=768, **us):
    times = {"ours": 10.0, "F.layer_norm": 20.0, "torch.compile": 12.5, "liger": 15.0, "quack": None,
             "flashinfer": 11.0, "copy": 8.0}
    return {"op": op, "mode": mode, "dtype": "bfloat16", "tokens": tokens, "hidden": hidden, "bytes": 1000,
            "us": dict(times, **us), "err": {"ours": 0.0, "F.layer_norm": 4e-3, "flashinfer": 5e-3}}


def sample():
    return {"meta": {"command": "layer_norm", "commit": "abc", "dirty": False, "device": {"gpu": "Fake GPU"},
                     "copy_GBps": 4000.0},
            "results": [record(op="modulate", mode="cold", liger=None, flashinfer=None), record(),
                        record(op="bwd", tokens=16384, hidden=8192, flashinfer=None)],
            "errors": [{"where": "quack fwd bfloat16 4096x768", "error": "RuntimeError: x"}],
            "skipped": {"flashinfer (flashinfer's layernorm: forward only, no fused add or modulation)": "2 cases"}}


def test_report_and_files(tmp_path):
    text = layer_norm.format_report(sample())
    assert text.index("== layer_norm, graph mode") < text.index("== backward, graph mode") < text.index(
        "== layer_norm_modulate, cold mode")
    assert "geomean ours / best peer: 0.909 over 1 cases" in text and "error: quack fwd bfloat16 4096x768" in text
    written = common.write_report(layer_norm, sample(), str(tmp_path), "ln", charts=False)
    assert sorted(os.path.basename(p) for p in written) == ["ln.csv", "ln.json", "ln.md"]
    with open(tmp_path / "ln.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["op"] for r in rows] == ["modulate", "fwd", "bwd"] and rows[2]["hidden"] == "8192"
    assert rows[1]["ours_us"] == "10.000" and rows[1]["quack_us"] == "" and rows[1]["flashinfer_err"] == "5.000e-03"
    assert "copy_err" not in rows[0]
    md = " ".join((tmp_path / "ln.md").read_text().split())
    assert md.startswith("# LayerNorm: Fake GPU") and "copy bandwidth: 4000 GB/s" in md
    assert "| 4096x768 | 10.00 | 20.00 | 12.50 | 15.00 | - | 11.00 | 8.00 | 0.909 | 1.250 | 5.0e-03 |" in md


def test_charts_are_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    paths = layer_norm.write_charts(sample(), str(tmp_path / "ln"))
    assert sorted(os.path.basename(p) for p in paths) == ["ln_cold_bfloat16.png", "ln_graph_bfloat16.png"]
    for path in paths:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_replot_of_a_saved_report(tmp_path, capsys):
    saved = tmp_path / "run.json"
    report.write_json(str(saved), sample())
    assert cli.main(["layer_norm", "--replot", str(saved), "--out", str(tmp_path / "out"), "--no-chart"]) == 0
    assert capsys.readouterr().out == layer_norm.format_report(json.loads(saved.read_text())) + "\n"
    assert sorted(os.listdir(tmp_path / "out")) == ["run.csv", "run.md"]


# -- no GPU ----------------------------------------------------------------------------------------------
def test_no_gpu_exits_3_saying_no_report_is_committed_yet(monkeypatch, capsys):
    monkeypatch.setattr(timing, "gpu_missing", lambda: "CUDARuntimeError: no device")
    assert cli.main(["layer_norm", "--quick"]) == common.EXIT_NO_GPU == 3
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1
    assert out.err.startswith("cupy-rmsnorm-bench layer_norm: no CUDA GPU available, nothing measured "
                              "(CUDARuntimeError: no device). ")
    report = common.committed_report("layer_norm")
    if report is None:       # this checkout holds no report of it yet
        assert "No report of layer_norm is committed yet (it would be benchmarks/results/layer_norm.json)" in out.err
    else:
        assert out.err.rstrip().endswith(f"-m cupy_rmsnorm.bench layer_norm --replot {report}")


def test_a_missing_torch_is_an_error_saying_what_to_install(monkeypatch, capsys):
    monkeypatch.setattr(timing, "gpu_missing", lambda: None)
    monkeypatch.setattr(common, "torch_missing", lambda: "PyTorch is not importable; " + common.INSTALL_HINTS["torch"])
    assert cli.main(["layer_norm"]) == common.EXIT_ERROR
    assert "pip install torch" in capsys.readouterr().err
