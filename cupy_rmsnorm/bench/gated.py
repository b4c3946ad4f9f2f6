"""``gated``: the gated RMSNorm against its peers, forward, backward and forward + backward, in graph
and cold modes. norm-gate: y = rmsnorm(x) * w * silu(gate) (Qwen3-Next, Gated DeltaNet); gate-norm:
y = rmsnorm(x * silu(gate)) * w (Mamba2). Outputs are checked against ours before timing.
"""

import functools
import sys
import time
from typing import NamedTuple, Optional

from . import common, peers, report

SUMMARY = "the gated RMSNorm (Gated DeltaNet, Mamba2) against FLA, torch.compile and HF, forward and backward"
IMPLS = ("ours", "ours_cupy", "fla", "fla_grouped", "torch.compile", "hf", "copy")
PEERS = ("fla", "fla_grouped", "torch.compile", "hf")        # "best peer" is among these
SELECTABLE = IMPLS[1:]                                         # what --peers chooses; "ours" always runs
CUPY_IMPLS = ("ours_cupy",)                                    # on the CuPy runner; the rest on torch's
OPS = ("fwd", "bwd", "fwdbwd")
OP_TITLES = {"fwd": "forward", "bwd": "backward", "fwdbwd": "forward + backward"}
ARRAYS_MOVED = {"fwd": 3, "bwd": 5, "fwdbwd": 8}               # x-sized arrays read + written
LAYOUTS = ("heads", "rows")
ORDERS = ("norm-gate", "gate-norm")
MODES = ("graph", "cold")
EPS = 1e-6
TOLERANCE = 2e-2          # of max |ours|: a few bfloat16 units (the peers round in other places)
TOKENS = (1, 32, 256, 4096, 16384)
TOKENS_TEXT = ",".join(map(str, TOKENS))
HEADS = tuple((t, 32) for t in TOKENS)
SHAPES = tuple((t, h) for h in (4096, 8192) for t in TOKENS)
GROUP_SIZES = (None, 1024)
DEFAULTS = {"heads": list(HEADS), "shapes": list(SHAPES), "dtypes": ["bfloat16"], "modes": list(MODES),
            "repeats": 7}
QUICK = {"heads": [(1, 32), (4096, 32)], "shapes": [(1, 4096), (4096, 4096)], "repeats": 3}
DESCRIPTIONS = {
    "ours": "cupy_rmsnorm on torch tensors (autograd via cupy_rmsnorm.torch.RMSNormGated for fwd + bwd)",
    "ours_cupy": "the same functions on CuPy views of the same memory",
    "fla": "FLA's FusedRMSNormGated (Triton): norm-gate, no group size",
    "fla_grouped": "FLA's RMSNormGated (Mamba2's Triton kernel): group size, both orders",
    "torch.compile": "the Hugging Face formula under torch.compile(fullgraph=True, dynamic=False)",
    "hf": "transformers' Qwen3NextRMSNormGated / MambaRMSNormGated, eager",
    "copy": "a device copy of the pass's bytes: the floor",
}
NOTE = ("TxHxD: x and the gate (T, H, D) views into one packed (T, 2*H*D) buffer, each head normalized; "
        "TxW: whole rows, group: channels normalized together; err: max |theirs - ours| / max |ours|")
NEEDS = (f"torch with CUDA; fla, fla_grouped: {common.INSTALL_HINTS['fla']}; hf: "
         f"{common.INSTALL_HINTS['transformers']}")


class Case(NamedTuple):
    """One problem: ``layout`` 'heads' (views into one packed buffer) or 'rows'; ``width``: the normalized axis."""
    layout: str
    tokens: int
    heads: int
    width: int
    group_size: Optional[int]
    order: str

    @property
    def norm_before_gate(self):
        return self.order == "norm-gate"

    @property
    def shape(self):
        return (self.tokens, self.heads, self.width) if self.layout == "heads" else (self.tokens, self.width)


def case_of(record):
    """The Case of a result record (a dict holding Case's fields)."""
    return Case(*(record[f] for f in Case._fields))


def shape_text(case):
    return "x".join(map(str, case.shape))


def describe(case):
    """``4096x32x128 norm-gate``, ``4096x8192 g1024 norm-gate``."""
    group = f" g{case.group_size}" if case.group_size else ""
    return f"{shape_text(case)}{group} {case.order}"


# -- arguments ---------------------------------------------------------------------------------
def parse_group_size(text):
    """``none`` (the whole row) or a positive number of channels."""
    if text.lower() == "none":
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"bad group size {text!r}: none or a positive integer")
    return int(text)


