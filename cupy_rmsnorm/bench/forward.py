"""``forward`` (the default sub-command): rms_norm and fused_add_rms_norm against their peers over a
grid of shapes in three modes, and the first-call latency in fresh processes."""

import contextlib
import dataclasses
import functools
import sys
import time

from . import common, peers, report, timing
from .peers import (
    COPY,
    DESCRIPTIONS,
    IMPLS,
    IN_PLACE,
    IN_PLACE_PEERS,
    OP_TITLES,
    OPS,
    OURS,
    PEERS,
)
from .report import fmt_num, fmt_us, geomean
from .timing import MODE_TITLES, MODES

SUMMARY = "rms_norm and fused_add_rms_norm against their peers (the default)"
DEFAULT_REPEATS = {"graph": 10, "cold": 30, "hot": 5}
QUICK_REPEATS = {"graph": 5, "cold": 10, "hot": 3}
CALL_LIMITS = {"graph": (20, 200), "hot": (10, 100)}          # (min, max) calls timed together
QUICK_CALL_LIMITS = {"graph": (10, 100), "hot": (5, 50)}
FIRST_CALL_SHAPE = (4096, 4096)

# A token sweep at two common hidden sizes, small and odd ones at 4096 tokens, two widths at 256.
DEFAULT_SHAPES = tuple(sorted(
    {(t, h) for h in (4096, 8192) for t in (1, 32, 256, 1024, 4096, 16384)}
    | {(4096, h) for h in (512, 1024, 2048, 255, 4095)}
    | {(256, 5120), (256, 7168)},
    key=lambda s: (s[1], s[0])))
QUICK_SHAPES = ((1, 4096), (256, 4096), (4096, 4096), (4096, 4095), (1, 8192))
DEFAULTS = {"shapes": list(DEFAULT_SHAPES), "dtypes": ["bfloat16", "float16"], "modes": list(timing.MODES)}
QUICK = {"shapes": list(QUICK_SHAPES), "dtypes": ["bfloat16"]}

NEEDS = "CuPy; the torch peers torch with CUDA, liger: " + common.INSTALL_HINTS["liger"]


def add_arguments(p):
    common.add_common_options(p, peers=peers.SELECTABLE, shapes=f"the standard grid of {len(DEFAULT_SHAPES)} shapes",
                              dtypes="bf16,fp16; --quick: bf16", modes=(timing.MODES, "all three"),
                              repeats="timing rounds per measurement, every mode (default: graph 10, cold 30, "
                                      "hot 5; --quick: 5, 10, 3)")
    p.add_argument("--ops", type=common.comma_list(str, peers.OPS, "op"), default=list(peers.OPS),
                   help="ops to measure: rms, fused ")
    p.add_argument("--compile", choices=peers.COMPILE_MODES, default="tokens",
                   help="torch_compile peer: 'tokens' = token axis dynamic, hidden static, one compile "
                        "per hidden size (default; as a server compiles); 'static' = one compile per "
                        "shape (slower to warm up)")
    p.add_argument("--no-first-call", action="store_true",
                   help="skip the first-call latency measurement (fresh processes)")


def finish_args(args, parser):
    repeats = args.repeats
    common.resolve_defaults(args, DEFAULTS, QUICK)
    base = QUICK_REPEATS if args.quick else DEFAULT_REPEATS
    args.repeats = {m: repeats or base[m] for m in timing.MODES}
    args.call_limits = QUICK_CALL_LIMITS if args.quick else CALL_LIMITS


def requirements_missing(args):
    return None          # CuPy is all it needs; missing peers are left out with a note


# -- the report: plain records, so it runs without a GPU and --replot redraws a saved run -----------
FIELDS = ("op", "dtype", "tokens", "hidden", "impl", "mode", "us", "GBps", "pct_copy", "bytes",
          "calls", "repeats", "max_abs_err")
PLAN_TEXT_KEYS = (("variant", ""), ("threads_per_row", "g"), ("vecs_per_thread", "nv"),
                  ("vec", "v"), ("cluster", "c"), ("block", "b"), ("grid", "grid"))
LARGE_ELEMENTS = 4096 * 4096     # "large shapes": tokens x hidden at least this (far past the L2)
CHART_MODES = ("graph", "cold")


