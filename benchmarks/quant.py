"""Quantized RMSNorm benchmark: GPU time of rms_norm_quant / fused_add_rms_norm_quant (FP8 e4m3,
bfloat16 in) against the peers, all in one run (CUDA-graph mode: CUDA events around the replay
of a graph of many calls; median over rounds).

    python benchmarks/quant.py --out DIR [--shapes 4096x4096,...] [--repeats 5] [--budget-s 240]
                               [--flashinfer .flashinfer/libfiquant.so]

Cases: ``static`` (a per-tensor scale in device memory), ``per_token`` (a scale per row) and
``per_group`` (a scale per 1x128 group), each as rms_norm and as the fused add (``fused ...``;
ours and FlashInfer's update the residual in place, as vLLM's serving path does).
Implementations (the same torch tensors; weight bf16, eps 1e-6):
- ours: ``rn.rms_norm_quant(x, w, ...)`` / ``rn.fused_add_rms_norm_quant(x, r, w, ..., residual_out=r)``;
- flashinfer: FlashInfer's ``RMSNormQuant``, ``FusedAddRMSNormQuant`` and
  ``FusedAddRMSNormFP8BlockQuant`` (the fused per-group form; it also writes a bf16 copy of the
  normalized rows, 2 more bytes an element) built from its headers by nvcc
  (benchmarks/flashinfer_quant.cu), when --flashinfer names the library;
- torch.compile: the composite (the fp32 RMSNorm formula, then the quantization of the
  contract) under ``torch.compile(fullgraph=True, dynamic=False)``: specialized per shape;
- copy: a device copy moving the same bytes (the floor): read x (and residual), write q (one
  byte an element), residual_out and the scales.
``agree`` is the fraction of q's bytes equal to the eager composite's (near ties and the
float32 order of the sum of squares account for the rest). Writes ``quant.csv`` and
``quant.json`` to --out after every shape.
"""

import argparse
import ctypes
import sys
import time

SHAPES = ((4096, 4096), (1, 4096), (16384, 8192), (256, 4096), (4096, 7168), (16384, 4096), (32, 7168),
          (4096, 8192))
CASES = ("static", "per_token", "per_group", "fused static", "fused per_token", "fused per_group")
IMPLS = ("ours", "flashinfer", "torch.compile", "copy")
PEERS = ("flashinfer", "torch.compile")
EPS = 1e-6
from cupy_rmsnorm._reference import min_scale, quant_max  # noqa: E402 - the contract's constants
from cupy_rmsnorm.bench.report import add_result, print_summary, record_failure  # noqa: E402
from cupy_rmsnorm.bench.shapes import shape_list  # noqa: E402

FP8_MAX = quant_max("float8_e4m3fn")
MIN_SCALE = float(min_scale("float8_e4m3fn"))
GROUP = 128


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for quant.csv / quant.json")
    p.add_argument("--shapes", default=",".join(f"{r}x{h}" for r, h in SHAPES), help="comma-separated ROWSxHIDDEN")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated, of " + ", ".join(CASES))
    p.add_argument("--repeats", type=int, default=7, help="timed graph replays per measurement")
    p.add_argument("--target-us", type=float, default=1500.0, help="GPU time per graph replay to aim for")
    p.add_argument("--budget-s", type=float, default=240.0, help="start no new shape past this")
    p.add_argument("--flashinfer", default=None, help="path of the built benchmarks/flashinfer_quant.cu library")
    p.add_argument("--warm-only", action="store_true",
                   help="compile everything a run would (torch.compile's and CuPy's on-disk caches), time nothing")
    args = p.parse_args(argv)
    args.shapes = shape_list(args.shapes)
    args.cases = args.cases.split(",")
    bad = set(args.cases) - set(CASES)
    if bad:
        p.error(f"unknown cases {sorted(bad)}")
    return args


