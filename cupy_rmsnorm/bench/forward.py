"""``forward`` (the default sub-command): rms_norm and fused_add_rms_norm against their peers
over a grid of shapes on the current GPU, in three modes; a table per mode, op and dtype, and
CSV, JSON, Markdown and PNG charts. Also the first-call latency in fresh processes."""

import contextlib
import functools
import sys
import time

from . import common, forward_report, peers, timing

SUMMARY = "rms_norm and fused_add_rms_norm against their peers (the default)"
DEFAULT_REPEATS = {"graph": 10, "cold": 30, "hot": 5}
QUICK_REPEATS = {"graph": 5, "cold": 10, "hot": 3}
CALL_LIMITS = {"graph": (20, 200), "hot": (10, 100)}          # (min, max) calls timed together
QUICK_CALL_LIMITS = {"graph": (10, 100), "hot": (5, 50)}
FIRST_CALL_SHAPE = (4096, 4096)

# The default grid: a token sweep at the two common hidden sizes, the
# smaller and odd hidden sizes at 4096 tokens, and two model widths at 256 tokens.
DEFAULT_SHAPES = tuple(sorted(
    {(t, h) for h in (4096, 8192) for t in (1, 32, 256, 1024, 4096, 16384)}
    | {(4096, h) for h in (512, 1024, 2048, 255, 4095)}
    | {(256, 5120), (256, 7168)},
    key=lambda s: (s[1], s[0])))
QUICK_SHAPES = ((1, 4096), (256, 4096), (4096, 4096), (4096, 4095), (1, 8192))
DEFAULTS = {"shapes": list(DEFAULT_SHAPES), "dtypes": ["bfloat16", "float16"], "modes": list(timing.MODES)}
QUICK = {"shapes": list(QUICK_SHAPES), "dtypes": ["bfloat16"]}

DESCRIPTIONS = peers.DESCRIPTIONS
NEEDS = "CuPy; the torch peers torch with CUDA, liger: " + common.INSTALL_HINTS["liger"]


def add_arguments(p):
    common.add_common_options(p, shapes=f"the standard grid of {len(DEFAULT_SHAPES)} shapes",
                              dtypes="bf16,fp16; --quick: bf16", modes=(timing.MODES, "all three"),
                              repeats="timing rounds per measurement, every mode (default: graph 10, cold 30, "
                                      "hot 5; --quick: 5, 10, 3)")
    p.add_argument("--ops", type=common.comma_list(str, peers.OPS, "op"), default=list(peers.OPS),
                   help="ops to measure: rms, fused (default: both)")
    p.add_argument("--peers", type=_peers, default=list(peers.SELECTABLE),
                   help=f"all, none or a list of {', '.join(peers.SELECTABLE)} (default: all that are "
                        f"installed; 'ours' always runs)")
    p.add_argument("--compile", choices=peers.COMPILE_MODES, default="tokens",
                   help="torch_compile peer: 'tokens' = token axis dynamic, hidden static, one compile "
                        "per hidden size (default; as a server compiles); 'static' = one compile per "
                        "shape (slower to warm up)")
    p.add_argument("--no-first-call", action="store_true",
                   help="skip the first-call latency measurement (fresh processes)")


def _peers(text):
    key = text.strip().lower()
    if key == "all":
        return list(peers.SELECTABLE)
    if key == "none":
        return []
    return common.comma_list(str, peers.SELECTABLE, "peer")(text)


def finish_args(args, parser):
    repeats = args.repeats
    common.resolve_defaults(args, DEFAULTS, QUICK)
    base = QUICK_REPEATS if args.quick else DEFAULT_REPEATS
    args.repeats = {m: repeats or base[m] for m in timing.MODES}
    args.call_limits = QUICK_CALL_LIMITS if args.quick else CALL_LIMITS


def requirements_missing(args):
    return None          # CuPy is all it needs; missing peers are left out with a note


format_report = forward_report.format_report
format_markdown = forward_report.format_markdown
csv_records = forward_report.csv_records
write_charts = forward_report.write_charts


def plan_for(op, tokens, hidden, itemsize, sm_count, max_cluster=1):
    """Our launch plan for a contiguous problem (16-byte vectors, as the pool's aligned
    allocations allow; rows off the vector grid when hidden is not a multiple)."""
    import cupy_rmsnorm as rn
    vec = 16 // itemsize
    return rn.launch_plan(tokens, hidden, itemsize, vec, sm_count, op == "fused",
                          edges=hidden % vec != 0, max_cluster=max_cluster)


