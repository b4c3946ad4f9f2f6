"""Backward benchmark: GPU time of the RMSNorm backward alone and of forward + backward, ours
against the peers, all in one run (graph mode: CUDA events around the replay of a graph of
many calls; cold mode: one call after a 512 MiB write flushed the L2; medians over rounds).

    python -m cupy_rmsnorm.bench backward --out DIR [--dtypes bfloat16,float16] [--repeats 7] [--budget-s 240]

Implementations (on the same torch tensors; weight of x's dtype, eps 1e-6):
- ours: ``rn.rms_norm_backward(dy, x, w)`` (backward); ``torch.autograd.grad`` through
  ``rn.rms_norm`` (forward + backward; the registered op and its backward op);
- F.rms_norm: ``torch.nn.functional.rms_norm`` under autograd;
- torch.compile: the eager fp32-formula function ``(x.float() * rsqrt(mean(x.float()**2) +
  eps) * w.float()).to(x.dtype)`` under ``torch.compile(fullgraph=True)``, its compiled
  backward (AOTAutograd) included;
- liger: Liger-Kernel's ``LigerRMSNormFunction`` (casting_mode "llama", in_place=False so
  that dy survives the replays) when importable;
- copy: a device copy moving the same bytes (the floor): the backward reads dy and x and
  writes dx (3 x rows x hidden elements; the weight and dweight are small), forward +
  backward adds the forward's read and write (5 x).
The peers' backward-alone times are ``torch.autograd.grad(y, (x, w), dy, retain_graph=True)``
on one recorded forward. The ``agree`` column is the max |dx - dx of F.rms_norm| of ours,
relative to max |dx|. Writes ``backward.csv`` and ``backward.json`` to --out, after every shape.
"""

import argparse
import json
import os
import sys
import time

from .report import add_result, print_summary, record_failure
from .shapes import shape_list

SHAPES = ((1, 4096), (1024, 4096), (4096, 4096), (16384, 4096), (4096, 8192), (16384, 8192), (4096, 512), (4096, 2048),
          (4096, 4095))
IMPLS = ("ours", "F.rms_norm", "torch.compile", "liger", "copy")
PHASES = ("backward", "forward+backward")
EPS = 1e-6
BYTES_PER_ELEMENT_MOVED = {"backward": 3, "forward+backward": 5}   # x-sized arrays read + written


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="cupy-rmsnorm-bench backward", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for backward.csv / backward.json")
    p.add_argument("--dtypes", default="bfloat16,float16")
    p.add_argument("--shapes", default=",".join(f"{r}x{h}" for r, h in SHAPES),
                   help="comma-separated ROWSxHIDDEN")
    p.add_argument("--repeats", type=int, default=7, help="timed graph replays per measurement")
    p.add_argument("--target-us", type=float, default=2000.0, help="GPU time per graph replay to aim for")
    p.add_argument("--budget-s", type=float, default=240.0, help="start no new shape past this")
    p.add_argument("--report", default=None, metavar="JSON",
                   help="write backward.md and the charts of a saved backward.json to --out, and stop")
    p.add_argument("--modes", default="graph,cold",
                   help="graph (replays of a CUDA graph of many calls) and/or cold (one call after an L2 flush)")
    args = p.parse_args(argv)
    args.dtypes = args.dtypes.split(",")
    args.modes = args.modes.split(",")
    if not set(args.modes) <= {"graph", "cold"}:
        p.error(f"--modes: graph and/or cold, not {args.modes}")
    args.shapes = shape_list(args.shapes)
    return args


def eager_rms_norm(x, w, eps=EPS):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def liger_apply():
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except Exception as e:  # noqa: BLE001 - any import failure: the peer is left out
        return None, f"{type(e).__name__}: {e}"
    return LigerRMSNormFunction.apply, None


def forward_of(impl, compiled, liger):
    """The differentiable forward y = norm(x, w) of an implementation."""
    import torch.nn.functional as F

    import cupy_rmsnorm as rn
    if impl == "ours":
        return lambda x, w: rn.rms_norm(x, w, EPS)
    if impl == "F.rms_norm":
        return lambda x, w: F.rms_norm(x, (x.shape[-1],), w, EPS)
    if impl == "torch.compile":
        return compiled
    if impl == "liger":
        return lambda x, w: liger(x, w, EPS, 0.0, "llama", False)
    raise ValueError(impl)


