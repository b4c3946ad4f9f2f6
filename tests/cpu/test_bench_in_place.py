"""The benchmark's in-place forms without a GPU: ``peers.build("ours_ip", case)`` on a
NumPy-backed case (cupy_rmsnorm runs its reference on NumPy arrays), its check on fresh
copies, its inputs restored before every timing round, and how far the values drift
between two restores."""

import contextlib

import ml_dtypes
import numpy as np
import pytest

from cupy_rmsnorm.bench import cli, forward, peers, timing

DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
          "bfloat16": np.dtype(ml_dtypes.bfloat16)}


class NumpyCase:
    """``peers.Case``'s interface over NumPy arrays, with a float64 reference."""

    made = []

    def __init__(self, op, dtype, tokens, hidden, seed=0):
        rng = np.random.default_rng(seed)
        dt = DTYPES[dtype]
        self.op, self.dtype, self.tokens, self.hidden = op, dtype, tokens, hidden
        self.x = rng.standard_normal((tokens, hidden)).astype(dt)
        self.residual = rng.standard_normal((tokens, hidden)).astype(dt) if op == "fused" else None
        self.weight = (1.0 + 0.1 * rng.standard_normal(hidden)).astype(dt)
        self.out = np.empty_like(self.x)
        self.residual_out = np.empty_like(self.x) if op == "fused" else None
        self.inputs_at_start = (self.x.copy(), None if self.residual is None else self.residual.copy())
        NumpyCase.made.append(self)

    def reference(self):
        s = self.x + self.residual if self.op == "fused" else self.x     # rounded to the dtype
        s = s.astype(np.float64)
        return s / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + peers.EPS) * self.weight.astype(np.float64)

    def max_abs_err(self, result):
        y = result[0] if isinstance(result, tuple) else result
        return float(np.max(np.abs(y.astype(np.float64) - self.reference())))

    def fresh_inputs(self):
        return self.x.copy(), self.residual.copy()

    def restore_inputs(self, x, residual):
        x[...] = self.x
        residual[...] = self.residual

    def poison_outputs(self):
        for a in (self.out, self.residual_out):
            if a is not None:
                a.fill(np.nan)

    def release(self):
        pass


class HostRunner:
    """A runner whose "stream" is the host: what it runs has finished when it returns."""

    kind = "cupy"
    event_stream = contextlib.nullcontext()

    def context(self):
        return contextlib.nullcontext()

    def synchronize(self):
        pass


class LoopTimer:
    """A timer that really calls: ``calls`` calls a round (and, as the graph timer's first
    replay does, one round's worth when made in graph mode); keeps each round's first result."""

    def __init__(self, mode, runner, fn, calls):
        self.runner, self.fn, self.calls, self.mode = runner, fn, calls, mode
        self.samples, self.first_results = [], []
        if mode == "graph":
            for _ in range(calls):
                fn()

    def round(self):
        first = self.fn()
        self.first_results.append(tuple(a.copy() for a in first) if isinstance(first, tuple) else first.copy())
        for _ in range(self.calls - 1):
            self.fn()
        self.samples.append(1.0)
        return 1.0

    def close(self):
        pass


def counting_run(log):
    """A ``run`` for ``warm_up_and_check`` that calls on the host and logs (callable, calls)."""
    def run(fn, calls=timing.WARMUP_CALLS):
        log.append((fn, calls))
        result = None
        for _ in range(calls):
            result = fn()
        return result
    return run


def test_in_place_is_checked_by_one_call_on_fresh_copies_and_timed_on_copies_of_its_own():
    case = NumpyCase("fused", "float32", 4, 256)
    fn = peers.build("ours_ip", case)
    log = []
    err = peers.warm_up_and_check(case, fn, counting_run(log))
    assert err < 1e-5                                      # float32 against the float64 reference
    assert [calls for _, calls in log] == [1, timing.WARMUP_CALLS]
    assert log[0][0] is not fn and log[1][0] is fn         # checked on other copies, then warmed up
    np.testing.assert_array_equal(case.x, case.inputs_at_start[0])          # the case's inputs intact
    np.testing.assert_array_equal(case.residual, case.inputs_at_start[1])
    drifted = fn()
    assert case.max_abs_err(drifted) > 0.1                 # its own arrays moved on, call after call
    fn.restore_inputs()
    assert case.max_abs_err(fn()) < 1e-5                   # restored: the next call computes the op again


