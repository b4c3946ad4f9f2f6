"""``layer_norm``: the LayerNorm family (forward, backward, forward + backward, fused add, adaLN
modulate) against its peers on (T, D) rows, in graph and cold modes; float32 weight and bias copies for
the peers that take only those. Outputs are checked against ours before timing.
"""

import functools
import inspect
import sys
import time

from . import common, peers, report

SUMMARY = ("LayerNorm (forward, backward, fused add, adaLN modulate) against F.layer_norm, torch.compile, Liger, "
           "quack and FlashInfer")
IMPLS = ("ours", "F.layer_norm", "torch.compile", "liger", "quack", "flashinfer", "copy")
PEERS = IMPLS[1:-1]                                  # "best peer" is among these
SELECTABLE = IMPLS[1:]                               # what --peers chooses; "ours" always runs
OPS = ("fwd", "bwd", "fwdbwd", "fused", "modulate")
OP_TITLES = {"fwd": "layer_norm", "bwd": "backward", "fwdbwd": "forward + backward",
             "fused": "fused_add_layer_norm", "modulate": "layer_norm_modulate"}
# x-sized arrays read + written: y = f(x); dx from dy and x; fused reads x, residual and writes y, the sum
ARRAYS_MOVED = {"fwd": 2, "bwd": 3, "fwdbwd": 5, "fused": 4, "modulate": 2}
MODES = ("graph", "cold")
EPS = 1e-5
TOLERANCE = 2e-2          # of max |ours|: a few bfloat16 units (the peers round in other places)
TOKENS = (1, 32, 256, 4096, 16384)
HIDDEN = (768, 1152, 1280, 4096, 8192)
SHAPES = tuple((t, d) for d in HIDDEN for t in TOKENS)
DEFAULTS = {"shapes": list(SHAPES), "dtypes": ["bfloat16"], "modes": list(MODES), "repeats": 7}
QUICK = {"shapes": [(32, 1152), (4096, 4096)], "repeats": 3}
HINTS = {"liger": common.INSTALL_HINTS["liger"], "quack": "pip install quack-kernels",
         "flashinfer": "pip install flashinfer-python"}
DESCRIPTIONS = {
    "ours": "cupy_rmsnorm on torch tensors (autograd via cupy_rmsnorm.torch.LayerNorm for fwd + bwd)",
    "F.layer_norm": "torch.nn.functional.layer_norm, eager (fused, modulate: composed around it)",
    "torch.compile": "the F.layer_norm composite under torch.compile(fullgraph=True, dynamic=False)",
    "liger": "Liger-Kernel's LigerLayerNormFunction (Triton)",
    "quack": "quack's layernorm (CuTe DSL): forward, float32 weight",
    "flashinfer": "flashinfer.norm.layernorm: forward, bfloat16 x, float32 weight and bias",
    "copy": "a device copy of the pass's bytes: the floor",
}
NOTE = "TxD: tokens x hidden; modulate: shift and scale (1, D); err: max |theirs - ours| / max |ours|"
NEEDS = (f"torch with CUDA; liger: {HINTS['liger']}; quack: {HINTS['quack']}; flashinfer: {HINTS['flashinfer']}")


def describe(shape):
    return "x".join(map(str, shape))


# -- arguments ---------------------------------------------------------------------------------
def add_arguments(p):
    common.add_common_options(p, peers=SELECTABLE, budget_s=900.0, dtypes="bf16", modes=(MODES, "both"),
                              shapes=f"{','.join(map(str, TOKENS))}x{','.join(map(str, HIDDEN))}",
                              repeats=common.ROUNDS_HELP)
    p.add_argument("--ops", type=common.comma_list(str.lower, OPS, "op"), default=list(OPS),
                   help="passes: fwd, bwd, fwdbwd, fused, modulate")


def moved_bytes(op, tokens, hidden, itemsize):
    """Bytes ``op`` must move at least (weight, bias, shift and scale left out)."""
    return ARRAYS_MOVED[op] * tokens * hidden * itemsize


def availability(names):
    """(the implementations of ``names`` that can run, in IMPLS order; {name: why not} for the others)."""
    checks = {"torch.compile": common.triton_missing,
              "liger": lambda: common.module_missing("liger_kernel.ops.layer_norm", "liger-kernel", HINTS["liger"]),
              "quack": lambda: common.module_missing("quack.layernorm", "quack-kernels", HINTS["quack"]),
              "flashinfer": lambda: common.module_missing("flashinfer.norm", "flashinfer-python", HINTS["flashinfer"])}
    missing = {n: why for n in names if n in checks for why in [checks[n]()] if why}
    return [n for n in IMPLS if n in names and n not in missing], missing


