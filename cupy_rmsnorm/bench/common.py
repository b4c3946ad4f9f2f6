"""What every sub-command shares: options, exit codes, run metadata, the sweep and the run
loop. No CuPy or torch import at module level: the command line and reports work without a GPU.
"""

import argparse
import importlib
import importlib.util
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from importlib import metadata

from .report import (DIRTY_WARNING, csv_of, error_text, flatten, log, sectioned_report, unique, write_csv,
                     write_json)

PROG = "cupy-rmsnorm-bench"
EXIT_OK = 0
EXIT_ERROR = 1            # nothing measured, a report that cannot be read, a missing requirement
EXIT_USAGE = 2            # argparse's own exit status for a bad command line
EXIT_NO_GPU = 3           # no CUDA GPU: nothing can be measured here
EXIT_INTERRUPTED = 130    # Ctrl-C during a run (what was measured is still written)
DEFAULT_OUT = "bench_results"
COMMITTED_RESULTS = "benchmarks/results"   # the committed reports, in the repository

DTYPE_ALIASES = {"bf16": "bfloat16", "bfloat16": "bfloat16",
                 "fp16": "float16", "float16": "float16", "half": "float16",
                 "fp32": "float32", "float32": "float32", "float": "float32"}
ROUNDS_HELP = "timed rounds per measurement (default: 7; --quick: 3)"
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}

INSTALL_HINTS = {
    "torch": "pip install torch (a CUDA build)",
    "triton": "Triton comes with the CUDA builds of torch on Linux (pip install triton)",
    "liger": "pip install liger-kernel",
    "transformers": "pip install transformers",
    "flashinfer": "pip install flashinfer-python (its headers) and nvcc on PATH, or --flashinfer",
    "fla": "pip install fla-core (flash-linear-attention's Triton kernels)",
}
PEERS_HELP = ("peers are used where installed, else left out with a note: `pip install liger-kernel` (Liger);\n"
              "e2e, train: `pip install transformers`; quant, qk_rope: `pip install flashinfer-python` and nvcc;\n"
              "gated: `pip install fla-core`. torch.compile needs the Triton that Linux torch wheels bring.")


# -- arguments ---------------------------------------------------------------------------------

def parse_dtype(name):
    """``bf16`` / ``bfloat16`` / ``fp16`` / ... -> the canonical dtype name."""
    key = name.strip().lower()
    if key not in DTYPE_ALIASES:
        raise ValueError(f"unknown dtype {name!r}; use one of bf16, fp16, fp32")
    return DTYPE_ALIASES[key]


def _positive_ints(text, what, spec):
    values = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"bad shape {spec!r}: {what} must be positive integers, got {part!r}")
        values.append(int(part))
    return values


def parse_shapes(spec):
    """``"TOKENSxHIDDEN"`` -> [(tokens, hidden)], either side a comma list: ``"1,32x4096,8192"``: four."""
    text = spec.strip().lower()
    if text.count("x") != 1:
        raise ValueError(f"bad shape {spec!r}: expected TOKENSxHIDDEN, e.g. 4096x4096 or 1,32x8192")
    tokens_text, hidden_text = text.split("x")
    tokens = _positive_ints(tokens_text, "tokens", spec)
    hiddens = _positive_ints(hidden_text, "hidden sizes", spec)
    return [(t, h) for h in hiddens for t in tokens]


def argparse_type(parse):
    """``parse`` as an argparse type: its ValueError becomes a usage error."""
    def convert(text):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return convert


def positive_int(text):
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def comma_list(parse=str, choices=None, what="value"):
    """An argparse type: a comma list, each item through ``parse`` (among ``choices``), no duplicates."""
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
        return unique(out)
    return convert


def selection(choices, what):
    """An argparse type: ``all``, ``none`` or a comma list of ``choices``."""
    pick = comma_list(str, choices, what)

    def convert(text):
        key = text.strip().lower()
        if key in ("all", "none"):
            return list(choices) if key == "all" else []
        return pick(text)
    return convert


