"""Every kernel instantiation the launcher can produce compiles with NVRTC, without a GPU.

CuPy's own compile path asks the device for its architecture; ``compile_offline`` goes
through CuPy's low-level NVRTC binding with an explicit ``-arch`` and the CUDA headers of
the ``nvidia-cuda-runtime-cu12`` wheel, so this runs on CPU-only CI (which installs
``nvidia-cuda-runtime-cu12`` and ``nvidia-cuda-nvrtc-cu12``). Without CuPy, NVRTC or the
headers the tests skip and say why.

Cost: NVRTC takes ~0.1 s per program, then per instantiation ~0.3 s with the library's
options or ~0.07 s with ``--Ofast-compile=max`` (NVRTC >= 12.8: the same front end,
template instantiation and ptxas, fewer optimizations), three quarters of it in ptxas;
there are ~600 instantiations per architecture. So the full set is compiled in fast
mode, many instantiations to a program, programs in parallel threads (NVRTC releases
the GIL): ~50 CPU seconds. The heaviest instantiations (most registers per thread) are
also compiled with exactly the library's own options.
"""

import concurrent.futures
import functools
import os
import re

import pytest

from cupy_rmsnorm import _compile, launch_plan
from cupy_rmsnorm._compile import CUDA_TYPES, instantiation_name

ARCHS = ("sm_80", "sm_90")
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
VECS = {"float32": (1, 2, 4), "float16": (1, 2, 4, 8), "bfloat16": (1, 2, 4, 8)}   # up to 16 bytes
# Vectors per row (hidden // vec) at each boundary of launch_plan: groups of 8..1024 threads
# with 1, 2 or 4 vectors each, then streaming. Times each vec, these hidden sizes reach every
# plan the launcher makes (test_enumeration_is_complete checks that against a full scan).
VECTOR_COUNTS = (1, 8, 9, 16, 17, 32, 33, 64, 65, 128, 129, 256, 257, 512, 513, 1024, 1025,
                 2048, 2049, 4096, 4097, 100_000)
HIDDEN_SIZES = sorted({n * v for n in VECTOR_COUNTS for v in (1, 2, 4, 8)}
                      | {1, 7, 255, 1000, 4095, 4096, 5120, 8192, 16384, 65536, 262144})
# Row counts in each of the heuristic's regimes: few rows (clusters of 8, 4, 2 blocks per
# row on 132 SMs, then one block per row up to 256 rows) and many rows.
ROWS = (1, 30, 60, 100, 257, 10 ** 6)
MAX_CLUSTER = 8
SMS = 132
# C++ type -> its Itanium mangling (float is a builtin; the others are class names)
MANGLED = {"float": "f", "__half": "6__half", "__nv_bfloat16": "13__nv_bfloat16"}
KERNEL_NAME = re.compile(rb"_ZN7rmsnorm\d+rms_norm_\w+")


def _nvrtc_missing():
    """None when NVRTC and the CUDA headers are usable, else why not."""
    try:
        from cupy_backends.cuda.libs import nvrtc
    except Exception as e:  # noqa: BLE001 - any import failure means no NVRTC
        return f"CuPy's NVRTC binding is not importable ({type(e).__name__}: {e})"
    try:
        major, _ = nvrtc.getVersion()
    except Exception as e:  # noqa: BLE001
        return f"NVRTC library not found ({type(e).__name__}: {e}); pip install nvidia-cuda-nvrtc-cu12"
    if not _compile.cuda_include_dirs(major):
        return "no CUDA headers (cuda_bf16.h) found; pip install nvidia-cuda-runtime-cu12"
    return None


NVRTC_MISSING = _nvrtc_missing()
pytestmark = pytest.mark.skipif(NVRTC_MISSING is not None, reason=f"NVRTC compile test: {NVRTC_MISSING}")


@functools.cache
def _plans(dtype, fused):
    """Every distinct plan shape (kernel, template arguments) the launcher makes for HIDDEN_SIZES."""
    plans = {}
    for vec in VECS[dtype]:
        for h in HIDDEN_SIZES:
            for rows in ROWS:
                for edges in ((True, False) if h % vec == 0 else (True,)):
                    p = launch_plan(rows, h, ITEMSIZE[dtype], vec, SMS, fused, edges=edges,
                                    max_cluster=MAX_CLUSTER)
                    plans.setdefault(p.template_args(), p)
    return plans


@functools.cache
def instantiations(dtype):
    """Every distinct (name expression, mangled prefix) for one storage dtype."""
    exprs = set()
    for fused in (False, True):
        for plan in _plans(dtype, fused).values():
            for weight in (None, dtype, "float32"):     # None and x's dtype are the same kernel
                exprs.add((instantiation_name(dtype, weight, fused, plan),
                           _mangled_prefix(dtype, weight, fused, plan)))
    return sorted(exprs)


def _mangled_prefix(dtype, weight, fused, plan):
    """The start of the symbol NVRTC must emit for one instantiation (its template arguments)."""
    kernel = instantiation_name(dtype, weight, fused, plan).split("<")[0].split("::")[-1]
    t, w = CUDA_TYPES[dtype], CUDA_TYPES[weight or dtype]
    w_code = MANGLED[w] if (w == "float" or w != t) else "S1_"   # S1_: substitution, W == T
    ints = "".join(f"Lb{int(a == 'true')}E" if a in ("true", "false") else f"Li{a}E"
                   for a in plan.template_args())
    return f"_ZN7rmsnorm{len(kernel)}{kernel}I{MANGLED[t]}{w_code}Lb{int(fused)}E{ints}EE".encode()


