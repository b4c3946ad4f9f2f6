"""Kernel instantiations the launcher can produce compile with NVRTC, without a GPU.

CuPy's own compile path asks the device for its architecture; ``compile_offline`` goes
through CuPy's low-level NVRTC binding with an explicit ``-arch`` and the CUDA headers of
the ``nvidia-cuda-runtime-cu12`` wheel, so this runs on CPU-only CI (which installs
``nvidia-cuda-runtime-cu12`` and ``nvidia-cuda-nvrtc-cu12``). Without CuPy, NVRTC or the
headers the tests skip and say why; so does each architecture of ``helpers.COMPILE_ARCHS``
(sm_80, sm_90, sm_100, sm_120) that the installed NVRTC cannot compile for.

What is compiled: by default, for sm_90, a representative set: every storage dtype, op
(fused or not), vector width, plan kind (warp group, block, streamed block, cluster,
streamed cluster) and edges true / false, with each (op, vector width, plan kind) compiled
with both weight types (x's dtype and float32) - 220 instantiations; for sm_80, sm_100 and
sm_120 a cross-section of it: per dtype one instantiation of each (op, plan kind, edges),
the vector widths taken by turns (60 each, every vector width on each). The heaviest
instantiation of each variant compiles with exactly the library's own options for every
architecture (every dtype on sm_90, one by turns on the others), and the register variants
go through ptxas -v at sm_90 (no spills; the 16-bit dtypes and the weight types by turns).
``CUPY_RMSNORM_COMPILE_ALL=1`` compiles every distinct instantiation the launcher can make
(about 2,300) for every architecture, the heaviest of every dtype for every architecture
with the library's options, and every register variant of every dtype with both weight
types for the spill check.

Cost: NVRTC takes ~0.1-0.3 s per program, then per instantiation ~0.3 s with the library's
options or ~0.1 s with ``--Ofast-compile=max`` (NVRTC >= 12.8: the same front end,
template instantiation and ptxas, fewer optimizations), three quarters of it in ptxas.
So the sets compile in fast mode, many instantiations to a program, programs in parallel
threads (NVRTC releases the GIL; ``helpers.compile_program``), started when the run starts
(tests/cpu/conftest.py) so that they overlap the other tests.
"""

import functools

import pytest
from helpers import (COMPILE_ALL, COMPILE_ARCHS, FULL_ARCH, HIDDEN_SIZES, ITEMSIZE, MANGLED, MAX_CLUSTER, PLAN_KINDS,
                     ROWS, SMS, VECS, arch_missing, arch_params, by_turns, check_symbols, chunks, compile_program,
                     heaviest_dtypes, nvrtc_archs, nvrtc_missing, nvrtc_version, plan_kind, ptxas_entries,
                     spill_turns, template_ints)

from cupy_rmsnorm import _compile, launch_plan
from cupy_rmsnorm._abi import CUDA_TYPES, instantiation_name

KERNEL_NAME = rb"_ZN7rmsnorm\d+rms_norm_\w+"
BATCH = 40   # instantiations per NVRTC program at most: programs of a few seconds, even work for the threads

pytestmark = pytest.mark.skipif(nvrtc_missing() is not None, reason=f"NVRTC compile test: {nvrtc_missing()}")


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


@functools.cache
def cross_section_choices(dtype, arch):
    """The cross-section of the representative set for an architecture other than FULL_ARCH:
    per op, plan kind and edges value one choice, the vector widths by turns (another turn
    for each architecture); the weight types follow (float32 where edges == fused)."""
    return by_turns(representative_choices(dtype), lambda c: (c[0], plan_kind(c[2]), c[2].edges),
                    COMPILE_ARCHS.index(arch))


def instantiations(dtype, arch=FULL_ARCH):
    """What this run compiles for one storage dtype and architecture: every instantiation
    with CUPY_RMSNORM_COMPILE_ALL=1, else the representative set (FULL_ARCH) or its
    cross-section."""
    if COMPILE_ALL:
        return every_instantiation(dtype)
    if arch == FULL_ARCH:
        return _pairs(dtype, representative_choices(dtype))
    return _pairs(dtype, cross_section_choices(dtype, arch))


def _mangled_prefix(dtype, weight, fused, plan):
    """The start of the symbol NVRTC must emit for one instantiation (its template arguments)."""
    kernel = instantiation_name(dtype, weight, fused, plan).split("<")[0].split("::")[-1]
    t, w = CUDA_TYPES[dtype], CUDA_TYPES[weight or dtype]
    w_code = MANGLED[w] if (w == "float" or w != t) else "S1_"   # S1_: substitution, W == T
    ints = template_ints(plan.template_args())
    return f"_ZN7rmsnorm{len(kernel)}{kernel}I{MANGLED[t]}{w_code}Lb{int(fused)}E{ints}".encode()   # then the defaulted types R, O