# -- the run -------------------------------------------------------------------------------------
def run(args):
    """Measure what ``args`` asks for: the device and its copy bandwidth, the implementations
    present, first-call latency, the sweep; then the report written and printed."""
    started = time.perf_counter()
    bar = None

    def log(msg):
        if bar is not None:
            bar.write(msg, file=sys.stderr)   # above the bar
        else:
            common.log(msg)

    device = common.gpu_device()
    log(f"{common.PROG} forward on {device['gpu']} ({device['sm_count']} SMs)")
    copy_gbps, copy_samples = timing.copy_bandwidth_gbps()
    log(f"copy bandwidth: {copy_gbps:.0f} GB/s")
    impls, missing = peers.availability(["ours"] + list(args.peers))
    for name, why in missing.items():
        log(f"note: {name} left out: {why}")
    first_call = [] if args.no_first_call else measure_first_calls(args, log)

    n_cases = len(args.ops) * len(args.dtypes) * len(args.shapes)
    log(f"sweep: {n_cases} cases x {len(impls)} implementations ({', '.join(impls)}) x {len(args.modes)} modes")
    from tqdm import tqdm
    # into a log file, a line a minute rather than a redraw a second
    bar = tqdm(total=n_cases * len(impls) * len(args.modes), file=sys.stderr, dynamic_ncols=True,
               mininterval=1 if sys.stderr.isatty() else 60)
    sweep = Sweep(args, device["sm_count"], device["max_cluster"], copy_gbps, impls, bar, log)
    interrupted = False
    try:
        sweep.run()
    except KeyboardInterrupt:
        interrupted = True
        log("interrupted: saving what was measured")
    finally:
        bar.close()
        bar = None

    meta = common.run_metadata(
        "forward", device, copy_GBps=copy_gbps, copy_GBps_samples=copy_samples, copy_bytes=timing.COPY_BYTES,
        scratch_bytes=timing.SCRATCH_BYTES, ops=args.ops, dtypes=args.dtypes, modes=args.modes,
        shapes=[list(s) for s in args.shapes], repeats=args.repeats, compile_mode=args.compile,
        implementations={n: peers.DESCRIPTIONS[n] for n in impls}, left_out=missing,
        warmup_seconds=sweep.warmup_s, seconds=time.perf_counter() - started, interrupted=interrupted)
    payload = {"meta": meta, "first_call": first_call, "results": sweep.records, "errors": sweep.errors}
    real_errors = [e for e in sweep.errors if not e.get("skipped")]
    log(f"{len(sweep.records)} measurements, {len(real_errors)} errors, {meta['seconds']:.0f} s (warm-up and "
        "compiles: " + ", ".join(f"{k} {v:.0f} s" for k, v in sweep.warmup_s.items()) + ")")
    return common.finish_run(forward_report, args, payload, interrupted)


def measure_first_calls(args, log):
    out = []
    tokens, hidden = FIRST_CALL_SHAPE
    for op in args.ops:
        log(f"first-call latency of {op} in fresh processes ...")
        try:
            out.append(timing.first_call_latency(op, args.dtypes[0], tokens, hidden))
        except Exception as e:  # noqa: BLE001 - reported, the sweep goes on
            out.append({"op": op, "dtype": args.dtypes[0], "tokens": tokens, "hidden": hidden,
                        "error": common.error_text(e)})
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
        grad_mode = contextlib.nullcontext()
        if any(peers.RUNNER_KIND[n] == "torch" for n in self.impls):
            import torch
            grad_mode = torch.no_grad()   # forward only, as in inference
            self.runners["torch"] = timing.TorchRunner()
        self.scratch = timing.Scratch()
        with grad_mode:
            self._measure_all()

    def _measure_all(self):
        args = self.args
        for op in args.ops:
            for dtype in args.dtypes:
                for tokens, hidden in args.shapes:
                    case = peers.Case(op, dtype, tokens, hidden)
                    for name in self.impls:
                        self.measure(case, name)
                    case.release()

    def _error(self, where, e, quiet=False):
        text = e if isinstance(e, str) else common.error_text(e)
        self.errors.append({"where": where, "error": text, **({"skipped": True} if quiet else {})})
        if not quiet:
            self.log(f"error: {where}: {text}")

    def measure(self, case, name):
        """Warm-up (and correctness check: ``peers.warm_up_and_check``), then each mode, of
        one implementation."""
        args, bar = self.args, self.bar
        itemsize = common.ITEMSIZE[case.dtype]
        nbytes = peers.logical_bytes(case.op, case.tokens, case.hidden, itemsize)
        plan = plan_for(case.op, case.tokens, case.hidden, itemsize, self.sm_count, self.max_cluster)
        runner = self.runners[peers.RUNNER_KIND[name]]
        where = f"{case.op} {case.dtype} {case.tokens}x{case.hidden} {name}"
        bar.set_postfix_str(f"{where} (warm-up)")
        t0 = time.perf_counter()
        try:
            fn = peers.build(name, case, compile_mode=args.compile)
            err = peers.warm_up_and_check(case, fn, functools.partial(timing.warm_up, runner))
        except peers.Unsupported as e:
            self._error(where, str(e), quiet=True)
            bar.update(len(args.modes))
            return
        except Exception as e:  # noqa: BLE001 - one failing peer must not end the run
            self._error(where, e)
            bar.update(len(args.modes))
            return
        finally:
            self.warmup_s[name] = self.warmup_s.get(name, 0.0) + time.perf_counter() - t0
        for mode in args.modes:
            bar.set_postfix_str(f"{where} {mode}")
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
                self.records.append(forward_report.make_record(
                    case.op, case.dtype, case.tokens, case.hidden, name, mode, us, nbytes,
                    self.copy_gbps, calls, args.repeats[mode], mode_err, plan))
            except Exception as e:  # noqa: BLE001
                self._error(f"{where} {mode}", e)
            bar.update()
