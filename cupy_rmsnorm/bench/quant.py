"""``quant``: rms_norm_quant and fused_add_rms_norm_quant (FP8 e4m3; static, per-token, per-group
scales) against FlashInfer (nvcc-built), torch.compile and a copy; ``agree``: q's bytes equal to eager's.
"""

import ctypes
import functools
import sys
import time

from . import common, report

SUMMARY = "the quantized forms (FP8) against FlashInfer, torch.compile and a copy"
CASES = ("static", "per_token", "per_group", "fused static", "fused per_token", "fused per_group")
IMPLS = ("ours", "flashinfer", "torch.compile", "copy")
PEERS = ("flashinfer", "torch.compile")
MODES = ("graph", "cold")
EPS = 1e-6
GROUP = 128
FP8_MAX = 448.0                      # float8_e4m3fn's largest finite value
MIN_SCALE = 1.0 / (FP8_MAX * 512)    # the contract's floor of a dynamic scale (an all-zero row gives zeros)
SHAPES = ((4096, 4096), (1, 4096), (16384, 8192), (256, 4096), (4096, 7168), (16384, 4096), (32, 7168),
          (4096, 8192))
DEFAULTS = {"shapes": list(SHAPES), "dtypes": ["bfloat16"], "modes": ["graph"], "repeats": 7}
QUICK = {"shapes": [(1, 4096), (4096, 4096)], "repeats": 3}
BYTES_NOTE = ("agree: the fraction of q's bytes equal to the eager composite's; bytes: ours (FlashInfer's fused "
              "per-group form also writes a bf16 copy: +2 bytes an element)")
NEEDS = f"torch with CUDA; flashinfer: {common.INSTALL_HINTS['flashinfer']}"


def add_arguments(p):
    common.add_common_options(p, budget_s=240.0, target_us=1500.0, shapes=", ".join(f"{r}x{h}" for r, h in SHAPES),
                              dtypes="bf16", modes=(MODES, "graph"), repeats=common.ROUNDS_HELP)
    p.add_argument("--cases", type=common.comma_list(str, CASES, "case"), default=list(CASES),
                   help=f"a list of {', '.join(CASES)}")
    p.add_argument("--flashinfer", metavar="PATH",
                   help="FlashInfer's kernels: a built library (.so), a folder of extracted headers "
                        "(python -m cupy_rmsnorm.bench.flashinfer WHEEL), a flashinfer_python wheel, or "
                        "'none' (default: the installed flashinfer-python's headers, built with nvcc)")