# -- the programs, one list for the tests and for the run's start (tests/cpu/conftest.py) ------

def _instantiation_programs(arch, dtype):
    """[(pairs, program kwargs)]: this run's instantiations in programs of up to BATCH."""
    return [(chunk, dict(names=[e for e, _ in chunk], arch=arch))
            for chunk in chunks(instantiations(dtype, arch), BATCH)]


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


def _heaviest_program(arch, dtype):
    return dict(names=[e for e, _ in _heaviest_per_variant(dtype)], arch=arch, fast=False)


@functools.cache
def _register_variant_plans(dtype):
    """Per op, edges, vectors per thread and plan kind, the register plan with the most
    threads per row at full width (the plan kinds share their code; the group size changes
    little else): [(fused, plan)], sorted."""
    best = {}
    for fused in (False, True):
        for plan in _plans(dtype, fused).values():
            if plan.variant != "registers" or plan.vec != max(VECS[dtype]):
                continue
            key = (fused, plan.edges, plan.vecs_per_thread, plan_kind(plan))
            if key not in best or plan.threads_per_row > best[key].threads_per_row:
                best[key] = plan
    return [(key[0], best[key]) for key in sorted(best, key=repr)]


@functools.cache
def _register_variants(dtype):
    """The spill check's instantiations: the register variant plans with a float32 weight and
    with x's dtype (helpers.spill_turns: by default the 16-bit dtypes and the weight types by
    turns)."""
    plans = _register_variant_plans(dtype)
    return sorted({instantiation_name(dtype, w, *plans[i]) for i, weights in spill_turns(dtype, len(plans))
                   for w in weights})


SPILL_BATCH = 12


def _spill_programs(dtype):
    """ptxas -v at the library's own options (sm_90)."""
    return [dict(names=chunk, arch="sm_90", fast=False, extra_options=("-Xptxas=-v",))
            for chunk in chunks(_register_variants(dtype), SPILL_BATCH)]


def compile_jobs():
    """[(test function, its parameters, program)]: every program this module's tests compile
    (for tests/cpu/conftest.py to start those of the selected tests early)."""
    if nvrtc_missing():
        return []
    jobs = []
    for arch in COMPILE_ARCHS:
        if arch_missing(arch):
            continue
        for dtype in CUDA_TYPES:
            jobs += [("test_instantiations_compile", dict(arch=arch, dtype=dtype), kwargs)
                     for _, kwargs in _instantiation_programs(arch, dtype)]
            if dtype in heaviest_dtypes(arch):
                jobs.append(("test_heaviest_instantiations_compile_with_library_options", dict(arch=arch),
                             _heaviest_program(arch, dtype)))
    if not arch_missing("sm_90"):
        jobs += [("test_register_variants_do_not_spill", {}, kwargs) for dtype in CUDA_TYPES
                 for kwargs in _spill_programs(dtype)]
    return jobs


# -- the tests -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", list(CUDA_TYPES))
@pytest.mark.parametrize("arch", arch_params())
def test_instantiations_compile(arch, dtype):
    """The representative set on sm_90, a cross-section of it on the other architectures
    (every instantiation everywhere with CUPY_RMSNORM_COMPILE_ALL=1)."""
    programs = _instantiation_programs(arch, dtype)
    futures = [compile_program(**kwargs) for _, kwargs in programs]
    for (pairs, _), future in zip(programs, futures):
        check_symbols(future.result().get(), pairs, KERNEL_NAME)


def test_the_default_set_is_representative():
    """Every (op, vector width, plan kind, edges) is in it, every (op, vector width, plan
    kind) with both weight types, and nothing the launcher does not make; each cross-section
    has every (op, plan kind, edges), both weight types and every vector width."""
    for dtype in CUDA_TYPES:
        choices = representative_choices(dtype)
        ops_vecs_kinds = [(f, v, k) for f in (False, True) for v in VECS[dtype] for k in PLAN_KINDS]
        assert {(f, p.vec, plan_kind(p), p.edges) for f, _, p in choices} == \
            {key + (e,) for key in ops_vecs_kinds for e in (True, False)}
        assert {(f, p.vec, plan_kind(p), CUDA_TYPES[w]) for f, w, p in choices} == \
            {key + (CUDA_TYPES[w],) for key in ops_vecs_kinds for w in (dtype, "float32")}
        assert set(_pairs(dtype, choices)) <= set(every_instantiation(dtype))
        others = [a for a in COMPILE_ARCHS if a != FULL_ARCH]
        for arch in others:
            section = cross_section_choices(dtype, arch)
            assert sorted((f, plan_kind(p), p.edges) for f, _, p in section) == \
                sorted((f, k, e) for f in (False, True) for k in PLAN_KINDS for e in (True, False))
            assert {CUDA_TYPES[w] for _, w, _ in section} == {CUDA_TYPES[dtype], "float"}
            assert {p.vec for _, _, p in section} == set(VECS[dtype])
            assert all(c in choices for c in section)


