"""benchmarks/rows_scan.py on the CPU: its arguments, the line it fits, and a clear message
without a GPU."""

import pytest
from helpers import load_benchmark


def test_arguments():
    b = load_benchmark("rows_scan")
    args = b.parse_args(["--rows", "1320,4096", "--cases", "per_group,copy", "--hidden", "7168"])
    assert args.rows == [1320, 4096] and args.cases == ["per_group", "copy"] and args.hidden == 7168
    assert b.parse_args([]).cases == ["static", "per_token", "per_group", "copy"]
    with pytest.raises(SystemExit):
        b.parse_args(["--cases", "fused static"])


def test_fit_line_recovers_a_line_and_refuses_too_few_points():
    b = load_benchmark("rows_scan")
    per_row, at_zero = b.fit_line([(r, 0.003 * r + 2.5) for r in (5280, 6600, 16384)])
    assert per_row == pytest.approx(0.003) and at_zero == pytest.approx(2.5)
    per_row, at_zero = b.fit_line([(0, 1.0), (2, 2.0), (2, 4.0)])   # least squares, not a line through two
    assert per_row == pytest.approx(1.0) and at_zero == pytest.approx(1.0)
    with pytest.raises(ValueError, match="two points"):
        b.fit_line([(4096, 12.0)])
    with pytest.raises(ValueError, match="different row counts"):
        b.fit_line([(4096, 12.0), (4096, 13.0)])


def test_says_why_without_a_gpu(capsys):
    b = load_benchmark("rows_scan")
    from cupy_rmsnorm.bench import peers, timing
    why = timing.gpu_missing() or peers.torch_missing()
    if not why:
        pytest.skip("a GPU and torch are here: the scan would run")
    assert b.main(["--rows", "4096"]) == 2
    assert "no GPU run" in capsys.readouterr().out
