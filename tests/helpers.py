"""Shared test helpers: dtypes, ops, seeds, tolerances, and GPU / torch availability (with
the reason shown on skip). Needs neither CuPy nor a GPU to import."""

import functools
import os
import zlib

import ml_dtypes
import numpy as np
import pytest

DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
          "bfloat16": np.dtype(ml_dtypes.bfloat16)}
DTYPE_NAMES = tuple(DTYPES)
FUSED = "fused_add_rms_norm"
OPS = ("rms_norm", FUSED)
MODES = ("fp32", "llama")
EPS = 1e-6


def seed(*parts):
    """A seed of its own for every named case (stable across runs and processes)."""
    return zlib.crc32("-".join(map(str, parts)).encode())


# -- tolerances ---------------------------------------------------------------------------
MANTISSA_BITS = {"float32": 23, "float16": 10, "bfloat16": 7}
# the spacing of the dtype's numbers relative to a value at the bottom of its binade,
# so |a - b| <= ULP_REL * |b| allows (at least) one ulp
ULP_REL = {k: 2.0 ** -p for k, p in MANTISSA_BITS.items()}
# the smallest spacing of each 16-bit dtype (float16 subnormals; bfloat16's never matter)
MIN_SPACING = {"float16": 2.0 ** -24, "bfloat16": 2.0 ** -133}
# The kernel's float32 arithmetic (the sum of squares over up to 262144 terms in its own
# order, rsqrtf, the products) is typically ~1e-6 relative off the float64 value. For
# float32 outputs that is the whole tolerance; for 16-bit outputs it is the slack on top
# of the rounding.
FLOAT32_RTOL = 1e-5
NOISE_REL = 1e-5
# Against the float64 reference (tests/gpu_reference.py): absolute slack near zero
# (float16 subnormals are spaced 2**-24 apart).
REFERENCE_ATOL = {"float32": 1e-12, "float16": 4 * 2.0 ** -24, "bfloat16": 1e-12}
# Against the float32 NumPy reference (the same float32 math summed in another order;
# llama mode rounds twice): two ulps of the dtype relative, plus a slack near zero.
HOST_RTOL = {"float32": FLOAT32_RTOL, "float16": 2 * ULP_REL["float16"], "bfloat16": 2 * ULP_REL["bfloat16"]}
HOST_ATOL = {"float32": 1e-6, "float16": 2.0 ** -22, "bfloat16": 1e-6}
# (rtol, atol) for values of order one: about two units in the last place of each dtype.
TOL = {"float32": (1e-5, 1e-5), "float16": (2e-3, 2e-3), "bfloat16": (1.6e-2, 1.6e-2)}


# -- what this machine has ----------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def gpu_missing():
    """None when a CUDA GPU is usable through CuPy, else why not (the benchmark's own check)."""
    from cupy_rmsnorm.bench.timing import gpu_missing as reason
    why = reason()
    return None if why is None else f"no CUDA GPU: {why}"


@functools.lru_cache(maxsize=None)
def torch_cuda_missing():
    """None when torch with CUDA is usable, else why not."""
    reason = gpu_missing()
    if reason:
        return reason
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        return f"PyTorch is not installed ({type(e).__name__})"
    return None if torch.cuda.is_available() else "PyTorch sees no CUDA device"


@functools.lru_cache(maxsize=None)
def two_gpus_missing():
    """None when CuPy sees two GPUs, else why not."""
    reason = gpu_missing()
    if reason:
        return reason
    import cupy
    n = cupy.cuda.runtime.getDeviceCount()
    return None if n >= 2 else f"needs two GPUs, this machine has {n}"


@functools.lru_cache(maxsize=None)
def two_torch_gpus_missing():
    """None when CuPy and torch see two GPUs, else why not."""
    reason = two_gpus_missing() or torch_cuda_missing()
    if reason:
        return reason
    import torch
    n = torch.cuda.device_count()
    return None if n >= 2 else f"needs two GPUs, torch sees {n}"


requires_gpu = pytest.mark.skipif(gpu_missing() is not None, reason=f"GPU test: {gpu_missing()}")
requires_torch_gpu = pytest.mark.skipif(torch_cuda_missing() is not None,
                                        reason=f"torch GPU test: {torch_cuda_missing()}")
requires_two_gpus = pytest.mark.skipif(two_gpus_missing() is not None,
                                       reason=f"two-GPU test: {two_gpus_missing()}")
requires_two_torch_gpus = pytest.mark.skipif(two_torch_gpus_missing() is not None,
                                             reason=f"two-GPU torch test: {two_torch_gpus_missing()}")


def child_env(**overrides):
    """The environment of a child Python that is to import the cupy_rmsnorm this session
    imported: that package's folder first on PYTHONPATH. Run the child in a folder with
    no cupy_rmsnorm/ of its own (``tmp_path``): ``-c`` and ``-m`` put the working folder first."""
    import cupy_rmsnorm
    root = os.path.dirname(os.path.dirname(os.path.abspath(cupy_rmsnorm.__file__)))
    env = dict(os.environ, **overrides)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def load_benchmark(name):
    """benchmarks/<name>.py as a module (the scripts are not a package)."""
    import importlib.util
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(name, os.path.join(root, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_llama(layers, hidden, vocab=1000, heads=4, kv_heads=2, device="cuda", dtype="bfloat16",
               random_norm_weights=True):
    """A small randomly initialized transformers LlamaForCausalLM (nothing downloaded), in
    eval mode, seeded. ``random_norm_weights``: the RMSNorm weights drawn around one (HF
    starts them at one, where "llama" and "fp32" rounding give the same bits)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=256, rms_norm_eps=EPS, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2)
    model = LlamaForCausalLM(config).to(device=device, dtype=getattr(torch, dtype)).eval()
    if random_norm_weights:
        with torch.no_grad():
            for m in model.modules():
                if type(m).__name__ == "LlamaRMSNorm":
                    m.weight.copy_(1.0 + 0.3 * torch.randn(hidden))
    return model


# -- tracing the registered torch ops (CPU; needs torch, imported here only when called) ----
def trace_graphs(fn, *args):
    """Compile ``fn`` with fullgraph=True (a graph break fails) and a backend that records
    the graph and runs it on fake tensors (no GPU needed); returns the graphs."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)

        def run(*inputs):
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                return gm(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in inputs])
        return run

    torch._dynamo.reset()
    torch.compile(fn, fullgraph=True, backend=backend)(*args)
    return graphs


def op_calls(graphs):
    """The cupy_rmsnorm ops the graphs call, in order."""
    return [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"
            and "cupy_rmsnorm" in str(n.target)]


# -- the docs' code blocks ----------------------------------------------------------------------
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC_FILES = ("README.md", "docs/design.md", "docs/numerics.md", "docs/performance.md")


def doc_blocks():
    """Every fenced code block of the README and docs/: (file, line, language, needs a GPU,
    code). A block needs a GPU when the line just before it is ``<!-- gpu -->``."""
    import re
    blocks = []
    for name in DOC_FILES:
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            lines = f.read().split("\n")
        i = 0
        while i < len(lines):
            m = re.match(r"^```(\w*)\s*$", lines[i])
            if not m:
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            gpu = i > 0 and lines[i - 1].strip() == "<!-- gpu -->"
            blocks.append((name, i + 1, m.group(1), gpu, "\n".join(lines[i + 1:end])))
            i = end + 1
    return blocks