def add_arguments(p):
    common.add_common_options(p, peers=SELECTABLE, budget_s=450.0, shapes=f"whole rows {TOKENS_TEXT}x4096,8192",
                              dtypes="bf16", modes=(MODES, "both"), repeats=common.ROUNDS_HELP)
    p.add_argument("--heads", type=common.argparse_type(common.parse_shapes), nargs="+", metavar="TxH",
                   help="Gated DeltaNet cases as TOKENSxHEADS (heads of --head-dim channels; x and the gate "
                        f"views into one packed buffer), either side a comma list; default: {TOKENS_TEXT}x32")
    p.add_argument("--head-dim", type=common.positive_int, default=128, help="channels per head")
    p.add_argument("--group-sizes", type=common.comma_list(parse_group_size, what="group size"),
                   default=list(GROUP_SIZES), help="the whole-row cases' group sizes: none (the row) and "
                   "channel counts, each where it divides the row")
    p.add_argument("--layouts", type=common.comma_list(str.lower, LAYOUTS, "layout"), default=list(LAYOUTS),
                   help="heads (the --heads cases), rows (the --shapes cases)")
    p.add_argument("--orders", type=common.comma_list(str.lower, ORDERS, "order"), default=["norm-gate"],
                   help="norm-gate: rmsnorm(x) * w * silu(gate) (Qwen3-Next); gate-norm: rmsnorm(x * "
                        "silu(gate)) * w (Mamba2)")
    p.add_argument("--ops", type=common.comma_list(str.lower, OPS, "op"), default=list(OPS),
                   help="passes: fwd, bwd, fwdbwd")


def finish_args(args, parser):
    common.resolve_defaults(args, DEFAULTS, QUICK)
    if isinstance(args.heads[0], list):              # one list per --heads spec
        args.heads = report.unique(s for spec in args.heads for s in spec)
    if not cases(args):
        parser.error("no case to measure: no --group-sizes divides a --shapes hidden size")


def cases(args):
    """The cases of a command line: the heads cases first, then the whole rows."""
    out = []
    if "heads" in args.layouts:
        out += [Case("heads", t, h, args.head_dim, None, o) for t, h in args.heads for o in args.orders]
    if "rows" in args.layouts:
        out += [Case("rows", t, 1, w, g, o) for t, w in args.shapes for g in args.group_sizes
                if g is None or w % g == 0 for o in args.orders]
    return out


def moved_bytes(op, case, itemsize):
    """Bytes ``op`` must move at least (the weight left out): ``ARRAYS_MOVED`` arrays of x's size."""
    return ARRAYS_MOVED[op] * case.tokens * case.heads * case.width * itemsize


def unsupported(impl, case):
    """Why ``impl`` cannot compute ``case``, or None."""
    if impl == "fla" and not case.norm_before_gate:
        return "FusedRMSNormGated normalizes before the gate only"
    if impl == "fla" and case.group_size:
        return "FusedRMSNormGated has no group size"
    if impl == "hf" and case.norm_before_gate and case.group_size:
        return "Qwen3NextRMSNormGated has no group size"
    if impl == "hf" and case.group_size and not _mamba_takes_group_size():
        return "this transformers' MambaRMSNormGated has no group size"
    return None


def _mamba_gated_norm():
    """Mamba2's gated norm class: ``Mamba2RMSNormGated`` from transformers 5.25 on, ``MambaRMSNormGated`` before."""
    from transformers.models.mamba2 import modeling_mamba2
    return getattr(modeling_mamba2, "Mamba2RMSNormGated", None) or modeling_mamba2.MambaRMSNormGated


def _mamba_takes_group_size():
    """Whether Mamba2's gated norm takes a group size (transformers 5.24 on does, 5.17 not)."""
    import inspect
    return "group_size" in inspect.signature(_mamba_gated_norm().__init__).parameters


def availability(names):
    """(the implementations of ``names`` that can run, in IMPLS order; {name: why not})."""
    missing = {}
    for name in names:
        why = None
        if name in ("fla", "fla_grouped"):
            why = common.module_missing("fla.modules", "fla-core", "fla")
        elif name == "torch.compile":
            why = common.triton_missing()
        elif name == "hf":
            why = common.module_missing("transformers.models.qwen3_next.modeling_qwen3_next", "transformers",
                                        "transformers")
        if why:
            missing[name] = why
    return [n for n in IMPLS if n in names and n not in missing], missing


# -- the report ----------------------------------------------------------------------------------
HEADERS = ["shape", "group", "order", *IMPLS, "ours / best", "ours / copy", "max err"]
CSV_COLUMNS = {**dict.fromkeys(("op", "mode", "dtype", *Case._fields, "bytes")),
               **report.time_columns(IMPLS, checked=IMPLS[:-1])}


