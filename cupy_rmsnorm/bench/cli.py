"""``python -m cupy_rmsnorm.bench`` / ``cupy-rmsnorm-bench``: the benchmark report.

Measures cupy_rmsnorm and its peers over a grid of shapes on the current GPU, prints a
table per mode, op and dtype, and writes CSV, JSON, Markdown and PNG charts.
``cupy-rmsnorm-bench e2e ...`` is the whole-model benchmark instead (``e2e.py``).
"""

import argparse
import os
import subprocess
import sys
import time

from . import progress, report, shapes, timing
from .peers import COMPILE_MODES, DESCRIPTIONS, SELECTABLE

EXIT_NO_GPU = 1
DEFAULT_REPEATS = {"graph": 10, "cold": 30, "hot": 5}
QUICK_REPEATS = {"graph": 5, "cold": 10, "hot": 3}
CALL_LIMITS = {"graph": (20, 200), "hot": (10, 100)}          # (min, max) calls timed together
QUICK_CALL_LIMITS = {"graph": (10, 100), "hot": (5, 50)}
FIRST_CALL_SHAPE = (4096, 4096)


def _list(parse, choices=None, what="value"):
    """An argparse type: a comma-separated list, each item through ``parse``."""
    def convert(text):
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"empty {what} list")
        out = []
        for item in items:
            try:
                value = parse(item)
            except ValueError as e:
                raise argparse.ArgumentTypeError(str(e)) from None
            if choices is not None and value not in choices:
                raise argparse.ArgumentTypeError(f"unknown {what} {item!r}; choose from {', '.join(choices)}")
            out.append(value)
        return shapes.unique(out)
    return convert