def unsupported(impl, op, dtype_name):
    """Why ``impl`` cannot compute ``op`` in ``dtype_name``, or None."""
    if impl == "liger" and op in ("fused", "modulate"):
        return "Liger has no fused-add or modulated LayerNorm"
    if impl in ("quack", "flashinfer") and op != "fwd":
        return f"{impl}'s layernorm: forward only, no fused add or modulation"
    if impl == "flashinfer" and dtype_name != "bfloat16":
        return "flashinfer.norm.layernorm takes bfloat16 x only"
    return None


# -- the report ----------------------------------------------------------------------------------
HEADERS = ["shape", *IMPLS, "ours / best", "ours / copy", "max err"]
CSV_COLUMNS = {**dict.fromkeys(("op", "mode", "dtype", "tokens", "hidden", "bytes")),
               **report.time_columns(IMPLS, checked=IMPLS[:-1])}


def table_rows(results):
    return [[f"{r['tokens']}x{r['hidden']}", *report.timing_cells(r["us"], IMPLS, PEERS), report.worst_err(r)]
            for r in results]


REPORT = report.SectionedReport(heading="LayerNorm", note=NOTE, headers=HEADERS, left=(0,), rows=table_rows,
                                op_titles=OP_TITLES, modes=MODES, peers=PEERS)


format_report, format_markdown, write_charts = common.report_functions(
    REPORT, "LayerNorm", IMPLS[:-1], lambda r: f"{r['tokens']}x{r['hidden']}")


