"""``qk_rope``: Qwen3's QK norm + RoPE (each head of q and k RMS-normalized, then rotated, NeoX
halves) against its peers, fwd (in place where it can be) and fwd + bwd, in graph and cold modes, on
q and k views into one packed projection. Outputs are checked against a float64 reference first.
"""

import functools
import re
import sys
import time
import types
from typing import NamedTuple

from . import common, peers, report

SUMMARY = "QK norm + RoPE (Qwen3's attention input) against torch.compile, Liger and FlashInfer, fwd and fwd + bwd"
IMPLS = ("ours", "ours_unfused", "torch_compile", "liger", "flashinfer", "copy")
PEERS = ("torch_compile", "liger", "flashinfer")              # "best peer" is among these
SELECTABLE = IMPLS[1:]                                         # what --peers chooses; "ours" always runs
OPS = ("fwd", "fwdbwd")
OP_TITLES = {"fwd": "forward (in place)", "fwdbwd": "forward + backward"}
ARRAYS_MOVED = {"fwd": 2, "fwdbwd": 5}                         # q-and-k-sized arrays read + written
MODES = ("graph", "cold")
EPS = 1e-6
CASTING = "llama"                  # Qwen3RMSNorm's: x * rsqrt(...) rounded to the dtype, then the weight
ROPE_THETA = 1e6                   # Qwen3's
MAX_POSITION = 32768
TOLERANCE = 2e-2                   # of max |reference|: a few bfloat16 units (the peers round in other places)
TOKENS = (1, 8, 64, 512, 4096, 16384)
HEADS = ((32, 8, 128), (32, 4, 128))
MODELS = {(32, 8, 128): "Qwen3-8B", (32, 4, 128): "Qwen3-30B-A3B"}
DEFAULTS = {"tokens": list(TOKENS), "heads": list(HEADS), "dtypes": ["bfloat16"], "modes": list(MODES),
            "repeats": 7}
QUICK = {"tokens": [1, 4096], "repeats": 3}
DESCRIPTIONS = {
    "ours": "cupy_rmsnorm.qk_norm_rope on torch tensors, in place (autograd via the registered op)",
    "ours_unfused": "cupy_rmsnorm.rms_norm on the q and k views, then compiled apply_rotary_pos_emb",
    "torch_compile": "transformers' Qwen3 norm and rotation under torch.compile(fullgraph=True, dynamic=False)",
    "liger": "Liger's LigerRMSNormFunction, then LigerRopeFunction in place",
    "flashinfer": "rms_norm in place, then FlashInfer's BatchQKApplyRotaryPosIdsCosSinCache (nvcc-built); fwd only",
    "copy": "a device copy of the pass's bytes: the floor",
}
HEADS_TEXT = ", ".join(f"{q}/{k}x{d} ({name})" for (q, k, d), name in MODELS.items())
NOTE = ("TxHQ/HKxD: q (T, HQ, D) and k (T, HK, D) views into one packed (T, (HQ + 2*HK) * D) projection, "
        f"each head normalized then rotated; {HEADS_TEXT}; err: max |theirs - float64 reference| / max |reference|")
NEEDS = f"torch with CUDA; liger: {common.INSTALL_HINTS['liger']}; flashinfer: {common.INSTALL_HINTS['flashinfer']}"


class Case(NamedTuple):
    """One problem: ``tokens`` rows of a packed projection of q, k and v heads of ``head_dim`` channels."""
    tokens: int
    q_heads: int
    k_heads: int
    head_dim: int


def case_of(record):
    """The Case of a result record (a dict holding Case's fields)."""
    return Case(*(record[f] for f in Case._fields))


def heads_text(q_heads, k_heads, head_dim):
    return f"{q_heads}/{k_heads}x{head_dim}"


def describe(case):
    """``4096x32/8x128``."""
    return f"{case.tokens}x{heads_text(*case[1:])}"


