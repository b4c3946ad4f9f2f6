"""The measurements of a run: first-call latency in fresh processes, and the sweep over
(op, dtype, shape) x implementation x mode."""

import functools
import time

from . import peers, report, shapes, timing

FIRST_CALL_SHAPE = (4096, 4096)


def error_text(e):
    return " ".join(f"{type(e).__name__}: {e}".split())[:300]


def measure_first_calls(args, log):
    out = []
    tokens, hidden = FIRST_CALL_SHAPE
    for op in args.ops:
        log(f"first-call latency of {op} in fresh processes ...")
        try:
            out.append(timing.first_call_latency(op, args.dtypes[0], tokens, hidden))
        except Exception as e:  # noqa: BLE001 - reported, the sweep goes on
            out.append({"op": op, "dtype": args.dtypes[0], "tokens": tokens, "hidden": hidden,
                        "error": error_text(e)})
    return out


class Sweep:
    """Every (op, dtype, shape) x implementation x mode of one run.

    Results go to ``records``, failures to ``errors`` (one failing peer never ends the
    run), warm-up and compile seconds per implementation to ``warmup_s``.
    """

    def __init__(self, args, sm_count, max_cluster, copy_gbps, impls, bar, log):
        self.args, self.sm_count, self.copy_gbps, self.impls = args, sm_count, copy_gbps, impls
        self.max_cluster = max_cluster
        self.bar, self.log = bar, log
        self.records, self.errors, self.warmup_s = [], [], {}

    def run(self):
        self.runners = {"cupy": timing.CupyRunner()}
        if any(peers.RUNNER_KIND[n] == "torch" for n in self.impls):
            import torch
            torch.set_grad_enabled(False)   # forward only, as in inference
            self.runners["torch"] = timing.TorchRunner()
        self.scratch = timing.Scratch()
        args = self.args
        for op in args.ops:
            for dtype in args.dtypes:
                for tokens, hidden in args.shapes:
                    case = peers.Case(op, dtype, tokens, hidden)
                    for name in self.impls:
                        self.measure(case, name)
                    case.release()

    def _error(self, where, e, quiet=False):
        text = e if isinstance(e, str) else error_text(e)
        self.errors.append({"where": where, "error": text, **({"skipped": True} if quiet else {})})
        if not quiet:
            self.log(f"error: {where}: {text}")

    def measure(self, case, name):
        """Warm-up (and correctness check: ``peers.warm_up_and_check``), then each mode, of
        one implementation."""
        args, bar = self.args, self.bar
        itemsize = shapes.ITEMSIZE[case.dtype]
        nbytes = shapes.logical_bytes(case.op, case.tokens, case.hidden, itemsize)
        plan = shapes.plan_for(case.op, case.tokens, case.hidden, itemsize, self.sm_count, self.max_cluster)
        runner = self.runners[peers.RUNNER_KIND[name]]
        where = f"{case.op} {case.dtype} {case.tokens}x{case.hidden} {name}"
        bar.update(f"{where} (warm-up)")
        t0 = time.perf_counter()
        try:
            fn = peers.build(name, case, compile_mode=args.compile)
            err = peers.warm_up_and_check(case, fn, functools.partial(timing.warm_up, runner))
        except peers.Unsupported as e:
            self._error(where, str(e), quiet=True)
            bar.advance(len(args.modes))
            return
        except Exception as e:  # noqa: BLE001 - one failing peer must not end the run
            self._error(where, e)
            bar.advance(len(args.modes))
            return
        finally:
            self.warmup_s[name] = self.warmup_s.get(name, 0.0) + time.perf_counter() - t0
        for mode in args.modes:
            bar.update(f"{where} {mode}")
            try:
                calls = 1
                if mode in args.call_limits:
                    calls = timing.calls_for(nbytes, self.copy_gbps, *args.call_limits[mode])
                check_graph = name == "ours" and mode == "graph"
                if check_graph:
                    case.poison_outputs()
                timer = timing.make_timer(mode, runner, fn, calls, self.scratch)
                try:
                    mode_err = err
                    if check_graph:   # the graph replayed once: our outputs must hold the result
                        mode_err = case.max_abs_err(case.out)
                        if not mode_err <= max(4 * err, 0.25):
                            self._error(f"{where} graph", f"replay check: max abs error {mode_err} "
                                        f"vs {err} eager: is the capture recording our launches?")
                    us = timing.measure(timer, args.repeats[mode],
                                        before_round=getattr(fn, "restore_inputs", None))
                finally:
                    timer.close()
                self.records.append(report.make_record(
                    case.op, case.dtype, case.tokens, case.hidden, name, mode, us, nbytes,
                    self.copy_gbps, calls, args.repeats[mode], mode_err, plan))
            except Exception as e:  # noqa: BLE001
                self._error(f"{where} {mode}", e)
            bar.advance()