def _shape_spec(text):
    try:
        return shapes.parse_shape_spec(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _peers(text):
    key = text.strip().lower()
    if key == "all":
        return list(SELECTABLE)
    if key == "none":
        return []
    return _list(str, SELECTABLE, "peer")(text)


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def build_parser():
    impls = "\n".join(f"  {name:14s} {text}" for name, text in DESCRIPTIONS.items())
    p = argparse.ArgumentParser(
        prog="cupy-rmsnorm-bench",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Benchmark cupy_rmsnorm against its peers on the current GPU.",
        epilog=f"implementations:\n{impls}\n\nmodes:\n"
               + "\n".join(f"  {shapes.MODE_TITLES[m]}" for m in shapes.MODES)
               + "\n\nwhole-model benchmark (a Llama-shaped transformers model generating):\n"
                 "  cupy-rmsnorm-bench e2e --help")
    p.add_argument("--ops", type=_list(str, shapes.OPS, "op"), default=list(shapes.OPS),
                   help="ops to measure: rms, fused (default: both)")
    p.add_argument("--dtypes", type=_list(shapes.parse_dtype, what="dtype"), default=None,
                   help="bf16, fp16, fp32 (default: bf16,fp16; --quick: bf16)")
    p.add_argument("--shapes", type=_shape_spec, nargs="+", default=None, metavar="TxH",
                   help="shapes as TOKENSxHIDDEN, either side a comma list for every combination "
                        "(e.g. 1,32x8192,16384); default: the issue's grid")
    p.add_argument("--modes", type=_list(str, shapes.MODES, "mode"), default=list(shapes.MODES),
                   help="graph, cold, hot (default: all three)")
    p.add_argument("--peers", type=_peers, default=list(SELECTABLE),
                   help=f"all, none or a list of {', '.join(SELECTABLE)} (default: all that are "
                        f"installed; 'ours' always runs)")
    p.add_argument("--compile", choices=COMPILE_MODES, default="tokens",
                   help="torch_compile peer: 'tokens' = token axis dynamic, hidden static, one compile "
                        "per hidden size (default; as a server compiles); 'static' = one compile per "
                        "shape (slower to warm up)")
    p.add_argument("--out", default="bench_results", help="output folder (default: ./bench_results)")
    p.add_argument("--name", default="rmsnorm_bench", help="file name stem of the outputs")
    p.add_argument("--repeats", type=_positive_int, default=None,
                   help="timing rounds per measurement, every mode (default: graph 10, cold 30, hot 5)")
    p.add_argument("--quick", action="store_true",
                   help="a short run: a few shapes, bf16, fewer repeats")
    p.add_argument("--no-first-call", action="store_true",
                   help="skip the first-call latency measurement (fresh processes)")
    p.add_argument("--no-chart", action="store_true", help="write no PNG charts")
    p.add_argument("--replot", metavar="JSON",
                   help="no measuring: print the tables and write the charts of a saved run")
    return p


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    if args.dtypes is None:
        args.dtypes = list(shapes.QUICK_DTYPES if args.quick else shapes.DEFAULT_DTYPES)
    if args.shapes is None:
        args.shapes = list(shapes.QUICK_SHAPES if args.quick else shapes.DEFAULT_SHAPES)
    else:
        args.shapes = shapes.unique(s for spec in args.shapes for s in spec)
    base = QUICK_REPEATS if args.quick else DEFAULT_REPEATS
    args.repeats = {m: args.repeats or base[m] for m in shapes.MODES}
    args.call_limits = QUICK_CALL_LIMITS if args.quick else CALL_LIMITS
    return args


def no_gpu_message(reason):
    reason = " ".join(str(reason).split())   # one line, whatever the driver said
    return f"cupy-rmsnorm-bench: no CUDA GPU available ({reason}); nothing to measure"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["e2e"]:      # the whole-model benchmark, with options of its own
        from . import e2e
        return e2e.main(argv[1:])
    args = parse_args(argv)
    if args.replot:
        return replot(args)
    reason = timing.gpu_missing()
    if reason:
        print(no_gpu_message(reason), file=sys.stderr)
        return EXIT_NO_GPU
    return run(args)


# -- the run ------------------------------------------------------------------------------------
def git_info(path):
    """(commit, dirty) of the git checkout holding ``path``, or (None, None)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, capture_output=True,
                                text=True, timeout=10)
        if commit.returncode != 0:
            return None, None
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=path,
                                capture_output=True, text=True, timeout=10)
        return commit.stdout.strip(), bool(status.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return None, None


def nvidia_driver_version():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def _err_text(e):
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
                        "error": _err_text(e)})
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
        from . import peers
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
        text = e if isinstance(e, str) else _err_text(e)
        self.errors.append({"where": where, "error": text, **({"skipped": True} if quiet else {})})
        if not quiet:
            self.log(f"error: {where}: {text}")

    def measure(self, case, name):
        """Warm-up (and correctness check), then each mode, of one implementation."""
        from . import peers
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
            err = case.max_abs_err(timing.warm_up(runner, fn))
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
                    us = timing.measure(timer, args.repeats[mode])
                finally:
                    timer.close()
                self.records.append(report.make_record(
                    case.op, case.dtype, case.tokens, case.hidden, name, mode, us, nbytes,
                    self.copy_gbps, calls, args.repeats[mode], mode_err, plan))
            except Exception as e:  # noqa: BLE001
                self._error(f"{where} {mode}", e)
            bar.advance()


def run(args):
    from . import peers
    started = time.perf_counter()

    bar = None

    def log(msg):
        if bar is not None:
            bar.write(msg)
        else:
            print(msg, file=sys.stderr, flush=True)

    info = timing.device_info()
    log(f"cupy-rmsnorm-bench on {info['gpu']} ({info['sm_count']} SMs)")
    copy_gbps, copy_samples = timing.copy_bandwidth_gbps()
    log(f"copy bandwidth: {copy_gbps:.0f} GB/s")
    impls, missing = peers.availability(["ours"] + list(args.peers))
    for name, why in missing.items():
        log(f"note: {name} left out: {why}")
    first_call = [] if args.no_first_call else measure_first_calls(args, log)

    n_configs = len(args.ops) * len(args.dtypes) * len(args.shapes)
    log(f"sweep: {n_configs} cases x {len(impls)} implementations ({', '.join(impls)}) x "
        f"{len(args.modes)} modes")
    bar = progress.ProgressBar(n_configs * len(impls) * len(args.modes))
    sweep = Sweep(args, info["sm_count"], info["max_cluster"], copy_gbps, impls, bar, log)
    interrupted = False
    try:
        sweep.run()
    except KeyboardInterrupt:
        interrupted = True
        log("interrupted: saving what was measured")
    finally:
        bar.close()
        bar = None
    records, errors, warmup_s = sweep.records, sweep.errors, sweep.warmup_s

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    commit, dirty = git_info(root)
    meta = dict(info, driver_version=nvidia_driver_version(), copy_GBps=copy_gbps,
                copy_GBps_samples=copy_samples, copy_bytes=timing.COPY_BYTES,
                scratch_bytes=timing.SCRATCH_BYTES, versions=peers.versions(), git_commit=commit,
                git_dirty=dirty, date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                argv=sys.argv[1:], ops=args.ops, dtypes=args.dtypes, modes=args.modes,
                shapes=[list(s) for s in args.shapes], repeats=args.repeats, compile_mode=args.compile,
                implementations={n: DESCRIPTIONS[n] for n in impls}, left_out=missing,
                warmup_seconds=warmup_s, seconds=time.perf_counter() - started,
                interrupted=interrupted)
    payload = {"meta": meta, "first_call": first_call, "results": records, "errors": errors}
    written = write_outputs(args, payload)
    print(format_report(payload))
    real_errors = [e for e in errors if not e.get("skipped")]
    log(f"\n{len(records)} measurements, {len(real_errors)} errors, {meta['seconds']:.0f} s "
        f"(warm-up and compiles: " + ", ".join(f"{k} {v:.0f} s" for k, v in warmup_s.items()) + ")")
    for path in written:
        log(f"wrote {path}")
    if interrupted:
        return 130
    return 0 if records else 1


def format_report(payload):
    parts = [report.format_header(payload.get("meta", {})),
             report.format_first_call(payload.get("first_call")),
             report.format_tables(payload.get("results", []))]
    errors = [e for e in payload.get("errors", []) if not e.get("skipped")]
    if errors:
        parts.append("errors:\n" + "\n".join(f"  {e['where']}: {e['error']}" for e in errors))
    return "\n\n".join(p for p in parts if p)


def write_outputs(args, payload):
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, args.name)
    records = payload["results"]
    report.write_csv(stem + ".csv", records)
    report.write_json(stem + ".json", payload)
    written = [stem + ".csv", stem + ".json"]
    md = report.format_markdown(records)
    if md:
        with open(stem + ".md", "w", encoding="utf-8") as f:
            f.write(md)
        written.append(stem + ".md")
    if not args.no_chart:
        charts = report.write_charts(args.out, args.name, records, payload["meta"].get("copy_GBps"))
        if not charts and records:
            print("note: matplotlib is not installed: no chart", file=sys.stderr)
        written += charts
    return written


def replot(args):
    try:
        payload = report.load_json(args.replot)
    except (OSError, ValueError) as e:
        print(f"cupy-rmsnorm-bench: cannot read {args.replot}: {e}", file=sys.stderr)
        return 2
    print(format_report(payload))
    if not args.no_chart:
        os.makedirs(args.out, exist_ok=True)
        for path in report.write_charts(args.out, args.name, payload.get("results", []),
                                        payload.get("meta", {}).get("copy_GBps")):
            print(f"wrote {path}", file=sys.stderr)
    return 0
