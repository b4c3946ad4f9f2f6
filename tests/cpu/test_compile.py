"""Kernel instantiations the launcher can produce compile with NVRTC, without a GPU.

CuPy's own compile path asks the device for its architecture; ``compile_offline`` goes
through CuPy's low-level NVRTC binding with an explicit ``-arch`` and the CUDA headers of
the ``nvidia-cuda-runtime-cu12`` wheel, so this runs on CPU-only CI (which installs
``nvidia-cuda-runtime-cu12`` and ``nvidia-cuda-nvrtc-cu12``). Without CuPy, NVRTC or the
headers the tests skip and say why; so does each architecture of ``helpers.COMPILE_ARCHS``
(sm_80, sm_90, sm_100, sm_120) that the installed NVRTC cannot compile for.

What is compiled: by default, for sm_90, a representative set: every op (fused or not),
vector width, plan kind (warp group, block, streamed block, cluster, streamed cluster) and
edges true / false, with each (op, vector width, plan kind) compiled with both weight types
(x's dtype and float32). float32 compiles all of it (60 instantiations); float16 and
bfloat16, the same templates and plans with other conversions, split the 16-bit set (80)
between them (helpers.sixteen_bit_share: each takes one edges value of each (op, vector
width, plan kind), by turns): 140 in all. For sm_80, sm_100 and sm_120 a cross-section of
it, one storage dtype on each (helpers.arch_dtypes: each dtype on one of them): one
instantiation of each (op, plan kind, edges), the vector widths by turns (20 each, every
vector width on each). The heaviest instantiation of each variant compiles with exactly the
library's own options for every architecture (every dtype on sm_90, one by turns on the
others, not the cross-section's). The register variants with edges go through ptxas -v at
sm_90 (no spills; without edges the kernels run the same code less the head and tail, under
the same launch bounds), each dtype and the weight types taking the plans by turns: float16
and bfloat16 share them, and float32 needs no more registers than they do at each (a 16-byte
vector holds half the values; measured). ``CUPY_RMSNORM_COMPILE_ALL=1`` compiles every
distinct instantiation the launcher can make (about 2,300) for every dtype and architecture,
the heaviest of every dtype for every architecture with the library's options, and every
register variant of every dtype with both weight types for the spill check.

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
                     ROWS, SIXTEEN_BIT, SMS, VECS, arch_dtype_params, arch_dtypes, arch_missing, arch_params, by_turns,
                     check_symbols, chunks, compile_program, nvrtc_archs, nvrtc_missing, nvrtc_version, plan_kind,
                     ptxas_entries, sixteen_bit_share, spill_turns, template_ints)

from cupy_rmsnorm import _compile, launch_plan
from cupy_rmsnorm._abi import CUDA_TYPES
from cupy_rmsnorm.ops.forward.launch import instantiation_name

KERNEL_NAME = rb"_ZN7rmsnorm\d+rms_norm_\w+"
BATCH = 40   # instantiations per NVRTC program at most: programs of a few seconds, even work for the threads
# the cross-sections' dtypes (helpers.arch_dtypes): the one after the heaviest instantiations'
# on each architecture, so that each compiles two dtypes there
CROSS_SECTION_TURN = 1

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
    true and false and between the ops. sm_90 compiles dtype_choices(dtype) of it."""
    choices = []
    for fused in (False, True):
        groups = {}
        for plan in sorted(_plans(dtype, fused).values(), key=lambda p: p.template_args()):
            groups.setdefault((plan.vec, plan_kind(plan), plan.edges), []).append(plan)
        for i, key in enumerate(sorted(groups)):
            edges = key[2]
            choices.append((fused, "float32" if edges == fused else dtype, groups[key][i % len(groups[key])]))
    return choices


def _op_vec_kind(choice):
    fused, _, plan = choice
    return fused, plan.vec, plan_kind(plan)


@functools.cache
def dtype_choices(dtype):
    """The representative set's choices sm_90 compiles for ``dtype``: all for float32; float16
    and bfloat16 split them, each taking one edges value (and so one weight type) of each
    (op, vector width, plan kind), by turns (helpers.sixteen_bit_share)."""
    return sixteen_bit_share(dtype, representative_choices(dtype), _op_vec_kind)


@functools.cache
def cross_section_choices(dtype, arch):
    """The cross-section of the dtype's choices for an architecture other than FULL_ARCH: per
    op, plan kind and edges value one choice, the vector widths by turns (another turn for
    each architecture); the weight types follow (float32 where edges == fused)."""
    return by_turns(dtype_choices(dtype), lambda c: (c[0], plan_kind(c[2]), c[2].edges), COMPILE_ARCHS.index(arch))


