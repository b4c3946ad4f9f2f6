"""``python -m cupy_rmsnorm.bench gated`` on the CPU: its arguments and cases, the bytes of each
pass, the packed views of the Gated DeltaNet layout, the composite and the Hugging Face peer's
passes (CPU torch), the check, the table, the files, --replot and the no-GPU path (the timing
itself needs a GPU)."""

import contextlib
import csv
import json
import os
import subprocess
import sys

import pytest
from helpers import child_env

from cupy_rmsnorm.bench import cli, common, gated, report, timing

HEADS_CASE = gated.Case("heads", 4096, 32, 128, None, "norm-gate")
ROWS_CASE = gated.Case("rows", 16384, 1, 8192, 1024, "norm-gate")


# -- arguments and cases ----------------------------------------------------------------------------
def test_defaults():
    args = cli.parse_args(["gated"])
    assert args.heads == [(1, 32), (32, 32), (256, 32), (4096, 32), (16384, 32)] and args.head_dim == 128
    assert args.shapes == [(t, h) for h in (4096, 8192) for t in (1, 32, 256, 4096, 16384)]
    assert args.group_sizes == [None, 1024] and args.orders == ["norm-gate"] and args.layouts == ["heads", "rows"]
    assert args.ops == ["fwd", "bwd", "fwdbwd"] and args.modes == ["graph", "cold"] and args.dtypes == ["bfloat16"]
    assert args.peers == ["ours_cupy", "fla", "fla_grouped", "torch.compile", "hf", "copy"]
    assert (args.repeats, args.out, args.name, args.replot) == (7, "bench_results", "gated", None)
    cases = gated.cases(args)
    assert len(cases) == 5 + 10 * 2
    assert cases[0] == gated.Case("heads", 1, 32, 128, None, "norm-gate")
    assert cases[5:7] == [gated.Case("rows", 1, 1, 4096, None, "norm-gate"),
                          gated.Case("rows", 1, 1, 4096, 1024, "norm-gate")]
    assert cases[-1] == gated.Case("rows", 16384, 1, 8192, 1024, "norm-gate")


def test_options():
    args = cli.parse_args(["gated", "--heads", "8,16x4", "2x8", "--head-dim", "64", "--shapes", "4x2048,3000",
                           "--group-sizes", "512,none,512", "--orders", "gate-norm,norm-gate", "--ops", "bwd,FWD",
                           "--peers", "fla,copy", "--dtypes", "bf16,fp16", "--modes", "cold", "--layouts", "rows"])
    assert args.heads == [(8, 4), (16, 4), (2, 8)] and args.head_dim == 64
    assert args.shapes == [(4, 2048), (4, 3000)] and args.group_sizes == [512, None]
    assert args.orders == ["gate-norm", "norm-gate"] and args.ops == ["bwd", "fwd"]
    assert args.peers == ["fla", "copy"] and args.dtypes == ["bfloat16", "float16"] and args.modes == ["cold"]
    # rows only; 512 does not divide 3000: that hidden size gets the whole row alone
    assert [gated.describe(c) for c in gated.cases(args)] == [
        "4x2048 g512 gate-norm", "4x2048 g512 norm-gate", "4x2048 gate-norm", "4x2048 norm-gate",
        "4x3000 gate-norm", "4x3000 norm-gate"]
    assert cli.parse_args(["gated", "--peers", "none"]).peers == []
    assert cli.parse_args(["gated", "--peers", "ALL"]).peers == list(gated.SELECTABLE)
    heads = cli.parse_args(["gated", "--layouts", "heads", "--heads", "4x2", "--head-dim", "64"])
    assert gated.cases(heads) == [gated.Case("heads", 4, 2, 64, None, "norm-gate")]


def test_quick():
    args = cli.parse_args(["gated", "--quick", "--ops", "fwd"])
    assert args.heads == [(1, 32), (4096, 32)] and args.shapes == [(1, 4096), (4096, 4096)]
    assert args.repeats == 3 and args.ops == ["fwd"] and len(gated.cases(args)) == 2 + 2 * 2