@pytest.mark.parametrize("arch", arch_params())
def test_heaviest_instantiations_compile_with_library_options(arch):
    """The same NVRTC options the library uses at run time (no fast-compile mode): every
    dtype on sm_90, one dtype by turns on the other architectures."""
    dtypes = heaviest_dtypes(arch)
    futures = {d: compile_program(**_heaviest_program(arch, d)) for d in dtypes}
    for d in dtypes:
        pairs = _heaviest_per_variant(d)
        variants = {(p.variant, f) for f in (False, True) for p in _plans(d, f).values()}
        assert len(pairs) == len(variants) >= 4     # registers and stream, fused and not
        check_symbols(futures[d].result().get(), pairs, KERNEL_NAME)


def test_every_dtype_compiles_with_library_options_somewhere_else_too():
    others = [a for a in COMPILE_ARCHS if a != FULL_ARCH]
    assert {d for a in others for d in heaviest_dtypes(a)} == set(CUDA_TYPES)
    assert all(len(heaviest_dtypes(a)) == (len(CUDA_TYPES) if COMPILE_ALL else 1) for a in others)


@pytest.mark.skipif(arch_missing("sm_90") is not None, reason=f"NVRTC compile test (sm_90): {arch_missing('sm_90')}")
def test_register_variants_do_not_spill():
    """ptxas -v at the library's own options (sm_90): no spill stores in the register variants
    (the row kept in registers must stay there)."""
    futures = {dtype: [compile_program(**kwargs) for kwargs in _spill_programs(dtype)] for dtype in CUDA_TYPES}
    for dtype in CUDA_TYPES:
        names = _register_variants(dtype)
        found = []
        for future in futures[dtype]:
            result = future.result()
            result.get()
            found += ptxas_entries(result.log)
        assert len(found) == len(names)
        bad = [f for f in found if f[1] != "0"]
        assert not bad, (dtype, bad)


def test_the_spill_check_takes_every_register_variant():
    """The spill check's set: every register variant plan, for float32 and for float16 or
    bfloat16 (the same plans), with both weight types over the set."""
    def plan_of(name):                                   # fused and the template arguments
        return name.split(", ", 2)[2]

    for dtype in CUDA_TYPES:
        assert {n.split(", ")[1] for n in _register_variants(dtype)} == {CUDA_TYPES[dtype], "float"}, dtype
    every = {plan_of(instantiation_name("float16", None, f, p)) for f, p in _register_variant_plans("float16")}
    assert {plan_of(instantiation_name("float16", None, f, p)) for f, p in _register_variant_plans("bfloat16")} == every
    assert {plan_of(n) for d in ("float16", "bfloat16") for n in _register_variants(d)} == every
    every32 = {plan_of(instantiation_name("float32", None, f, p)) for f, p in _register_variant_plans("float32")}
    assert {plan_of(n) for n in _register_variants("float32")} == every32 and len(every32) >= 12


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


@pytest.mark.skipif(arch_missing("sm_90") is not None, reason=f"NVRTC compile test (sm_90): {arch_missing('sm_90')}")
def test_a_broken_expression_fails_loudly():
    with pytest.raises(RuntimeError, match="NVRTC failed for sm_90"):
        _compile.compile_offline(["rmsnorm::no_such_kernel<float>"], "sm_90")


def test_nvrtc_compiles_for_the_architectures_users_have():
    """NVRTC 12.8+ (what the cuda12 extra installs) compiles for Ampere, Hopper and both
    Blackwells; an older one skips those it lacks (with the reason) above."""
    if nvrtc_version() < (12, 8):
        pytest.skip(f"NVRTC {nvrtc_version()} predates sm_100 / sm_120")
    assert [a for a in COMPILE_ARCHS if arch_missing(a)] == [], {a: arch_missing(a) for a in COMPILE_ARCHS}
    archs = nvrtc_archs()
    assert archs is None or {80, 90, 100, 120} <= set(archs)