def instantiations(dtype, arch=FULL_ARCH):
    """What this run compiles for one storage dtype and architecture: every instantiation
    with CUPY_RMSNORM_COMPILE_ALL=1, else the dtype's part of the representative set
    (FULL_ARCH) or its cross-section."""
    if COMPILE_ALL:
        return every_instantiation(dtype)
    if arch == FULL_ARCH:
        return _pairs(dtype, dtype_choices(dtype))
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


def _heaviest_program(arch):
    """The heaviest of arch_dtypes(arch), in one program."""
    return dict(names=[e for d in arch_dtypes(arch) for e, _ in _heaviest_per_variant(d)], arch=arch, fast=False)


@functools.cache
def _register_variant_plans(dtype):
    """Per op, vectors per thread and plan kind, the register plan with edges with the most
    threads per row at full width (the plan kinds share their code; the group size changes
    little else): [(fused, plan)], sorted. Without edges (CUPY_RMSNORM_COMPILE_ALL=1 takes
    those too) the kernels run the same code less the head and tail (kernels/rms_norm.cu's
    EDGES) under the same launch bounds: fewer registers (at sm_90 26-48 against 32-69)."""
    best = {}
    for fused in (False, True):
        for plan in _plans(dtype, fused).values():
            if plan.variant != "registers" or plan.vec != max(VECS[dtype]) or not (plan.edges or COMPILE_ALL):
                continue
            key = (fused, plan.edges, plan.vecs_per_thread, plan_kind(plan))
            if key not in best or plan.threads_per_row > best[key].threads_per_row:
                best[key] = plan
    return [(key[0], best[key]) for key in sorted(best, key=repr)]


@functools.cache
def _register_variants(dtype):
    """The spill check's instantiations: the register variant plans with a float32 weight and
    with x's dtype (helpers.spill_turns: by default every dtype and the weight types by turns,
    float32 too: at each plan it needs no more registers than float16 and bfloat16, measured
    at sm_90 for every plan and weight type)."""
    plans = _register_variant_plans(dtype)
    return sorted({instantiation_name(dtype, w, *plans[i])
                   for i, weights in spill_turns(dtype, len(plans), float32_by_turns=True) for w in weights})


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
        jobs += [("test_instantiations_compile", dict(arch=arch, dtype=dtype), kwargs)
                 for dtype in arch_dtypes(arch, CROSS_SECTION_TURN)
                 for _, kwargs in _instantiation_programs(arch, dtype)]
        jobs.append(("test_heaviest_instantiations_compile_with_library_options", dict(arch=arch),
                     _heaviest_program(arch)))
    if not arch_missing("sm_90"):
        jobs += [("test_register_variants_do_not_spill", {}, kwargs) for dtype in CUDA_TYPES
                 for kwargs in _spill_programs(dtype)]
    return jobs


# -- the tests -----------------------------------------------------------------------------------

@pytest.mark.parametrize("arch,dtype", arch_dtype_params(CROSS_SECTION_TURN))
def test_instantiations_compile(arch, dtype):
    """The representative set on sm_90 (float16 and bfloat16 splitting theirs), a
    cross-section of it on the other architectures, one dtype each (every instantiation of
    every dtype everywhere with CUPY_RMSNORM_COMPILE_ALL=1)."""
    programs = _instantiation_programs(arch, dtype)
    futures = [compile_program(**kwargs) for _, kwargs in programs]
    for (pairs, _), future in zip(programs, futures):
        check_symbols(future.result().get(), pairs, KERNEL_NAME)


