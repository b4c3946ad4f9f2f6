"""``backward``: the RMSNorm backward alone and forward + backward against F.rms_norm, torch.compile,
Liger and a copy, in graph and cold modes; ``agree dx`` / ``dw``: max |ours - F.rms_norm's| / max |theirs|.
"""

import sys
import time

from . import common, report

SUMMARY = "the backward alone and forward + backward against the peers (training)"
IMPLS = ("ours", "F.rms_norm", "torch.compile", "liger", "copy")
PEERS = ("F.rms_norm", "torch.compile", "liger")
PHASES = ("backward", "forward+backward")
MODES = ("graph", "cold")
EPS = 1e-6
BYTES_PER_ELEMENT_MOVED = {"backward": 3, "forward+backward": 5}   # x-sized arrays read + written
SHAPES = ((1, 4096), (1024, 4096), (4096, 4096), (16384, 4096), (1024, 8192), (4096, 8192), (16384, 8192),
          (4096, 512), (4096, 2048), (4096, 4095))
DEFAULTS = {"shapes": list(SHAPES), "dtypes": ["bfloat16", "float16"], "modes": list(MODES), "repeats": 7}
QUICK = {"shapes": [(1, 4096), (4096, 4096), (4096, 4095)], "dtypes": ["bfloat16"], "repeats": 3}
NEEDS = f"torch with CUDA; liger: {common.INSTALL_HINTS['liger']}"


def add_arguments(p):
    common.add_common_options(p, budget_s=240.0, shapes=", ".join(f"{r}x{h}" for r, h in SHAPES), dtypes="bf16,fp16",
                              modes=(MODES, "both"), repeats=common.ROUNDS_HELP)


# -- the report ----------------------------------------------------------------------------------
HEADERS = ["shape", *IMPLS, "ours / best", "ours / copy", "agree dx", "agree dw"]
CSV_COLUMNS = {**dict.fromkeys(("dtype", "rows", "hidden", "phase", "mode")), **report.time_columns(IMPLS),
               "agree_dx": ".3e", "agree_dw": ".3e"}


def table_rows(results):
    return [[f"{r['rows']}x{r['hidden']}", *report.timing_cells(r["us"], IMPLS, PEERS), f"{r['agree_dx']:.2e}",
             f"{r['agree_dw']:.2e}"] for r in results]


REPORT = report.SectionedReport(heading="Backward", note="", headers=HEADERS, left=(0,), rows=table_rows,
                                op_titles={p: p for p in PHASES}, modes=MODES, peers=PEERS, op_key="phase")


format_report, format_markdown, write_charts = common.report_functions(
    REPORT, "backward", IMPLS[:-1], lambda r: f"{r['rows']}x{r['hidden']}\n{r['dtype']}", per_dtype=False)


# -- the run ---------------------------------------------------------------------------------------
def _liger():
    why = common.module_missing("liger_kernel.ops.rms_norm", "liger-kernel", "liger")
    if why:
        return None, why
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    return LigerRMSNormFunction.apply, None


def _build(torch, impl, phase, x, w, dy, compiled, liger):
    """One call of ``impl`` in ``phase`` as a zero-argument callable."""
    import torch.nn.functional as F

    import cupy_rmsnorm as rn
    if impl == "copy":
        n = x.numel() * BYTES_PER_ELEMENT_MOVED[phase] // 2
        src = torch.empty(n, dtype=x.dtype, device=x.device).normal_()
        dst = torch.empty_like(src)
        return lambda: dst.copy_(src)
    if impl == "ours" and phase == "backward":
        return lambda: rn.rms_norm_backward(dy, x, w, EPS)
    forward = {"ours": lambda x, w: rn.rms_norm(x, w, EPS),
               "F.rms_norm": lambda x, w: F.rms_norm(x, (x.shape[-1],), w, EPS),
               "torch.compile": compiled,
               "liger": lambda x, w: liger(x, w, EPS, 0.0, "llama", False)}[impl]
    xg, wg = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    if phase == "backward":
        y = forward(xg, wg)
        return lambda: torch.autograd.grad(y, (xg, wg), dy, retain_graph=True)
    return lambda: torch.autograd.grad(forward(xg, wg), (xg, wg), dy)


def _agreement(torch, x, w, dy):
    """max |dx ours - dx F.rms_norm| / max |dx F.rms_norm| (and the same for dweight)."""
    import torch.nn.functional as F

    import cupy_rmsnorm as rn
    dx, dw = rn.rms_norm_backward(dy, x, w, EPS)
    xg, wg = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    rx, rw = torch.autograd.grad(F.rms_norm(xg, (x.shape[-1],), wg, EPS).float(), (xg, wg), dy.float())

    def rel(a, b):
        return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
    return rel(dx, rx), rel(dw, rw)


def run(args):
    import torch
    started = time.perf_counter()
    torch._dynamo.config.cache_size_limit = 64

    def eager_rms_norm(x, w, eps=EPS):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)
    compiled = torch.compile(eager_rms_norm, fullgraph=True, dynamic=False)
    liger, liger_why = _liger()
    payload, runners, scratch, bandwidth = common.start_run(
        "backward", args, impls=[i for i in IMPLS if i != "liger" or liger], missing={"liger": liger_why} if liger_why
        else {}, shapes=[list(s) for s in args.shapes])
    runner = runners["torch"]
    def measure(shape, dtype):
        _measure_shape(torch, args, payload, *shape, dtype, compiled, liger, runner, scratch, bandwidth)
    return common.run_sweep(sys.modules[__name__], args, payload, started, args.shapes, lambda s: f"{s[0]}x{s[1]}",
                            measure)


def _measure_shape(torch, args, payload, rows_, hidden, dtype_name, compiled, liger, runner, scratch, bandwidth):
    gen = torch.Generator(device="cuda").manual_seed(rows_ * 7 + hidden)
    dtype = getattr(torch, dtype_name)
    x = torch.randn((rows_, hidden), generator=gen, device="cuda").to(dtype)
    dy = torch.randn((rows_, hidden), generator=gen, device="cuda").to(dtype)
    w = (1 + 0.1 * torch.randn((hidden,), generator=gen, device="cuda")).to(dtype)
    agree_dx, agree_dw = _agreement(torch, x, w, dy)
    for phase in PHASES:
        nbytes = BYTES_PER_ELEMENT_MOVED[phase] * x.numel() * x.element_size()
        rows = common.mode_rows(args.modes, IMPLS, {"dtype": dtype_name, "rows": rows_, "hidden": hidden,
                                                    "phase": phase, "agree_dx": agree_dx, "agree_dw": agree_dw,
                                                    "bytes": nbytes}, checked=False)
        for impl in IMPLS:
            if impl != "liger" or liger is not None:
                common.check_and_time(payload, args, rows, impl, runner,
                                      lambda: _build(torch, impl, phase, x, w, dy, compiled, liger), nbytes=nbytes,
                                      bandwidth=bandwidth, scratch=scratch, where=f"{phase} {dtype_name} {rows_}x{hidden}")
        common.keep_rows(payload, rows, table_rows)