def build(impl, phase, x, w, dy, compiled, liger):
    """One call of ``impl`` in ``phase`` as a zero-argument callable."""
    import cupy_rmsnorm as rn
    if impl == "copy":
        n = x.numel() * BYTES_PER_ELEMENT_MOVED[phase] // 2
        src = torch.empty(n, dtype=x.dtype, device=x.device).normal_()
        dst = torch.empty_like(src)
        return lambda: dst.copy_(src)
    xg, wg = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    if impl == "ours" and phase == "backward":
        return lambda: rn.rms_norm_backward(dy, x, w, EPS)
    forward = forward_of(impl, compiled, liger)
    if phase == "backward":
        y = forward(xg, wg)
        return lambda: torch.autograd.grad(y, (xg, wg), dy, retain_graph=True)
    return lambda: torch.autograd.grad(forward(xg, wg), (xg, wg), dy)


def agreement(x, w, dy):
    """max |dx ours - dx F.rms_norm| / max |dx F.rms_norm| (and the same for dweight)."""
    import torch.nn.functional as F

    import cupy_rmsnorm as rn
    dx, dw = rn.rms_norm_backward(dy, x, w, EPS)
    xg, wg = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    rx, rw = torch.autograd.grad(F.rms_norm(xg, (x.shape[-1],), wg, EPS).float(), (xg, wg), dy.float())
    rel = lambda a, b: float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))  # noqa: E731
    return rel(dx, rx), rel(dw, rw)


def measure(runner, fn, nbytes, bandwidth, args, mode="graph", scratch=None):
    from . import timing
    calls = timing.calls_for(nbytes, bandwidth, 3, 200, args.target_us)
    return timing.timed_us(runner, fn, mode, calls, args.repeats, scratch)


def table(rows):
    lines = [f"{'dtype':9} {'shape':>12} {'phase':17} {'mode':5} " + " ".join(f"{i:>13}" for i in IMPLS)
             + f" {'ours/best':>9} {'agree dx':>9} {'agree dw':>9}"]
    for r in rows:
        t = r["us"]
        peers = [t[i] for i in ("F.rms_norm", "torch.compile", "liger") if t.get(i) is not None]
        ratio = f"{t['ours'] / min(peers):9.3f}" if peers and t.get("ours") else f"{'-':>9}"
        cells = " ".join(f"{t[i]:13.2f}" if t.get(i) is not None else f"{'-':>13}" for i in IMPLS)
        lines.append(f"{r['dtype']:9} {r['rows']:>5}x{r['hidden']:<6} {r['phase']:17} {r.get('mode', 'graph'):5} {cells} {ratio} "
                     f"{r['agree_dx']:9.2e} {r['agree_dw']:9.2e}")
    return "\n".join(lines)


