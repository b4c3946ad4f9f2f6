"""The forward report (``python -m cupy_rmsnorm.bench [forward]``) on the CPU: its arguments,
byte counts, plans, best peers, CSV and charts, first-call latency's
plumbing, and whole runs with the GPU parts replaced by fakes."""

import csv
import importlib.util
import json
import os
import subprocess

import pytest

from cupy_rmsnorm.bench import cli, common, forward, peers, report, timing

PLAN = {"variant": "block", "vec": 8, "threads_per_row": 256, "vecs_per_thread": 2,
        "rows_per_block": 1, "block": 256, "grid": 4096}


def rec(impl, us, mode="graph", op="rms", dtype="bfloat16", tokens=4096, hidden=4096, plan=PLAN):
    nbytes = peers.logical_bytes(op, tokens, hidden, common.ITEMSIZE[dtype])
    return forward.make_record(op, dtype, tokens, hidden, impl, mode, us, nbytes, 4000.0, 100, 10,
                              0.01, plan if impl == "ours" else plan)


# -- arguments ----------------------------------------------------------------------------------
def test_default_arguments_are_the_standard_grid():
    args = cli.parse_args([])
    assert args.command == args.name == "forward"
    assert args.ops == ["rms", "fused"]
    assert args.dtypes == ["bfloat16", "float16"]
    assert args.modes == ["graph", "cold", "hot"]
    assert args.peers == list(peers.SELECTABLE)
    expected = ({(t, h) for t in (1, 32, 256, 1024, 4096, 16384) for h in (4096, 8192)}
                | {(4096, h) for h in (512, 1024, 2048, 255, 4095)} | {(256, 5120), (256, 7168)})
    assert len(args.shapes) == len(expected) == 19
    assert set(args.shapes) == expected
    assert args.repeats == forward.DEFAULT_REPEATS and args.out == "bench_results"
    assert not args.quick and not args.no_first_call and args.replot is None and not args.no_chart
    assert args.compile == "tokens"


def test_flags_choose_ops_dtypes_shapes_modes_peers():
    args = cli.parse_args(["--ops", "fused", "--dtypes", "bf16,FP32,bfloat16", "--shapes", "1,32x8192",
                           "4096x255", "32x8192", "--modes", "hot,graph", "--peers", "liger,cupy",
                           "--repeats", "7", "--out", "somewhere", "--name", "run1", "--compile", "static"])
    assert args.ops == ["fused"]
    assert args.dtypes == ["bfloat16", "float32"]          # aliases, duplicates dropped
    assert args.shapes == [(1, 8192), (32, 8192), (4096, 255)]
    assert args.modes == ["hot", "graph"]
    assert args.peers == ["liger", "cupy"]
    assert args.repeats == {"graph": 7, "cold": 7, "hot": 7}
    assert (args.out, args.name, args.compile) == ("somewhere", "run1", "static")


def test_peers_all_and_none():
    assert cli.parse_args(["--peers", "none"]).peers == []
    assert cli.parse_args(["--peers", "all"]).peers == list(peers.SELECTABLE)


def test_peers_chooses_the_copy_and_the_in_place_forms():
    assert cli.parse_args(["--peers", "copy,ours_ip,liger_ip"]).peers == ["copy", "ours_ip", "liger_ip"]
    assert {"copy", "ours_ip", "liger_ip"} <= set(cli.parse_args([]).peers)    # on by default
    help_text = cli.build_parser()[1]["forward"].format_help()
    for name in ("copy", "ours_ip", "liger_ip"):
        assert name in peers.RUNNER_KIND and name in help_text and peers.DESCRIPTIONS[name]
    assert not set(peers.PEERS) & {"copy", "ours_ip", "liger_ip"}             # no "best peer"


