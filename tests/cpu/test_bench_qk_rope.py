"""``python -m cupy_rmsnorm.bench qk_rope`` on the CPU: its arguments and cases, the bytes of each
pass, the packed views and the angles, the float64 reference against the library's own, the
transformers composites against transformers, the torch peers' passes (CPU torch, eager in place
of compiled), the check, the table, the files, --replot, the no-GPU path, what is left out and why,
and FlashInfer's rope header and wrapper (the timing itself needs a GPU). Every report here is made
up in the test: no report of qk_rope is committed until one is measured."""

import contextlib
import csv
import ctypes
import glob
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from helpers import ROOT, child_env

from cupy_rmsnorm.bench import cli, common, flashinfer, qk_rope, report, timing

QWEN3_8B = qk_rope.Case(4096, 32, 8, 128)
SMALL = qk_rope.Case(5, 4, 2, 16)


# -- arguments and cases ----------------------------------------------------------------------------
def test_defaults():
    args = cli.parse_args(["qk_rope"])
    assert args.tokens == [1, 8, 64, 512, 4096, 16384] and args.heads == [(32, 8, 128), (32, 4, 128)]
    assert args.ops == ["fwd", "fwdbwd"] and args.modes == ["graph", "cold"] and args.dtypes == ["bfloat16"]
    assert args.peers == ["ours_unfused", "torch_compile", "liger", "flashinfer", "copy"]
    assert (args.repeats, args.out, args.name, args.replot, args.flashinfer) == (7, "bench_results", "qk_rope", None,
                                                                                   None)
    cases = qk_rope.cases(args)
    assert len(cases) == 12 and cases[0] == qk_rope.Case(1, 32, 8, 128) and cases[5] == qk_rope.Case(16384, 32, 8, 128)
    assert cases[6:] == [qk_rope.Case(t, 32, 4, 128) for t in qk_rope.TOKENS]
    assert [qk_rope.describe(c) for c in cases[4:7]] == ["4096x32/8x128", "16384x32/8x128", "1x32/4x128"]


def test_options():
    args = cli.parse_args(["qk_rope", "--tokens", "8,1,8", "--heads", "16/2x64,32/4X128", "--ops", "FWDBWD",
                           "--peers", "liger,copy", "--dtypes", "fp16", "--modes", "cold", "--flashinfer", ".flashinfer",
                           "--budget-s", "60"])
    assert args.tokens == [8, 1] and args.heads == [(16, 2, 64), (32, 4, 128)] and args.ops == ["fwdbwd"]
    assert args.peers == ["liger", "copy"] and args.dtypes == ["float16"] and args.modes == ["cold"]
    assert args.flashinfer == ".flashinfer" and args.budget_s == 60
    assert qk_rope.cases(args) == [qk_rope.Case(8, 16, 2, 64), qk_rope.Case(1, 16, 2, 64),
                                   qk_rope.Case(8, 32, 4, 128), qk_rope.Case(1, 32, 4, 128)]
    assert cli.parse_args(["qk_rope", "--peers", "none"]).peers == []
    assert cli.parse_args(["qk_rope", "--peers", "ALL"]).peers == list(qk_rope.SELECTABLE)
    assert {"--out", "--name", "--quick", "--replot", "--dtypes", "--modes", "--repeats", "--no-chart"} <= {
        o for a in cli.build_parser()[1]["qk_rope"]._actions for o in a.option_strings}


def test_quick():
    args = cli.parse_args(["qk_rope", "--quick"])
    assert args.tokens == [1, 4096] and args.heads == list(qk_rope.HEADS) and args.repeats == 3
    assert len(qk_rope.cases(args)) == 4
    assert cli.parse_args(["qk_rope", "--quick", "--tokens", "64"]).tokens == [64]     # given: kept


