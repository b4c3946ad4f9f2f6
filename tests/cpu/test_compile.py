"""Kernel instantiations the launcher can produce compile with NVRTC, without a GPU.

CuPy's own compile path asks the device for its architecture; ``compile_offline`` goes
through CuPy's low-level NVRTC binding with an explicit ``-arch`` and the CUDA headers of
the ``nvidia-cuda-runtime-cu12`` wheel, so this runs on CPU-only CI (which installs
``nvidia-cuda-runtime-cu12`` and ``nvidia-cuda-nvrtc-cu12``). Without CuPy, NVRTC or the
headers the tests skip and say why.

What is compiled: by default a representative set, for sm_80 and sm_90: every storage
dtype, op (fused or not), vector width, plan kind (warp group, block, streamed block,
cluster, streamed cluster) and edges true / false, with each (op, vector width, plan
kind) compiled with both weight types (x's dtype and float32) - about 440
instantiations. ``CUPY_RMSNORM_COMPILE_ALL=1`` compiles every distinct instantiation
the launcher can make instead (about 4,600; several CPU minutes).

Cost: NVRTC takes ~0.1 s per program, then per instantiation ~0.3 s with the library's
options or ~0.07 s with ``--Ofast-compile=max`` (NVRTC >= 12.8: the same front end,
template instantiation and ptxas, fewer optimizations), three quarters of it in ptxas.
So the set is compiled in fast mode, many instantiations to a program, programs in
parallel threads (NVRTC releases the GIL). The heaviest instantiations (most registers
per thread) are also compiled with exactly the library's own options.
"""

import concurrent.futures
import functools
import os
import re

import pytest

from cupy_rmsnorm import _compile, launch_plan
from cupy_rmsnorm._abi import CUDA_TYPES, instantiation_name

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
COMPILE_ALL = os.environ.get("CUPY_RMSNORM_COMPILE_ALL") == "1"
PLAN_KINDS = ("warp group", "block", "stream", "block cluster", "stream cluster")


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


def plan_kind(plan):
    """Which code path of the kernels a plan takes (one of PLAN_KINDS)."""
    shape = "stream" if plan.vecs_per_thread == 0 else "warp group" if plan.threads_per_row <= 32 else "block"
    return shape + (" cluster" if plan.cluster > 1 else "")


def _pairs(dtype, choices):
    """Sorted distinct (name expression, mangled prefix) of (fused, weight, plan) choices."""
    return sorted({(instantiation_name(dtype, weight, fused, plan), _mangled_prefix(dtype, weight, fused, plan))
                   for fused, weight, plan in choices})


@functools.cache
def every_instantiation(dtype):
    """Every distinct (name expression, mangled prefix) for one storage dtype."""
    return _pairs(dtype, [(fused, weight, plan) for fused in (False, True)
                          for plan in _plans(dtype, fused).values()
                          for weight in (None, dtype, "float32")])   # None and x's dtype are the same kernel


@functools.cache
def representative_choices(dtype):
    """[(fused, weight, plan)]: per op, vector width, plan kind and edges value one plan
    (the kind's plans taken by turns, so that different group sizes and vectors per
    thread get compiled), with x's dtype or float32 as the weight, swapped between edges
    true and false and between the ops."""
    choices = []
    for fused in (False, True):
        groups = {}
        for plan in sorted(_plans(dtype, fused).values(), key=lambda p: p.template_args()):
            groups.setdefault((plan.vec, plan_kind(plan), plan.edges), []).append(plan)
        for i, key in enumerate(sorted(groups)):
            edges = key[2]
            choices.append((fused, "float32" if edges == fused else dtype, groups[key][i % len(groups[key])]))
    return choices


def instantiations(dtype):
    """What this run compiles for one storage dtype: every instantiation with
    CUPY_RMSNORM_COMPILE_ALL=1, else the representative set."""
    return every_instantiation(dtype) if COMPILE_ALL else _pairs(dtype, representative_choices(dtype))


def _mangled_prefix(dtype, weight, fused, plan):
    """The start of the symbol NVRTC must emit for one instantiation (its template arguments)."""
    kernel = instantiation_name(dtype, weight, fused, plan).split("<")[0].split("::")[-1]
    t, w = CUDA_TYPES[dtype], CUDA_TYPES[weight or dtype]
    w_code = MANGLED[w] if (w == "float" or w != t) else "S1_"   # S1_: substitution, W == T
    ints = "".join(f"Lb{int(a == 'true')}E" if a in ("true", "false") else f"Li{a}E"
                   for a in plan.template_args())
    return f"_ZN7rmsnorm{len(kernel)}{kernel}I{MANGLED[t]}{w_code}Lb{int(fused)}E{ints}".encode()   # then the defaulted types R, O


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