def add_common_options(parser, *, shapes=None, dtypes=None, modes=None, repeats=None, charts=True, peers=None,
                       budget_s=None, target_us=2000.0):
    """The options every sub-command spells alike; a keyword's value is its default's help text, None: none."""
    if shapes is not None:
        parser.add_argument("--shapes", type=argparse_type(parse_shapes), nargs="+", metavar="TxH",
                            help="shapes as TOKENSxHIDDEN, either side a comma list for every combination "
                                 f"(e.g. 1,32x4096,8192); default: {shapes}")
    if dtypes is not None:
        parser.add_argument("--dtypes", type=comma_list(parse_dtype, what="dtype"),
                            help=f"a list of bf16, fp16, fp32 (default: {dtypes})")
    if modes is not None:
        choices, text = modes
        parser.add_argument("--modes", type=comma_list(str.lower, choices, "mode"),
                            help=f"a list of {', '.join(choices)} (default: {text})")
    if repeats is not None:
        parser.add_argument("--repeats", type=positive_int, metavar="N", help=repeats)
    if peers is not None:
        parser.add_argument("--peers", type=selection(peers, "peer"), default=list(peers),
                            help=f"all, none or a list of {', '.join(peers)} (default: all that are installed; "
                                 "'ours' always runs)")
    if budget_s is not None:     # the sweeps': graph replays long enough to time, a time budget
        parser.add_argument("--target-us", type=float, default=target_us, help="GPU time per graph replay to aim for")
        parser.add_argument("--budget-s", type=float, default=budget_s, help="start no new case past this many seconds")
    parser.add_argument("--out", default=DEFAULT_OUT, help="output folder")
    parser.add_argument("--name", help="file name stem of the outputs (default: the sub-command's name; "
                                       "with --replot, the report's)")
    parser.add_argument("--quick", action="store_true", help="a short run (fewer shapes, repeats, steps)")
    if charts:
        parser.add_argument("--no-chart", action="store_true", help="write no PNG charts")
    parser.add_argument("--replot", metavar="JSON",
                        help="measure nothing: print the report of a saved run (its .json) and write its "
                             "Markdown, CSV and charts to --out")


def resolve_defaults(args, defaults, quick=None):
    """Options the user left out (None): from ``quick`` with --quick, else from ``defaults``."""
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, (quick or {}).get(key, value) if args.quick else value)
    if getattr(args, "shapes", None) and isinstance(args.shapes[0], list):   # one list per --shapes spec
        args.shapes = unique(s for spec in args.shapes for s in spec)
    if args.name is None:
        args.name = args.command
    if not hasattr(args, "no_chart"):
        args.no_chart = True
    return args


def committed_report(command):
    """The committed report of ``command``: its path from here or in the repository, None if none."""
    results = os.path.join(library_root(), COMMITTED_RESULTS)
    path = os.path.join(results, f"{command}.json")
    if not os.path.isfile(path):
        return None if os.path.isdir(results) else f"{COMMITTED_RESULTS}/{command}.json"
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def report_path(path):
    """A --replot path as given, else from the top of the library's checkout."""
    if os.path.isabs(path) or os.path.exists(path):
        return path
    in_checkout = os.path.join(library_root(), path)
    return in_checkout if os.path.exists(in_checkout) else path


def python_command():
    """``python`` where that is this interpreter on PATH, else its full path."""
    on_path = shutil.which("python")
    return "python" if on_path and os.path.realpath(on_path) == os.path.realpath(sys.executable) else sys.executable


def no_gpu_message(command, reason):
    """The one line printed without a GPU: why, and the command that shows the committed report."""
    reason = " ".join(str(reason).split())    # one line, whatever the driver said
    report = committed_report(command)
    if report is None:
        return (f"{PROG} {command}: no CUDA GPU available, nothing measured ({reason}). No report of {command} "
                f"is committed yet (it would be {COMMITTED_RESULTS}/{command}.json)")
    where = "" if os.path.isfile(report) else "From the top folder of a checkout of the repository: "
    return (f"{PROG} {command}: no CUDA GPU available, nothing measured ({reason}). {where}The committed report: "
            f"{python_command()} -m cupy_rmsnorm.bench {command} --replot {report}")