def write_report(out, payload):
    """backward.md (the table per mode, with the run's device and versions) and, with
    matplotlib, backward_<mode>.png: each implementation's GPU time over the copy floor's,
    per shape and dtype (1.0 = the speed of a device copy of the same bytes)."""
    os.makedirs(out, exist_ok=True)
    results = payload["results"]
    modes = [m for m in ("graph", "cold") if any(r.get("mode", "graph") == m for r in results)]
    device = payload.get("device", {})
    lines = [f"# Backward: {device.get('gpu', '?')}, copy bandwidth {payload.get('copy_bandwidth_gbps', 0):.0f} GB/s",
             "", f"versions: {payload.get('versions', {})}", ""]
    for mode in modes:
        lines += [f"## {mode} (GPU microseconds per call, medians)", "", "```",
                  table([r for r in results if r.get("mode", "graph") == mode]), "```", ""]
    for k, v in payload.get("skipped", {}).items():
        lines.append(f"- skipped {k}: {v}")
    with open(os.path.join(out, "backward.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return
    for mode in modes:
        rows = [r for r in results if r.get("mode", "graph") == mode and r["us"].get("copy")]
        phases = [p for p in PHASES if any(r["phase"] == p for r in rows)]
        fig = Figure(figsize=(11, 3.6 * len(phases)), layout="constrained")
        axes = fig.subplots(len(phases), 1, squeeze=False)
        impls = [i for i in IMPLS if i != "copy"]
        for ax, phase in zip(axes[:, 0], phases):
            sel = [r for r in rows if r["phase"] == phase]
            labels = [f"{r['rows']}x{r['hidden']}\n{r['dtype']}" for r in sel]
            width = 0.8 / len(impls)
            for k, impl in enumerate(impls):
                vals = [(r["us"][impl] / r["us"]["copy"]) if r["us"].get(impl) else 0 for r in sel]
                ax.bar([i + (k - (len(impls) - 1) / 2) * width for i in range(len(sel))], vals, width, label=impl)
            ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="copy of the same bytes")
            ax.set_xticks(range(len(sel)))
            ax.set_xticklabels(labels, fontsize=7)
            ax.set_ylabel("time / copy time")
            ax.set_title(f"{phase}, {mode}", fontsize=10)
            ax.grid(axis="y", alpha=0.3)
        axes[0][0].legend(fontsize=7, ncol=5)
        fig.savefig(os.path.join(out, f"backward_{mode}.png"), dpi=110)


def write(args, payload):
    from .report import us_cells, write_results
    columns = ["dtype", "rows", "hidden", "phase", "mode"] + [f"{i}_us" for i in IMPLS] + ["agree_dx", "agree_dw"]
    write_results(args.out, "backward", payload, columns, lambda r: [
        r["dtype"], str(r["rows"]), str(r["hidden"]), r["phase"], r.get("mode", "graph"), *us_cells(r["us"], IMPLS),
        f"{r['agree_dx']:.3e}", f"{r['agree_dw']:.3e}"])


def main(argv=None):
    global torch
    args = parse_args(argv)
    if args.report:                       # a saved run's markdown and charts, no GPU needed
        with open(args.report) as f:
            write_report(args.out, json.load(f))
        return 0
    from . import peers, timing
    why = timing.gpu_missing() or peers.torch_missing()
    if why:
        print(f"backward benchmark: no GPU run ({why})")
        return 2
    import torch
    torch._dynamo.config.cache_size_limit = 64
    liger, liger_why = liger_apply()
    compiled = torch.compile(eager_rms_norm, fullgraph=True, dynamic=False)
    runner = timing.TorchRunner()
    scratch = timing.Scratch() if "cold" in args.modes else None
    bandwidth, _ = timing.copy_bandwidth_gbps()
    payload = {"device": timing.device_info(), "versions": peers.versions(), "copy_bandwidth_gbps": bandwidth,
               "modes": args.modes, "repeats": args.repeats, "skipped": {}, "results": []}
    if liger is None:
        payload["skipped"]["liger"] = liger_why
    print(f"{payload['device']['gpu']}: copy bandwidth {bandwidth:.0f} GB/s; liger: {liger_why or 'yes'}", flush=True)
    start = time.perf_counter()
    for hidden_rows in args.shapes:
        if time.perf_counter() - start > args.budget_s:
            payload["skipped"][f"{hidden_rows}"] = "time budget"
            continue
        rows, hidden = hidden_rows
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            gen = torch.Generator(device="cuda").manual_seed(rows * 7 + hidden)
            x = torch.randn((rows, hidden), generator=gen, device="cuda").to(dtype)
            dy = torch.randn((rows, hidden), generator=gen, device="cuda").to(dtype)
            w = (1 + 0.1 * torch.randn((hidden,), generator=gen, device="cuda")).to(dtype)
            agree_dx, agree_dw = agreement(x, w, dy)
            for phase in PHASES:
                nbytes = BYTES_PER_ELEMENT_MOVED[phase] * x.numel() * x.element_size()
                for mode in args.modes:
                    us = {}
                    for impl in IMPLS:
                        if impl == "liger" and liger is None:
                            us[impl] = None
                            continue
                        try:
                            with runner.context():
                                fn = build(impl, phase, x, w, dy, compiled, liger)
                            us[impl] = measure(runner, fn, nbytes, bandwidth, args, mode, scratch)
                        except Exception as e:  # noqa: BLE001 - one failing peer does not end the run
                            us[impl] = None
                            record_failure(payload, f"{impl} {phase} {mode} {dtype_name} {rows}x{hidden}", e)
                    row = {"dtype": dtype_name, "rows": rows, "hidden": hidden, "phase": phase, "mode": mode,
                           "us": us, "agree_dx": agree_dx, "agree_dw": agree_dw, "bytes": nbytes}
                    add_result(payload, row, table)
            torch.cuda.empty_cache()
        write(args, payload)
    payload["elapsed_s"] = time.perf_counter() - start
    write(args, payload)
    write_report(args.out, payload)
    print_summary("GPU microseconds per call (graph: CUDA graph replay; cold: one call after an L2 flush; medians):",
                  table(payload["results"]), payload["skipped"])
    return 0


torch = None

if __name__ == "__main__":
    sys.exit(main())