def make_record(op, dtype, tokens, hidden, impl, mode, us, nbytes, copy_gbps, calls, repeats,
                max_abs_err=None, plan=None):
    """One measurement: ``us`` microseconds per call moving ``nbytes`` logical bytes."""
    gbps = nbytes / (us * 1e3) if us > 0 else float("inf")
    if dataclasses.is_dataclass(plan):
        plan = dataclasses.asdict(plan)
    return {"op": op, "dtype": dtype, "tokens": tokens, "hidden": hidden, "impl": impl, "mode": mode,
            "us": us, "GBps": gbps, "pct_copy": 100.0 * gbps / copy_gbps if copy_gbps else None,
            "bytes": nbytes, "calls": calls, "repeats": repeats, "max_abs_err": max_abs_err,
            "plan": plan}


def plan_text(plan):
    """A launch plan in a few characters: ``registers g256 nv2 v8 c1 b256 grid4096 [+edges]``."""
    if not plan:
        return "-"
    parts = [f"{prefix}{plan[key]}" for key, prefix in PLAN_TEXT_KEYS if key in plan]
    if plan.get("edges"):
        parts.append("+edges")
    known = {key for key, _ in PLAN_TEXT_KEYS} | {"rows_per_block", "edges"}
    return " ".join(parts + [f"{k}={v}" for k, v in plan.items() if k not in known])


def _order(values, preferred=()):
    seen = list(dict.fromkeys(values))
    return [v for v in preferred if v in seen] + [v for v in seen if v not in preferred]


def best_peer(by_impl, among=PEERS):
    """(name, record) of the fastest of ``among`` (never ours) in ``by_impl``, or None."""
    found = [(r["us"], name) for name, r in by_impl.items() if name not in OURS and name in among]
    return (min(found)[1], by_impl[min(found)[1]]) if found else None


def time_ratio(by_impl, a, b):
    """``a``'s time over ``b``'s in ``by_impl``, or None where either is missing."""
    return by_impl[a]["us"] / by_impl[b]["us"] if a in by_impl and b in by_impl else None


def section(mode, op, dtype, by_shape):
    """One table: per shape our time, GB/s, % of copy, our time over each other's, and our launch plan."""
    present = _order(sorted({name for d in by_shape.values() for name in d}), IMPLS)
    others = [n for n in present if n != "ours" and (n in OURS or n in PEERS)]
    extra = []   # (header, cell of a shape's {impl: record}): the copy and the in-place form
    if COPY in present:
        extra.append(("ours/copy", lambda d: fmt_num(time_ratio(d, "ours", COPY))))
    if "ours_ip" in present:
        extra.append(("ip us", lambda d: fmt_us(d["ours_ip"]["us"]) if "ours_ip" in d else "-"))
        extra += [(f"ip / {n}", lambda d, n=n: fmt_num(time_ratio(d, "ours_ip", n)))
                  for n in present if n in IN_PLACE_PEERS]
    headers = ["shape", "ours us", "GB/s", "%copy"] + others + ["vs best peer"] + [h for h, _ in extra] + ["plan"]
    rows, to_best, to_copy = [], [], []
    for (tokens, hidden), d in by_shape.items():
        ours, best = d.get("ours"), best_peer(d)
        row = [f"{tokens}x{hidden}"]
        row += [fmt_us(ours["us"]), fmt_num(ours["GBps"], 0), fmt_num(ours["pct_copy"], 1)] if ours else ["-"] * 3
        row += [fmt_num(time_ratio(d, "ours", n)) for n in others]
        if ours and best:
            to_best.append(ours["us"] / best[1]["us"])
        row.append(f"{to_best[-1]:.2f} {best[0]}" if ours and best else "-")
        row += [cell(d) for _, cell in extra]
        copy_ratio = time_ratio(d, "ours", COPY)
        if copy_ratio is not None and tokens * hidden >= LARGE_ELEMENTS:
            to_copy.append((copy_ratio, f"{tokens}x{hidden}"))
        rows.append(row + [plan_text(next((r.get("plan") for r in d.values() if r.get("plan")), None))])
    notes = ["ratio columns: our time / theirs (below 1: ours is faster)"]
    if "ours_ip" in present:
        notes += ["ip: ours in place (out=x, residual_out=residual)"] + [
            f"{n}: {DESCRIPTIONS[n]}" for n in present if n in IN_PLACE_PEERS]
    if to_best:
        notes.append(f"geomean ours / best peer: {geomean(to_best):.3f}; ours at or below the best peer "
                     f"at {sum(r <= 1.0 for r in to_best)} of {len(to_best)} shapes")
    if to_copy:
        worst = max(to_copy)
        notes.append(f"ours / copy at the {len(to_copy)} large shapes (tokens x hidden >= 4096 x 4096): "
                     f"geomean {geomean([r for r, _ in to_copy]):.3f}, max {worst[0]:.3f} ({worst[1]})")
    title = f"{OP_TITLES.get(op, op)}, {dtype}, {MODE_TITLES.get(mode, mode)}"
    return title, headers, rows, (0, headers.index("vs best peer"), len(headers) - 1), "; ".join(notes)