def table_rows(results):
    return [[shape_text(case_of(r)), r["group_size"] or "-", r["order"], *report.timing_cells(r["us"], IMPLS, PEERS),
             report.worst_err(r)] for r in results]


REPORT = report.SectionedReport(heading="Gated RMSNorm", note=NOTE, headers=HEADERS, left=(0, 2), rows=table_rows,
                                op_titles=OP_TITLES, modes=MODES, peers=PEERS)


format_report, format_markdown, write_charts = common.report_functions(
    REPORT, "gated RMSNorm", IMPLS[:-1], lambda r: describe(case_of(r)).replace(" ", "\n", 1))


# -- the inputs and the implementations ------------------------------------------------------------
def make_inputs(torch, case, dtype, device="cuda", seed=0):
    """x, gate, weight (around one), dy and ``packed`` (the heads layout's buffer) of a case."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(*shape):
        return torch.randn(shape, generator=gen, device=device).to(dtype)
    packed = None
    if case.layout == "heads":   # the gate a strided view, as it comes out of a packed projection
        n = case.heads * case.width
        packed = normal(case.tokens, 2 * n)
        x, gate = packed[:, :n].view(case.shape), packed[:, n:].view(case.shape)
    else:
        x, gate = normal(*case.shape), normal(*case.shape)
    weight = (1 + 0.1 * torch.randn(case.width, generator=gen, device=device)).to(dtype)
    return {"x": x, "gate": gate, "weight": weight, "dy": normal(*case.shape), "packed": packed}


@functools.lru_cache(maxsize=None)
def composite():
    """The Hugging Face formula: Qwen3NextRMSNormGated's casts (norm-gate), MambaRMSNormGated's (gate-norm)."""
    import torch
    import torch.nn.functional as F

    def gated_rms_norm(x, gate, weight, group_size, norm_before_gate, eps=EPS):
        dtype = x.dtype
        h = x.float()
        if not norm_before_gate:
            h = h * F.silu(gate.float())
        g = h if group_size is None else h.unflatten(-1, (-1, group_size))
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
        h = weight * (g if group_size is None else g.flatten(-2)).to(dtype)
        if norm_before_gate:
            h = h * F.silu(gate.float())
        return h.to(dtype)
    return gated_rms_norm


@functools.lru_cache(maxsize=None)
def _compiled():
    import torch
    peers.lift_recompile_limits()     # one graph per shape, dtype and pass
    return torch.compile(composite(), fullgraph=True, dynamic=False)


def _module(impl, case):
    """A fresh module of ``impl`` for ``case`` (on the CPU, float32)."""
    if impl == "ours":
        from cupy_rmsnorm.torch import RMSNormGated
        return RMSNormGated(case.width, EPS, group_size=case.group_size, norm_before_gate=case.norm_before_gate)
    if impl == "fla":
        from fla.modules import FusedRMSNormGated
        return FusedRMSNormGated(case.width, eps=EPS, activation="silu")
    if impl == "fla_grouped":
        try:                                             # fla-core 0.6 keeps the norms in fla.modules.norm
            from fla.modules.norm.layernorm_gated import RMSNormGated
        except ImportError:
            from fla.modules.layernorm_gated import RMSNormGated
        return RMSNormGated(case.width, eps=EPS, group_size=case.group_size, norm_before_gate=case.norm_before_gate)
    if impl == "hf" and case.norm_before_gate:
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated
        return Qwen3NextRMSNormGated(case.width, eps=EPS)
    if impl == "hf":
        norm = _mamba_gated_norm()
        if _mamba_takes_group_size():
            return norm(case.width, group_size=case.group_size or case.width, eps=EPS)
        return norm(case.width, eps=EPS)
    raise ValueError(f"no module for {impl!r}")


def torch_forward(torch, impl, case, weight):
    """(forward(x, gate) -> y, its weight as a leaf that requires grad) of a torch implementation."""
    if impl == "torch.compile":
        w = weight.detach().clone().requires_grad_(True)
        compiled = _compiled()
        return (lambda x, gate: compiled(x, gate, w, case.group_size, case.norm_before_gate)), w
    module = _module(impl, case).to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
    return module, module.weight


def _cupy_call(op, case, inputs):
    """ours_cupy: our functions on CuPy views of the case's torch tensors (the gate stays strided)."""
    import cupy

    import cupy_rmsnorm as rn

    from .arrays import to_cupy
    if case.layout == "heads":
        packed = to_cupy(inputs["packed"])
        n = packed.shape[1] // 2
        x, gate = packed[:, :n].reshape(case.shape), packed[:, n:].reshape(case.shape)
    else:
        x, gate = to_cupy(inputs["x"]), to_cupy(inputs["gate"])
    weight, dy = to_cupy(inputs["weight"]), to_cupy(inputs["dy"])
    kw = {"group_size": case.group_size, "norm_before_gate": case.norm_before_gate}
    out = cupy.empty(x.shape, x.dtype)
    if op == "fwd":
        return lambda: rn.rms_norm_gated(x, gate, weight, EPS, out=out, **kw)
    if op == "bwd":
        return lambda: rn.rms_norm_gated_backward(dy, x, gate, weight, EPS, **kw)

    def forward_and_backward():
        rn.rms_norm_gated(x, gate, weight, EPS, out=out, **kw)
        return rn.rms_norm_gated_backward(dy, x, gate, weight, EPS, **kw)
    return forward_and_backward