def test_availability_of_the_copy_and_the_in_place_forms(monkeypatch):
    names = ["ours", "liger", "ours_ip", "liger_ip", "copy"]
    monkeypatch.setattr(peers, "torch_missing", lambda: "PyTorch sees no CUDA device")
    available, missing = peers.availability(names)
    assert available == ["ours", "ours_ip", "copy"]                # the CuPy runner's need no torch
    assert missing == {"liger": "PyTorch sees no CUDA device", "liger_ip": "PyTorch sees no CUDA device"}
    monkeypatch.setattr(peers, "torch_missing", lambda: None)
    monkeypatch.setattr(common.importlib.util, "find_spec", lambda name: object())   # Triton "there"
    monkeypatch.setattr(peers, "liger_missing", lambda: "liger-kernel is not installed")
    available, missing = peers.availability(names)
    assert available == ["ours", "ours_ip", "copy"]
    assert missing == {"liger": "liger-kernel is not installed", "liger_ip": "liger-kernel is not installed"}
    monkeypatch.setattr(peers, "liger_missing", lambda: None)
    assert peers.availability(names) == (["ours", "liger", "ours_ip", "liger_ip", "copy"], {})


def test_quick_is_short_but_explicit_flags_win():
    quick = cli.parse_args(["--quick"])
    assert quick.shapes == list(forward.QUICK_SHAPES) and quick.dtypes == ["bfloat16"]
    assert quick.repeats == forward.QUICK_REPEATS and quick.call_limits == forward.QUICK_CALL_LIMITS
    assert all(quick.repeats[m] < forward.DEFAULT_REPEATS[m] for m in timing.MODES)
    assert len(quick.shapes) < len(forward.DEFAULT_SHAPES)
    mixed = cli.parse_args(["--quick", "--shapes", "2x64", "--dtypes", "fp16"])
    assert mixed.shapes == [(2, 64)] and mixed.dtypes == ["float16"]


