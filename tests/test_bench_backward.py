"""``python -m cupy_rmsnorm.bench backward`` (cupy_rmsnorm/bench/backward.py) and
benchmarks/train_llama.py on the CPU: arguments, the table and the files (the timing itself
needs a GPU), and a clear message without one."""

import json

import pytest
from helpers import load_benchmark

from cupy_rmsnorm.bench import backward as b
from cupy_rmsnorm.bench import cli

_load = load_benchmark


def test_backward_arguments_table_and_files(tmp_path):
    args = b.parse_args(["--out", str(tmp_path), "--shapes", "1x4096,4096x4095", "--dtypes", "bfloat16"])
    assert args.shapes == [(1, 4096), (4096, 4095)] and args.dtypes == ["bfloat16"]
    assert args.modes == ["graph", "cold"] and b.parse_args(["--out", "x", "--modes", "cold"]).modes == ["cold"]
    with pytest.raises(SystemExit):
        b.parse_args(["--out", "x", "--modes", "hot"])
    assert [tuple(s) for s in b.parse_args(["--out", "x"]).shapes] == list(b.SHAPES)
    row = {"dtype": "bfloat16", "rows": 4096, "hidden": 4095, "phase": "backward", "mode": "cold", "bytes": 1,
           "us": {"ours": 10.0, "F.rms_norm": 20.0, "torch.compile": 12.5, "liger": None, "copy": 8.0},
           "agree_dx": 1e-3, "agree_dw": 2e-3}
    text = b.table([row])
    assert "0.800" in text and "4096x4095" in text and "cold" in text        # ours / best peer = 10 / 12.5
    b.write(args, {"results": [row]})
    assert json.load(open(tmp_path / "backward.json"))["results"][0]["us"]["ours"] == 10.0
    lines = open(tmp_path / "backward.csv").read().splitlines()
    assert lines[0].startswith("dtype,rows,hidden,phase,mode,ours_us") and lines[1].split(",")[8] == ""   # liger absent


def test_backward_without_a_gpu_says_why(tmp_path, capsys):
    from helpers import gpu_missing
    if gpu_missing() is None:
        pytest.skip("a GPU is present: the benchmark would run")
    assert cli.main(["backward", "--out", str(tmp_path)]) == 2      # the subcommand reaches it
    assert "no GPU run" in capsys.readouterr().out


def test_train_llama_arguments():
    t = _load("train_llama")
    args = t.parse_args([])
    assert (args.steps, args.layers, args.hidden, args.batch, args.seq) == (100, 4, 1024, 8, 512)