def test_an_in_place_check_on_drifted_inputs_fails():
    """The check's one call matters: three calls on the same copies (a run ignoring
    ``calls``) give a result far from the reference, and the check reports it."""
    case = NumpyCase("fused", "float32", 4, 256)
    fn = peers.build("ours_ip", case)
    err = peers.warm_up_and_check(case, fn, lambda f, calls=None: [f() for _ in range(3)][-1])
    assert err > 0.1


def test_the_in_place_forms_are_fused_only():
    case = NumpyCase("rms", "float32", 2, 64)
    for name in peers.IN_PLACE:
        with pytest.raises(peers.Unsupported):
            peers.build(name, case)


def test_measure_restores_before_every_round():
    case = NumpyCase("fused", "float16", 2, 512)
    fn = peers.build("ours_ip", case)
    restored = []
    timer = LoopTimer("hot", HostRunner(), fn, calls=50)

    def restore():
        restored.append(len(timer.first_results))
        fn.restore_inputs()
    timing.measure(timer, 4, before_round=restore)
    assert restored == [0, 1, 2, 3, 4]                     # before each of the 1 + 4 rounds
    for y, _ in timer.first_results:                       # every round began from the inputs
        assert case.max_abs_err((y,)) < 1e-2


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_in_place_drift_between_two_restores_stays_finite(dtype):
    """The most calls between two restores: a mode's last round and then the next graph
    timer's first replay (or the warm-up, then that replay), each at most the largest call
    count of a round. float16 would overflow within a few thousand calls; here it keeps a
    wide margin (the GPU's grid has more rows: a somewhat larger largest element)."""
    calls = 2 * max(hi for _, hi in forward.CALL_LIMITS.values()) + timing.WARMUP_CALLS
    case = NumpyCase("fused", dtype, 8, 8192)
    fn = peers.build("ours_ip", case)
    for _ in range(calls):
        y, s = fn()
    largest = float(np.max(np.abs(s.astype(np.float32))))
    assert np.isfinite(y.astype(np.float32)).all() and np.isfinite(largest)
    assert largest < float(ml_dtypes.finfo(DTYPES[dtype]).max) / 4


def test_a_sweep_checks_times_and_restores_the_in_place_form(monkeypatch):
    """The sweep on NumPy: ours and ours_ip built for real, timers that really call; the
    in-place form's error is that of one call on fresh copies, each round starts from the
    inputs, the case's inputs stay intact, and rms skips it quietly."""
    monkeypatch.setattr(peers, "Case", NumpyCase)
    monkeypatch.setattr(NumpyCase, "made", [])
    monkeypatch.setattr(timing, "CupyRunner", HostRunner)
    monkeypatch.setattr(timing, "Scratch", lambda: None)
    timers = []

    def make_timer(mode, runner, fn, calls, scratch):
        timers.append(LoopTimer(mode, runner, fn, calls))
        return timers[-1]
    monkeypatch.setattr(timing, "make_timer", make_timer)
    args = cli.parse_args(["--ops", "rms,fused", "--dtypes", "fp32", "--shapes", "3x128", "--modes", "graph,hot",
                           "--repeats", "2"])

    class Bar:
        def set_postfix_str(self, label):
            pass

        def update(self, n=1):
            pass
    errors = []
    measured = forward.Sweep(args, 132, 8, 4000.0, ["ours", "ours_ip"], Bar(), errors.append)
    measured.run()
    assert errors == [] and [e["where"] for e in measured.errors] == ["rms float32 3x128 ours_ip"]
    assert measured.errors[0].get("skipped")
    by = {(r["op"], r["impl"], r["mode"]): r for r in measured.records}
    assert set(by) == {("rms", "ours", "graph"), ("rms", "ours", "hot"), ("fused", "ours", "graph"),
                       ("fused", "ours", "hot"), ("fused", "ours_ip", "graph"), ("fused", "ours_ip", "hot")}
    assert all(r["max_abs_err"] < 1e-5 for r in measured.records)
    assert by[("fused", "ours_ip", "graph")]["calls"] == forward.CALL_LIMITS["graph"][1]   # 200 calls a round
    fused_case = NumpyCase.made[1]
    np.testing.assert_array_equal(fused_case.x, fused_case.inputs_at_start[0])
    np.testing.assert_array_equal(fused_case.residual, fused_case.inputs_at_start[1])
    in_place_timers = timers[-2:]
    assert [t.mode for t in in_place_timers] == ["graph", "hot"]
    for t in in_place_timers:
        assert len(t.first_results) == 1 + 2
        assert all(fused_case.max_abs_err(y) < 1e-5 for y in t.first_results)