# -- arguments ---------------------------------------------------------------------------------
def parse_heads(text):
    """``32/8x128`` -> (q heads, k heads, head_dim)."""
    m = re.fullmatch(r"(\d+)/(\d+)x(\d+)", text.strip().lower())
    if not m or min(map(int, m.groups())) < 1:
        raise ValueError(f"bad heads {text!r}: expected QHEADS/KVHEADSxHEAD_DIM of positive integers, e.g. 32/8x128")
    q_heads, k_heads, head_dim = map(int, m.groups())
    if head_dim % 2:
        raise ValueError(f"bad heads {text!r}: the rotation pairs channels, so head_dim must be even")
    return q_heads, k_heads, head_dim


def add_arguments(p):
    common.add_common_options(p, peers=SELECTABLE, budget_s=480.0, dtypes="bf16", modes=(MODES, "both"),
                              repeats=common.ROUNDS_HELP)
    p.add_argument("--tokens", type=common.comma_list(common.positive_int, what="token count"), metavar="T,...",
                   help=f"token counts (rows of the packed projection) (default: {','.join(map(str, TOKENS))}; "
                        f"--quick: {','.join(map(str, QUICK['tokens']))})")
    p.add_argument("--heads", type=common.comma_list(parse_heads, what="heads"), metavar="HQ/HKxD,...",
                   help="attention shapes as query heads / key-value heads x head_dim, a comma list "
                        f"(default: {HEADS_TEXT})")
    p.add_argument("--ops", type=common.comma_list(str.lower, OPS, "op"), default=list(OPS),
                   help="passes: fwd (in place), fwdbwd (forward + backward through autograd) ")
    p.add_argument("--flashinfer", metavar="PATH",
                   help="FlashInfer's rope: a built libfirope.so, a folder of extracted headers (python -m "
                        "cupy_rmsnorm.bench.flashinfer WHEEL), a flashinfer_python wheel, or 'none' (default: the "
                        "installed flashinfer-python's headers, built with nvcc)")


def cases(args):
    """The cases of a command line: per attention shape, the token counts in order."""
    return [Case(t, *heads) for heads in args.heads for t in args.tokens]


def moved_bytes(op, case, itemsize):
    """Bytes ``op`` must move at least (angles and weights left out): ``ARRAYS_MOVED`` arrays of q's and k's size."""
    return ARRAYS_MOVED[op] * case.tokens * (case.q_heads + case.k_heads) * case.head_dim * itemsize


def unsupported(impl, op, dtype_name):
    """Why ``impl`` cannot run pass ``op`` in ``dtype_name``, or None."""
    if impl == "flashinfer" and op != "fwd":
        return "FlashInfer's rope has no backward"
    if impl == "flashinfer" and dtype_name not in ("bfloat16", "float16"):
        return "the FlashInfer wrapper is built for bfloat16 and float16"
    return None


def availability(names):
    """(the implementations of ``names`` that can run, in IMPLS order; {name: why not}); FlashInfer's
    build needs the GPU's architecture, so ``run`` checks it."""
    missing = {}
    for name in names:
        why = None
        if name in ("ours_unfused", "torch_compile", "liger"):
            why = common.triton_missing()
        if not why and name == "liger":
            why = common.module_missing("liger_kernel.ops.rope", "liger-kernel", "liger")
        if why:
            missing[name] = why
    return [n for n in IMPLS if n in names and n not in missing], missing


# -- the report ----------------------------------------------------------------------------------
HEADERS = ["shape", *IMPLS, "ours / best", "ours / copy", "ours / unfused", "max err"]
CSV_COLUMNS = {**dict.fromkeys(("op", "mode", "dtype", *Case._fields, "bytes")),
               **report.time_columns(IMPLS, checked=IMPLS[:-1])}


