"""``python -m cupy_rmsnorm.bench backward`` on the CPU: its arguments, the table, the files
and the chart (the timing itself needs a GPU)."""

import csv
import os

import pytest

from cupy_rmsnorm.bench import backward, cli, common


def row(mode="cold", liger=None, **over):
    return dict({"dtype": "bfloat16", "rows": 4096, "hidden": 4095, "phase": "backward", "mode": mode, "bytes": 1,
                 "us": {"ours": 10.0, "F.rms_norm": 20.0, "torch.compile": 12.5, "liger": liger, "copy": 8.0},
                 "agree_dx": 1e-3, "agree_dw": 2e-3}, **over)


def payload(results):
    return {"meta": {"command": "backward", "commit": "abc", "dirty": False, "device": {"gpu": "Fake GPU"},
                     "copy_GBps": 4000.0},
            "results": results, "errors": [{"where": "liger backward cold", "error": "RuntimeError: x"}],
            "skipped": {"16384x8192": "the time budget (240 s)"}}


def test_arguments():
    args = cli.parse_args(["backward", "--shapes", "1x4096", "4096x4095", "--dtypes", "bf16", "--modes", "cold"])
    assert args.shapes == [(1, 4096), (4096, 4095)] and args.dtypes == ["bfloat16"] and args.modes == ["cold"]
    default = cli.parse_args(["backward"])
    assert default.shapes == list(backward.SHAPES) and default.modes == ["graph", "cold"]
    assert (default.repeats, default.target_us, default.budget_s) == (7, 2000.0, 240.0)
    assert default.dtypes == ["bfloat16", "float16"] and default.out == "bench_results"


def test_files_and_chart(tmp_path):
    written = common.write_report(backward, payload([row(), row(mode="graph", liger=15.0)]), str(tmp_path), "b")
    names = sorted(os.path.basename(p) for p in written)
    charts = ["b_cold.png", "b_graph.png"] if "b_cold.png" in names else []
    assert names == sorted(["b.json", "b.csv", "b.md"] + charts)
    with open(tmp_path / "b.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows[0]["mode"] == "cold" and rows[0]["liger_us"] == "" and rows[1]["liger_us"] == "15.000"
    assert rows[0]["ours_us"] == "10.000" and rows[0]["agree_dw"] == "2.000e-03"


def test_chart_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    paths = backward.write_charts(payload([row(), row(phase="forward+backward", liger=30.0)]), str(tmp_path / "b"))
    assert [os.path.basename(p) for p in paths] == ["b_cold.png"]
    with open(paths[0], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