def sections(records):
    """A section per (mode, op, dtype): modes and ops in the usual order, dtypes and shapes as measured."""
    out = []
    for mode in _order([r["mode"] for r in records], MODES):
        for op in _order([r["op"] for r in records], OPS):
            for dtype in _order([r["dtype"] for r in records]):
                by_shape = {}
                for r in records:
                    if (r["mode"], r["op"], r["dtype"]) == (mode, op, dtype):
                        by_shape.setdefault((r["tokens"], r["hidden"]), {})[r["impl"]] = r
                if by_shape:
                    out.append(section(mode, op, dtype, by_shape))
    return out


def intro(payload):
    """The copy bandwidth, then a line per first-call measurement."""
    meta, lines = payload.get("meta", {}), []
    if meta.get("copy_GBps"):
        lines.append(f"copy bandwidth: {meta['copy_GBps']:.0f} GB/s (device-to-device memcpy of "
                     f"{meta.get('copy_bytes', 0) >> 20} MiB, bytes read + written): the ceiling")
    for fc in payload.get("first_call") or []:
        what = f"{OP_TITLES.get(fc.get('op'), fc.get('op'))} {fc.get('tokens')}x{fc.get('hidden')} {fc.get('dtype')}"
        lines.append(f"first call, {what}: {fc['error']}" if "error" in fc else
                     f"first call in a fresh process, {what}: empty kernel cache {fc['empty_cache_ms']:.0f} ms, "
                     f"warm cache {fc['warm_cache_ms']:.1f} ms (second call {fc['second_call_ms']:.2f} ms)")
    return lines


def format_report(payload, markdown=False):
    return report.render_report(payload, "Forward", intro(payload), sections(payload.get("results", [])), markdown)


format_markdown = functools.partial(format_report, markdown=True)


def csv_records(payload):
    """The records, the launch plan's fields as plan_* columns."""
    return [{**{k: v for k, v in r.items() if k != "plan"}, **{f"plan_{k}": v for k, v in (r.get("plan") or {}).items()}}
            for r in payload["results"]]


def chart_impls(impls):
    """The out-of-place implementations and the copy, in IMPLS order (in-place ones: tables only)."""
    return [n for n in _order(sorted(impls), IMPLS) if n not in IN_PLACE]