@pytest.mark.parametrize("argv, needle", [
    (["gated", "--ops", "back"], "unknown op 'back'"),
    (["gated", "--peers", "fla,liger"], "unknown peer 'liger'"),
    (["gated", "--group-sizes", "0"], "bad group size '0'"),
    (["gated", "--orders", "gate"], "unknown order"),
    (["gated", "--heads", "4x"], "argument --heads: bad shape '4x'"),
    (["gated", "--layouts", "rows", "--shapes", "4x1000", "--group-sizes", "1024"], "no case to measure"),
])
def test_bad_command_lines_exit_2(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == common.EXIT_USAGE
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_what_each_peer_cannot_do():
    gate_first = ROWS_CASE._replace(group_size=None, order="gate-norm")
    assert gated.unsupported("fla", ROWS_CASE) == "FusedRMSNormGated has no group size"
    assert gated.unsupported("fla", gate_first) == "FusedRMSNormGated normalizes before the gate only"
    assert gated.unsupported("fla", HEADS_CASE) is None
    assert gated.unsupported("hf", ROWS_CASE) == "Qwen3NextRMSNormGated has no group size"
    for impl in ("ours", "ours_cupy", "fla_grouped", "torch.compile", "copy"):
        assert all(gated.unsupported(impl, c) is None for c in (HEADS_CASE, ROWS_CASE, gate_first)), impl


def test_hugging_face_groups_as_the_installed_transformers_has_them():
    pytest.importorskip("transformers", reason="transformers is not installed")
    grouped_mamba = gated.unsupported("hf", ROWS_CASE._replace(order="gate-norm"))   # Mamba2's module: groups
    assert grouped_mamba == (None if gated._mamba_takes_group_size()                 # in newer transformers
                             else "this transformers' MambaRMSNormGated has no group size")


def test_a_missing_fla_says_how_to_install(monkeypatch):
    monkeypatch.setattr(common.importlib.util, "find_spec", lambda name: None)
    impls, missing = gated.availability(["ours", "fla", "fla_grouped", "torch.compile", "copy"])
    assert impls == ["ours", "copy"]
    assert missing["fla"] == missing["fla_grouped"] == "fla-core is not installed (pip install fla-core " \
                                                      "(flash-linear-attention's Triton kernels))"
    assert "Triton is not installed" in missing["torch.compile"]


# -- bytes, inputs, the composite and the torch passes (CPU torch) ------------------------------------
def test_bytes_of_each_pass():
    elements = 4096 * 32 * 128
    assert gated.moved_bytes("fwd", HEADS_CASE, 2) == 3 * elements * 2          # x, gate read; y written
    assert gated.moved_bytes("bwd", HEADS_CASE, 2) == 5 * elements * 2          # + dy read; dx, dgate written
    assert gated.moved_bytes("fwdbwd", HEADS_CASE, 2) == 8 * elements * 2
    assert gated.moved_bytes("fwd", ROWS_CASE, 4) == 3 * 16384 * 8192 * 4       # the group changes nothing


def test_the_heads_layout_is_two_views_into_one_packed_buffer():
    torch = pytest.importorskip("torch")
    case = gated.Case("heads", 5, 3, 16, None, "norm-gate")
    inputs = gated.make_inputs(torch, case, torch.bfloat16, "cpu", seed=3)
    x, gate, packed = inputs["x"], inputs["gate"], inputs["packed"]
    assert packed.shape == (5, 2 * 3 * 16) and packed.is_contiguous()
    assert x.shape == gate.shape == (5, 3, 16)
    assert x.stride() == gate.stride() == (2 * 3 * 16, 16, 1)                   # row stride of the packed buffer
    assert not x.is_contiguous() and not gate.is_contiguous()
    assert x.data_ptr() == packed.data_ptr() and gate.data_ptr() == packed.data_ptr() + 3 * 16 * 2
    assert torch.equal(gate[2, 1], packed[2, 3 * 16 + 16:3 * 16 + 32])
    assert inputs["weight"].shape == (16,) and inputs["dy"].shape == (5, 3, 16) and inputs["dy"].is_contiguous()
    rows = gated.make_inputs(torch, gated.Case("rows", 5, 1, 64, 16, "norm-gate"), torch.float16, "cpu")
    assert rows["packed"] is None and rows["x"].shape == rows["gate"].shape == (5, 64)
    assert rows["x"].is_contiguous() and rows["weight"].shape == (64,) and rows["x"].dtype == torch.float16


def _reference(torch, case, x, gate, weight):
    """The two orders in float64 (the per-head or per-group RMS, then the weight)."""
    x, gate, w = x.double(), gate.double(), weight.double()
    silu = gate * torch.sigmoid(gate)
    h = x if case.norm_before_gate else x * silu
    g = h.unflatten(-1, (-1, case.group_size)) if case.group_size else h
    g = g / torch.sqrt(g.pow(2).mean(-1, keepdim=True) + gated.EPS)
    y = (g.flatten(-2) if case.group_size else g) * w
    return y * silu if case.norm_before_gate else y


@pytest.mark.parametrize("case", [gated.Case("heads", 6, 4, 32, None, "norm-gate"),
                                  gated.Case("rows", 6, 1, 64, 16, "gate-norm"),
                                  gated.Case("rows", 6, 1, 64, None, "gate-norm")], ids=gated.describe)
def test_the_composite_is_the_formula_and_the_hf_modules(case):
    """The torch.compile peer's function: each order's formula, and bit for bit the Hugging Face
    module of that order (Qwen3-Next's, Mamba2's with groups), forward and gradients."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    inputs = gated.make_inputs(torch, case, torch.bfloat16, "cpu", seed=7)
    x, gate, weight, dy = (inputs[k] for k in ("x", "gate", "weight", "dy"))
    y = gated.composite()(x, gate, weight, case.group_size, case.norm_before_gate)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    expected = _reference(torch, case, x, gate, weight)
    assert float((y.double() - expected).abs().max() / expected.abs().max()) < 2 ** -6

    reason = gated.unsupported("hf", case)
    if reason:
        pytest.skip(f"the formula holds; the Hugging Face module: {reason}")
    assert torch.equal(gated.build(torch, "hf", "fwd", case, inputs)(), y)
    xg, gg = x.detach().requires_grad_(True), gate.detach().requires_grad_(True)
    wg = weight.detach().clone().requires_grad_(True)
    grads = torch.autograd.grad(gated.composite()(xg, gg, wg, case.group_size, case.norm_before_gate), (xg, gg, wg), dy)
    for op in ("bwd", "fwdbwd"):
        call = gated.build(torch, "hf", op, case, inputs)
        for _ in range(2):                                   # repeated calls: what a graph replays
            result = call()
            assert [tuple(t.shape) for t in result] == [x.shape, x.shape, (case.width,)]
            assert all(torch.equal(a, b) for a, b in zip(result, grads)), op
            assert common.disagreement(result, grads) == 0.0


def test_the_forward_records_no_graph_and_the_backward_keeps_the_strides():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    case = gated.Case("heads", 3, 2, 8, None, "norm-gate")
    inputs = gated.make_inputs(torch, case, torch.float32, "cpu")
    assert not gated.build(torch, "hf", "fwd", case, inputs)().requires_grad
    forward, weight = gated.torch_forward(torch, "hf", case, inputs["weight"])
    assert weight.requires_grad and weight.is_leaf and torch.equal(weight, inputs["weight"])
    assert weight.data_ptr() != inputs["weight"].data_ptr()             # the peer's own parameter


def test_disagreement():
    torch = pytest.importorskip("torch")
    ours = (torch.tensor([1.0, -4.0]), torch.tensor([2.0, 0.0]))
    assert common.disagreement(ours, ours) == 0.0
    assert common.disagreement((torch.tensor([1.0, -3.0]), ours[1]), ours) == pytest.approx(0.25)
    assert common.disagreement(torch.tensor([1.0, -4.0]).bfloat16(), torch.tensor([1.0, -4.1])) == pytest.approx(
        0.1 / 4.1, rel=1e-6)
    nan = common.disagreement((ours[0], torch.tensor([float("nan"), 0.0])), ours)
    assert nan != nan and not nan <= gated.TOLERANCE                       # a NaN fails the check
    with pytest.raises(ValueError, match="1 outputs where ours has 2"):
        common.disagreement(ours[0], ours)
    with pytest.raises(ValueError, match="shape"):
        common.disagreement(torch.zeros(3), torch.zeros(2))



def test_an_implementation_that_disagrees_is_an_error_and_not_timed(monkeypatch):
    """The measurement of one case with the GPU parts stood in for (CPU inputs, a fake timer, the
    HF module as ours): a peer off by 10% is recorded as an error and never timed, the others are."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    real_build, real_inputs = gated.build, gated.make_inputs

    def build(torch_, impl, op, case, inputs):
        if impl == "copy":
            return lambda: None
        call = real_build(torch_, "hf", op, case, inputs)
        if impl == "fla_grouped":                               # a wrong peer: outputs 10% off
            return lambda: tuple(t * 1.1 for t in call()) if op != "fwd" else call() * 1.1
        return call
    monkeypatch.setattr(gated, "build", build)
    monkeypatch.setattr(gated, "make_inputs", lambda t, case, dtype, device, seed: real_inputs(t, case, dtype, "cpu"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    timed = []

    class Runner:
        def context(self):
            return contextlib.nullcontext()

        def synchronize(self):
            pass
    monkeypatch.setattr(timing, "calls_for", lambda *a: 3)
    monkeypatch.setattr(timing, "timed_us", lambda runner, fn, mode, *a: timed.append(mode) or 2.0)
    args = cli.parse_args(["gated", "--layouts", "heads", "--heads", "4x2", "--head-dim", "8", "--ops", "fwd,bwd"])
    payload = {"results": [], "errors": [], "skipped": {}}
    gated.measure_case(torch, args, payload, ["ours", "fla_grouped", "hf", "copy"], {"torch": Runner()}, None, 1000.0,
                       {}, gated.cases(args)[0], "bfloat16")
    assert [(r["op"], r["mode"]) for r in payload["results"]] == [("fwd", "graph"), ("fwd", "cold"),
                                                                  ("bwd", "graph"), ("bwd", "cold")]
    for r in payload["results"]:
        assert r["us"] == {"ours": 2.0, "fla_grouped": None, "hf": 2.0, "copy": 2.0}
        assert r["err"]["hf"] == 0.0 and r["err"]["fla_grouped"] == pytest.approx(0.1, rel=0.05)
    assert len(timed) == 3 * 2 * 2                              # ours, hf, copy x modes x passes
    assert [e["where"] for e in payload["errors"]] == ["fla_grouped fwd bfloat16 4x2x8 norm-gate",
                                                       "fla_grouped bwd bfloat16 4x2x8 norm-gate"]
    assert all("past the tolerance" in e["error"] and "not timed" in e["error"] for e in payload["errors"])

# -- the report --------------------------------------------------------------------------------------
def record(case, op="fwd", mode="graph", dtype="bfloat16", **us):
    times = {"ours": 10.0, "ours_cupy": 9.0, "fla": 20.0, "fla_grouped": None, "torch.compile": 12.5, "hf": 40.0,
             "copy": 8.0}
    return {**case._asdict(), "op": op, "mode": mode, "dtype": dtype, "bytes": 1000,
            "us": dict(times, **us), "err": {"ours": 0.0, "ours_cupy": 0.0, "fla": 3e-3, "torch.compile": 5e-3}}


def payload(results):
    return {"meta": {"command": "gated", "commit": "abc", "dirty": False, "device": {"gpu": "Fake GPU"},
                     "copy_GBps": 4000.0},
            "results": results,
            "errors": [{"where": "fla_grouped fwd bfloat16 4096x32x128 norm-gate", "error": "RuntimeError: x"}],
            "skipped": {"fla (FusedRMSNormGated has no group size)": "1 cases"}}


def sample():
    return payload([record(HEADS_CASE, op="bwd", mode="cold"), record(ROWS_CASE, hf=None, fla=None),
                    record(HEADS_CASE), record(HEADS_CASE, op="fwd", mode="cold", ours=16.0)])


def test_files(tmp_path):
    written = common.write_report(gated, sample(), str(tmp_path), "g", charts=False)
    assert sorted(os.path.basename(p) for p in written) == ["g.csv", "g.json", "g.md"]
    with open(tmp_path / "g.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["op"] for r in rows] == ["bwd", "fwd", "fwd", "fwd"]
    assert rows[1]["layout"] == "rows" and rows[1]["group_size"] == "1024" and rows[1]["width"] == "8192"
    assert rows[1]["fla_us"] == "" and rows[1]["ours_us"] == "10.000" and rows[0]["fla_err"] == "3.000e-03"
    assert rows[0]["hf_err"] == "" and "copy_err" not in rows[0]
    md = " ".join((tmp_path / "g.md").read_text().split())   # the cells, whatever their padding
    assert md.startswith("# Gated RMSNorm: Fake GPU") and "copy bandwidth: 4000 GB/s" in md
    assert "## backward, cold mode, bfloat16: GPU microseconds per call (medians)" in md
    assert ("| 4096x32x128 | - | norm-gate | 10.00 | 9.00 | 20.00 | - | 12.50 | 40.00 | 8.00 | 0.800 | 1.250 "
            "| 5.0e-03 |") in md


def test_charts_are_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    paths = gated.write_charts(sample(), str(tmp_path / "g"))
    assert sorted(os.path.basename(p) for p in paths) == ["g_cold_bfloat16.png", "g_graph_bfloat16.png"]
    for path in paths:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_replot_of_a_saved_report(tmp_path, capsys):
    saved = tmp_path / "run.json"
    report.write_json(str(saved), sample())
    out = tmp_path / "out"
    assert cli.main(["gated", "--replot", str(saved), "--out", str(out), "--name", "re", "--no-chart"]) == 0
    text = capsys.readouterr().out
    assert text == gated.format_report(json.loads(saved.read_text())) + "\n"
    assert "== backward, cold mode, bfloat16" in text and "16384x8192" in text
    assert sorted(os.listdir(out)) == ["re.csv", "re.md"]
    assert (out / "re.md").read_text() == gated.format_markdown(sample())


def test_replot_refuses_another_subcommands_report(tmp_path, capsys):
    other = tmp_path / "b.json"
    report.write_json(str(other), dict(sample(), meta={"command": "backward"}))
    assert cli.main(["gated", "--replot", str(other), "--out", str(tmp_path)]) == common.EXIT_ERROR
    assert f"is a backward report: cupy-rmsnorm-bench backward --replot {other}" in capsys.readouterr().err


# -- no GPU, --help --------------------------------------------------------------------------------------
def test_no_gpu_exits_3_pointing_to_the_committed_report(monkeypatch, capsys):
    monkeypatch.setattr(timing, "gpu_missing", lambda: "CUDARuntimeError: no device")
    assert cli.main(["gated", "--quick"]) == common.EXIT_NO_GPU == 3
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1
    assert out.err.startswith("cupy-rmsnorm-bench gated: no CUDA GPU available, nothing measured "
                              "(CUDARuntimeError: no device). The committed report: ")
    replot = out.err.split("The committed report: ")[1].split()
    assert replot == [common.python_command(), "-m", "cupy_rmsnorm.bench", "gated", "--replot",
                      common.committed_report("gated")]
    assert replot[-1].replace(os.sep, "/").endswith("benchmarks/results/gated.json")


def test_help_and_no_gpu_from_the_command_line(tmp_path):
    env = child_env(CUDA_VISIBLE_DEVICES="")
    top = subprocess.run([sys.executable, "-m", "cupy_rmsnorm.bench", "--help"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert top.returncode == 0 and "| gated |" in top.stdout.splitlines()[0] and "pip install fla-core" in top.stdout
    helped = subprocess.run([sys.executable, "-m", "cupy_rmsnorm.bench", "gated", "--help"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith("usage: cupy-rmsnorm-bench gated")
    assert all(s in helped.stdout for s in ("--heads", "--group-sizes", "--ops", "FusedRMSNormGated",
                                            "Qwen3NextRMSNormGated", "pip install fla-core"))
    proc = subprocess.run([sys.executable, "-m", "cupy_rmsnorm.bench", "gated"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == common.EXIT_NO_GPU and proc.stdout == "" and "Traceback" not in proc.stderr
    assert "python -m cupy_rmsnorm.bench gated --replot" in proc.stderr and not os.listdir(tmp_path)
