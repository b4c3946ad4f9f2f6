"""``python -m cupy_rmsnorm.bench [SUBCOMMAND] [options]`` / ``cupy-rmsnorm-bench``: a sub-command
measures and writes NAME.json, .csv, .md and charts to --out; ``--replot JSON`` redraws a saved run.
"""

import argparse
import os
import sys

from . import backward, common, e2e, forward, gated, layer_norm, qk_rope, quant, report, timing, train

SUBCOMMANDS = {"forward": forward, "backward": backward, "quant": quant, "gated": gated, "qk_rope": qk_rope,
               "layer_norm": layer_norm, "e2e": e2e, "train": train}
DEFAULT = "forward"
EXIT_CODES = (f"exit status: {common.EXIT_OK} done; {common.EXIT_ERROR} nothing measured or an error; "
              f"{common.EXIT_USAGE} a bad command line;\n{common.EXIT_NO_GPU} no CUDA GPU (nothing measured: "
              f"--replot shows the committed report); {common.EXIT_INTERRUPTED} interrupted (what was "
              "measured is written)")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written; an option's argparse default after its help, unless the help says it."""

    def _get_help_string(self, action):
        default = action.default
        if default in (None, False, argparse.SUPPRESS) or "default:" in (action.help or ""):
            return action.help     # resolved after parsing, or the help says it
        text = ",".join("none" if v is None else str(v) for v in default) if isinstance(default, list) else default
        return f"{action.help} (default: {text})"


def build_parser():
    """The top-level parser and {name: its sub-command's parser}."""
    parser = argparse.ArgumentParser(
        prog=common.PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage=f"{common.PROG} [{' | '.join(SUBCOMMANDS)}] [options]",
        description="Benchmark cupy_rmsnorm against its peers on the current GPU. With no sub-command: "
                    f"{DEFAULT}. `{common.PROG} SUBCOMMAND --help` lists a sub-command's options.",
        epilog=f"the committed reports: {common.COMMITTED_RESULTS}/SUBCOMMAND.json (in the repository), "
               f"shown without a GPU by\n  {common.PROG} SUBCOMMAND --replot "
               f"{common.COMMITTED_RESULTS}/SUBCOMMAND.json\n\n{common.PEERS_HELP}\n\n{EXIT_CODES}")
    subparsers = parser.add_subparsers(dest="command", title="sub-commands", metavar="SUBCOMMAND")
    parsers = {}
    for name, module in SUBCOMMANDS.items():
        listing = "".join(f"\n  {k:14s} {v}" for k, v in getattr(module, "DESCRIPTIONS", {}).items())
        sub = subparsers.add_parser(name, prog=f"{common.PROG} {name}", help=module.SUMMARY,
                                    description=module.__doc__.strip().replace("``", ""),
                                    epilog=(f"implementations:{listing}\n\n" if listing else "")
                                    + f"needs {module.NEEDS}\n\n{EXIT_CODES}",
                                    formatter_class=HelpFormatter)
        module.add_arguments(sub)
        parsers[name] = sub
    return parser, parsers


def parse_args(argv):
    argv = list(argv)
    if not argv or (argv[0] not in SUBCOMMANDS and argv[0] not in ("-h", "--help")):
        argv = [DEFAULT] + argv
    parser, parsers = build_parser()
    args = parser.parse_args(argv)
    args.name_given = args.name
    module = SUBCOMMANDS[args.command]
    if hasattr(module, "finish_args"):
        module.finish_args(args, parsers[args.command])
    else:
        common.resolve_defaults(args, module.DEFAULTS, module.QUICK)
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    module = SUBCOMMANDS[args.command]
    if args.replot:
        return replot(module, args)
    if getattr(args, "device", "cuda") == "cuda":
        reason = timing.gpu_missing()
        if reason:
            print(common.no_gpu_message(args.command, reason), file=sys.stderr)
            return common.EXIT_NO_GPU
    # a sub-command without requirements_missing needs torch with CUDA
    missing = getattr(module, "requirements_missing", lambda _: common.torch_missing())(args)
    if missing:
        print(f"{common.PROG} {args.command}: {missing}", file=sys.stderr)
        return common.EXIT_ERROR
    return module.run(args)


def replot(module, args):
    """--replot: the report of a saved run printed, its Markdown, CSV and charts written."""
    args.replot = common.report_path(args.replot)
    try:
        payload = report.load_json(args.replot)
        command = payload["meta"]["command"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"{common.PROG} {args.command}: cannot read {args.replot} as a report: {report.error_text(e)}",
              file=sys.stderr)
        return common.EXIT_ERROR
    if command != args.command:
        print(f"{common.PROG} {args.command}: {args.replot} is a {command} report: "
              f"{common.PROG} {command} --replot {args.replot}", file=sys.stderr)
        return common.EXIT_ERROR
    print(module.format_report(payload))
    # named after the report's file (e2e_qwen3.json: e2e_qwen3.md), so two replots never collide
    name = args.name_given or os.path.splitext(os.path.basename(args.replot))[0]
    for path in common.write_report(module, payload, args.out, name, charts=not args.no_chart, with_json=False):
        report.log(f"wrote {path}")
    common.warn_if_dirty(payload["meta"])
    return common.EXIT_OK