def table_rows(results):
    def unfused(us):
        return report.fmt_num(us["ours"] / us["ours_unfused"] if us.get("ours") and us.get("ours_unfused") else None, 3)
    return [[describe(case_of(r)), *report.timing_cells(r["us"], IMPLS, PEERS), unfused(r["us"]), report.worst_err(r)]
            for r in results]


REPORT = report.SectionedReport(heading="QK norm + RoPE", note=NOTE, headers=HEADERS, left=(0,), rows=table_rows,
                                op_titles=OP_TITLES, modes=MODES, peers=PEERS)


format_report, format_markdown, write_charts = common.report_functions(
    REPORT, "QK norm + RoPE", IMPLS[:-1], lambda r: describe(case_of(r)).replace("x", "\n", 1))


# -- the inputs and the reference -------------------------------------------------------------------
def head_views(packed, q_heads, k_heads, head_dim):
    """q (T, q_heads, head_dim) and k (T, k_heads, head_dim): views into the packed projection."""
    tokens, n = packed.shape[0], q_heads * head_dim
    return (packed[:, :n].view(tokens, q_heads, head_dim),
            packed[:, n:n + k_heads * head_dim].view(tokens, k_heads, head_dim))


def cos_sin_cache(torch, head_dim, device):
    """vLLM's table: row p holds cos(p * f) then sin(p * f), computed in float64, stored in float32."""
    inv_freq = ROPE_THETA ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    freqs = torch.arange(MAX_POSITION, dtype=torch.float64, device=device)[:, None] * inv_freq
    return torch.cat([freqs.cos(), freqs.sin()], -1).float()