@pytest.mark.parametrize("argv, needle", [
    (["qk_rope", "--heads", "32/8"], "bad heads '32/8'"),
    (["qk_rope", "--heads", "32/0x128"], "positive integers"),
    (["qk_rope", "--heads", "32/8x127"], "head_dim must be even"),
    (["qk_rope", "--tokens", "0"], "expected a positive integer, got '0'"),
    (["qk_rope", "--tokens", "4096x128"], "expected a positive integer"),
    (["qk_rope", "--ops", "bwd"], "unknown op 'bwd'"),
    (["qk_rope", "--peers", "fla"], "unknown peer 'fla'"),
    (["qk_rope", "--modes", "hot"], "unknown mode 'hot'"),
])
def test_bad_command_lines_exit_2(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == common.EXIT_USAGE
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


# -- bytes, what runs where --------------------------------------------------------------------------
def test_bytes_of_each_pass():
    elements = 4096 * (32 + 8) * 128                          # q's and k's heads; v is not touched
    assert qk_rope.moved_bytes("fwd", QWEN3_8B, 2) == 2 * elements * 2          # read, written in place
    assert qk_rope.moved_bytes("fwdbwd", QWEN3_8B, 2) == 5 * elements * 2       # + do read, x read, dx written
    assert qk_rope.moved_bytes("fwd", qk_rope.Case(1, 32, 4, 128), 4) == 2 * 36 * 128 * 4


def test_what_cannot_run():
    assert qk_rope.unsupported("flashinfer", "fwdbwd", "bfloat16") == "FlashInfer's rope has no backward"
    assert qk_rope.unsupported("flashinfer", "fwd", "float32") == "the FlashInfer wrapper is built for bfloat16 and float16"
    assert qk_rope.unsupported("flashinfer", "fwd", "float16") is None
    for impl in ("ours", "ours_unfused", "torch_compile", "liger", "copy"):
        assert all(qk_rope.unsupported(impl, op, d) is None for op in qk_rope.OPS for d in ("bfloat16", "float32"))


def test_without_triton_or_liger_the_peers_say_how_to_install(monkeypatch):
    everything = ["ours", *qk_rope.SELECTABLE]
    monkeypatch.setattr(common.importlib.util, "find_spec", lambda name: None)
    impls, missing = qk_rope.availability(everything)
    assert impls == ["ours", "flashinfer", "copy"]           # FlashInfer's library is tried by the run
    assert set(missing) == {"ours_unfused", "torch_compile", "liger"}
    assert all(why.startswith("Triton is not installed") for why in missing.values())

    monkeypatch.setattr(common.importlib.util, "find_spec",                          # Triton, no Liger
                        lambda name: None if name.startswith("liger") else object())
    impls, missing = qk_rope.availability(everything)
    assert missing == {"liger": "liger-kernel is not installed (pip install liger-kernel)"}
    assert impls == ["ours", "ours_unfused", "torch_compile", "flashinfer", "copy"]


def test_without_nvcc_flashinfer_says_so(tmp_path, monkeypatch):
    """The rope wrapper's library from a wheel's headers: extracted, then no nvcc to build it."""
    wheel = tmp_path / "fi.whl"
    with __import__("zipfile").ZipFile(wheel, "w") as whl:
        whl.writestr(flashinfer.WHEEL_PREFIX + "norm.cuh", "#include \"math.cuh\"\n" + flashinfer.CUT)
        whl.writestr(flashinfer.WHEEL_PREFIX + "pos_enc.cuh", "#include \"math.cuh\"\n")
        whl.writestr(flashinfer.WHEEL_PREFIX + "math.cuh", "// math\n")
    monkeypatch.setattr(flashinfer, "find_nvcc", lambda: None)
    monkeypatch.setattr(flashinfer.tempfile, "gettempdir", lambda: str(tmp_path / "cache"))
    assert flashinfer.library(str(wheel), "90", flashinfer.ROPE) == (
        None, "RuntimeError: nvcc is not on PATH (a CUDA toolkit builds FlashInfer's kernels)")
    monkeypatch.setattr(flashinfer, "installed_package", lambda: None)
    lib, why = flashinfer.library(None, "90", flashinfer.ROPE)
    assert lib is None and "pip install flashinfer-python" in why


# -- inputs, the reference, the composites (CPU torch) -------------------------------------------------
def test_q_and_k_are_views_into_one_packed_projection():
    torch = pytest.importorskip("torch")
    inputs = qk_rope.make_inputs(torch, SMALL, torch.bfloat16, "cpu", seed=3)
    packed = inputs["packed"]
    width = (4 + 2 * 2) * 16
    assert packed.shape == (5, width) and packed.is_contiguous()
    q, k = qk_rope.head_views(packed, 4, 2, 16)
    assert q.shape == (5, 4, 16) and k.shape == (5, 2, 16)
    assert q.stride() == (width, 16, 1) and k.stride() == (width, 16, 1)
    assert q.data_ptr() == packed.data_ptr() and k.data_ptr() == packed.data_ptr() + 4 * 16 * 2
    assert torch.equal(k[2, 1], packed[2, 4 * 16 + 16:4 * 16 + 32])
    assert inputs["q_weight"].shape == inputs["k_weight"].shape == (16,)
    assert inputs["dq_out"].shape == (5, 4, 16) and inputs["dk_out"].shape == (5, 2, 16)


def test_the_angles_in_both_conventions_are_one_table():
    torch = pytest.importorskip("torch")
    inputs = qk_rope.make_inputs(torch, SMALL, torch.bfloat16, "cpu", seed=4)
    positions, cache = inputs["positions"], inputs["cos_sin_cache"]
    assert positions.dtype == torch.int64 and positions.shape == (5,)
    assert int(positions.min()) >= 0 and int(positions.max()) < qk_rope.MAX_POSITION
    assert cache.dtype == torch.float32 and cache.shape == (qk_rope.MAX_POSITION, 16)
    p = int(positions[1])
    freqs = p * qk_rope.ROPE_THETA ** (-np.arange(0, 16, 2) / 16)
    assert np.allclose(cache[p].numpy(), np.concatenate([np.cos(freqs), np.sin(freqs)]), atol=1e-7)
    cos32, sin32 = inputs["cos32"], inputs["sin32"]                          # transformers': NeoX halves repeated
    assert torch.equal(cos32[1], torch.cat([cache[p, :8], cache[p, :8]]))
    assert torch.equal(sin32[1], torch.cat([cache[p, 8:], cache[p, 8:]]))
    assert inputs["cos"].dtype == torch.bfloat16 and torch.equal(inputs["cos"], cos32.bfloat16())


def test_the_reference_is_the_librarys_contract():
    """The float64 reference against cupy_rmsnorm's NumPy reference (float32, one rounding) on
    float32 inputs, forward and backward: the same formula up to float32 rounding."""
    torch = pytest.importorskip("torch")
    import cupy_rmsnorm as rn
    inputs = qk_rope.make_inputs(torch, SMALL, torch.float32, "cpu", seed=5)
    q, k = (t.numpy().copy() for t in qk_rope.head_views(inputs["packed"], *SMALL[1:]))
    qw, kw, dq, dk = (inputs[n].numpy() for n in ("q_weight", "k_weight", "dq_out", "dk_out"))
    angles = {"positions": inputs["positions"].numpy(), "cos_sin_cache": inputs["cos_sin_cache"].numpy()}
    want = rn.qk_norm_rope(q, k, qw, kw, qk_rope.EPS, **angles)
    got = qk_rope.reference(torch, SMALL, inputs, "fwd")
    assert [g.dtype for g in got] == [torch.float64] * 2
    for g, w in zip(got, want):
        assert np.allclose(g.numpy(), w, rtol=1e-5, atol=1e-6)
    want = rn.qk_norm_rope_backward(dq, dk, q, k, qw, kw, qk_rope.EPS, **angles)
    got = qk_rope.reference(torch, SMALL, inputs, "fwdbwd")
    assert len(got) == 4
    for g, w in zip(got, want):
        assert np.allclose(g.numpy(), w, rtol=1e-4, atol=1e-5 * float(np.abs(w).max()))


def test_the_composites_are_transformers_qwen3():
    """The compiled peers' functions, bit for bit transformers' Qwen3RMSNorm and
    apply_rotary_pos_emb on the (batch, heads, tokens, head_dim) layout HF's attention uses."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.models.qwen3 import modeling_qwen3 as hf
    inputs = qk_rope.make_inputs(torch, SMALL, torch.bfloat16, "cpu", seed=6)
    q, k = qk_rope.head_views(inputs["packed"], *SMALL[1:])
    qw, kw, cos, sin = (inputs[n] for n in ("q_weight", "k_weight", "cos", "sin"))
    q_norm, k_norm = hf.Qwen3RMSNorm(16, qk_rope.EPS).bfloat16(), hf.Qwen3RMSNorm(16, qk_rope.EPS).bfloat16()
    with torch.no_grad():
        q_norm.weight.copy_(qw)
        k_norm.weight.copy_(kw)
        want = hf.apply_rotary_pos_emb(q_norm(q[None]).transpose(1, 2), k_norm(k[None]).transpose(1, 2), cos[None],
                                       sin[None])
        got = qk_rope.hf_functions().norm_rope(q, k, qw, kw, cos, sin)
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16 and torch.equal(g, w.transpose(1, 2)[0])


@pytest.fixture
def eager_peers(monkeypatch):
    """The torch peers with their compiled functions run eagerly (the same functions, on the CPU)."""
    monkeypatch.setattr(qk_rope, "compiled", lambda name: getattr(qk_rope.hf_functions(), name))


def test_the_in_place_composite_writes_the_views_only(eager_peers):
    torch = pytest.importorskip("torch")
    inputs = qk_rope.make_inputs(torch, SMALL, torch.bfloat16, "cpu", seed=7)
    before = inputs["packed"].clone()
    call = qk_rope.build(torch, "torch_compile", "fwd", SMALL, inputs)
    q_out, k_out = call()
    assert torch.equal(inputs["packed"], before)                            # its own copy of the projection
    packed = q_out.as_strided((5, 8 * 16), (8 * 16, 1))                     # that copy, through the output view
    assert torch.equal(packed[:, 6 * 16:], before[:, 6 * 16:])              # v untouched
    want = qk_rope.hf_functions().norm_rope(*qk_rope.head_views(before, *SMALL[1:]),
                                            *(inputs[n] for n in ("q_weight", "k_weight", "cos", "sin")))
    assert torch.equal(q_out, want[0]) and torch.equal(k_out, want[1])
    assert common.disagreement((q_out, k_out), qk_rope.reference(torch, SMALL, inputs, "fwd")) < qk_rope.TOLERANCE


def test_the_backward_pass_takes_gradients_of_q_k_and_both_weights(eager_peers):
    torch = pytest.importorskip("torch")
    inputs = qk_rope.make_inputs(torch, SMALL, torch.bfloat16, "cpu", seed=8)
    dq_out = inputs["dq_out"].clone()
    call = qk_rope.build(torch, "torch_compile", "fwdbwd", SMALL, inputs)
    for _ in range(2):                                                      # repeated calls: what a graph replays
        grads = call()
        assert [tuple(g.shape) for g in grads] == [(5, 4, 16), (5, 2, 16), (16,), (16,)]
        assert common.disagreement(grads, qk_rope.reference(torch, SMALL, inputs, "fwdbwd")) < qk_rope.TOLERANCE
    assert torch.equal(inputs["dq_out"], dq_out)                            # the implementation had its own copy


def test_a_disagreeing_implementation_is_an_error_and_not_timed(monkeypatch, eager_peers):
    """One case measured with the GPU parts stood in for (CPU inputs, a fake timer, the eager
    composite as ours): a peer off by 10% is an error and never timed, FlashInfer's backward is
    skipped with its reason, the others are timed in both modes."""
    torch = pytest.importorskip("torch")
    real_build, real_inputs = qk_rope.build, qk_rope.make_inputs

    def build(torch_, impl, op, case, inputs, lib=None):
        if impl == "copy":
            return lambda: None
        call = real_build(torch_, "torch_compile", op, case, inputs)
        if impl == "liger":                                   # a wrong peer: outputs 10% off
            return lambda: tuple(t * 1.1 for t in call())
        return call
    monkeypatch.setattr(qk_rope, "build", build)
    monkeypatch.setattr(qk_rope, "make_inputs", lambda t, case, dtype, device, seed: real_inputs(t, case, dtype, "cpu"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    timed = []

    class Runner:
        def context(self):
            return contextlib.nullcontext()

        def synchronize(self):
            pass
    monkeypatch.setattr(timing, "calls_for", lambda *a: 3)
    monkeypatch.setattr(timing, "timed_us", lambda runner, fn, mode, *a: timed.append(mode) or 2.0)
    args = cli.parse_args(["qk_rope", "--tokens", "4", "--heads", "4/2x16"])
    payload = {"results": [], "errors": [], "skipped": {}}
    counts = {}
    qk_rope.measure_case(torch, args, payload, ["ours", "torch_compile", "liger", "flashinfer", "copy"], Runner(),
                         None, 1000.0, None, counts, qk_rope.cases(args)[0], "bfloat16")
    assert [(r["op"], r["mode"]) for r in payload["results"]] == [("fwd", "graph"), ("fwd", "cold"),
                                                                  ("fwdbwd", "graph"), ("fwdbwd", "cold")]
    fwd, bwd = payload["results"][0], payload["results"][2]
    assert fwd["us"] == {"ours": 2.0, "torch_compile": 2.0, "liger": None, "flashinfer": 2.0, "copy": 2.0}
    assert bwd["us"] == {"ours": 2.0, "torch_compile": 2.0, "liger": None, "flashinfer": None, "copy": 2.0}
    assert fwd["err"]["liger"] == pytest.approx(0.1, rel=0.1) and fwd["err"]["ours"] < qk_rope.TOLERANCE
    assert "flashinfer" not in bwd["err"] and fwd["bytes"] == qk_rope.moved_bytes("fwd", qk_rope.cases(args)[0], 2)
    assert len(timed) == (4 + 3) * 2                          # fwd: 4 timed, fwdbwd: 3, in both modes
    assert [e["where"] for e in payload["errors"]] == ["liger fwd bfloat16 4x4/2x16", "liger fwdbwd bfloat16 4x4/2x16"]
    assert all("past the tolerance" in e["error"] and "not timed" in e["error"] for e in payload["errors"])
    assert payload["skipped"] == {"flashinfer (FlashInfer's rope has no backward)": "1 cases"}


# -- the report (a made-up payload) ------------------------------------------------------------------
def record(case, op="fwd", mode="graph", dtype="bfloat16", **us):
    times = {"ours": 10.0, "ours_unfused": 20.0, "torch_compile": 12.5, "liger": 25.0, "flashinfer": 16.0,
             "copy": 8.0}
    return {**case._asdict(), "op": op, "mode": mode, "dtype": dtype, "bytes": 1000, "us": dict(times, **us),
            "err": {"ours": 2e-3, "ours_unfused": 3e-3, "torch_compile": 4e-3, "liger": 6e-3, "flashinfer": 5e-3}}


def made_up_payload():
    """A synthetic report: its numbers are made up for the formatting tests."""
    decode = qk_rope.Case(1, 32, 4, 128)
    results = [record(QWEN3_8B, op="fwdbwd", mode="cold", flashinfer=None),
               record(QWEN3_8B), record(decode, liger=None, ours=40.0),
               record(QWEN3_8B, mode="cold", ours=16.0)]
    return {"meta": {"command": "qk_rope", "commit": "abc", "dirty": False, "device": {"gpu": "Made-up GPU"},
                     "copy_GBps": 4000.0},
            "results": results,
            "errors": [{"where": "liger fwd bfloat16 1x32/4x128", "error": "RuntimeError: x"}],
            "skipped": {"flashinfer (FlashInfer's rope has no backward)": "12 cases"}}


def test_files(tmp_path):
    written = common.write_report(qk_rope, made_up_payload(), str(tmp_path), "q", charts=False)
    assert sorted(os.path.basename(p) for p in written) == ["q.csv", "q.json", "q.md"]
    with open(tmp_path / "q.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0])[:8] == ["op", "mode", "dtype", "tokens", "q_heads", "k_heads", "head_dim", "bytes"]
    assert [r["op"] for r in rows] == ["fwdbwd", "fwd", "fwd", "fwd"]
    assert rows[0]["flashinfer_us"] == "" and rows[1]["ours_us"] == "10.000" and rows[1]["liger_err"] == "6.000e-03"
    assert rows[2]["tokens"] == "1" and rows[2]["k_heads"] == "4" and "copy_err" not in rows[0]
    md = " ".join((tmp_path / "q.md").read_text().split())   # the cells, whatever their padding
    assert md.startswith("# QK norm + RoPE: Made-up GPU") and "copy bandwidth: 4000 GB/s" in md
    assert "## forward + backward, cold mode, bfloat16: GPU microseconds per call (medians)" in md
    assert ("| 4096x32/8x128 | 10.00 | 20.00 | 12.50 | 25.00 | 16.00 | 8.00 | 0.800 | 1.250 | 0.500 | 6.0e-03 |"
            in md)
    assert "- error: liger fwd bfloat16 1x32/4x128: RuntimeError: x" in md


def test_charts_are_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    paths = qk_rope.write_charts(made_up_payload(), str(tmp_path / "q"))
    assert sorted(os.path.basename(p) for p in paths) == ["q_cold_bfloat16.png", "q_graph_bfloat16.png"]
    for path in paths:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_replot_of_a_saved_report(tmp_path, capsys):
    saved = tmp_path / "run.json"
    report.write_json(str(saved), made_up_payload())
    out = tmp_path / "out"
    assert cli.main(["qk_rope", "--replot", str(saved), "--out", str(out), "--name", "re", "--no-chart"]) == 0
    text = capsys.readouterr().out
    assert text == qk_rope.format_report(json.loads(saved.read_text())) + "\n"
    assert sorted(os.listdir(out)) == ["re.csv", "re.md"]
    assert (out / "re.md").read_text() == qk_rope.format_markdown(made_up_payload())
    other = tmp_path / "g.json"
    report.write_json(str(other), dict(made_up_payload(), meta={"command": "gated"}))
    assert cli.main(["qk_rope", "--replot", str(other), "--out", str(out)]) == common.EXIT_ERROR
    assert f"is a gated report: cupy-rmsnorm-bench gated --replot {other}" in capsys.readouterr().err


# -- no GPU, --help ------------------------------------------------------------------------------------
def test_no_gpu_exits_3_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(timing, "gpu_missing", lambda: "CUDARuntimeError: no device")
    assert cli.main(["qk_rope", "--quick"]) == common.EXIT_NO_GPU == 3
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1
    assert out.err.startswith("cupy-rmsnorm-bench qk_rope: no CUDA GPU available, nothing measured "
                              "(CUDARuntimeError: no device). ")
    if common.committed_report("qk_rope") is None:            # this checkout: none measured yet
        assert "No report of qk_rope is committed yet (it would be benchmarks/results/qk_rope.json)" in out.err
    else:
        assert "--replot" in out.err


def test_help_and_no_gpu_from_the_command_line(tmp_path):
    env = child_env(CUDA_VISIBLE_DEVICES="")
    top = subprocess.run([sys.executable, "-m", "cupy_rmsnorm.bench", "--help"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert top.returncode == 0 and "| qk_rope |" in top.stdout.splitlines()[0]
    helped = subprocess.run([sys.executable, "-m", "cupy_rmsnorm.bench", "qk_rope", "--help"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith("usage: cupy-rmsnorm-bench qk_rope")
    assert all(s in helped.stdout for s in ("--tokens", "--heads", "HQ/HKxD", "32/8x128 (Qwen3-8B)", "--flashinfer",
                                            "LigerRopeFunction", "BatchQKApplyRotaryPosIdsCosSinCache",
                                            "pip install liger-kernel"))
    proc = subprocess.run([sys.executable, "-m", "cupy_rmsnorm.bench", "qk_rope"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == common.EXIT_NO_GPU and proc.stdout == "" and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not os.listdir(tmp_path)


# -- FlashInfer's rope -----------------------------------------------------------------------------------
def _parameters(source, function):
    """The parameter declarations of ``function``'s definition in C++ ``source``, whitespace squeezed."""
    m = re.search(rf"\b{function}\s*\(([^)]*)\)\s*\{{", source)
    assert m, function
    return [" ".join(p.split()) for p in m.group(1).split(",")]


def test_the_wrapper_and_its_ctypes_types_agree():
    with open(flashinfer.ROPE.source, encoding="utf-8") as f:
        params = _parameters(f.read(), "fi_rope_pos_ids_cos_sin_cache")
    _, argtypes = flashinfer.ROPE.entry_points["fi_rope_pos_ids_cos_sin_cache"]
    kinds = {"void*": ctypes.c_void_p, "float*": ctypes.c_void_p, "int64_t*": ctypes.c_void_p,
             "unsigned": ctypes.c_uint, "size_t": ctypes.c_size_t, "int": ctypes.c_int}
    assert len(params) == 16 and [kinds[p.rsplit(" ", 1)[0]] for p in params] == list(argtypes)


def _flashinfer_wheel():
    found = ([os.environ["FLASHINFER_WHEEL"]] if os.environ.get("FLASHINFER_WHEEL") else []) + sorted(
        glob.glob(os.path.join(ROOT, ".whl", "flashinfer_python-*.whl")))
    return found[0] if found else None


@pytest.mark.skipif(_flashinfer_wheel() is None, reason="FlashInfer's headers: no flashinfer_python wheel here "
                    "(FLASHINFER_WHEEL=PATH, or one in .whl/)")
def test_the_real_wheels_headers_are_the_include_closure(tmp_path):
    """From the real wheel: pos_enc.cuh and norm.cuh and what they include, nothing else; FlashInfer's
    libcudacxx with the cuda::fast_mod_div fastdiv.cuh wants; and BatchQKApplyRotaryPosIdsCosSinCache
    declared with the parameters flashinfer_rope.cu passes."""
    include = flashinfer.headers_from_wheel(_flashinfer_wheel(), str(tmp_path))
    names = sorted(os.listdir(os.path.join(include, "flashinfer")))
    assert names == ["exception.h", "fastdiv.cuh", "layout.cuh", "math.cuh", "norm_rms.cuh", "page.cuh", "pos_enc.cuh",
                     "utils.cuh", "vec_dtypes.cuh"]
    with open(os.path.join(tmp_path, "cccl", "cuda", "__cmath", "fast_modulo_division.h"), encoding="utf-8") as f:
        assert "fast_mod_div" in f.read()
    with open(os.path.join(include, "flashinfer", "pos_enc.cuh"), encoding="utf-8") as f:
        params = _parameters(f.read(), "BatchQKApplyRotaryPosIdsCosSinCache")
    assert params == ["DType* q", "DType* k", "DType* q_rope", "DType* k_rope", "float* cos_sin_cache",
                      "IdType* pos_ids", "uint32_t nnz", "uint32_t num_qo_heads", "uint32_t num_kv_heads",
                      "uint32_t rotary_dim", "uint32_t head_dim", "size_t q_stride_n", "size_t q_stride_h",
                      "size_t k_stride_n", "size_t k_stride_h", "size_t q_rope_stride_n", "size_t q_rope_stride_h",
                      "size_t k_rope_stride_n", "size_t k_rope_stride_h", "bool interleave",
                      "cudaStream_t stream = nullptr"]


EXTRACTED = os.path.join(ROOT, ".flashinfer")


@pytest.mark.skipif(flashinfer.find_nvcc() is None or not os.path.isfile(os.path.join(EXTRACTED, "include", "flashinfer",
                                                                                      "pos_enc.cuh")),
                    reason="FlashInfer rope wrapper build: needs nvcc and .flashinfer/include "
                           "(python -m cupy_rmsnorm.bench.flashinfer WHEEL)")
def test_the_rope_wrapper_builds_and_reports_flashinfers_exceptions(tmp_path):
    """Built and loaded: a rotary_dim past head_dim is refused by FlashInfer before any CUDA call
    (so no GPU is touched), and the wrapper returns -1 with FlashInfer's message."""
    include = os.path.join(str(tmp_path), "include")
    os.symlink(os.path.join(EXTRACTED, "include"), include)
    if os.path.isdir(os.path.join(EXTRACTED, "cccl")):
        os.symlink(os.path.join(EXTRACTED, "cccl"), os.path.join(str(tmp_path), "cccl"))
    lib = flashinfer.load(flashinfer.build(include, str(tmp_path), "90", flashinfer.ROPE), flashinfer.ROPE)
    status = lib.fi_rope_pos_ids_cos_sin_cache(None, None, None, None, 4, 32, 8, 256, 128, 6144, 128, 6144, 128, 1, 1,
                                               None)
    assert status == -1 and "must be >= rotary_dim (256)" in lib.fi_rope_last_error().decode()