def test_the_default_set_is_representative():
    """Every (op, vector width, plan kind, edges) is in it, every (op, vector width, plan
    kind) with both weight types, and nothing the launcher does not make: float32's part
    alone, float16's and bfloat16's together (the same plans; each alone has every (op,
    vector width, plan kind)). Each cross-section has every (op, plan kind, edges), both
    weight types and every vector width; each architecture but sm_90 compiles one dtype,
    each dtype on one of them."""
    def weight_kind(dtype, weight):             # float32's two are one
        return "x's dtype" if weight == dtype else "float32"

    every = {}
    for dtype in CUDA_TYPES:
        choices = representative_choices(dtype)
        ops_vecs_kinds = [(f, v, k) for f in (False, True) for v in VECS[dtype] for k in PLAN_KINDS]
        every[dtype] = ({key + (e,) for key in ops_vecs_kinds for e in (True, False)},
                        {key + (weight_kind(dtype, w),) for key in ops_vecs_kinds for w in (dtype, "float32")})
        assert {(f, p.vec, plan_kind(p), p.edges) for f, _, p in choices} == every[dtype][0]
        assert {(f, p.vec, plan_kind(p), weight_kind(dtype, w)) for f, w, p in choices} == every[dtype][1]
        share = dtype_choices(dtype)
        assert all(c in choices for c in share)
        assert {_op_vec_kind(c) for c in share} == set(ops_vecs_kinds)
        assert len(share) == (len(choices) if COMPILE_ALL or dtype == "float32" else len(choices) // 2)
        assert set(_pairs(dtype, share)) <= set(every_instantiation(dtype))
    assert every["float16"] == every["bfloat16"]
    sixteen = [(d, c) for d in SIXTEEN_BIT for c in dtype_choices(d)]
    assert {(f, p.vec, plan_kind(p), p.edges) for _, (f, _, p) in sixteen} == every["float16"][0]
    assert {(f, p.vec, plan_kind(p), weight_kind(d, w)) for d, (f, w, p) in sixteen} == every["float16"][1]
    others = [a for a in COMPILE_ARCHS if a != FULL_ARCH]
    compiled = [(a, d) for a in others for d in arch_dtypes(a, CROSS_SECTION_TURN)]
    assert {d for _, d in compiled} == set(CUDA_TYPES)
    assert len(compiled) == len(others) * (len(CUDA_TYPES) if COMPILE_ALL else 1)
    for arch, dtype in compiled:
        section = cross_section_choices(dtype, arch)
        assert sorted((f, plan_kind(p), p.edges) for f, _, p in section) == \
            sorted((f, k, e) for f in (False, True) for k in PLAN_KINDS for e in (True, False))
        assert {CUDA_TYPES[w] for _, w, _ in section} == {CUDA_TYPES[dtype], "float"}
        assert {p.vec for _, _, p in section} == set(VECS[dtype])
        assert all(c in dtype_choices(dtype) for c in section)


@pytest.mark.parametrize("arch", arch_params())
def test_heaviest_instantiations_compile_with_library_options(arch):
    """The same NVRTC options the library uses at run time (no fast-compile mode): every
    dtype on sm_90, one dtype by turns on the other architectures."""
    future = compile_program(**_heaviest_program(arch))
    pairs = []
    for d in arch_dtypes(arch):
        pairs += _heaviest_per_variant(d)
        variants = {(p.variant, f) for f in (False, True) for p in _plans(d, f).values()}
        assert len(_heaviest_per_variant(d)) == len(variants) >= 4     # registers and stream, fused and not
    check_symbols(future.result().get(), pairs, KERNEL_NAME)


def test_every_dtype_compiles_with_library_options_somewhere_else_too():
    """Each dtype's heaviest on one architecture but sm_90, another dtype's cross-section there."""
    others = [a for a in COMPILE_ARCHS if a != FULL_ARCH]
    assert {d for a in others for d in arch_dtypes(a)} == set(CUDA_TYPES)
    assert all(len(arch_dtypes(a)) == (len(CUDA_TYPES) if COMPILE_ALL else 1) for a in others)
    assert COMPILE_ALL or all(arch_dtypes(a) != arch_dtypes(a, CROSS_SECTION_TURN) for a in others)


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
    """The spill check's set: every register variant plan with edges for float16 or bfloat16
    (the same plans), half of them for float32 (the same geometries), with both weight types
    over the set; each plan without edges has one with edges there, alike but for edges and
    of at least its threads per row."""
    def plan_of(name):                                   # fused and the template arguments
        return name.split(", ", 2)[2]

    for dtype in CUDA_TYPES:
        checked = {(f, p.vecs_per_thread, plan_kind(p)): p.threads_per_row
                   for f, p in _register_variant_plans(dtype) if p.edges}
        assert COMPILE_ALL or all(p.edges for _, p in _register_variant_plans(dtype))
        for fused in (False, True):
            for p in _plans(dtype, fused).values():
                if p.variant == "registers" and p.vec == max(VECS[dtype]) and not p.edges:
                    assert checked[(fused, p.vecs_per_thread, plan_kind(p))] >= p.threads_per_row, p

    for dtype in CUDA_TYPES:
        assert {n.split(", ")[1] for n in _register_variants(dtype)} == {CUDA_TYPES[dtype], "float"}, dtype
    every = {plan_of(instantiation_name("float16", None, f, p)) for f, p in _register_variant_plans("float16")}
    assert {plan_of(instantiation_name("float16", None, f, p)) for f, p in _register_variant_plans("bfloat16")} == every
    assert {plan_of(n) for d in ("float16", "bfloat16") for n in _register_variants(d)} == every
    # float32 by turns: its plans are the 16-bit dtypes' (vectors of 16 bytes), half of them
    def geometry(plan):
        return (plan.threads_per_row, plan.vecs_per_thread, plan.edges, plan.cluster)

    assert [(f, geometry(p)) for f, p in _register_variant_plans("float32")] == \
        [(f, geometry(p)) for f, p in _register_variant_plans("float16")]
    every32 = {plan_of(instantiation_name("float32", None, f, p)) for f, p in _register_variant_plans("float32")}
    taken32 = {plan_of(n) for n in _register_variants("float32")}
    assert taken32 <= every32 and len(every32) >= 12
    assert len(taken32) == (len(every32) if COMPILE_ALL else len(every32) // 2)


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

