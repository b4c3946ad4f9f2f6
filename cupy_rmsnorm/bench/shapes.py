"""What a sweep measures: the ops, dtypes and (tokens, hidden) shapes, and their byte counts.

Pure Python (no GPU, no CuPy), so the command line and the report can be tested on a CPU.
"""

import argparse

OPS = ("rms", "fused")
OP_TITLES = {"rms": "rms_norm", "fused": "fused_add_rms_norm"}

DTYPE_ALIASES = {"bf16": "bfloat16", "bfloat16": "bfloat16",
                 "fp16": "float16", "float16": "float16", "half": "float16",
                 "fp32": "float32", "float32": "float32", "float": "float32"}
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
DEFAULT_DTYPES = ("bfloat16", "float16")

MODES = ("graph", "cold", "hot")
MODE_TITLES = {"graph": "graph: GPU time per call (calls captured in one CUDA graph, replayed)",
               "cold": "cold: one call after a 512 MiB write flushed L2 (events around the call)",
               "hot": "hot: back-to-back calls from Python (host overhead shows here)"}

# The default grid: a token sweep at the two common hidden sizes, the
# smaller and odd hidden sizes at 4096 tokens, and two model widths at 256 tokens.
DEFAULT_SHAPES = tuple(sorted(
    {(t, h) for h in (4096, 8192) for t in (1, 32, 256, 1024, 4096, 16384)}
    | {(4096, h) for h in (512, 1024, 2048, 255, 4095)}
    | {(256, 5120), (256, 7168)},
    key=lambda s: (s[1], s[0])))
QUICK_SHAPES = ((1, 4096), (256, 4096), (4096, 4096), (4096, 4095), (1, 8192))
QUICK_DTYPES = ("bfloat16",)


def parse_dtype(name):
    """``bf16`` / ``bfloat16`` / ``fp16`` / ... -> the canonical dtype name."""
    key = name.strip().lower()
    if key not in DTYPE_ALIASES:
        raise ValueError(f"unknown dtype {name!r}; use one of bf16, fp16, fp32")
    return DTYPE_ALIASES[key]


def _positive_ints(text, what, spec):
    values = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"bad shape {spec!r}: {what} must be positive integers, got {part!r}")
        values.append(int(part))
    return values


def shape_list(text):
    """``"ROWSxHIDDEN,ROWSxHIDDEN,..."`` -> [(rows, hidden), ...] (the benchmarks' --shapes)."""
    return [tuple(int(v) for v in s.split("x")) for s in text.split(",")]


def parse_shape_spec(spec):
    """``"TOKENSxHIDDEN"`` -> [(tokens, hidden)]; either side may be a comma list,
    giving every combination: ``"1,32x4096,8192"`` is four shapes."""
    text = spec.strip().lower()
    if text.count("x") != 1:
        raise ValueError(f"bad shape {spec!r}: expected TOKENSxHIDDEN, e.g. 4096x4096 or 1,32x8192")
    tokens_text, hidden_text = text.split("x")
    tokens = _positive_ints(tokens_text, "tokens", spec)
    hiddens = _positive_ints(hidden_text, "hidden sizes", spec)
    return [(t, h) for h in hiddens for t in tokens]


def unique(items):
    """Items in first-seen order, duplicates dropped."""
    seen, out = set(), []
    for item in items:
        if item not in seen:
            seen.add(item)
            out.append(item)
    return out


def logical_bytes(op, tokens, hidden, itemsize, weight_itemsize=None):
    """Bytes one call must move at least: rms reads x and writes y; fused reads x and
    residual and writes residual_out and y; both read the weight once."""
    per_array = tokens * hidden * itemsize
    arrays = 2 if op == "rms" else 4
    return arrays * per_array + hidden * (weight_itemsize or itemsize)


def plan_for(op, tokens, hidden, itemsize, sm_count, max_cluster=1):
    """Our launch plan for a contiguous problem (16-byte vectors, as the pool's
    aligned allocations allow; rows off the vector grid when hidden is not a multiple)."""
    import cupy_rmsnorm as rn
    vec = 16 // itemsize
    return rn.launch_plan(tokens, hidden, itemsize, vec, sm_count, op == "fused",
                          edges=hidden % vec != 0, max_cluster=max_cluster)


def positive_int(text):
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value