def _nvrtc_version():
    from cupy_backends.cuda.libs import nvrtc
    return nvrtc.getVersion()


def _kernel_symbols(cubin):
    return set(KERNEL_NAME.findall(cubin))


def _compile_batches(batches, fast):
    """{key: cubin or the exception}, compiling (key, exprs, arch) batches in parallel threads."""
    def one(batch):
        key, exprs, arch = batch
        try:
            return key, _compile.compile_offline(exprs, arch)
        except Exception as e:  # noqa: BLE001 - reported by the test that owns the batch
            return key, e

    with pytest.MonkeyPatch.context() as mp:
        if fast and _nvrtc_version() >= (12, 8):
            plain = _compile.nvrtc_options
            mp.setattr(_compile, "nvrtc_options", lambda major=None: plain(major) + ("--Ofast-compile=max",))
        workers = max(2, min(len(batches), os.cpu_count() or 2))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            return dict(pool.map(one, sorted(batches, key=lambda b: -len(b[1]))))


BATCH = 70   # instantiations per NVRTC program: few programs, yet even work for the threads


def _chunks(pairs):
    return [pairs[i:i + BATCH] for i in range(0, len(pairs), BATCH)]


@pytest.fixture(scope="module")
def all_compiled():
    """Every instantiation, in programs of up to BATCH per (arch, dtype)."""
    batches = []
    for arch in ARCHS:
        for dtype in CUDA_TYPES:
            for i, chunk in enumerate(_chunks(instantiations(dtype))):
                batches.append(((arch, dtype, i), [e for e, _ in chunk], arch))
    return _compile_batches(batches, fast=True)


def _check_batch(result, pairs):
    if isinstance(result, Exception):
        raise AssertionError(str(result)[:20000])
    assert isinstance(result, bytes) and len(result) > 0
    symbols = _kernel_symbols(result)
    assert len(symbols) == len(pairs), "one kernel per name expression"
    for expr, prefix in pairs:
        assert any(s.startswith(prefix) for s in symbols), f"no lowered kernel for {expr} ({prefix!r})"


@pytest.mark.parametrize("dtype", list(CUDA_TYPES))
@pytest.mark.parametrize("arch", ARCHS)
def test_every_instantiation_compiles(all_compiled, arch, dtype):
    for i, chunk in enumerate(_chunks(instantiations(dtype))):
        _check_batch(all_compiled[(arch, dtype, i)], chunk)


def _heaviest_per_variant(dtype):
    """Per variant and fused or not, the plan with the most work per thread (most registers),
    with a float32 weight."""
    pairs = set()
    for fused in (False, True):
        best = {}
        for plan in _plans(dtype, fused).values():
            key = (plan.vecs_per_thread, plan.threads_per_row, plan.vec, plan.edges, plan.cluster)
            if plan.variant not in best or key > best[plan.variant][0]:
                best[plan.variant] = (key, plan)
        pairs |= {(instantiation_name(dtype, "float32", fused, p), _mangled_prefix(dtype, "float32", fused, p))
                  for _, p in best.values()}
    return sorted(pairs)


@pytest.mark.parametrize("arch", ARCHS)
def test_heaviest_instantiations_compile_with_library_options(arch):
    """The same NVRTC options the library uses at run time (no fast-compile mode)."""
    batches = [((arch, d), [e for e, _ in _heaviest_per_variant(d)], arch) for d in CUDA_TYPES]
    results = _compile_batches(batches, fast=False)
    for d in CUDA_TYPES:
        pairs = _heaviest_per_variant(d)
        variants = {(p.variant, f) for f in (False, True) for p in _plans(d, f).values()}
        assert len(pairs) == len(variants) >= 4     # registers and stream, fused and not
        _check_batch(results[(arch, d)], pairs)


def test_enumeration_is_complete():
    """Scanning every vector count up to past the stream boundary (then powers of two and
    one past them, for the cluster sizes), at row counts around each threshold of the
    heuristic, finds no plan that HIDDEN_SIZES x ROWS misses."""
    for dtype in ("float32", "float16"):          # bfloat16 plans are float16's (same itemsize)
        for fused in (False, True):
            scanned, variants = set(), set()
            for vec in VECS[dtype]:
                for n in list(range(1, 4200)) + [m for k in range(12, 18) for m in (2 ** k, 2 ** k + 1)]:
                    for rows in (0, 1, 16, 17, 33, 34, 66, 67, 256, 257, 4096, 10 ** 8):
                        for edges in (True, False):
                            p = launch_plan(rows, n * vec, ITEMSIZE[dtype], vec, SMS, fused, edges=edges,
                                            max_cluster=MAX_CLUSTER)
                            scanned.add(p.template_args())
                            variants.add(p.variant)
            assert scanned == set(_plans(dtype, fused)), (dtype, fused)
            assert variants == {"registers", "stream"}
            assert {a[0] for a in scanned} == set(VECS[dtype])


def test_a_broken_expression_fails_loudly():
    with pytest.raises(RuntimeError, match="NVRTC failed for sm_90"):
        _compile.compile_offline(["rmsnorm::no_such_kernel<float>"], "sm_90")