def moved_bytes(case, rows, hidden, itemsize=2):
    """Bytes the op must move: read x (and residual), write q, residual_out and the scales."""
    n = rows * hidden
    fused = case.startswith("fused")
    scales = {"static": 0, "per_token": rows, "per_group": rows * (hidden // GROUP)}[case.split()[-1]]
    return n * itemsize * (2 if fused else 1) + n + (n * itemsize if fused else 0) + 4 * scales


# -- the report ----------------------------------------------------------------------------------
HEADERS = ["shape", *IMPLS, "ours / best", "ours / copy", "ours GB/s", "agree"]
CSV_COLUMNS = {**dict.fromkeys(("case", "dtype", "mode", "rows", "hidden", "bytes")), **report.time_columns(IMPLS),
               "agree": ".6f"}


def table_rows(results):
    return [[f"{r['rows']}x{r['hidden']}", *report.timing_cells(r["us"], IMPLS, PEERS),
             f"{r['bytes'] / (r['us']['ours'] * 1e3):.0f}" if r["us"].get("ours") else "-",
             "-" if r.get("agree") is None else f"{r['agree']:.5f}"] for r in results]


REPORT = report.SectionedReport(heading="Quantized forms (FP8 e4m3)", note=BYTES_NOTE, headers=HEADERS, left=(0,),
                                rows=table_rows, op_titles={c: c for c in CASES}, modes=MODES, peers=PEERS,
                                op_key="case")


format_report, format_markdown, write_charts = common.report_functions(
    REPORT, "quantized forms", IMPLS[:-1], lambda r: f"{r['rows']}x{r['hidden']}")


# -- the implementations -----------------------------------------------------------------------------
def composite(torch, case):
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


def ours(case, x, r, w, scale):
    import cupy_rmsnorm as rn
    form = case.split()[-1]
    kw = {"scale": scale} if form == "static" else {"group_size": GROUP} if form == "per_group" else {}
    if case.startswith("fused"):
        return lambda: rn.fused_add_rms_norm_quant(x, r, w, EPS, residual_out=r, **kw)
    return lambda: rn.rms_norm_quant(x, w, EPS, **kw)


def flashinfer_call(torch, lib, case, x, r, w, scale):
    """A FlashInfer call of the case, or None where FlashInfer has none (or not for x's dtype)."""
    rows, hidden = x.shape
    form, fused = case.split()[-1], case.startswith("fused")
    if x.dtype != torch.bfloat16:
        return None
    out = torch.empty(rows, hidden, dtype=torch.float8_e4m3fn, device=x.device)
    p = ctypes.c_void_p

    def ptr(t):
        return p(t.data_ptr())

    def stream():
        return p(torch.cuda.current_stream().cuda_stream)
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


# -- the run ---------------------------------------------------------------------------------------
def run(args):
    import torch

    from . import flashinfer
    started = time.perf_counter()
    torch._dynamo.config.cache_size_limit = 256
    device = common.gpu_device()
    arch = device["compute_capability"].replace(".", "")
    report.log(f"quant on {device['gpu']}: preparing FlashInfer's kernels ...")
    lib, fi_why = flashinfer.library(args.flashinfer, arch)
    payload, runners, scratch, bandwidth = common.start_run(
        "quant", args, impls=[i for i in IMPLS if i != "flashinfer" or lib], missing={"flashinfer": fi_why} if lib is None
        else {}, device=device, shapes=[list(s) for s in args.shapes], cases=args.cases,
        flashinfer=args.flashinfer or "installed flashinfer-python")
    runner = runners["torch"]
    def measure(shape, dtype):
        _measure_shape(torch, args, payload, lib, *shape, dtype, runner, scratch, bandwidth)
    return common.run_sweep(sys.modules[__name__], args, payload, started, args.shapes, lambda s: f"{s[0]}x{s[1]}",
                            measure)


def _measure_shape(torch, args, payload, lib, n_rows, hidden, dtype_name, runner, scratch, bandwidth):
    gen = torch.Generator(device="cuda").manual_seed(n_rows * 7 + hidden)
    dtype = getattr(torch, dtype_name)
    x = torch.randn((n_rows, hidden), generator=gen, device="cuda").to(dtype)
    r0 = torch.randn((n_rows, hidden), generator=gen, device="cuda").to(dtype)
    w = (1 + 0.1 * torch.randn((hidden,), generator=gen, device="cuda")).to(dtype)
    scale = torch.full((1,), 0.02, device="cuda")
    for case in args.cases:
        nbytes = moved_bytes(case, n_rows, hidden, x.element_size())
        r = r0.clone()
        eager = composite(torch, case)
        agree = None
        try:   # fraction of q's bytes equal to the eager composite's, one call each on fresh residuals
            q = ours(case, x, r0.clone(), w, scale)()[0].view(torch.uint8)
            agree = float((q == eager(x, r0.clone(), w, scale)[0].view(torch.uint8)).float().mean())
        except Exception as e:  # noqa: BLE001 - reported, the timings still run
            common.record_error(payload, f"agree {case} {dtype_name} {n_rows}x{hidden}", e)
        rows = common.mode_rows(args.modes, IMPLS, {"case": case, "dtype": dtype_name, "rows": n_rows,
                                                    "hidden": hidden, "bytes": nbytes, "agree": agree}, checked=False)
        makers = {"ours": lambda: ours(case, x, r, w, scale),
                  "flashinfer": lambda: lib and flashinfer_call(torch, lib, case, x, r, w, scale),
                  "torch.compile": lambda: functools.partial(torch.compile(eager, fullgraph=True, dynamic=False),
                                                             x, r, w, scale),
                  "copy": lambda: common.device_copy(torch, nbytes)}
        for impl in IMPLS:
            common.check_and_time(payload, args, rows, impl, runner, makers[impl], nbytes=nbytes, bandwidth=bandwidth,
                                  scratch=scratch, where=f"{case} {dtype_name} {n_rows}x{hidden}")
        common.keep_rows(payload, rows, table_rows)
