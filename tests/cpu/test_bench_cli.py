"""The benchmark harness's command line on the CPU (``python -m cupy_rmsnorm.bench``): the
sub-commands and their common options, the shape syntax, the exit codes and the no-GPU
message, what every report records about its run, and ``--replot`` of each committed report."""

import csv
import io
import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT, child_env

from cupy_rmsnorm.bench import cli, common, peers, report, timing

COMMANDS = ("forward", "backward", "quant", "e2e", "train", "gated", "qk_rope")
RESULTS = os.path.join(ROOT, common.COMMITTED_RESULTS)
# the committed reports (the sub-command's name; e2e_qwen3: e2e --model qwen3) and what each one's
# console text must show (a table's content, not just a title)
REPORT_TEXT = {"forward": ("rms_norm, bfloat16, graph", "16384x8192", "fused_add_rms_norm, float16, cold"),
               "backward": ("forward+backward", "16384x8192", "liger"),
               "quant": ("fused per_group", "flashinfer", "geomean ours / best peer"),
               "e2e": ("ours_fused", "compiled", "agreement floor"),
               "train": ("max |loss difference|", "9 norms replaced", "99"),
               "gated": ("16384x32x128", "fla_grouped", "forward + backward, graph"),
               "qk_rope": ("16384x32/4x128", "flashinfer", "forward + backward, cold mode"),
               "e2e_qwen3": ("Qwen3", "ours_qk", "agreement floor")}


def options_of(command):
    return {o for action in cli.build_parser()[1][command]._actions for o in action.option_strings}