def build(torch, impl, op, case, inputs):
    """One call of ``impl``'s pass ``op`` as a zero-argument callable: y (fwd) or (dx, dgate, dweight)."""
    x, gate, weight, dy = (inputs[k] for k in ("x", "gate", "weight", "dy"))
    if impl == "copy":
        return common.device_copy(torch, moved_bytes(op, case, x.element_size()))
    if impl == "ours_cupy":
        return _cupy_call(op, case, inputs)
    if impl == "ours" and op in ("fwd", "bwd"):
        import cupy_rmsnorm as rn
        kw = {"group_size": case.group_size, "norm_before_gate": case.norm_before_gate}
        if op == "fwd":
            return lambda: rn.rms_norm_gated(x, gate, weight, EPS, **kw)
        return lambda: rn.rms_norm_gated_backward(dy, x, gate, weight, EPS, **kw)
    forward, w = torch_forward(torch, impl, case, weight)
    if op == "fwd":
        def call():
            with torch.no_grad():
                return forward(x, gate)
        return call
    # leaves with the inputs' strides (the gate still a view into the packed buffer)
    xg, gg = x.detach().requires_grad_(True), gate.detach().requires_grad_(True)
    if op == "bwd":
        y = forward(xg, gg)            # recorded once, outside the timed calls
        return lambda: torch.autograd.grad(y, (xg, gg, w), dy, retain_graph=True)
    return lambda: torch.autograd.grad(forward(xg, gg), (xg, gg, w), dy)


# -- the run ---------------------------------------------------------------------------------------
def run(args):
    import torch

    started = time.perf_counter()
    impls, missing = availability(["ours"] + list(args.peers))
    todo = cases(args)
    payload, runners, scratch, bandwidth = common.start_run(
        "gated", args, impls=impls, missing=missing, cupy=any(i in CUPY_IMPLS for i in impls), ops=args.ops,
        tolerance=TOLERANCE, cases=[c._asdict() for c in todo], implementations={n: DESCRIPTIONS[n] for n in impls})
    measure = functools.partial(measure_case, torch, args, payload, impls, runners, scratch, bandwidth, {})
    return common.run_sweep(sys.modules[__name__], args, payload, started, todo, describe, measure)


def measure_case(torch, args, payload, impls, runners, scratch, bandwidth, counts, case, dtype_name):
    """Every pass, implementation and mode of one case and dtype, each checked, then timed."""
    inputs = make_inputs(torch, case, getattr(torch, dtype_name), "cuda", seed=case.tokens * 7 + case.width)
    torch.cuda.synchronize()            # ready before the runners' streams read them
    where = f"{dtype_name} {describe(case)}"
    for op in args.ops:
        nbytes = moved_bytes(op, case, inputs["x"].element_size())
        try:   # ours' outputs, the reference of every check: y, or the backward's (dx, dgate, dweight)
            want = build(torch, "ours", "fwd" if op == "fwd" else "bwd", case, inputs)()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - nothing to check the others against: the next pass
            common.record_error(payload, f"ours {op} {where}", e)
            continue
        rows = common.mode_rows(args.modes, impls, {**case._asdict(), "op": op, "dtype": dtype_name,
                                                    "bytes": nbytes})
        for impl in impls:
            if not common.skip_unsupported(payload, counts, impl, unsupported(impl, case)):
                common.check_and_time(payload, args, rows, impl, runners["cupy" if impl in CUPY_IMPLS else "torch"],
                                      lambda: build(torch, impl, op, case, inputs), nbytes=nbytes,
                                      bandwidth=bandwidth, scratch=scratch, where=f"{op} {where}", reference=want,
                                      tolerance=TOLERANCE)
        common.keep_rows(payload, rows, table_rows)