def write_charts(payload, stem, modes=CHART_MODES):
    """GB/s against tokens, ``stem_MODE_DTYPE.png``: a row per op, a panel per swept hidden size."""
    from matplotlib.figure import Figure
    records, copy_gbps = payload["results"], payload["meta"].get("copy_GBps")
    paths = []
    for mode in modes:
        for dtype in _order([r["dtype"] for r in records if r["mode"] == mode], ()):
            recs = [r for r in records if r["mode"] == mode and r["dtype"] == dtype]
            ops = _order([r["op"] for r in recs], OPS)
            tokens_by_hidden = {}
            for r in recs:
                tokens_by_hidden.setdefault(r["hidden"], set()).add(r["tokens"])
            hiddens = sorted(h for h, ts in tokens_by_hidden.items() if len(ts) >= 2) or sorted(tokens_by_hidden)
            fig = Figure(figsize=(5.2 * len(hiddens), 3.9 * len(ops)), layout="constrained")
            axes = fig.subplots(len(ops), len(hiddens), squeeze=False)
            for i, op in enumerate(ops):
                for j, hidden in enumerate(hiddens):
                    ax = axes[i][j]
                    sel = [r for r in recs if r["op"] == op and r["hidden"] == hidden]
                    for impl in chart_impls({r["impl"] for r in sel}):
                        pts = sorted((r["tokens"], r["GBps"]) for r in sel if r["impl"] == impl)
                        ours = impl in OURS
                        style = {"linestyle": "--", "color": "gray"} if impl == COPY else {}
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3,
                                linewidth=2.2 if ours else 1.1, zorder=3 if ours else 2,
                                label="copy of the same bytes" if impl == COPY else impl, **style)
                    if copy_gbps:
                        ax.axhline(copy_gbps, linestyle="--", color="black", linewidth=1,
                                   label=f"copy bandwidth ({copy_gbps:.0f} GB/s)")
                    ax.set_xscale("log", base=2)
                    ticks = sorted({r["tokens"] for r in sel})
                    ax.set_xticks(ticks)
                    ax.set_xticklabels([str(t) for t in ticks])
                    ax.minorticks_off()
                    ax.set_title(f"{OP_TITLES.get(op, op)}, hidden {hidden}", fontsize=10)
                    ax.set_xlabel("tokens")
                    ax.set_ylabel("GB/s")
                    ax.grid(alpha=0.3)
            axes[0][0].legend(fontsize=7, loc="upper left")
            fig.suptitle(f"{dtype}, {MODE_TITLES.get(mode, mode)}", fontsize=10)
            path = f"{stem}_{mode}_{dtype}.png"
            fig.savefig(path, dpi=110)
            paths.append(path)
    return paths


def plan_for(op, tokens, hidden, itemsize, sm_count, max_cluster=1):
    """Our launch plan for a contiguous problem (16-byte vectors: the pool's allocations are aligned)."""
    import cupy_rmsnorm as rn
    vec = 16 // itemsize
    return rn.launch_plan(tokens, hidden, itemsize, vec, sm_count, op == "fused",
                          edges=hidden % vec != 0, max_cluster=max_cluster)


# -- the run -------------------------------------------------------------------------------------
def run(args):
    """Copy bandwidth, first-call latency, the sweep; then the report written and printed."""
    started = time.perf_counter()
    bar = None

    def log(msg):
        if bar is not None:
            bar.write(msg, file=sys.stderr)   # above the bar
        else:
            report.log(msg)

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
        implementations={n: DESCRIPTIONS[n] for n in impls}, left_out=missing,
        warmup_seconds=sweep.warmup_s, seconds=time.perf_counter() - started, interrupted=interrupted)
    payload = {"meta": meta, "first_call": first_call, "results": sweep.records, "errors": sweep.errors}
    real_errors = [e for e in sweep.errors if not e.get("skipped")]
    log(f"{len(sweep.records)} measurements, {len(real_errors)} errors, {meta['seconds']:.0f} s (warm-up and "
        "compiles: " + ", ".join(f"{k} {v:.0f} s" for k, v in sweep.warmup_s.items()) + ")")
    return common.finish_run(sys.modules[__name__], args, payload, interrupted)


def measure_first_calls(args, log):
    out = []
    tokens, hidden = FIRST_CALL_SHAPE
    for op in args.ops:
        log(f"first-call latency of {op} in fresh processes ...")
        try:
            out.append(timing.first_call_latency(op, args.dtypes[0], tokens, hidden))
        except Exception as e:  # noqa: BLE001 - reported, the sweep goes on
            out.append({"op": op, "dtype": args.dtypes[0], "tokens": tokens, "hidden": hidden,
                        "error": report.error_text(e)})
    return out


class Sweep:
    """Every (op, dtype, shape) x implementation x mode of one run, into ``records`` and ``errors``."""

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
        text = e if isinstance(e, str) else report.error_text(e)
        self.errors.append({"where": where, "error": text, **({"skipped": True} if quiet else {})})
        if not quiet:
            self.log(f"error: {where}: {text}")

    def measure(self, case, name):
        """One implementation: warm-up and check (``peers.warm_up_and_check``), then each mode."""
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
                self.records.append(make_record(
                    case.op, case.dtype, case.tokens, case.hidden, name, mode, us, nbytes,
                    self.copy_gbps, calls, args.repeats[mode], mode_err, plan))
            except Exception as e:  # noqa: BLE001
                self._error(f"{where} {mode}", e)
            bar.update()
