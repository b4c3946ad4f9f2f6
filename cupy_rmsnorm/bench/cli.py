"""``python -m cupy_rmsnorm.bench`` / ``cupy-rmsnorm-bench``: the command line of the
benchmark report (its arguments; ``run`` measures, ``report`` prints and writes).

Measures cupy_rmsnorm and its peers over a grid of shapes on the current GPU, prints a
table per mode, op and dtype, and writes CSV, JSON, Markdown and PNG charts.
``cupy-rmsnorm-bench e2e ...`` is the whole-model benchmark instead (``e2e.py``), and
``cupy-rmsnorm-bench backward ...`` the backward's (``backward.py``).
"""

import argparse
import os
import sys

from . import report, shapes, timing
from .peers import COMPILE_MODES, DESCRIPTIONS, SELECTABLE
from .run import run

EXIT_NO_GPU = 1
DEFAULT_REPEATS = {"graph": 10, "cold": 30, "hot": 5}
QUICK_REPEATS = {"graph": 5, "cold": 10, "hot": 3}
CALL_LIMITS = {"graph": (20, 200), "hot": (10, 100)}          # (min, max) calls timed together
QUICK_CALL_LIMITS = {"graph": (10, 100), "hot": (5, 50)}


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


def build_parser():
    impls = "\n".join(f"  {name:14s} {text}" for name, text in DESCRIPTIONS.items())
    p = argparse.ArgumentParser(
        prog="cupy-rmsnorm-bench",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Benchmark cupy_rmsnorm against its peers on the current GPU.",
        epilog=f"implementations:\n{impls}\n\nmodes:\n"
               + "\n".join(f"  {shapes.MODE_TITLES[m]}" for m in shapes.MODES)
               + "\n\nwhole-model benchmark (a Llama-shaped transformers model generating):\n"
                 "  cupy-rmsnorm-bench e2e --help"
               + "\n\nthe backward (alone, and forward + backward; training):\n"
                 "  cupy-rmsnorm-bench backward --help")
    p.add_argument("--ops", type=_list(str, shapes.OPS, "op"), default=list(shapes.OPS),
                   help="ops to measure: rms, fused (default: both)")
    p.add_argument("--dtypes", type=_list(shapes.parse_dtype, what="dtype"), default=None,
                   help="bf16, fp16, fp32 (default: bf16,fp16; --quick: bf16)")
    p.add_argument("--shapes", type=_shape_spec, nargs="+", default=None, metavar="TxH",
                   help="shapes as TOKENSxHIDDEN, either side a comma list for every combination "
                        "(e.g. 1,32x8192,16384); default: the standard grid of "
                        f"{len(shapes.DEFAULT_SHAPES)} shapes")
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
    p.add_argument("--repeats", type=shapes.positive_int, default=None,
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
    if argv[:1] == ["backward"]:  # the backward and forward + backward against the peers
        from . import backward
        return backward.main(argv[1:])
    args = parse_args(argv)
    if args.replot:
        return replot(args)
    reason = timing.gpu_missing()
    if reason:
        print(no_gpu_message(reason), file=sys.stderr)
        return EXIT_NO_GPU
    return run(args)


def replot(args):
    """--replot: the tables and charts of a saved run, nothing measured."""
    try:
        payload = report.load_json(args.replot)
    except (OSError, ValueError) as e:
        print(f"cupy-rmsnorm-bench: cannot read {args.replot}: {e}", file=sys.stderr)
        return 2
    print(report.format_report(payload))
    if not args.no_chart:
        os.makedirs(args.out, exist_ok=True)
        for path in report.write_charts(args.out, args.name, payload.get("results", []),
                                        payload.get("meta", {}).get("copy_GBps")):
            print(f"wrote {path}", file=sys.stderr)
    return 0
