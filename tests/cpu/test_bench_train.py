"""``python -m cupy_rmsnorm.bench train`` on the CPU: its arguments, the report, the files and
the chart of a run (training needs a GPU)."""

import csv
import importlib.util
import os

import pytest

from cupy_rmsnorm.bench import cli, common, report, train


def payload(steps=12):
    hf = [10.0 - 0.1 * i for i in range(steps)]
    ours = [v + (0.002 if i == 7 else 0.0) for i, v in enumerate(hf)]
    results = [{"variant": name, "losses": losses, "step_s": [0.02] * 5 + [0.014] * (steps - 5),
                "median_step_ms": ms} for name, losses, ms in (("hf", hf, 14.9), ("ours", ours, 13.9))]
    return {"meta": {"command": "train", "commit": "abc", "dirty": False, "device": {"gpu": "Fake GPU"},
                     "config": {"steps": steps, "layers": 2, "hidden": 512, "batch": 8, "seq": 256},
                     "params": "bfloat16 (AdamW states bfloat16, no autocast)", "norms_replaced": 5},
            "results": results, "errors": [], "max_abs_loss_diff": 0.002}


def test_arguments():
    args = cli.parse_args(["train"])
    assert (args.steps, args.layers, args.hidden, args.batch, args.seq, args.lr) == (100, 4, 1024, 8, 512, 3e-4)
    quick = cli.parse_args(["train", "--quick", "--batch", "2"])
    assert (quick.steps, quick.layers, quick.hidden, quick.batch, quick.seq) == (20, 2, 512, 2, 256)


def test_report_shows_every_tenth_step_and_the_last():
    assert [row[0] for row in train.table_rows(payload())] == ["0", "10", "11"]
    assert train.table_rows(payload())[2][1:] == ["8.9000", "8.9000", "0.0000"]


def test_files_and_chart(tmp_path):
    written = common.write_report(train, payload(), str(tmp_path), "t")
    names = {os.path.basename(p) for p in written}
    assert {"t.json", "t.csv", "t.md"} <= names
    with open(tmp_path / "t.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 12 and float(rows[7]["abs_diff"]) == pytest.approx(0.002)
    assert float(rows[0]["hf_step_ms"]) == pytest.approx(20.0)
    if "t.png" in names:
        with open(tmp_path / "t.png", "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_an_interrupted_run_has_one_curve_and_no_table():
    half = payload()
    half["results"] = half["results"][:1]
    assert train.csv_records(half) == [] and train.table_rows(half) == []
    assert "max |loss difference|" not in train.format_report(half)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None,
                    reason="needs torch and transformers (not installed)")
def test_a_tiny_run_on_the_cpu(tmp_path, capsys):
    """The whole path of a run, the hf variant alone (ours needs CUDA): model, steps, report."""
    assert cli.main(["train", "--device", "cpu", "--steps", "3", "--layers", "1", "--hidden", "64", "--batch", "1",
                     "--seq", "16", "--no-chart", "--out", str(tmp_path)]) == 0
    saved = report.load_json(tmp_path / "train.json")
    (hf,) = saved["results"]
    assert hf["variant"] == "hf" and len(hf["losses"]) == len(hf["step_s"]) == 3 and hf["median_step_ms"] > 0
    assert saved["skipped"] == {"ours": "needs CUDA (--device cpu)"} and saved["meta"]["config"]["hidden"] == 64
    assert saved["meta"]["command"] == "train" and "commit" in saved["meta"]
    assert "skipped ours: needs CUDA" in capsys.readouterr().out