def make_inputs(torch, case, dtype, device="cuda", seed=0):
    """The packed projection, the weights, the angles (positions and cache; transformers' cos and sin
    in ``dtype`` and float32) and the backward's output gradients."""
    gen = torch.Generator(device=device).manual_seed(seed)
    t, hq, hk, d = case

    def normal(*shape):
        return torch.randn(shape, generator=gen, device=device)
    packed = normal(t, (hq + 2 * hk) * d).to(dtype)
    q_weight, k_weight = ((1 + 0.1 * normal(d)).to(dtype) for _ in range(2))
    positions = torch.randint(0, MAX_POSITION, (t,), generator=gen, device=device)     # int64, as vLLM's
    cache = cos_sin_cache(torch, d, device)
    rows = cache[positions]
    cos32, sin32 = (torch.cat([half, half], -1) for half in (rows[:, :d // 2], rows[:, d // 2:]))   # NeoX halves
    return {"packed": packed, "q_weight": q_weight, "k_weight": k_weight, "positions": positions,
            "cos_sin_cache": cache, "cos": cos32.to(dtype), "sin": sin32.to(dtype), "cos32": cos32, "sin32": sin32,
            "dq_out": normal(t, hq, d).to(dtype), "dk_out": normal(t, hk, d).to(dtype)}


def reference(torch, case, inputs, op):
    """The float64 norm then rotation: (q_out, k_out) (fwd) or (dq, dk, dq_weight, dk_weight) (fwdbwd)."""
    cos, sin = inputs["cos32"].double()[:, None], inputs["sin32"].double()[:, None]
    rotate_half = hf_functions().rotate_half
    leaves = [t.double().requires_grad_(op != "fwd")
              for t in (*head_views(inputs["packed"], *case[1:]), inputs["q_weight"], inputs["k_weight"])]

    def one(x, w):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w
        return y * cos + rotate_half(y) * sin
    with torch.enable_grad():
        q_out, k_out = one(leaves[0], leaves[2]), one(leaves[1], leaves[3])
        if op == "fwd":
            return q_out.detach(), k_out.detach()
        return torch.autograd.grad((q_out, k_out), leaves, (inputs["dq_out"].double(), inputs["dk_out"].double()))


# -- the implementations ---------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def hf_functions():
    """transformers' Qwen3 norm and rotation as written there, and the composites the peers compile."""
    import torch

    rms_norm = peers.torch_functions()["torch_eager"][0]     # Qwen3RMSNorm's formula is LlamaRMSNorm's

    def rotate_half(x):
        x1 = x[..., : x.shape[-1] // 2]
        x2 = x[..., x.shape[-1] // 2:]
        return torch.cat((-x2, x1), dim=-1)

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        cos = cos.unsqueeze(unsqueeze_dim)
        sin = sin.unsqueeze(unsqueeze_dim)
        return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)

    def norm_rope(q, k, q_weight, k_weight, cos, sin):
        return apply_rotary_pos_emb(rms_norm(q, q_weight, EPS), rms_norm(k, k_weight, EPS), cos, sin)

    def norm_rope_in_place(packed, q_weight, k_weight, cos, sin, q_heads, k_heads, head_dim):
        q, k = head_views(packed, q_heads, k_heads, head_dim)
        q_out, k_out = norm_rope(q, k, q_weight, k_weight, cos, sin)
        q.copy_(q_out)
        k.copy_(k_out)

    def rope_in_place(packed, cos, sin, q_heads, k_heads, head_dim):
        q, k = head_views(packed, q_heads, k_heads, head_dim)
        q_out, k_out = apply_rotary_pos_emb(q, k, cos, sin)
        q.copy_(q_out)
        k.copy_(k_out)
    return types.SimpleNamespace(rms_norm=rms_norm, rotate_half=rotate_half,
                                 apply_rotary_pos_emb=apply_rotary_pos_emb, norm_rope=norm_rope,
                                 norm_rope_in_place=norm_rope_in_place, rope_in_place=rope_in_place)


@functools.lru_cache(maxsize=None)
def compiled(name):
    """``hf_functions()``'s ``name`` under torch.compile(fullgraph=True, dynamic=False)."""
    import torch
    peers.lift_recompile_limits()     # one graph per shape, dtype and pass
    return torch.compile(getattr(hf_functions(), name), fullgraph=True, dynamic=False)


# Each implementation's forward: (torch, case, inputs, packed: its own copy of the projection, the
# FlashInfer library) -> a call returning (q_out, k_out) of (T, H, D); and where it has one, its
# differentiable form: (torch, inputs) -> forward(q, k, q_weight, k_weight) -> (q_out, k_out).
def ours_forward(torch, case, inputs, packed, lib):
    import cupy_rmsnorm as rn
    import cupy_rmsnorm.torch  # noqa: F401 - the registered ops (and their autograd)
    q, k = head_views(packed, *case[1:])
    weights, angles = (inputs["q_weight"], inputs["k_weight"]), {n: inputs[n] for n in ("positions", "cos_sin_cache")}
    return lambda: rn.qk_norm_rope(q, k, *weights, EPS, casting_mode=CASTING, out_q=q, out_k=k, **angles)


def ours_differentiable(torch, inputs):
    import cupy_rmsnorm as rn
    import cupy_rmsnorm.torch  # noqa: F401
    angles = {n: inputs[n] for n in ("positions", "cos_sin_cache")}
    return lambda q, k, qw, kw: rn.qk_norm_rope(q, k, qw, kw, EPS, casting_mode=CASTING, **angles)


def ours_unfused_forward(torch, case, inputs, packed, lib):
    import cupy_rmsnorm as rn
    q, k = head_views(packed, *case[1:])
    qw, kw, cos, sin = (inputs[n] for n in ("q_weight", "k_weight", "cos", "sin"))
    rope = compiled("rope_in_place")

    def call():
        rn.rms_norm(q, qw, EPS, out=q, casting_mode=CASTING)
        rn.rms_norm(k, kw, EPS, out=k, casting_mode=CASTING)
        rope(packed, cos, sin, *case[1:])
        return q, k
    return call


def ours_unfused_differentiable(torch, inputs):
    import cupy_rmsnorm as rn
    import cupy_rmsnorm.torch  # noqa: F401
    rope, cos, sin = compiled("apply_rotary_pos_emb"), inputs["cos"], inputs["sin"]
    return lambda q, k, qw, kw: rope(rn.rms_norm(q, qw, EPS, casting_mode=CASTING),
                                     rn.rms_norm(k, kw, EPS, casting_mode=CASTING), cos, sin)


def torch_compile_forward(torch, case, inputs, packed, lib):
    q, k = head_views(packed, *case[1:])
    args = [inputs[n] for n in ("q_weight", "k_weight", "cos", "sin")] + list(case[1:])
    norm_rope = compiled("norm_rope_in_place")

    def call():
        norm_rope(packed, *args)
        return q, k
    return call


def torch_compile_differentiable(torch, inputs):
    norm_rope, cos, sin = compiled("norm_rope"), inputs["cos"], inputs["sin"]
    return lambda q, k, qw, kw: norm_rope(q, k, qw, kw, cos, sin)


def liger_differentiable(torch, inputs):
    """Liger's norm on each view, then its rope on both in place as (1, H, T, D); (T, H, D) views back."""
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.rope import LigerRopeFunction
    cos, sin = inputs["cos"], inputs["sin"]

    def forward(q, k, qw, kw):
        # (X, W, eps, offset, casting_mode, in_place: the backward writes dX over dY, as LigerRMSNorm's default)
        yq = LigerRMSNormFunction.apply(q, qw, EPS, 0.0, "llama", True)
        yk = LigerRMSNormFunction.apply(k, kw, EPS, 0.0, "llama", True)
        q_out, k_out = LigerRopeFunction.apply(yq.unsqueeze(0).transpose(1, 2), yk.unsqueeze(0).transpose(1, 2),
                                               cos, sin)
        return q_out.transpose(1, 2)[0], k_out.transpose(1, 2)[0]
    return forward


def liger_forward(torch, case, inputs, packed, lib):
    forward = liger_differentiable(torch, inputs)
    q, k = head_views(packed, *case[1:])
    qw, kw = inputs["q_weight"], inputs["k_weight"]

    def call():
        with torch.no_grad():
            return forward(q, k, qw, kw)
    return call


def flashinfer_forward(torch, case, inputs, packed, lib):
    import cupy_rmsnorm as rn
    if lib is None:
        raise RuntimeError("no FlashInfer library")
    tokens, q_heads, k_heads, head_dim = case
    q, k = head_views(packed, q_heads, k_heads, head_dim)
    qw, kw = inputs["q_weight"], inputs["k_weight"]
    positions, cache = inputs["positions"], inputs["cos_sin_cache"]
    # pointers, sizes and strides in elements: FlashInfer's apply_rope_with_cos_sin_cache_inplace's call
    fixed = (q.data_ptr(), k.data_ptr(), cache.data_ptr(), positions.data_ptr(), tokens, q_heads, k_heads,
             cache.shape[1], head_dim, *q.stride()[:2], *k.stride()[:2], 1, int(q.dtype == torch.bfloat16))

    def call():
        rn.rms_norm(q, qw, EPS, out=q, casting_mode=CASTING)
        rn.rms_norm(k, kw, EPS, out=k, casting_mode=CASTING)
        status = lib.fi_rope_pos_ids_cos_sin_cache(*fixed, torch.cuda.current_stream().cuda_stream)
        if status:
            detail = lib.fi_rope_last_error().decode() if status == -1 else f"CUDA error {status}"
            raise RuntimeError(f"FlashInfer's rope failed: {detail}")
        return q, k
    return call


FORWARDS = {"ours": ours_forward, "ours_unfused": ours_unfused_forward, "torch_compile": torch_compile_forward,
            "liger": liger_forward, "flashinfer": flashinfer_forward}
DIFFERENTIABLE = {"ours": ours_differentiable, "ours_unfused": ours_unfused_differentiable,
                  "torch_compile": torch_compile_differentiable, "liger": liger_differentiable}


def build(torch, impl, op, case, inputs, lib=None):
    """One call of ``impl``'s pass ``op`` as a zero-argument callable, returning (q_out, k_out) or
    (dq, dk, dq_weight, dk_weight); the forward works on its own copy of the packed projection."""
    if impl == "copy":
        return common.device_copy(torch, moved_bytes(op, case, inputs["packed"].element_size()))
    if op == "fwd":
        return FORWARDS[impl](torch, case, inputs, inputs["packed"].clone(), lib)
    forward = DIFFERENTIABLE[impl](torch, inputs)
    # leaves with the packed views' strides; weights of the implementation's own; gradients too
    leaves = ([t.detach().requires_grad_(True) for t in head_views(inputs["packed"], *case[1:])]
              + [inputs[n].detach().clone().requires_grad_(True) for n in ("q_weight", "k_weight")])
    grads = (inputs["dq_out"].clone(), inputs["dk_out"].clone())
    return lambda: torch.autograd.grad(forward(*leaves), leaves, grads)


# -- the run ---------------------------------------------------------------------------------------
def run(args):
    import torch

    from . import flashinfer
    started = time.perf_counter()
    device = common.gpu_device()
    impls, missing = availability(["ours"] + list(args.peers))
    lib = None
    if "flashinfer" in impls:
        report.log(f"qk_rope on {device['gpu']}: preparing FlashInfer's rope ...")
        lib, why = flashinfer.library(args.flashinfer, device["compute_capability"].replace(".", ""), flashinfer.ROPE)
        if lib is None:
            impls.remove("flashinfer")
            missing["flashinfer"] = why
    todo = cases(args)
    payload, runners, scratch, bandwidth = common.start_run(
        "qk_rope", args, impls=impls, missing=missing, device=device, ops=args.ops, tolerance=TOLERANCE,
        casting_mode=CASTING, rope_theta=ROPE_THETA, max_position=MAX_POSITION, cases=[c._asdict() for c in todo],
        flashinfer=args.flashinfer or "installed flashinfer-python", implementations={n: DESCRIPTIONS[n] for n in impls})
    runner = runners["torch"]
    measure = functools.partial(measure_case, torch, args, payload, impls, runner, scratch, bandwidth, lib, {})
    return common.run_sweep(sys.modules[__name__], args, payload, started, todo, describe, measure)


def measure_case(torch, args, payload, impls, runner, scratch, bandwidth, lib, counts, case, dtype_name):
    """Every pass, implementation and mode of one case and dtype, each checked, then timed."""
    inputs = make_inputs(torch, case, getattr(torch, dtype_name), "cuda", seed=case.tokens * 7 + case.k_heads)
    torch.cuda.synchronize()            # ready before the runner's stream reads them
    where = f"{dtype_name} {describe(case)}"
    for op in args.ops:
        nbytes = moved_bytes(op, case, inputs["packed"].element_size())
        try:
            want = reference(torch, case, inputs, op)
        except Exception as e:  # noqa: BLE001 - nothing to check against (out of memory): the next pass
            common.record_error(payload, f"reference {op} {where}", e)
            continue
        rows = common.mode_rows(args.modes, impls, {**case._asdict(), "op": op, "dtype": dtype_name,
                                                    "bytes": nbytes})
        for impl in impls:
            if not common.skip_unsupported(payload, counts, impl, unsupported(impl, op, dtype_name)):
                common.check_and_time(payload, args, rows, impl, runner,
                                      lambda: build(torch, impl, op, case, inputs, lib), nbytes=nbytes,
                                      bandwidth=bandwidth, scratch=scratch, where=f"{op} {where}", reference=want,
                                      tolerance=TOLERANCE)
        del want
        common.keep_rows(payload, rows, table_rows)