# -- optional peers ------------------------------------------------------------------------------
def torch_missing():
    """None when torch sees a CUDA device, else why not (with how to get it)."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure: no torch here
        return f"PyTorch is not importable ({type(e).__name__}: {e}); {INSTALL_HINTS['torch']}"
    if not torch.cuda.is_available():
        return f"PyTorch sees no CUDA device (torch {torch.__version__}); {INSTALL_HINTS['torch']}"
    return None


def module_missing(module, what, hint):
    """None when ``module`` imports, else why not, with how to install it (``INSTALL_HINTS[hint]`` or ``hint``)."""
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return f"{what} is not installed ({INSTALL_HINTS.get(hint, hint)})"
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - installed but broken (no Triton, no CUTLASS DSL): left out
        return f"{module} does not import ({error_text(e)})"
    return None


def triton_missing():
    return None if importlib.util.find_spec("triton") else f"Triton is not installed ({INSTALL_HINTS['triton']})"


def transformers_missing(args):
    """What the e2e and train runs need: torch with CUDA (not with --device cpu) and transformers."""
    why = torch_missing() if args.device == "cuda" else None
    return why or module_missing("transformers", "transformers", "transformers")


# -- what a report records about its run -----------------------------------------------------------
def library_root():
    """The folder holding the cupy_rmsnorm package that is measured."""
    import cupy_rmsnorm
    return os.path.dirname(os.path.dirname(os.path.abspath(cupy_rmsnorm.__file__)))


def git_state(path):
    """(commit, dirty) of the git checkout whose top folder is ``path``, else (None, None)."""
    def git(*cmd):
        return subprocess.run(["git", *cmd], cwd=path, capture_output=True, text=True, timeout=10)
    try:
        top = git("rev-parse", "--show-toplevel")
        if top.returncode != 0 or os.path.realpath(top.stdout.strip()) != os.path.realpath(path):
            return None, None
        commit = git("rev-parse", "HEAD").stdout.strip() or None
        status = git("status", "--porcelain", "--untracked-files=no")
        return commit, bool(status.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return None, None


VERSIONED = ("numpy", "ml_dtypes", "cupy-cuda12x", "cupy-cuda13x", "torch", "triton", "liger-kernel",
             "transformers", "flashinfer-python", "fla-core", "flash-linear-attention", "einops", "matplotlib")


def versions():
    """Versions of this Python, the library and what took part (installed distributions)."""
    import cupy_rmsnorm
    out = {"python": platform.python_version(), "cupy_rmsnorm": cupy_rmsnorm.__version__}
    for dist in VERSIONED:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    torch = sys.modules.get("torch")       # CUDA version of torch's build, where torch is loaded
    if torch is not None and getattr(torch, "version", None) is not None:
        out["torch_cuda"] = torch.version.cuda
    return out


def nvidia_driver_version():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def provenance():
    """The measured library's commit, whether its tree was dirty (then a loud ``warning``), the date."""
    commit, dirty = git_state(library_root())
    out = {"commit": commit, "dirty": dirty, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    return dict(out, warning=DIRTY_WARNING) if dirty else out


def run_metadata(command, device, **extra):
    """The ``meta`` of every report: command, provenance, argv, device, versions, then ``extra``."""
    return {"command": command, **provenance(), "argv": sys.argv[1:], "device": device, "versions": versions(),
            **extra}


def warn_if_dirty(meta):
    """The dirty-tree warning on stderr, where a report's meta carries it."""
    if meta.get("dirty"):
        log(f"{PROG} {meta.get('command', '')}: {DIRTY_WARNING}")


def gpu_device():
    """``timing.device_info()`` with the driver version: the ``device`` of a GPU run's meta."""
    from . import timing
    return dict(timing.device_info(), driver_version=nvidia_driver_version())


def write_report(module, payload, out, name, charts=True, with_json=True):
    """NAME.json (not on a replot), NAME.csv, NAME.md and the charts into ``out``; the paths written."""
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, name)
    written = []
    if with_json:
        write_json(stem + ".json", payload)
        written.append(stem + ".json")
    records = module.csv_records(payload) if hasattr(module, "csv_records") else map(flatten, payload["results"])
    write_csv(stem + ".csv", *csv_of(list(records), getattr(module, "CSV_COLUMNS", None)))
    written.append(stem + ".csv")
    md = module.format_markdown(payload)
    if md:
        with open(stem + ".md", "w", encoding="utf-8") as f:
            f.write(md)
        written.append(stem + ".md")
    if charts and hasattr(module, "write_charts") and payload.get("results"):
        if importlib.util.find_spec("matplotlib") is None:
            log("note: matplotlib is not installed: no chart (pip install matplotlib)")
        else:
            written += module.write_charts(payload, stem)
    return written


