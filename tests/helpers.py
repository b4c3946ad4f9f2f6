"""Shared test helpers: dtypes, ops, seeds, tolerances, and GPU / torch availability (with
the reason shown on skip). Needs neither CuPy nor a GPU to import."""

import contextlib
import functools
import os
import re
import threading
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


def tiny_qwen3(layers=2, hidden=128, vocab=1000, heads=4, kv_heads=2, head_dim=64, moe=False, device="cuda",
               dtype="bfloat16"):
    """A small randomly initialized transformers Qwen3ForCausalLM (``moe``: Qwen3MoeForCausalLM,
    four experts) in eval mode, seeded, nothing downloaded; every RMSNorm weight (q_norm and
    k_norm included) drawn around one, where "llama" and "fp32" rounding differ."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(0)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                  max_position_embeddings=256, rms_norm_eps=EPS, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if moe:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2,
                                                   moe_intermediate_size=hidden, decoder_sparse_step=1))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    model = model.to(device=device, dtype=getattr(torch, dtype)).eval()
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__.endswith("RMSNorm"):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape[0]))
    return model


def cpu_tensor_to_numpy(t):
    """A CPU torch tensor's values as a NumPy array (bfloat16 as ml_dtypes'), None as None."""
    import torch
    if t is None:
        return None
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def numpy_to_cpu_tensor(a):
    """The inverse of cpu_tensor_to_numpy."""
    import torch
    if a is None:
        return None
    a = np.ascontiguousarray(a)
    if a.dtype == np.dtype(ml_dtypes.bfloat16):
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


@contextlib.contextmanager
def cpu_kernels_of_the_ops(kernels):
    """``kernels`` ({registered op's name: function}) run as the CPU implementations of the
    library's torch ops inside the block; after it, each op's own implementation runs on the CPU
    again (a kernel registered for a custom op stays registered: the op's default is put back
    in its place, so tests that expect the real path's refusal of CPU tensors still see it)."""
    import torch
    from torch._library.custom_ops import OPDEFS   # the registered custom ops, by qualified name

    import cupy_rmsnorm.torch  # noqa: F401 - the ops registered
    for name, fn in kernels.items():
        torch.library.register_kernel(f"cupy_rmsnorm::{name}", "cpu", fn)
    try:
        yield
    finally:
        for name in kernels:
            op = OPDEFS[f"cupy_rmsnorm::{name}"]
            op._backend_fns["cpu"] = op._backend_fns[None]


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


# -- NVRTC compile tests (tests/cpu/test_compile*.py) -----------------------------------------
# Compiled without a GPU through CuPy's low-level NVRTC binding (_compile.compile_offline),
# for each architecture of COMPILE_ARCHS that the installed NVRTC supports: FULL_ARCH gets the
# representative sets (float16 and bfloat16 splitting theirs: sixteen_bit_share), the others
# a cross-section of them for one storage dtype each (arch_dtypes); CUPY_RMSNORM_COMPILE_ALL=1
# compiles every instantiation the launcher can make, for every dtype and architecture.
COMPILE_ALL = os.environ.get("CUPY_RMSNORM_COMPILE_ALL") == "1"
COMPILE_ARCHS = ("sm_80", "sm_90", "sm_100", "sm_120")   # Ampere, Hopper, Blackwell (B200, RTX 50)
FULL_ARCH = "sm_90"
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
VECS = {"float32": (1, 2, 4), "float16": (1, 2, 4, 8), "bfloat16": (1, 2, 4, 8)}   # up to 16 bytes
SMS = 132
MAX_CLUSTER = 8
# Vectors per row (hidden // vec) at each boundary of launch_plan: groups of 8..1024 threads
# with 1, 2 or 4 vectors each, then streaming. Times each vec, these hidden sizes reach every
# plan the launcher makes (test_compile.py's test_enumeration_is_complete checks that against
# a full scan).
VECTOR_COUNTS = (1, 8, 9, 16, 17, 32, 33, 64, 65, 128, 129, 256, 257, 512, 513, 1024, 1025,
                 2048, 2049, 4096, 4097, 100_000)
HIDDEN_SIZES = sorted({n * v for n in VECTOR_COUNTS for v in (1, 2, 4, 8)}
                      | {1, 7, 255, 1000, 4095, 4096, 5120, 8192, 16384, 65536, 262144})
# Row counts in each of the heuristic's regimes: few rows (clusters of 8, 4, 2 blocks per
# row on 132 SMs, then one block per row up to 256 rows) and many rows.
ROWS = (1, 30, 60, 100, 257, 10 ** 6)
PLAN_KINDS = ("warp group", "block", "stream", "block cluster", "stream cluster")
# C++ type -> its Itanium mangling (float is a builtin; the others are class names)
MANGLED = {"float": "f", "__half": "6__half", "__nv_bfloat16": "13__nv_bfloat16"}
# NVRTC >= 12.8: the same front end, template instantiation and ptxas, fewer optimizations
# (about a third of the time per instantiation)
FAST_COMPILE = ("--Ofast-compile=max",)


@functools.lru_cache(maxsize=None)
def nvrtc_missing():
    """None when NVRTC and the CUDA headers are usable, else why not."""
    try:
        from cupy_backends.cuda.libs import nvrtc
    except Exception as e:  # noqa: BLE001 - any import failure means no NVRTC
        return f"CuPy's NVRTC binding is not importable ({type(e).__name__}: {e})"
    try:
        major, _ = nvrtc.getVersion()
    except Exception as e:  # noqa: BLE001
        return f"NVRTC library not found ({type(e).__name__}: {e}); pip install nvidia-cuda-nvrtc-cu12"
    from cupy_rmsnorm import _compile
    if not _compile.cuda_include_dirs(major):
        return "no CUDA headers (cuda_bf16.h) found; pip install nvidia-cuda-runtime-cu12"
    return None


def nvrtc_version():
    from cupy_backends.cuda.libs import nvrtc
    return tuple(nvrtc.getVersion())


@functools.lru_cache(maxsize=None)
def nvrtc_archs():
    """The compute capabilities the installed NVRTC compiles for (nvrtcGetSupportedArchs:
    CuPy's getSupportedArchs), or None where CuPy cannot ask."""
    from cupy_backends.cuda.libs import nvrtc
    try:
        return tuple(int(a) for a in nvrtc.getSupportedArchs())
    except Exception:  # noqa: BLE001 - an older CuPy or NVRTC: arch_missing tries a compile
        return None


@functools.lru_cache(maxsize=None)
def arch_missing(arch):
    """None when the installed NVRTC compiles for ``arch`` ("sm_90"), else why not: NVRTC's
    own list where CuPy can ask for it, else a compile of an empty kernel."""
    reason = nvrtc_missing()
    if reason:
        return reason
    version = ".".join(map(str, nvrtc_version()))
    archs = nvrtc_archs()
    if archs is not None:
        if int(arch.split("_")[1]) in archs:
            return None
        return f"NVRTC {version} does not compile for {arch} (it does for sm_{', sm_'.join(map(str, archs))})"
    from cupy_backends.cuda.libs import nvrtc
    prog = nvrtc.createProgram("extern \"C\" __global__ void probe() {}", "probe.cu", [], [])
    try:
        nvrtc.compileProgram(prog, [f"-arch={arch}"])
    except Exception as e:  # noqa: BLE001
        return f"NVRTC {version} does not compile for {arch} ({type(e).__name__}: {str(e)[:200]})"
    finally:
        nvrtc.destroyProgram(prog)
    return None


def requires_arch(arch):
    """A skip mark for a test that compiles for ``arch``, with the reason."""
    reason = arch_missing(arch)
    return pytest.mark.skipif(reason is not None, reason=f"NVRTC compile test ({arch}): {reason}")


def arch_params(archs=COMPILE_ARCHS):
    """``archs`` as parameters, each skipped with the reason where NVRTC cannot compile for it."""
    return [pytest.param(a, id=a, marks=requires_arch(a)) for a in archs]


def arch_dtype_params(turn=0):
    """(arch, dtype) parameters: each architecture of COMPILE_ARCHS with its arch_dtypes(arch,
    ``turn``), skipped with the reason where NVRTC cannot compile for it."""
    return [pytest.param(a, d, id=f"{a}-{d}", marks=requires_arch(a)) for a in COMPILE_ARCHS
            for d in arch_dtypes(a, turn)]


def plan_kind(plan):
    """Which code path of the kernels a forward (or quantized) plan takes (one of PLAN_KINDS)."""
    shape = "stream" if plan.vecs_per_thread == 0 else "warp group" if plan.threads_per_row <= 32 else "block"
    return shape + (" cluster" if plan.cluster > 1 else "")


def template_ints(args):
    """The mangled template arguments after the types (ints and bools)."""
    return "".join(f"Lb{int(a == 'true')}E" if a in ("true", "false") else f"Li{a}E" for a in args)


def by_turns(items, key, turn=0):
    """One item per value of ``key(item)``: of the i-th group (groups sorted by key, members
    in ``items``' order) the (turn + i)-th member, cyclically, so that the groups take
    different members, and so do different turns."""
    groups = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return [group[(turn + i) % len(group)]
            for i, (_, group) in enumerate(sorted(groups.items(), key=lambda kv: repr(kv[0])))]


def chunks(items, size):
    """``items`` in runs of equal length (one more in the first ones), up to ``size`` each."""
    items = list(items)
    if not items:
        return []
    n = -(-len(items) // size)
    base, extra = divmod(len(items), n)
    bounds = [i * base + min(i, extra) for i in range(n + 1)]
    return [items[a:b] for a, b in zip(bounds, bounds[1:])]


class CompiledProgram:
    """What compile_offline gave for one program: the cubin and NVRTC's log, or the error."""

    def __init__(self, cubin=None, log="", error=None):
        self.cubin, self.log, self.error = cubin, log, error

    def get(self):
        """The cubin; an AssertionError with NVRTC's message where the compile failed."""
        if self.error is not None:
            raise AssertionError(f"{type(self.error).__name__}: {str(self.error)[:20000]}")
        assert isinstance(self.cubin, bytes) and len(self.cubin) > 0
        return self.cubin


_compile_pool = None
_compile_jobs = {}
_compile_lock = threading.Lock()
_CORES = max(2, os.cpu_count() or 2)
# programs compiling at once: all cores but one while other tests run, then every core
_compile_slots = threading.Semaphore(_CORES - 1)
_every_core = []


def compile_program(names, arch, program="forward", fast=True, extra_options=()):
    """A future of one NVRTC program (a CompiledProgram): the name expressions ``names`` of
    ``program`` for ``arch``, in fast-compile mode or with exactly the library's own options
    (``fast=False``), plus ``extra_options``. Programs run in a pool of threads (NVRTC
    releases the GIL) shared by all compile tests, each program once per session:
    tests/cpu/conftest.py hands the selected tests' programs to the pool when the run
    starts, and runs those tests last, so the compiles overlap the other tests (on all cores
    but one until the compile tests start: compile_on_every_core)."""
    global _compile_pool
    options = (FAST_COMPILE if fast and nvrtc_version() >= (12, 8) else ()) + tuple(extra_options)
    key = (tuple(names), arch, program, options)
    with _compile_lock:
        future = _compile_jobs.get(key)
        if future is None:
            if _compile_pool is None:
                import concurrent.futures
                _compile_pool = concurrent.futures.ThreadPoolExecutor(_CORES, thread_name_prefix="nvrtc")
            future = _compile_jobs[key] = _compile_pool.submit(_compile_one, list(names), arch, program, options)
    return future


def _compile_one(names, arch, program, options):
    from cupy_rmsnorm import _compile
    log = []
    with _compile_slots:
        try:
            cubin = _compile.compile_offline(names, arch, program, options, log)
        except Exception as e:  # noqa: BLE001 - reported by the test that owns the program
            return CompiledProgram(error=e)
    return CompiledProgram(cubin, log[0].replace("\0", "") if log else "")


def compile_on_every_core():
    """From now on programs compile on every core (the compile tests are running: the main
    thread only waits for them)."""
    with _compile_lock:
        if not _every_core:
            _every_core.append(True)
            _compile_slots.release()


def library_options_programs(names, arch, program, compiled):
    """Programs (compile_program's keyword arguments) that compile ``names`` with the library's
    own options for ``arch``: those of ``compiled`` (a test module's other programs) that
    already do so for some of them (ptxas -v, which spill checks add, only reports), and one
    program of the rest. Each is compiled once for both tests."""
    held = [kw for kw in compiled if kw["arch"] == arch and kw.get("program", "forward") == program
            and not kw.get("fast", True) and set(kw["names"]) & set(names)]
    rest = [n for n in names if not any(n in kw["names"] for kw in held)]
    return ([dict(names=rest, arch=arch, program=program, fast=False)] if rest else []) + held


def check_symbols(cubin, pairs, symbol_pattern):
    """Every name expression of (name, mangled prefix) ``pairs`` lowered to a kernel of the
    cubin, one kernel each (``symbol_pattern``: a bytes regex of the program's kernel names)."""
    symbols = set(re.findall(symbol_pattern, cubin))
    assert len(symbols) == len(pairs), "one kernel per name expression"
    for expr, prefix in pairs:
        assert any(s.startswith(prefix) for s in symbols), f"no lowered kernel for {expr} ({prefix!r})"


def ptxas_entries(log, entry=r"\w+", registers=False):
    """ptxas -v's report per compiled entry function: (the groups of ``entry``..., spill store
    bytes[, registers used])."""
    pattern = rf"Compiling entry function '({entry})'.*?(\d+) bytes spill stores"
    if registers:
        pattern += r".*?Used (\d+) registers"
    return re.findall(pattern, log, re.S)


def start_compiles(jobs):
    """Hands ``jobs`` (compile_program's keyword arguments) to the pool, the costliest first
    (programs of the library's own options, quantized and backward kernels take longer), so
    that the last ones to finish are short."""
    def cost(job):
        per = 1.0 if job.get("fast", True) else 3.0
        if job.get("program") == "backward" or any("quant" in n for n in job["names"][:1]):
            per *= 2
        return per * (len(job["names"]) + 2)
    for job in sorted(jobs, key=cost, reverse=True):
        compile_program(**job)


def stop_compiles():
    """Drops the programs not yet started (the session is over; an interrupted run exits
    without waiting for them)."""
    with _compile_lock:
        if _compile_pool is not None:
            _compile_pool.shutdown(wait=False, cancel_futures=True)


SIXTEEN_BIT = ("float16", "bfloat16")


def sixteen_bit_share(dtype, items, key=lambda item: None, float32_by_turns=False):
    """The part of ``items`` that ``dtype`` compiles. float32: every item (every dtype every
    item with CUPY_RMSNORM_COMPILE_ALL=1). float16 and bfloat16 run the same templates with the
    same plans (only the conversions of T differ), so they split the items: of the i-th group
    of ``key(item)`` (groups sorted by key, members in ``items``' order) float16 takes the
    members j with i + j even, bfloat16 the others. Together they take every item; each takes
    every other member of each group (a group of two or more is met by both), starting by
    turns, and every other group of one. ``float32_by_turns``: float32 takes bfloat16's part
    of its own items, for spill checks whose float32 plans are the 16-bit dtypes' and need
    no more registers than theirs (a 16-byte vector holds half the values)."""
    items = list(items)
    if COMPILE_ALL or (dtype not in SIXTEEN_BIT and not float32_by_turns):
        return items
    turn = SIXTEEN_BIT.index(dtype) if dtype in SIXTEEN_BIT else SIXTEEN_BIT.index("bfloat16")
    index = {k: i for i, k in enumerate(sorted({key(item) for item in items}, key=repr))}
    seen, share = {}, []
    for item in items:
        k = key(item)
        j = seen[k] = seen.get(k, -1) + 1
        if (index[k] + j) % 2 == turn:
            share.append(item)
    return share


def spill_turns(dtype, count, float32_by_turns=False):
    """[(i, weight types)]: which of a spill check's ``count`` plans (sorted) are compiled for
    ``dtype``, with which weights. With CUPY_RMSNORM_COMPILE_ALL=1 every plan with both weight
    types; by default float32 takes every plan (by turns with ``float32_by_turns``: see
    sixteen_bit_share), float16 and bfloat16 (the same plans, the same 16-bit registers) take
    them by turns, and the weight types alternate (float32, x's dtype) over the plans each
    dtype takes."""
    if COMPILE_ALL:
        return [(i, tuple(dict.fromkeys((dtype, "float32")))) for i in range(count)]
    return [(i, (("float32", dtype)[(i // 2) % 2],))
            for i in sixteen_bit_share(dtype, range(count), float32_by_turns=float32_by_turns)]


def arch_dtypes(arch, turn=0):
    """The storage dtypes a test compiles for ``arch``: all on FULL_ARCH (or with
    CUPY_RMSNORM_COMPILE_ALL=1), one on each of the others, by turns (as many others as dtypes:
    each dtype on one of them). ``turn`` shifts the turns, so that tests with different turns
    compile different dtypes for an architecture (the heaviest instantiations take turn 0)."""
    dtypes = list(DTYPES)
    if COMPILE_ALL or arch == FULL_ARCH:
        return dtypes
    others = [a for a in COMPILE_ARCHS if a != FULL_ARCH]
    return [dtypes[(others.index(arch) + turn) % len(dtypes)]]


# -- the docs' code blocks ----------------------------------------------------------------------
# the repository's top folder: its files (docs, committed reports) are read from here, not from
# wherever the package under test is installed
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