def moved_bytes(case, rows, hidden, itemsize=2):
    """Bytes the op must move: read x (and residual), write q, residual_out and the scales."""
    n = rows * hidden
    fused = case.startswith("fused")
    scales = {"static": 0, "per_token": rows, "per_group": rows * (hidden // GROUP)}[case.split()[-1]]
    return n * itemsize * (2 if fused else 1) + n + (n * itemsize if fused else 0) + 4 * scales


def composite(case):
    """The eager composite of a case: (x, r, w, scale) -> the outputs (q, [residual_out,] scales)."""
    form, fused = case.split()[-1], case.startswith("fused")

    def fn(x, r, w, scale):
        s = (x.float() + r.float()).to(x.dtype) if fused else x
        xf = s.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * w.float()
        if form == "static":
            q, scales = (y * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale
        else:
            g = y if form == "per_token" else y.unflatten(-1, (-1, GROUP))
            sc = (g.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
            q = (g * (1.0 / sc)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).reshape(y.shape)
            scales = sc if form == "per_token" else sc[..., 0]
        return (q, s, scales) if fused else (q, scales)
    return fn


def device_copy(nbytes):
    """The floor: a device copy moving ``nbytes`` (half read, half written, as int32)."""
    src = torch.empty(nbytes // 2 // 4, dtype=torch.int32, device="cuda")
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def ours(case, x, r, w, scale):
    import cupy_rmsnorm as rn
    form = case.split()[-1]
    kw = {"scale": scale} if form == "static" else {"group_size": GROUP} if form == "per_group" else {}
    if case.startswith("fused"):
        return lambda: rn.fused_add_rms_norm_quant(x, r, w, EPS, residual_out=r, **kw)
    return lambda: rn.rms_norm_quant(x, w, EPS, **kw)


def flashinfer(lib, case, x, r, w, scale):
    """A FlashInfer call of the case, or None where FlashInfer has none."""
    rows, hidden = x.shape
    form, fused = case.split()[-1], case.startswith("fused")
    out = torch.empty(rows, hidden, dtype=torch.float8_e4m3fn, device=x.device)
    p = ctypes.c_void_p
    ptr = lambda t: p(t.data_ptr())  # noqa: E731
    stream = lambda: p(torch.cuda.current_stream().cuda_stream)  # noqa: E731
    if form == "static" and not fused:
        return lambda: _check(lib.fi_rmsnorm_quant(ptr(x), ptr(w), ptr(out), rows, hidden, ptr(scale),
                                                   ctypes.c_float(EPS), stream()))
    if form == "static":
        return lambda: _check(lib.fi_fused_add_rmsnorm_quant(ptr(x), ptr(r), ptr(w), ptr(out), rows, hidden,
                                                             ptr(scale), ctypes.c_float(EPS), stream()))
    if form == "per_group" and fused:
        if hidden > 16384 or hidden % (32 * (8 if hidden <= 8192 else 16)):
            return None
        block_scale = torch.empty(hidden // GROUP, (rows + 3) // 4 * 4, device=x.device)
        normed = torch.empty_like(x)
        return lambda: _check(lib.fi_fused_add_rmsnorm_fp8_block_quant(ptr(x), ptr(r), ptr(w), ptr(out),
                                                                       ptr(block_scale), ptr(normed), rows, hidden,
                                                                       ctypes.c_float(EPS), stream()))
    return None


def _check(err):
    if err:
        raise RuntimeError(f"FlashInfer launch failed: CUDA error {err}")


def load_flashinfer(path):
    if not path:
        return None, "no --flashinfer library given"
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        return None, f"{type(e).__name__}: {e}"
    for name in ("fi_rmsnorm_quant", "fi_fused_add_rmsnorm_quant", "fi_fused_add_rmsnorm_fp8_block_quant"):
        getattr(lib, name).restype = ctypes.c_int
    return lib, None


def agreement(fn_ours, fn_ref):
    """Fraction of q's bytes equal between ours and the eager composite (one call each)."""
    q = fn_ours()[0].view(torch.uint8)
    q_ref = fn_ref()[0].view(torch.uint8)
    return float((q == q_ref).float().mean())


def measure(runner, fn, nbytes, bandwidth, args):
    from cupy_rmsnorm.bench import timing
    calls = timing.calls_for(nbytes, bandwidth, 3, 200, args.target_us)
    return timing.timed_us(runner, fn, "graph", calls, args.repeats)


def table(rows):
    lines = [f"{'case':16} {'shape':>12} " + " ".join(f"{i:>13}" for i in IMPLS)
             + f" {'ours/best':>9} {'ours/copy':>9} {'ours GB/s':>9} {'agree':>8}"]
    for r in rows:
        t = r["us"]
        peers = [t[i] for i in PEERS if t.get(i) is not None]
        ratio = f"{t['ours'] / min(peers):9.3f}" if peers and t.get("ours") else f"{'-':>9}"
        copy = f"{t['ours'] / t['copy']:9.3f}" if t.get("ours") and t.get("copy") else f"{'-':>9}"
        gbs = f"{r['bytes'] / (t['ours'] * 1e3):9.0f}" if t.get("ours") else f"{'-':>9}"
        cells = " ".join(f"{t[i]:13.2f}" if t.get(i) is not None else f"{'-':>13}" for i in IMPLS)
        agree = f"{r['agree']:8.5f}" if r.get("agree") is not None else f"{'-':>8}"
        lines.append(f"{r['case']:16} {r['rows']:>5}x{r['hidden']:<6} {cells} {ratio} {copy} {gbs} {agree}")
    return "\n".join(lines)


def write(args, payload):
    from cupy_rmsnorm.bench.report import us_cells, write_results
    columns = ["case", "rows", "hidden", "bytes"] + [f"{i}_us" for i in IMPLS] + ["agree"]
    write_results(args.out, "quant", payload, columns, lambda r: [
        r["case"], str(r["rows"]), str(r["hidden"]), str(r["bytes"]), *us_cells(r["us"], IMPLS),
        "" if r.get("agree") is None else format(r["agree"], ".6f")])


def inputs(rows, hidden):
    gen = torch.Generator(device="cuda").manual_seed(rows * 7 + hidden)
    x = torch.randn((rows, hidden), generator=gen, device="cuda").to(torch.bfloat16)
    r = torch.randn((rows, hidden), generator=gen, device="cuda").to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn((hidden,), generator=gen, device="cuda")).to(torch.bfloat16)
    return x, r, w, torch.full((1,), 0.02, device="cuda")


def warm(args):
    """One call of ours and of each torch.compile composite per (shape, case): their kernels land
    in the on-disk caches (CuPy's, inductor's FX graph and Triton caches) for a later run."""
    start = time.perf_counter()
    for rows, hidden in args.shapes:
        x, r, w, scale = inputs(rows, hidden)
        for case in args.cases:
            ours(case, x, r.clone(), w, scale)()
            torch.compile(composite(case), fullgraph=True, dynamic=False)(x, r, w, scale)
        torch.cuda.synchronize()
        print(f"warm {rows}x{hidden}: {time.perf_counter() - start:.0f} s", flush=True)
    return 0


def main(argv=None):
    global torch
    args = parse_args(argv)
    from cupy_rmsnorm.bench import peers, timing
    why = timing.gpu_missing() or peers.torch_missing()
    if why:
        print(f"quant benchmark: no GPU run ({why})")
        return 2
    import torch
    torch._dynamo.config.cache_size_limit = 256
    if args.warm_only:
        return warm(args)
    lib, fi_why = load_flashinfer(args.flashinfer)
    runner = timing.TorchRunner()
    bandwidth, _ = timing.copy_bandwidth_gbps()
    payload = {"device": timing.device_info(), "versions": peers.versions(), "copy_bandwidth_gbps": bandwidth,
               "mode": "graph", "repeats": args.repeats, "flashinfer": args.flashinfer, "skipped": {}, "results": []}
    if lib is None:
        payload["skipped"]["flashinfer"] = fi_why
    print(f"{payload['device']['gpu']}: copy bandwidth {bandwidth:.0f} GB/s; flashinfer: {fi_why or 'yes'}",
          flush=True)
    start = time.perf_counter()
    for rows, hidden in args.shapes:
        if time.perf_counter() - start > args.budget_s:
            payload["skipped"][f"{rows}x{hidden}"] = "time budget"
            continue
        x, r0, w, scale = inputs(rows, hidden)
        for case in args.cases:
            nbytes = moved_bytes(case, rows, hidden)
            r = r0.clone()
            eager = composite(case)
            agree = None
            try:
                agree = agreement(ours(case, x, r0.clone(), w, scale), lambda: eager(x, r0.clone(), w, scale))
            except Exception as e:  # noqa: BLE001 - reported, the timings still run
                payload["skipped"][f"agree {case} {rows}x{hidden}"] = f"{type(e).__name__}: {e}"
            us = {}
            for impl in IMPLS:
                try:
                    with runner.context():
                        if impl == "ours":
                            fn = ours(case, x, r, w, scale)
                        elif impl == "flashinfer":
                            fn = flashinfer(lib, case, x, r, w, scale) if lib is not None else None
                        elif impl == "torch.compile":
                            compiled = torch.compile(eager, fullgraph=True, dynamic=False)
                            fn = lambda c=compiled: c(x, r, w, scale)  # noqa: E731
                        else:
                            fn = device_copy(nbytes)
                    us[impl] = None if fn is None else measure(runner, fn, nbytes, bandwidth, args)
                except Exception as e:  # noqa: BLE001 - one failing peer does not end the run
                    us[impl] = None
                    record_failure(payload, f"{impl} {case} {rows}x{hidden}", e)
            row = {"case": case, "rows": rows, "hidden": hidden, "bytes": nbytes, "us": us, "agree": agree}
            add_result(payload, row, table)
        torch.cuda.empty_cache()
        write(args, payload)
    payload["elapsed_s"] = time.perf_counter() - start
    write(args, payload)
    print_summary("GPU microseconds per call (CUDA graph replay, median); bytes: ours (FlashInfer's fused per-group "
                  "form also writes a bf16 copy: +2 bytes an element):", table(payload["results"]), payload["skipped"])
    return 0


torch = None

if __name__ == "__main__":
    sys.exit(main())