def finish_run(module, args, payload, interrupted=False, measured=None):
    """The files written and the report printed; the exit status (an error where nothing was ``measured``)."""
    written = write_report(module, payload, args.out, args.name, charts=not args.no_chart)
    print(module.format_report(payload))
    for path in written:
        log(f"wrote {path}")
    warn_if_dirty(payload["meta"])
    if interrupted:
        return EXIT_INTERRUPTED
    return EXIT_OK if (payload.get("results") if measured is None else measured) else EXIT_ERROR


def run_sweep(module, args, payload, started, items, label, measure):
    """``measure(item, dtype)`` until --budget-s is spent, saving after each item; the report, also after Ctrl-C."""
    import torch
    interrupted = False
    try:
        for item in items:
            if time.perf_counter() - started > args.budget_s:
                payload["skipped"][label(item)] = f"the time budget ({args.budget_s:.0f} s)"
                continue
            for dtype in args.dtypes:
                measure(item, dtype)
            torch.cuda.empty_cache()
            os.makedirs(args.out, exist_ok=True)       # NAME.json so far: a crash keeps what came before
            write_json(os.path.join(args.out, args.name + ".json"), payload)
    except KeyboardInterrupt:
        interrupted = True
        log("interrupted: saving what was measured")
    payload["meta"]["seconds"] = time.perf_counter() - started
    return finish_run(module, args, payload, interrupted)


def start_run(command, args, *, impls=(), missing=None, device=None, cupy=False, **meta):
    """(payload, runners, cold-mode scratch, copy bandwidth) of a sweep, and its opening log line."""
    from . import timing
    device = device or gpu_device()
    runners = {"torch": timing.TorchRunner(), **({"cupy": timing.CupyRunner()} if cupy else {})}
    scratch = timing.Scratch() if "cold" in args.modes else None
    bandwidth, _ = timing.copy_bandwidth_gbps()
    payload = {"meta": run_metadata(command, device, copy_GBps=bandwidth, dtypes=args.dtypes, modes=args.modes,
                                    repeats=args.repeats, target_us=args.target_us, **meta),
               "results": [], "errors": [], "skipped": dict(missing or {})}
    log(f"{command} on {device['gpu']}: copy bandwidth {bandwidth:.0f} GB/s" + (f"; {', '.join(impls)}" if impls else "")
        + "".join(f"\nnote: {n} left out: {why}" for n, why in payload["skipped"].items()))
    return payload, runners, scratch, bandwidth


def record_error(payload, where, e):
    """An error of a run (an exception or a sentence) into the payload's errors, and logged."""
    text = e if isinstance(e, str) else error_text(e)
    payload["errors"].append({"where": where, "error": text})
    log(f"error: {where}: {text}")


def mode_rows(modes, impls, record, checked=True):
    """{mode: a result record}: ``record``'s fields, the mode, times (None until measured), errors."""
    return {mode: {**record, "mode": mode, "us": dict.fromkeys(impls), **({"err": {}} if checked else {})}
            for mode in modes}


def keep_rows(payload, rows, table_rows):
    """The records of ``mode_rows`` into the payload's results, each logged as its table row."""
    for row in rows.values():
        payload["results"].append(row)
        log("  " + "  ".join(map(str, [row.get("op", ""), row["mode"], *table_rows([row])[0]])))


def skip_unsupported(payload, counts, impl, reason):
    """Whether ``impl`` cannot run here (``reason``), counted into the payload's skipped."""
    if reason:
        key = f"{impl} ({reason})"
        counts[key] = counts.get(key, 0) + 1
        payload["skipped"][key] = f"{counts[key]} cases"
    return bool(reason)