BATCH = 70   # instantiations per NVRTC program at most: few programs, yet even work for the threads


def _chunks(pairs):
    """``pairs`` in programs of equal size (one more in the first ones), up to BATCH each."""
    n = -(-len(pairs) // BATCH)
    size, extra = divmod(len(pairs), n)
    bounds = [i * size + min(i, extra) for i in range(n + 1)]
    return [pairs[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.fixture(scope="module")
def compiled():
    """This run's instantiations, in programs of up to BATCH per (arch, dtype)."""
    batches = []
    for arch in ARCHS:
        for dtype in CUDA_TYPES:
            for i, chunk in enumerate(_chunks(instantiations(dtype))):
                batches.append(((arch, dtype, i), [e for e, _ in chunk], arch))
    return _compile_batches(batches, fast=True)


def _check_batch(result, pairs, kernel_symbols=None):
    """One compiled batch: every name expression lowered to a kernel (``kernel_symbols``:
    the program's kernel names in the binary; the forward's by default)."""
    if isinstance(result, Exception):
        raise AssertionError(str(result)[:20000])
    assert isinstance(result, bytes) and len(result) > 0
    symbols = (kernel_symbols or _kernel_symbols)(result)
    assert len(symbols) == len(pairs), "one kernel per name expression"
    for expr, prefix in pairs:
        assert any(s.startswith(prefix) for s in symbols), f"no lowered kernel for {expr} ({prefix!r})"


@pytest.mark.parametrize("dtype", list(CUDA_TYPES))
@pytest.mark.parametrize("arch", ARCHS)
def test_instantiations_compile(compiled, arch, dtype):
    """The representative set (every instantiation with CUPY_RMSNORM_COMPILE_ALL=1)."""
    for i, chunk in enumerate(_chunks(instantiations(dtype))):
        _check_batch(compiled[(arch, dtype, i)], chunk)


def test_the_default_set_is_representative():
    """Every (op, vector width, plan kind, edges) is in it, every (op, vector width, plan
    kind) with both weight types, and nothing the launcher does not make."""
    for dtype in CUDA_TYPES:
        choices = representative_choices(dtype)
        ops_vecs_kinds = [(f, v, k) for f in (False, True) for v in VECS[dtype] for k in PLAN_KINDS]
        assert {(f, p.vec, plan_kind(p), p.edges) for f, _, p in choices} == \
            {key + (e,) for key in ops_vecs_kinds for e in (True, False)}
        assert {(f, p.vec, plan_kind(p), CUDA_TYPES[w]) for f, w, p in choices} == \
            {key + (CUDA_TYPES[w],) for key in ops_vecs_kinds for w in (dtype, "float32")}
        assert set(_pairs(dtype, choices)) <= set(every_instantiation(dtype))


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


def _register_variants(dtype):
    """Per op, edges, vectors per thread and plan kind, the register plan with the most
    threads per row at full width (the plan kinds share their code; the group size changes
    little else), with a float32 weight and with x's dtype."""
    best = {}
    for fused in (False, True):
        for plan in _plans(dtype, fused).values():
            if plan.variant != "registers" or plan.vec != max(VECS[dtype]):
                continue
            key = (fused, plan.edges, plan.vecs_per_thread, plan_kind(plan))
            if key not in best or plan.threads_per_row > best[key].threads_per_row:
                best[key] = plan
    return sorted({instantiation_name(dtype, w, key[0], p) for key, p in best.items() for w in ("float32", dtype)})


def test_register_variants_do_not_spill():
    """ptxas -v at the library's own options (sm_90): no spill stores in the register variants
    (the row kept in registers must stay there)."""
    def spills(dtype):
        names = _register_variants(dtype)
        log = []
        _compile.compile_offline(names, "sm_90", "forward", ("-Xptxas=-v",), log)
        found = re.findall(r"Compiling entry function '(\w+)'.*?(\d+) bytes spill stores", log[0].replace("\0", ""), re.S)
        assert len(found) == len(names)
        return [f for f in found if f[1] != "0"]

    with concurrent.futures.ThreadPoolExecutor(len(CUDA_TYPES)) as pool:
        for dtype, bad in zip(CUDA_TYPES, pool.map(spills, CUDA_TYPES)):
            assert not bad, (dtype, bad)


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