@pytest.mark.parametrize("argv, needle", [
    (["--dtypes", "int8"], "unknown dtype"),
    (["--shapes", "4096"], "TOKENSxHIDDEN"),
    (["--shapes", "0x4096"], "positive"),
    (["--shapes", "4x4x4"], "TOKENSxHIDDEN"),
    (["--modes", "warm"], "unknown mode"),
    (["--ops", "layernorm"], "unknown op"),
    (["--peers", "flashinfer"], "unknown peer"),
    (["--repeats", "0"], "positive integer"),
    (["--compile", "max-autotune"], "invalid choice"),
])
def test_bad_arguments_are_usage_errors(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_logical_bytes():
    assert peers.logical_bytes("rms", 4096, 4096, 2) == 2 * 4096 * 4096 * 2 + 4096 * 2
    assert peers.logical_bytes("fused", 3, 255, 2) == 4 * 3 * 255 * 2 + 255 * 2
    assert peers.logical_bytes("rms", 1, 8, 2, weight_itemsize=4) == 2 * 8 * 2 + 8 * 4


def test_plan_for_is_the_library_plan():
    import cupy_rmsnorm as rn
    assert forward.plan_for("rms", 4096, 4095, 2, 132) == rn.launch_plan(4096, 4095, 2, 8, 132)
    assert forward.plan_for("rms", 1, 4096, 4, 132) == rn.launch_plan(1, 4096, 4, 4, 132, edges=False)
    assert forward.plan_for("fused", 1, 32768, 2, 132, 8) == \
        rn.launch_plan(1, 32768, 2, 8, 132, True, edges=False, max_cluster=8)
    assert forward.plan_for("fused", 4096, 4096, 2, 132) == rn.launch_plan(4096, 4096, 2, 8, 132, True, edges=False)
    assert forward.plan_for("fused", 4096, 4096, 2, 132) != forward.plan_for("rms", 4096, 4096, 2, 132)


def test_calls_for_targets_the_time_within_limits():
    assert timing.calls_for(16 << 10, 4000.0, 20, 200) == 200           # tiny: capped
    big = timing.calls_for(1 << 30, 4000.0, 20, 200)
    assert big == 20                                                    # huge: the floor
    mid = timing.calls_for(64 << 20, 4000.0, 1, 10_000)                 # ~18.8 us a call
    assert abs(mid * (64 * 2 ** 20 / 4e6 + 2.0) - timing.GRAPH_TARGET_US) < 20


# -- records and text ----------------------------------------------------------------------------
def test_paired_host_ratio_alternates_and_takes_the_median_ratio():
    """Each side goes first in every other round; on a clock where ours costs 3 units a call
    and theirs 4, and the machine slows down by half midway, every round's ratio is 0.75."""
    now, order = [0.0], []
    slow = [1.0]

    def clock():
        return now[0]

    def cost(name, units):
        def call():
            order.append(name)
            now[0] += units * slow[0] * 1e-6
        return call

    def sync():
        if len(order) > 20:
            slow[0] = 1.5
    m = timing.paired_host_ratio(cost("ours", 3), cost("theirs", 4), sync, calls=5, rounds=4, warmup=1, clock=clock)
    firsts = [order[k] for k in range(2, len(order), 5)]     # after the warm-up pair, each block's first call
    assert firsts == ["ours", "theirs", "theirs", "ours", "ours", "theirs", "theirs", "ours"]
    assert m["ratio_median"] == pytest.approx(0.75) and m["ratio_min"] == pytest.approx(0.75)
    assert m["host_us_rounds"][0] == pytest.approx(3.0) and m["host_us_rounds"][-1] == pytest.approx(4.5)


def test_make_record_derives_bandwidth():
    r = forward.make_record("fused", "float16", 2, 1000, "ours", "cold", 2.0, 16_000, 4000.0, 1, 30,
                           None, PLAN)
    assert r["GBps"] == pytest.approx(8.0)                              # 16 kB in 2 us
    assert r["pct_copy"] == pytest.approx(0.2)
    assert r["plan"] == PLAN and r["mode"] == "cold" and r["bytes"] == 16_000


def test_make_record_flattens_a_dataclass_plan():
    import cupy_rmsnorm as rn
    plan = rn.launch_plan(4096, 4096, 2, 8, 132)
    r = forward.make_record("rms", "bfloat16", 4096, 4096, "ours", "graph", 10.0, 1, 1.0, 1, 1, 0.0, plan)
    assert r["plan"]["variant"] == plan.variant and r["plan"]["grid"] == plan.grid


# one run's records at four rms shapes and two fused ones, with the copy and the in-place forms;
# the copy and liger_ip are faster than liger, so only the rule keeps them from "best peer"
COPY_AND_IN_PLACE = [
    rec("ours", 17.0), rec("liger", 18.0), rec("copy", 16.0),
    rec("ours", 130.0, tokens=16384, hidden=8192), rec("liger", 129.0, tokens=16384, hidden=8192),
    rec("copy", 125.0, tokens=16384, hidden=8192),
    rec("ours", 1.2, tokens=1), rec("liger", 1.5, tokens=1), rec("copy", 0.8, tokens=1),
    rec("ours", 21.0, hidden=4095), rec("copy", 17.0, hidden=4095),             # not a large shape
    rec("ours", 34.0, op="fused"), rec("liger", 35.0, op="fused"), rec("copy", 32.0, op="fused"),
    rec("ours_ip", 30.0, op="fused"), rec("liger_ip", 33.0, op="fused"),
    rec("ours", 1.5, op="fused", tokens=1), rec("liger", 1.7, op="fused", tokens=1),
    rec("ours_ip", 1.4, op="fused", tokens=1)]


def test_best_peer_is_never_the_copy_or_an_in_place_form():
    d = {r["impl"]: r for r in COPY_AND_IN_PLACE if r["op"] == "fused" and r["tokens"] == 4096}
    assert forward.best_peer(d)[0] == "liger"
    assert forward.best_peer({k: d[k] for k in ("ours", "copy", "ours_ip", "liger_ip")}) is None
    assert forward.best_peer(d, among=peers.IN_PLACE_PEERS)[0] == "liger_ip"


def test_charts_draw_the_copy_and_leave_the_in_place_forms_out():
    assert forward.chart_impls({"liger_ip", "copy", "liger", "ours_ip", "ours", "cupy"}) == \
        ["ours", "cupy", "liger", "copy"]


# -- files --------------------------------------------------------------------------------------
def test_csv_has_every_field_and_the_flattened_plan(tmp_path):
    records = [rec("ours", 2.0), rec("liger", 4.0, plan=None), rec("ours", 1.5, mode="hot")]
    records[1]["plan"] = None
    path = tmp_path / "r.csv"
    report.write_csv(path, *report.csv_of(forward.csv_records({"results": records})))
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3
    assert list(rows[0])[: len(forward.FIELDS)] == list(forward.FIELDS)
    assert rows[0]["plan_variant"] == "block" and rows[0]["plan_grid"] == "4096"
    assert rows[1]["plan_variant"] == ""
    assert float(rows[2]["us"]) == 1.5 and rows[2]["mode"] == "hot"
    assert float(rows[0]["GBps"]) == pytest.approx(records[0]["GBps"])


def test_json_round_trip_with_non_finite_values(tmp_path):
    records = [rec("ours", 2.0)]
    records[0]["max_abs_err"] = float("nan")
    payload = {"meta": {"command": "forward", "copy_GBps": 4000.0}, "first_call": [], "results": records,
               "errors": []}
    path = tmp_path / "r.json"
    report.write_json(path, payload)
    text = path.read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    back = report.load_json(path)
    assert back["meta"]["copy_GBps"] == 4000.0 and back["results"][0]["plan"] == PLAN
    assert back["results"][0]["max_abs_err"] == "nan"
    assert back["results"][0]["us"] == 2.0


def test_charts_are_png_files(tmp_path):
    pytest.importorskip("matplotlib")
    records = [rec(impl, us * t / 64 + 1, tokens=t, dtype=dt, mode=mode)
               for impl, us in (("ours", 1.0), ("liger", 1.3)) for t in (1, 64, 4096)
               for dt in ("bfloat16", "float16") for mode in ("graph", "cold", "hot")]
    records.append(rec("ours", 3.0, tokens=4096, hidden=255))     # a single point: no panel
    records += [rec(impl, 1.0, tokens=t, op="fused") for impl in ("copy", "ours_ip") for t in (1, 64)]
    paths = forward.write_charts({"meta": {"copy_GBps": 4000.0}, "results": records}, str(tmp_path / "s"))
    names = sorted(os.path.basename(p) for p in paths)
    assert names == ["s_cold_bfloat16.png", "s_cold_float16.png", "s_graph_bfloat16.png",
                     "s_graph_float16.png"]
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_the_files_but_no_chart(tmp_path, monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(common.importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    payload = {"meta": {"command": "forward"}, "results": [rec("ours", 1.0)], "errors": []}
    written = common.write_report(forward, payload, str(tmp_path), "s")
    assert sorted(os.listdir(tmp_path)) == ["s.csv", "s.json", "s.md"] == sorted(os.path.basename(p) for p in written)
    assert "matplotlib is not installed" in capsys.readouterr().err


# -- first-call latency ----------------------------------------------------------------------------
def test_first_call_environment():
    env = timing.first_call_env("/tmp/k", "/src", {"PYTHONPATH": "/other", "CUPY_CACHE_IN_MEMORY": "1",
                                                  "HOME": "/h"})
    assert env["CUPY_CACHE_DIR"] == "/tmp/k" and "CUPY_CACHE_IN_MEMORY" not in env
    assert env["PYTHONPATH"] == os.pathsep.join(["/src", "/other"]) and env["HOME"] == "/h"


def test_first_call_latency_runs_two_fresh_processes_on_one_cache(monkeypatch):
    """Two children share a kernel cache (empty, then warm); each prints its two call times as
    JSON, read back as milliseconds; a child that fails is an error naming its last line."""
    runs = []

    def fake_run(cmd, env, capture_output, text, timeout):
        runs.append((cmd, env["CUPY_CACHE_DIR"]))
        seconds = "[0.9, 0.002]" if len(runs) == 1 else "[0.03, 0.001]"
        return subprocess.CompletedProcess(cmd, 0, stdout=f"noise\n{seconds}\n", stderr="")
    monkeypatch.setattr(timing.subprocess, "run", fake_run)
    got = timing.first_call_latency("fused", "float16", 8, 64)
    assert got == {"op": "fused", "dtype": "float16", "tokens": 8, "hidden": 64, "empty_cache_ms": 900.0,
                   "warm_cache_ms": 30.0, "second_call_ms": 1.0}
    (cmd, cache), (_, cache_again) = runs
    assert cache == cache_again and cmd[1:3] == ["-c", timing.FIRST_CALL_CODE] and cmd[3:] == ["fused", "float16",
                                                                                                "8", "64"]
    compile(timing.FIRST_CALL_CODE, "<first call>", "exec")
    assert "first_call_child" in timing.FIRST_CALL_CODE and callable(timing.first_call_child)
    monkeypatch.setattr(timing.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 1, stdout="", stderr="Traceback\nImportError: no cupy"))
    with pytest.raises(RuntimeError, match="exit 1.*ImportError: no cupy"):
        timing.first_call_latency("rms")


# -- a whole run, GPU parts faked ------------------------------------------------------------------
class FakeTimer:
    def __init__(self, us):
        self.us, self.samples = us, []

    def round(self):
        self.samples.append(self.us)
        return self.us

    def close(self):
        pass


class FakeCase:
    graph_writes = True     # False: the replayed graph leaves our NaN-poisoned output alone

    def __init__(self, op, dtype, tokens, hidden):
        self.op, self.dtype, self.tokens, self.hidden = op, dtype, tokens, hidden
        self.out = "our output"
        self.poisoned = False

    def poison_outputs(self):
        self.poisoned = True

    def max_abs_err(self, result):
        if result is self.out and self.poisoned and not self.graph_writes:
            return float("nan")
        return 0.0078125

    def release(self):
        pass


SPEED = {"ours": 1.0, "cupy": 8.0, "copy": 0.8}


def fake_build(name, case, compile_mode="tokens"):
    assert compile_mode in peers.COMPILE_MODES
    if name == "cupy" and case.hidden == 255:
        raise RuntimeError("composite failed")
    if name == "cupy" and case.op == "fused" and case.tokens == 1:
        raise peers.Unsupported("not offered")

    def fn():
        return "output"
    fn.us = SPEED[name] * (1 + case.tokens * case.hidden / 1e6)
    if name == "copy":          # a check of its own, as peers' copy has: no error against the reference
        def check(run):
            run(fn, 1)
            if case.hidden == 255:
                raise RuntimeError("copy check: the destination differs from the source after a copy")
            run(fn)
            return None
        fn.check = check
    return fn


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(timing, "gpu_missing", lambda: None)
    monkeypatch.setattr(timing, "device_info", lambda: {"device_id": 0, "gpu": "Fake GPU", "sm_count": 132,
                                                        "compute_capability": "9.0", "max_cluster": 8})
    monkeypatch.setattr(timing, "copy_bandwidth_gbps", lambda: (4000.0, [3990.0, 4000.0]))
    monkeypatch.setattr(timing, "CupyRunner", lambda: "cupy-runner")
    monkeypatch.setattr(timing, "Scratch", lambda: "scratch")
    monkeypatch.setattr(timing, "warm_up", lambda runner, fn, calls=timing.WARMUP_CALLS: fn())
    monkeypatch.setattr(timing, "make_timer", lambda mode, runner, fn, calls, scratch: FakeTimer(fn.us))
    monkeypatch.setattr(common, "nvidia_driver_version", lambda: "580.1")
    monkeypatch.setattr(timing, "first_call_latency", lambda op, dtype, tokens, hidden: {
        "op": op, "dtype": dtype, "tokens": tokens, "hidden": hidden, "empty_cache_ms": 900.0,
        "warm_cache_ms": 40.0, "second_call_ms": 0.02})
    monkeypatch.setattr(peers, "Case", FakeCase)
    monkeypatch.setattr(peers, "availability", lambda names: (
        [n for n in ("ours", "cupy", "copy") if n in names], {"liger": "liger-kernel is not installed"}))
    monkeypatch.setattr(peers, "build", fake_build)


def test_a_whole_run_with_a_fake_gpu(fake_gpu, tmp_path, capsys):
    out_dir = tmp_path / "out"
    rc = cli.main(["--quick", "--peers", "cupy", "--out", str(out_dir), "--shapes", "1,4096x4096", "4096x255"])
    assert rc == 0
    captured = capsys.readouterr()
    assert "Fake GPU" in captured.out and "4000 GB/s" in captured.out
    assert "empty kernel cache 900 ms" in captured.out
    assert "rms_norm, bfloat16, graph" in captured.out and "fused_add_rms_norm, bfloat16, hot" in captured.out
    assert "0.12 cupy" in captured.out                 # ours / cupy = 1 / 8
    assert "composite failed" in captured.out          # reported in the errors section
    assert "not offered" not in captured.out           # an unsupported op is no error
    assert "liger left out: liger-kernel is not installed" in captured.err
    assert "[" in captured.err and "100%" in captured.err      # the progress bar

    payload = json.loads((out_dir / "forward.json").read_text())
    meta = payload["meta"]
    assert meta["command"] == "forward" and meta["device"]["gpu"] == "Fake GPU" and meta["copy_GBps"] == 4000.0
    assert meta["device"]["driver_version"] == "580.1"
    assert meta["left_out"] == {"liger": "liger-kernel is not installed"}
    assert meta["compile_mode"] == "tokens" and meta["repeats"] == forward.QUICK_REPEATS
    assert set(meta["implementations"]) == {"ours", "cupy"}
    assert meta["commit"] == common.git_state(common.library_root())[0]
    assert meta["versions"]["cupy_rmsnorm"] and meta["shapes"] == [[1, 4096], [4096, 4096], [4096, 255]]
    results = payload["results"]
    # 2 ops x 3 shapes x 3 modes of ours; cupy misses 4096x255 (error) and fused 1x4096 (unsupported)
    assert sum(r["impl"] == "ours" for r in results) == 18
    assert sum(r["impl"] == "cupy" for r in results) == 18 - 6 - 3
    import dataclasses

    import cupy_rmsnorm as rn
    for r in results:    # every row carries our plan for its shape (132 SMs, 16-byte vectors, clusters)
        assert r["plan"] == dataclasses.asdict(rn.launch_plan(
            r["tokens"], r["hidden"], 2, 8, 132, r["op"] == "fused", edges=r["hidden"] % 8 != 0, max_cluster=8))
    assert {e["where"] for e in payload["errors"] if not e.get("skipped")} == \
        {"rms bfloat16 4096x255 cupy", "fused bfloat16 4096x255 cupy"}
    ours = next(r for r in results if r["impl"] == "ours" and r["tokens"] == 4096 and r["hidden"] == 4096
                and r["op"] == "rms" and r["mode"] == "graph")
    assert ours["us"] == pytest.approx(1 + 4096 * 4096 / 1e6)
    assert ours["pct_copy"] == pytest.approx(100 * ours["GBps"] / 4000.0)

    with open(out_dir / "forward.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == len(results)
    md = " ".join((out_dir / "forward.md").read_text().split())   # the cells, whatever their padding
    assert "| 4096x4096 |" in md and " cupy " in md
    if importlib.util.find_spec("matplotlib"):
        assert (out_dir / "forward_graph_bfloat16.png").is_file()


def test_a_whole_run_with_the_copy_of_the_same_bytes(fake_gpu, tmp_path, capsys):
    rc = cli.main(["--no-first-call", "--no-chart", "--ops", "rms", "--dtypes", "bf16", "--modes", "graph",
                   "--shapes", "4096x4096", "4096x255", "--peers", "copy", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("4096x4096 "))
    assert f" {1 / 0.8:.2f} " in row                                         # ours over the copy
    assert "rms bfloat16 4096x255 copy: RuntimeError: copy check" in out      # a failed check is an error
    payload = json.loads((tmp_path / "forward.json").read_text())
    copies = [r for r in payload["results"] if r["impl"] == "copy"]
    assert [(r["hidden"], r["max_abs_err"]) for r in copies] == [(4096, None)]  # no error against the op
    md = " ".join((tmp_path / "forward.md").read_text().split())
    assert "| ours/copy |" in md and f"| {1 / 0.8:.2f} |" in md


def test_replot_redraws_a_saved_run(fake_gpu, tmp_path, capsys):
    cli.main(["--quick", "--no-first-call", "--no-chart", "--out", str(tmp_path), "--shapes", "1,64x4096"])
    first = capsys.readouterr().out
    saved = tmp_path / "forward.json"
    assert not list(tmp_path.glob("*.png"))
    assert cli.main(["--replot", str(saved), "--out", str(tmp_path / "re")]) == 0
    again = capsys.readouterr().out
    assert again == first and "rms_norm, bfloat16, graph" in again     # the report the run printed
    assert (tmp_path / "re" / "forward.md").read_text() == (tmp_path / "forward.md").read_text()
    assert not (tmp_path / "re" / "forward.json").exists()     # a replot never rewrites the run


def test_a_graph_that_does_not_write_our_output_is_an_error(fake_gpu, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(FakeCase, "graph_writes", False)
    assert cli.main(["--no-first-call", "--no-chart", "--ops", "rms", "--dtypes", "bf16", "--shapes",
                     "8x64", "--peers", "none", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "forward.json").read_text())
    assert [e["where"] for e in payload["errors"]] == ["rms bfloat16 8x64 ours graph"]
    graph = next(r for r in payload["results"] if r["mode"] == "graph")
    assert graph["max_abs_err"] == "nan"
    assert "replay check" in capsys.readouterr().out


def test_timed_us_warms_up_times_in_the_mode_and_closes_the_timer(monkeypatch):
    """timed_us: a warm-up on the runner, make_timer's timer for the mode, the median of the
    rounds after the unrecorded first, and the timer closed even when a round fails."""
    from cupy_rmsnorm.bench import timing
    made, closed = [], []

    class Timer:
        def __init__(self, values):
            self.values, self.samples = iter(values), []

        def round(self):
            v = next(self.values)
            if v is None:
                raise RuntimeError("round failed")
            self.samples.append(v)

        def close(self):
            closed.append(self)

    class Runner:

        def context(self):
            import contextlib
            return contextlib.nullcontext()

        def synchronize(self):
            pass

    def make_timer(mode, runner, fn, calls, scratch):
        made.append((mode, calls, scratch))
        return Timer([100.0, 3.0, 1.0, 2.0] if mode == "cold" else [100.0, None])

    monkeypatch.setattr(timing, "make_timer", make_timer)
    calls = []
    runner = Runner()
    assert timing.timed_us(runner, lambda: calls.append(1), "cold", 7, 3, scratch="s") == 2.0
    assert made == [("cold", 7, "s")] and len(calls) == timing.WARMUP_CALLS and len(closed) == 1
    with pytest.raises(RuntimeError, match="round failed"):
        timing.timed_us(runner, lambda: None, "graph", 5, 3)
    assert made[-1] == ("graph", 5, None) and len(closed) == 2