def check_and_time(payload, args, rows, impl, runner, make, *, nbytes, bandwidth, scratch, where, reference=None,
                   tolerance=None):
    """Check ``make()``'s first call against ``reference``, then time it per mode; failures are recorded."""
    from . import timing
    try:
        with runner.context():
            fn = make()
            result = fn() if fn is not None and reference is not None else None
        if fn is None:
            return
        runner.synchronize()
        if reference is not None and impl != "copy":
            err = disagreement(result, reference)
            for row in rows.values():
                row["err"][impl] = err
            if not err <= tolerance:
                record_error(payload, f"{impl} {where}", f"max |{impl} - reference| / max |reference| = {err:.2e}, "
                             f"past the tolerance {tolerance}: not timed")
                return
        del result
        calls = timing.calls_for(nbytes, bandwidth, 3, 200, args.target_us)
    except Exception as e:  # noqa: BLE001 - one failing peer does not end the run
        record_error(payload, f"{impl} {where}", e)
        return
    for mode in args.modes:
        try:
            rows[mode]["us"][impl] = timing.timed_us(runner, fn, mode, calls, args.repeats, scratch)
        except Exception as e:  # noqa: BLE001
            record_error(payload, f"{impl} {mode} {where}", e)


def disagreement(result, reference):
    """max |result - reference| / max |reference|, the worst over the outputs (torch or CuPy; NaN wins)."""
    import torch
    results = result if isinstance(result, (tuple, list)) else (result,)
    references = reference if isinstance(reference, (tuple, list)) else (reference,)
    if len(results) != len(references):
        raise ValueError(f"{len(results)} outputs where ours has {len(references)}")
    errs = []
    for a, b in zip(results, references):
        if not isinstance(a, torch.Tensor):
            from .arrays import to_torch
            a = to_torch(a)
        a, b = a.float(), b.float()
        if a.shape != b.shape:
            raise ValueError(f"an output of shape {tuple(a.shape)} where ours is {tuple(b.shape)}")
        errs.append(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)))
    return float("nan") if any(math.isnan(e) for e in errs) else max(errs)


def device_copy(torch, nbytes):
    """The floor: a device copy moving ``nbytes`` (half read, half written, as int32)."""
    src = torch.empty(nbytes // 2 // 4, dtype=torch.int32, device="cuda")
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def bar_chart(path, title, groups, labels, series):
    """Bars of time over the copy's: a panel per (title, {series: values}) of ``groups``. Returns [path]."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(11, 3.6 * len(groups)), layout="constrained")
    axes = fig.subplots(len(groups), 1, squeeze=False)[:, 0]
    for ax, (panel, values), panel_labels in zip(axes, groups, labels):
        width = 0.8 / len(series)
        for k, name in enumerate(series):
            xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(panel_labels))]
            ax.bar(xs, [v or 0 for v in values[name]], width, label=name)
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="copy of the same bytes")
        ax.set_xticks(range(len(panel_labels)))
        ax.set_xticklabels(panel_labels, fontsize=7)
        ax.set_ylabel("time / copy time")
        ax.set_title(panel, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7, ncol=len(series) + 1)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    return [path]


def section_charts(spec, payload, stem, title, impls, label, per_dtype=True):
    """``stem_MODE[_DTYPE].png``: each of ``impls``' time over the copy's, a panel per pass."""
    paths = []
    results = [r for r in payload["results"] if r["us"].get("copy")]
    for mode, dtype in unique((r["mode"], r["dtype"] if per_dtype else None) for r in results):
        chart = [r for r in results if r["mode"] == mode and dtype in (None, r["dtype"])]
        panels = [[r for r in chart if r[spec.op_key] == op] for op in spec.op_titles]
        panels = [rows for rows in panels if rows]
        groups = [(spec.op_titles[rows[0][spec.op_key]],
                   {i: [r["us"][i] / r["us"]["copy"] if r["us"].get(i) else None for r in rows] for i in impls})
                  for rows in panels]
        paths += bar_chart(f"{stem}_{mode}{f'_{dtype}' if dtype else ''}.png", title(mode, dtype), groups,
                           [[label(r) for r in rows] for rows in panels], impls)
    return paths


def report_functions(spec, chart_name, impls, label, per_dtype=True):
    """``format_report``, ``format_markdown`` and ``write_charts`` of a sectioned report."""
    def title(mode, dtype):
        return f"{chart_name}{f', {dtype}' if dtype else ''}, {mode} mode: time over a copy of the same bytes"
    return (lambda payload: sectioned_report(spec, payload),
            lambda payload: sectioned_report(spec, payload, markdown=True),
            lambda payload, stem: section_charts(spec, payload, stem, title, impls, label, per_dtype))