# -- the inputs and the implementations ------------------------------------------------------------
def make_inputs(torch, shape, dtype, device="cuda", seed=0):
    """x, residual, dy (T, D), weight, bias, shift and scale in ``dtype``; weight32 and bias32 in float32."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(*size, mean=0.0, std=1.0):
        return (mean + std * torch.randn(size, generator=gen, device=device)).to(dtype)
    tokens, hidden = shape
    out = {"x": normal(tokens, hidden), "residual": normal(tokens, hidden), "dy": normal(tokens, hidden),
           "weight": normal(hidden, mean=1.0, std=0.1), "bias": normal(hidden, std=0.1),
           "shift": normal(1, hidden, std=0.1), "scale": normal(1, hidden, std=0.1)}
    return dict(out, weight32=out["weight"].float(), bias32=out["bias"].float())


@functools.lru_cache(maxsize=None)
def composite(op):
    """The torch function a user writes for ``op`` ("plain": the forward and backward passes)."""
    import torch.nn.functional as F

    def plain(x, weight, bias, eps=EPS):
        return F.layer_norm(x, x.shape[-1:], weight, bias, eps)

    def fused(x, residual, weight, bias, eps=EPS):
        s = x + residual                    # rounded to the dtype, as the library's sum is
        return F.layer_norm(s, s.shape[-1:], weight, bias, eps), s

    def modulate(x, shift, scale, eps=EPS):     # DiT's modulate over a LayerNorm without affine
        return F.layer_norm(x, x.shape[-1:], None, None, eps) * (1 + scale) + shift
    return {"plain": plain, "fused": fused, "modulate": modulate}[op]


@functools.lru_cache(maxsize=None)
def _compiled(op):
    import torch
    peers.lift_recompile_limits()     # one graph per shape, dtype and pass
    return torch.compile(composite(op), fullgraph=True, dynamic=False)


@functools.lru_cache(maxsize=None)
def quack_takes_bias():
    from quack.layernorm import layernorm
    return "bias" in inspect.signature(layernorm).parameters


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def torch_forward(torch, impl, inputs):
    """(forward(x) -> y, its parameters: leaves that require grad) of ``impl``'s plain layer_norm."""
    weight, bias = inputs["weight"], inputs["bias"]
    if impl == "ours":
        from cupy_rmsnorm.torch import LayerNorm
        module = LayerNorm(weight.shape[0], EPS).to(device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            module.weight.copy_(weight)
            module.bias.copy_(bias)
        return module, (module.weight, module.bias)
    if impl == "quack":
        from quack.layernorm import layernorm
        w32, b32 = inputs["weight32"], inputs["bias32"]
        if quack_takes_bias():
            return (lambda x: layernorm(x, w32, bias=b32, eps=EPS)), ()
        return (lambda x: layernorm(x, w32, eps=EPS)), ()
    if impl == "flashinfer":
        from flashinfer.norm import layernorm
        return (lambda x: layernorm(x, inputs["weight32"], inputs["bias32"], EPS)), ()
    w, b = _leaf(weight), _leaf(bias)
    if impl == "liger":
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
        return (lambda x: LigerLayerNormFunction.apply(x, w, b, EPS)), (w, b)
    fn = _compiled("plain") if impl == "torch.compile" else composite("plain")
    return (lambda x: fn(x, w, b, EPS)), (w, b)


def build(torch, impl, op, inputs):
    """One call of ``impl``'s pass ``op``: y (fwd, modulate), (y, the sum) (fused) or (dx, dweight, dbias)."""
    x, residual, weight, bias, dy, shift, scale = (inputs[k] for k in ("x", "residual", "weight", "bias", "dy",
                                                                      "shift", "scale"))
    if impl == "copy":
        return common.device_copy(torch, moved_bytes(op, *x.shape, x.element_size()))
    if impl == "ours" and op != "fwdbwd":
        import cupy_rmsnorm as rn
        return {"fwd": lambda: rn.layer_norm(x, weight, bias, EPS),
                "bwd": lambda: rn.layer_norm_backward(dy, x, weight, bias, EPS),
                "fused": lambda: rn.fused_add_layer_norm(x, residual, weight, bias, EPS),
                "modulate": lambda: rn.layer_norm_modulate(x, shift, scale, EPS)}[op]
    if op in ("fused", "modulate"):
        fn = _compiled(op) if impl == "torch.compile" else composite(op)
        args = (x, residual, weight, bias) if op == "fused" else (x, shift, scale)
        return lambda: fn(*args, EPS)
    forward, params = torch_forward(torch, impl, inputs)
    if op == "fwd":
        def call():
            with torch.no_grad():
                return forward(x)
        return call
    xg = x.detach().requires_grad_(True)
    if op == "bwd":
        y = forward(xg)            # recorded once, outside the timed calls
        return lambda: torch.autograd.grad(y, (xg, *params), dy, retain_graph=True)
    return lambda: torch.autograd.grad(forward(xg), (xg, *params), dy)


# -- the run ---------------------------------------------------------------------------------------
def run(args):
    import torch

    started = time.perf_counter()
    impls, missing = availability(["ours"] + list(args.peers))
    payload, runners, scratch, bandwidth = common.start_run(
        "layer_norm", args, impls=impls, missing=missing, ops=args.ops, tolerance=TOLERANCE, eps=EPS,
        shapes=[list(s) for s in args.shapes], implementations={n: DESCRIPTIONS[n] for n in impls})
    measure = functools.partial(measure_shape, torch, args, payload, impls, runners, scratch, bandwidth, {})
    return common.run_sweep(sys.modules[__name__], args, payload, started, args.shapes, describe, measure)


def measure_shape(torch, args, payload, impls, runners, scratch, bandwidth, counts, shape, dtype_name):
    """Every pass, implementation and mode of one shape and dtype, each checked against ours, then timed."""
    inputs = make_inputs(torch, shape, getattr(torch, dtype_name), "cuda", seed=shape[0] * 7 + shape[1])
    torch.cuda.synchronize()            # ready before the runners' streams read them
    where = f"{dtype_name} {describe(shape)}"
    for op in args.ops:
        nbytes = moved_bytes(op, *shape, inputs["x"].element_size())
        try:   # ours' outputs, the reference of every check (forward + backward: the backward's)
            want = build(torch, "ours", "bwd" if op == "fwdbwd" else op, inputs)()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - nothing to check the others against: the next pass
            common.record_error(payload, f"ours {op} {where}", e)
            continue
        rows = common.mode_rows(args.modes, impls, {"op": op, "dtype": dtype_name, "tokens": shape[0],
                                                    "hidden": shape[1], "bytes": nbytes})
        for impl in impls:
            if common.skip_unsupported(payload, counts, impl, unsupported(impl, op, dtype_name)):
                continue
            reference = want
            if impl == "quack" and not quack_takes_bias():   # a weight-only quack: ours without the bias
                reference = build(torch, "ours", "fwd", dict(inputs, bias=None))()
                torch.cuda.synchronize()
            common.check_and_time(payload, args, rows, impl, runners["torch"],
                                  lambda: build(torch, impl, op, inputs), nbytes=nbytes, bandwidth=bandwidth,
                                  scratch=scratch, where=f"{op} {where}", reference=reference, tolerance=TOLERANCE)
        common.keep_rows(payload, rows, table_rows)
