"""One measured run, step by step: the device and its copy bandwidth, the implementations
present, first-call latency, the sweep, then the report printed and written."""

import sys
import time

from . import metadata, peers, progress, report, sweep, timing


def run(args):
    """Measure what ``args`` (cli.parse_args) asks for; the exit status."""
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
    first_call = [] if args.no_first_call else sweep.measure_first_calls(args, log)

    n_configs = len(args.ops) * len(args.dtypes) * len(args.shapes)
    log(f"sweep: {n_configs} cases x {len(impls)} implementations ({', '.join(impls)}) x "
        f"{len(args.modes)} modes")
    bar = progress.ProgressBar(n_configs * len(impls) * len(args.modes))
    measured = sweep.Sweep(args, info["sm_count"], info["max_cluster"], copy_gbps, impls, bar, log)
    interrupted = False
    try:
        measured.run()
    except KeyboardInterrupt:
        interrupted = True
        log("interrupted: saving what was measured")
    finally:
        bar.close()
        bar = None
    records, errors, warmup_s = measured.records, measured.errors, measured.warmup_s

    meta = metadata.run_metadata(args, info, copy_gbps, copy_samples, impls, missing, warmup_s,
                                 started, interrupted)
    payload = {"meta": meta, "first_call": first_call, "results": records, "errors": errors}
    written = report.write_run(args.out, args.name, payload, charts=not args.no_chart)
    print(report.format_report(payload))
    real_errors = [e for e in errors if not e.get("skipped")]
    log(f"\n{len(records)} measurements, {len(real_errors)} errors, {meta['seconds']:.0f} s "
        f"(warm-up and compiles: " + ", ".join(f"{k} {v:.0f} s" for k, v in warmup_s.items()) + ")")
    for path in written:
        log(f"wrote {path}")
    if interrupted:
        return 130
    return 0 if records else 1