# -- sub-commands and options --------------------------------------------------------------------
def test_help_lists_every_subcommand_how_to_add_peers_and_the_exit_codes(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    usage = out.splitlines()[0]
    assert usage.startswith("usage: cupy-rmsnorm-bench") and all(c in usage for c in COMMANDS)
    assert "pip install liger-kernel" in out and "pip install flashinfer-python" in out
    assert "3 no CUDA GPU" in out and "2 a bad command line" in out


def test_no_subcommand_is_forward():
    assert cli.parse_args([]).command == "forward"
    assert cli.parse_args(["--quick", "--ops", "rms"]).command == "forward"
    assert [cli.parse_args([c]).command for c in COMMANDS] == list(COMMANDS)


def test_every_subcommand_spells_the_common_options_alike():
    for command in COMMANDS:
        assert {"--out", "--name", "--quick", "--replot"} <= options_of(command), command
        args = cli.parse_args([command])
        assert (args.out, args.name, args.replot) == ("bench_results", command, None)
    for command in ("forward", "backward", "quant"):
        assert {"--shapes", "--dtypes", "--modes", "--repeats", "--no-chart"} <= options_of(command)
    assert "--repeats" in options_of("e2e") and "--no-chart" in options_of("train")


@pytest.mark.parametrize("command", ["forward", "backward", "quant"])
def test_one_shape_syntax(command):
    args = cli.parse_args([command, "--shapes", "1,32x4096,8192", "4096x4095", "32x4096", "--dtypes", "bf16,FP16"])
    assert args.shapes == [(1, 4096), (32, 4096), (1, 8192), (32, 8192), (4096, 4095)]
    assert args.dtypes == ["bfloat16", "float16"]


@pytest.mark.parametrize("argv, needle", [
    (["backward", "--shapes", "1x4096,4096x4095"], "TOKENSxHIDDEN"),   # the old backward syntax
    (["quant", "--shapes", "0x4096"], "positive"),
    (["backward", "--modes", "hot"], "unknown mode"),
    (["quant", "--cases", "per_block"], "unknown case"),
    (["train", "--hidden", "1000"], "multiple of the 16"),
    (["e2e", "--repeats", "0"], "positive integer"),
    (["nonsense"], "unrecognized arguments"),
])
def test_bad_command_lines_exit_2(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == common.EXIT_USAGE == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_parse_shapes_is_a_product():
    assert common.parse_shapes("1,32x4096,8192") == [(1, 4096), (32, 4096), (1, 8192), (32, 8192)]
    assert common.parse_shapes(" 7X9 ") == [(7, 9)]
    for bad in ("x4096", "4096x", "ax4", "1,,2x4", "-1x4", "4x4x4"):
        with pytest.raises(ValueError):
            common.parse_shapes(bad)


def test_quick_changes_only_what_was_not_given():
    quick = cli.parse_args(["backward", "--quick", "--dtypes", "fp16"])
    assert quick.dtypes == ["float16"] and quick.repeats == 3 and len(quick.shapes) == 3
    assert cli.parse_args(["train", "--quick"]).steps == 20 and cli.parse_args(["train"]).steps == 100
    e2e = cli.parse_args(["e2e", "--quick", "--layers", "3"])
    assert (e2e.layers, e2e.prefill, e2e.repeats) == (3, 512, 2)


# -- no GPU, missing requirements ----------------------------------------------------------------
@pytest.mark.parametrize("command", COMMANDS)
def test_no_gpu_is_one_line_pointing_to_the_committed_report(command, monkeypatch, capsys):
    monkeypatch.setattr(timing, "gpu_missing", lambda: "CUDARuntimeError: no device\n(detail)")
    assert cli.main([command]) == common.EXIT_NO_GPU == 3
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1
    assert out.err.startswith(f"cupy-rmsnorm-bench {command}: no CUDA GPU available, nothing measured "
                              "(CUDARuntimeError: no device (detail))")
    replot = out.err.split("The committed report: ")[1].split()
    assert replot[:5] == [common.python_command(), "-m", "cupy_rmsnorm.bench", command, "--replot"]
    where = replot[5] if os.path.exists(replot[5]) else os.path.join(ROOT, replot[5])   # installed: in the repository
    assert os.path.samefile(where, os.path.join(RESULTS, f"{command}.json"))


def test_no_gpu_from_the_command_line_and_its_replot(tmp_path):
    """The message's command, run as printed, shows the committed report without a GPU."""
    env = child_env(CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "cupy_rmsnorm.bench", "backward"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == common.EXIT_NO_GPU and proc.stdout == "", proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA GPU available" in lines[0] and "Traceback" not in proc.stderr
    command = lines[0].split("The committed report: ")[1].split()
    # a checkout's library names the report's absolute path; an installed one, its place in the
    # repository, where a user runs the command from the top folder
    where = tmp_path if os.path.isabs(command[-1]) else ROOT
    replot = subprocess.run([sys.executable, *command[1:], "--no-chart", "--out", str(tmp_path / "bench_results")],
                            cwd=where, env=env, capture_output=True, text=True, timeout=120)
    assert replot.returncode == 0, replot.stderr
    assert "backward, graph mode" in replot.stdout and "16384x8192" in replot.stdout
    assert sorted(os.listdir(tmp_path / "bench_results")) == ["backward.csv", "backward.md"]


@pytest.mark.parametrize("command", ["backward", "quant", "train", "e2e"])
def test_a_missing_requirement_is_an_error_saying_what_to_install(command, monkeypatch, capsys):
    monkeypatch.setattr(timing, "gpu_missing", lambda: None)
    monkeypatch.setattr(common, "torch_missing", lambda: "PyTorch is not importable (ImportError: x); "
                                                         + common.INSTALL_HINTS["torch"])
    assert cli.main([command]) == common.EXIT_ERROR
    assert "pip install torch" in capsys.readouterr().err


def test_module_missing_says_how_to_install():
    assert common.module_missing("no_such_module_here", "liger-kernel", "liger") == \
        "liger-kernel is not installed (pip install liger-kernel)"
    assert common.module_missing("json", "json", "liger") is None


def test_gpu_missing_never_raises(monkeypatch):
    cupy = pytest.importorskip("cupy", reason="needs CuPy to stand in a broken runtime")

    def broken():
        raise RuntimeError("driver exploded")
    monkeypatch.setattr(timing._driver, "_driver_library", lambda: object())   # as if a driver were there
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", broken)
    assert "driver exploded" in timing.gpu_missing()


# -- what a report records -------------------------------------------------------------------------
def test_run_metadata_records_the_commit_of_the_library_measured(monkeypatch):
    root = common.library_root()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
    monkeypatch.setattr(sys, "argv", ["cupy-rmsnorm-bench", "backward", "--quick"])
    meta = common.run_metadata("backward", {"gpu": "G"}, repeats=3)
    if head.returncode == 0:
        assert meta["commit"] == head.stdout.strip() and isinstance(meta["dirty"], bool)
    else:                                                      # an installed package: nothing to record
        assert meta["commit"] is None and meta["dirty"] is None
    assert meta["command"] == "backward" and meta["argv"] == ["backward", "--quick"]
    assert meta["device"] == {"gpu": "G"} and meta["repeats"] == 3 and len(meta["date"]) >= 19
    assert {"python", "cupy_rmsnorm"} <= set(meta["versions"])


@pytest.mark.parametrize("command", COMMANDS)
def test_every_report_records_commit_date_and_dirty_and_warns_loudly_when_dirty(command, tmp_path, monkeypatch,
                                                                                capsys):
    """One function stamps every sub-command's report; from a tree with uncommitted changes the
    report says so in its meta, its header (console and Markdown) and on stderr, at the run's
    end and at a replot."""
    module = cli.SUBCOMMANDS[command]
    monkeypatch.setattr(common, "git_state", lambda path: ("c" * 40, True))
    meta = common.run_metadata(command, {"gpu": "G"})
    assert meta["commit"] == "c" * 40 and meta["dirty"] is True and len(meta["date"]) >= 19
    assert meta["warning"] == report.DIRTY_WARNING
    assert report.DIRTY_WARNING in report.format_header(meta)
    payload = report.load_json(os.path.join(RESULTS, f"{command}.json"))     # a real report, restamped
    payload["meta"].update(common.provenance())
    no_chart = ["--no-chart"] if command != "e2e" else []
    args = cli.parse_args([command, "--out", str(tmp_path), "--name", "r"] + no_chart)
    common.finish_run(module, args, payload)
    err = capsys.readouterr().err
    assert report.DIRTY_WARNING in err
    assert cli.main([command, "--replot", str(tmp_path / "r.json"), "--out", str(tmp_path / "re")] + no_chart) == 0
    assert report.DIRTY_WARNING in capsys.readouterr().err
    monkeypatch.setattr(common, "git_state", lambda path: ("c" * 40, False))
    clean = common.run_metadata(command, {"gpu": "G"})
    assert clean["dirty"] is False and "warning" not in clean
    assert report.DIRTY_WARNING not in report.format_header(clean)


def test_git_state_only_of_the_checkout_holding_the_library(tmp_path):
    assert common.git_state(str(tmp_path)) == (None, None)                 # no repository
    inside = os.path.join(common.library_root(), "cupy_rmsnorm")
    assert common.git_state(inside) == (None, None)                        # not the checkout's top


def test_timing_cells_compare_ours_with_the_best_peer_and_the_copy():
    us = {"ours": 10.0, "a": 20.0, "b": 12.5, "c": None, "copy": 8.0}
    assert report.timing_cells(us, list(us), ("a", "b", "c")) == ["10.00", "20.00", "12.50", "-", "8.00", "0.800",
                                                                   "1.250"]
    assert report.best_peer_summary([{"us": us}, {"us": dict(us, ours=40.0)}], ("a", "b")).startswith(
        "geomean ours / best peer: 1.600 over 2 cases")


# -- the committed reports ------------------------------------------------------------------------
def report_of(name):
    """The committed report a results file belongs to: its name up to the first dot, less a
    chart's suffix (forward_graph_bfloat16.png is forward's)."""
    stem = name.split(".")[0]
    return max((r for r in REPORT_TEXT if stem == r or stem.startswith(r + "_")), key=len, default=None)


def test_results_hold_the_current_reports_only():
    names = sorted(os.listdir(RESULTS))
    assert {report_of(n) for n in names} == set(REPORT_TEXT), names
    assert all(f"{r}.{ext}" in names for r in REPORT_TEXT for ext in ("json", "md", "csv"))
    assert set(COMMANDS) <= set(REPORT_TEXT)


@pytest.mark.parametrize("name", REPORT_TEXT)
def test_each_committed_report_records_its_commit_or_says_why_not(name):
    meta = report.load_json(os.path.join(RESULTS, f"{name}.json"))["meta"]
    assert name == meta["command"] or name.startswith(meta["command"] + "_"), name
    assert meta["device"]["gpu"] == "NVIDIA H200"
    if meta["commit"] is None:
        assert "predates commit recording" in meta["note"]
    else:
        assert len(meta["commit"]) == 40 and isinstance(meta["dirty"], bool)


def committed_serving_rows(text, columns):
    return [{k: row[k] for k in columns} for row in csv.DictReader(io.StringIO(text)) if row["measure"] != "generate"]


@pytest.mark.parametrize("name", REPORT_TEXT)
def test_replot_of_each_committed_report(name, tmp_path, capsys):
    """--replot prints the name's tables and writes its Markdown and CSV (the CSV the very file
    committed beside the JSON); it never writes the JSON."""
    path = os.path.join(RESULTS, f"{name}.json")
    command = report.load_json(path)["meta"]["command"]
    assert cli.main([command, "--replot", path, "--out", str(tmp_path), "--name", "re"]
                    + (["--no-chart"] if command != "e2e" else [])) == 0
    out = capsys.readouterr().out
    assert all(text in out for text in REPORT_TEXT[name]), out[:2000]
    with open(os.path.join(RESULTS, f"{name}.csv"), encoding="utf-8") as f:
        committed = f.read()
    replotted = (tmp_path / "re.csv").read_text(encoding="utf-8")
    if command == "e2e":
        # e2e no longer measures generate: its committed CSV's generate rows and columns are
        # left out of a replot; the serving rows are the same values
        assert committed_serving_rows(committed, replotted.splitlines()[0].split(",")) == list(
            csv.DictReader(io.StringIO(replotted)))
    else:
        assert replotted == committed
    assert (tmp_path / "re.md").is_file() and not (tmp_path / "re.json").exists()


@pytest.mark.skipif(not os.path.isdir(os.path.join(common.library_root(), common.COMMITTED_RESULTS)),
                    reason="replot from any folder: the library imported is an installed package, not a checkout "
                           "(the no-GPU message then names the top folder to run from)")
def test_replot_resolves_a_repository_path_from_any_folder(tmp_path, monkeypatch, capsys):
    """``--replot benchmarks/results/X.json``, as the docs and the no-GPU message write it,
    works from a folder that is not the repository's top."""
    monkeypatch.chdir(tmp_path)
    relative = f"{common.COMMITTED_RESULTS}/backward.json"
    assert cli.main(["backward", "--replot", relative, "--no-chart", "--out", "here"]) == 0
    assert "16384x8192" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path / "here")) == ["backward.csv", "backward.md"]


def test_replots_of_two_reports_of_one_subcommand_do_not_overwrite_each_other(tmp_path, capsys):
    """The files of a replot are named after the report's file: e2e.json and e2e_qwen3.json
    (both e2e reports) give e2e.* and e2e_qwen3.*, side by side; --name still wins."""
    for name in ("e2e", "e2e_qwen3"):
        assert cli.main(["e2e", "--replot", os.path.join(RESULTS, f"{name}.json"), "--out", str(tmp_path)]) == 0
    assert sorted(os.listdir(tmp_path)) == ["e2e.csv", "e2e.md", "e2e_qwen3.csv", "e2e_qwen3.md"]
    assert "Qwen3" in (tmp_path / "e2e_qwen3.md").read_text() and "Qwen3" not in (tmp_path / "e2e.md").read_text()
    source = tmp_path / "saved.json"
    source.write_text(json.dumps(report.load_json(os.path.join(RESULTS, "train.json"))))
    assert cli.main(["train", "--replot", str(source), "--no-chart", "--out", str(tmp_path / "n")]) == 0
    assert cli.main(["train", "--replot", str(source), "--no-chart", "--out", str(tmp_path / "n"), "--name", "t"]) == 0
    assert sorted(os.listdir(tmp_path / "n")) == ["saved.csv", "saved.md", "t.csv", "t.md"]


def test_replot_refuses_a_report_of_another_subcommand_and_unreadable_files(tmp_path, capsys):
    forward_json = os.path.join(RESULTS, "forward.json")
    assert cli.main(["backward", "--replot", forward_json, "--out", str(tmp_path)]) == common.EXIT_ERROR
    assert f"is a forward report: cupy-rmsnorm-bench forward --replot {forward_json}" in capsys.readouterr().err
    assert cli.main(["quant", "--replot", str(tmp_path / "missing.json")]) == common.EXIT_ERROR
    (tmp_path / "old.json").write_text(json.dumps({"device": {}, "results": []}))
    assert cli.main(["quant", "--replot", str(tmp_path / "old.json")]) == common.EXIT_ERROR
    assert capsys.readouterr().err.count("cannot read") == 2


def test_peers_say_how_to_install_what_is_missing(monkeypatch):
    monkeypatch.setattr(peers, "torch_missing", lambda: None)
    monkeypatch.setattr(common.importlib.util, "find_spec", lambda name: None)    # no Triton, no Liger
    _, missing = peers.availability(["ours", "torch_compile"])
    assert "Triton" in missing["torch_compile"] and "torch" in missing["torch_compile"]
    peers.liger_missing.cache_clear()
    try:
        assert "pip install liger-kernel" in peers.liger_missing()
    finally:
        peers.liger_missing.cache_clear()
