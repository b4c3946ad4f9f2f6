"""The backward kernels' instantiations compile with NVRTC, without a GPU (see test_compile.py).

By default, for sm_90, a representative set: per storage dtype, every geometry backward_plan
makes (warp groups of 8..32 threads with one or two vectors, blocks of 128..1024 threads, the
streamed block) at full vector width with edges, and a sample at the narrower widths and
without edges, with weights of x's dtype and float32 (float16 and bfloat16, the same plans,
split the weight types: each takes every plan with one of them, by turns,
helpers.sixteen_bit_share; 39 in all); for sm_80, sm_100 and sm_120 a cross-section of it,
one storage dtype on each (helpers.arch_dtypes: each dtype on one of them): one of each
(group kind, edges), the weight types by turns; all in fast mode. The three dweight
reductions compile everywhere, and the heaviest plan of each variant (registers, stream,
row) with the library's own options for every architecture (every dtype on sm_90, one by
turns on the others, not the cross-section's). ``CUPY_RMSNORM_COMPILE_ALL=1`` compiles every
instantiation the launcher can make, for every dtype and architecture.
The register, staged and row variants are also compiled with ptxas -v at the library's
options (sm_90): they must not spill (the plan's geometry was chosen for that). float16 and
bfloat16, which have the same plans, take them by turns; float32 takes every one, but the
staged ones by turns too (it needs fewer registers than they do there); of the block-wide
plans alike but for their size, under one register cap, the largest block stands for the
others (the same code a thread). The staged and row ones compile for another architecture
too (fast mode, a cross-section, one dtype each). On sm_90 the heaviest instantiations that
a spill check compiles (the same options) are compiled there only.
"""

import functools
import re

import pytest
from helpers import (COMPILE_ALL, COMPILE_ARCHS, FULL_ARCH, ITEMSIZE, MANGLED, SIXTEEN_BIT, SMS, VECS,
                     arch_dtype_params, arch_dtypes, arch_missing, arch_params, by_turns, check_symbols, chunks,
                     compile_program, library_options_programs, nvrtc_missing, ptxas_entries, sixteen_bit_share,
                     spill_turns, template_ints)

from cupy_rmsnorm import backward_plan
from cupy_rmsnorm._abi import ADD_GRAD, CUDA_TYPES, DIRECT_WEIGHT, HAS_WEIGHT, LLAMA, WEIGHT_GRAD, reduce_instantiation_name, row_kernel_flags
from cupy_rmsnorm.ops.backward.launch import backward_instantiation_name

pytestmark = pytest.mark.skipif(nvrtc_missing() is not None, reason=f"NVRTC compile test: {nvrtc_missing()}")
requires_sm_90 = pytest.mark.skipif(arch_missing("sm_90") is not None,
                                    reason=f"NVRTC compile test (sm_90): {arch_missing('sm_90')}")

# vectors per row at each boundary of backward_geometry, times each vec
VECTOR_COUNTS = (1, 8, 9, 16, 17, 32, 33, 64, 65, 128, 129, 256, 257, 512, 513, 1024, 1025, 5000)
KERNEL_SYMBOL = rb"_ZN7rmsnorm\d+rms_norm_backward\w+"
BATCH = 16          # instantiations per program (a backward instantiation costs about twice a forward one)
SPILL_BATCH = 8
# the cross-sections' dtypes on the architectures but sm_90 (helpers.arch_dtypes): not the
# heaviest instantiations' (turn 0) there
CROSS_SECTION_TURN = 1


@functools.cache
def backward_plans(dtype, rows=4096):
    """Every distinct backward plan (template arguments) of ``rows`` rows for VECTOR_COUNTS."""
    plans = {}
    for vec in VECS[dtype]:
        for n in VECTOR_COUNTS:
            for hidden in (n * vec, n * vec + 1):
                for edges in ((True, False) if hidden % vec == 0 else (True,)):
                    p = backward_plan(rows, hidden, ITEMSIZE[dtype], vec, SMS, edges=edges)
                    plans.setdefault((p.variant, p.template_args()), p)
    return plans


def _mangled(dtype, weight, plan):
    t, w = CUDA_TYPES[dtype], CUDA_TYPES[weight]
    w_code = MANGLED[w] if (w == "float" or w != t) else "S1_"
    return f"_ZN7rmsnorm24rms_norm_backward_kernelI{MANGLED[t]}{w_code}{template_ints(plan.template_args())}".encode()   # then the defaulted type N


def group_kind(plan):
    """warp group, block or stream (the code paths of rms_norm_backward_kernel)."""
    return "stream" if plan.vecs_per_thread == 0 else "warp group" if plan.threads_per_row <= 32 else "block"


@functools.cache
def representative_plans(dtype):
    """The representative set's plans (every plan with CUPY_RMSNORM_COMPILE_ALL=1)."""
    plans = list(backward_plans(dtype).values())
    if not COMPILE_ALL:
        widest = max(VECS[dtype])
        geometries = {}
        for p in plans:                    # every geometry at full width, with edges
            if p.vec == widest and p.edges:
                geometries[(p.threads_per_row, p.vecs_per_thread)] = p
        narrow = [p for p in plans if p.vec == 1 and p.edges] + [p for p in plans if not p.edges][:3]
        plans = list(geometries.values()) + narrow[::3]
    return plans


@functools.cache
def representative_choices(dtype):
    """[(plan, weight)] of the representative set: every plan with weights of x's dtype and
    float32 (one weight type a plan for float16 and bfloat16, which split them: each plan's
    two weights go one to each, by turns)."""
    choices = [(p, weight) for p in representative_plans(dtype) for weight in dict.fromkeys((dtype, "float32"))]
    return sixteen_bit_share(dtype, choices, lambda c: (c[0].variant, c[0].template_args()))


@functools.cache
def cross_section_choices(dtype, arch):
    """For an architecture other than FULL_ARCH: per group kind and edges value one choice of
    the representative set, the geometries and weight types by turns (another turn per
    architecture)."""
    return by_turns(representative_choices(dtype), lambda c: (group_kind(c[0]), c[0].edges),
                    COMPILE_ARCHS.index(arch))


def _pairs(dtype, choices):
    return sorted({(backward_instantiation_name(dtype, w, p), _mangled(dtype, w, p)) for p, w in choices})


@functools.cache
def instantiations(dtype, arch=FULL_ARCH):
    """(name expression, mangled prefix) pairs to compile for one storage dtype and architecture."""
    if COMPILE_ALL or arch == FULL_ARCH:
        return _pairs(dtype, representative_choices(dtype))
    return _pairs(dtype, cross_section_choices(dtype, arch))


def _reductions():
    return sorted((reduce_instantiation_name(w),
                   f"_ZN7rmsnorm31rms_norm_backward_reduce_kernelI{MANGLED[c]}EE".encode())
                  for w, c in CUDA_TYPES.items())


def _instantiation_programs(arch, dtype):
    """[(pairs, program kwargs)] in fast mode (the library's options: the heaviest and the
    spill checks below)."""
    return [(chunk, dict(names=[e for e, _ in chunk], arch=arch, program="backward"))
            for chunk in chunks(instantiations(dtype, arch), BATCH)]


def _reduction_program(arch):
    return dict(names=[e for e, _ in _reductions()], arch=arch, program="backward", fast=False)


@pytest.mark.parametrize("arch,dtype", arch_dtype_params(CROSS_SECTION_TURN))
def test_backward_instantiations_compile(arch, dtype):
    """The representative set on sm_90, a cross-section of it on the other architectures, one
    dtype each."""
    programs = _instantiation_programs(arch, dtype)
    futures = [compile_program(**kwargs) for _, kwargs in programs]
    for (pairs, _), future in zip(programs, futures):
        check_symbols(future.result().get(), pairs, KERNEL_SYMBOL)


@pytest.mark.parametrize("arch", arch_params())
def test_reductions_compile(arch):
    check_symbols(compile_program(**_reduction_program(arch)).result().get(), _reductions(), KERNEL_SYMBOL)


def test_cross_sections_are_representative():
    """Each architecture but sm_90 compiles one storage dtype, each dtype on one of them; its
    cross-section has every (group kind, edges value) the representative set has and both
    weight types; and nothing the representative set lacks."""
    others = [a for a in COMPILE_ARCHS if a != FULL_ARCH]
    compiled = [(a, d) for a in others for d in arch_dtypes(a, CROSS_SECTION_TURN)]
    assert {d for _, d in compiled} == set(CUDA_TYPES)
    assert len(compiled) == len(others) * (len(CUDA_TYPES) if COMPILE_ALL else 1)
    assert COMPILE_ALL or all(arch_dtypes(a) != arch_dtypes(a, CROSS_SECTION_TURN) for a in others)
    for arch, dtype in compiled:
        full = {(group_kind(p), p.edges) for p, _ in representative_choices(dtype)}
        assert {k for k, _ in full} == {"warp group", "block", "stream"} and {e for _, e in full} == {True, False}
        section = cross_section_choices(dtype, arch)
        assert sorted((group_kind(p), p.edges) for p, _ in section) == sorted(full)
        assert {CUDA_TYPES[w] for _, w in section} == {CUDA_TYPES[dtype], "float"}
        assert set(_pairs(dtype, section)) <= set(instantiations(dtype))


def test_float16_and_bfloat16_split_the_weight_types():
    """Each 16-bit dtype compiles every representative plan with one weight type, both weight
    types over the plans; the two together every plan with both."""
    def args(name):                   # the weight (x's dtype or float32) and the template arguments after it
        t, w, rest = name[:-1].split("<")[1].split(", ", 2)
        return ("x's dtype" if w == t else w), rest

    assert [p.template_args() for p in representative_plans("float16")] == \
        [p.template_args() for p in representative_plans("bfloat16")]
    every = {(w, ", ".join(map(str, p.template_args())))
             for p in representative_plans("float16") for w in ("x's dtype", "float")}
    assert {args(e) for d in SIXTEEN_BIT for e, _ in instantiations(d)} == every
    for dtype in SIXTEEN_BIT:
        taken = [args(e) for e, _ in instantiations(dtype)]
        assert len(taken) == len(representative_plans(dtype)) * (2 if COMPILE_ALL else 1)
        assert {w for w, _ in taken} == {"x's dtype", "float"}


def _heaviest(dtype):
    """Per variant (registers, stream, row), the plan with the most work per thread, float32
    weights (the row kernel with every flag)."""
    best = {}
    for rows in (4096, 7):
        for p in backward_plans(dtype, rows).values():
            key = (p.vecs_per_thread, p.threads_per_row, p.vec, p.edges)
            if p.variant not in best or key > best[p.variant][0]:
                best[p.variant] = (key, p)
    return sorted(backward_instantiation_name(dtype, "float32", p, ROW_FLAGS[0] if p.variant == "row" else None)
                  for _, p in best.values())


def _heaviest_programs(arch):
    """The programs that compile the heaviest of every dtype on sm_90 (where the spill checks'
    programs hold some), one dtype by turns on the other architectures (helpers.arch_dtypes)."""
    spill = [] if arch_missing("sm_90") else \
        [kw for d in CUDA_TYPES for kw in _spill_programs(register_variant_names(d)) + _spill_programs(row_names(d))]
    return library_options_programs([n for d in arch_dtypes(arch) for n in _heaviest(d)], arch, "backward", spill)


@pytest.mark.parametrize("arch", arch_params())
def test_heaviest_instantiations_compile_with_library_options(arch):
    """The same NVRTC options the library uses at run time (no fast-compile mode), for the
    heaviest plan of each variant (every dtype on sm_90, one by turns on the others)."""
    names = [n for d in arch_dtypes(arch) for n in _heaviest(d)]
    assert len(names) == 3 * len(arch_dtypes(arch))
    assert {n.split("<")[0] for n in names} == {"rmsnorm::rms_norm_backward_kernel",
                                                 "rmsnorm::rms_norm_backward_row_kernel"}
    programs = _heaviest_programs(arch)
    assert sorted(n for kw in programs for n in kw["names"] if n in names) == sorted(names)
    for kwargs in programs:
        symbols = set(re.findall(KERNEL_SYMBOL, compile_program(**kwargs).result().get()))
        assert len(symbols) == len(kwargs["names"]), "one kernel per name expression"


def test_every_geometry_is_covered():
    """The representative set meets every (threads per row, vectors per thread) of the full one."""
    for dtype in CUDA_TYPES:
        full = {(p.threads_per_row, p.vecs_per_thread) for p in backward_plans(dtype).values()}
        assert {(8, 1), (32, 2), (128, 1), (1024, 1), (512, 0)} <= full
        names = {e for e, _ in instantiations(dtype)}
        for g, nv in full:
            assert any(f", {g}, {nv}, " in e for e in names), (dtype, g, nv)


def _spill_programs(names):
    """ptxas -v at the library's own options (sm_90), in programs of up to SPILL_BATCH."""
    return [dict(names=chunk, arch="sm_90", program="backward", fast=False, extra_options=("-Xptxas=-v",))
            for chunk in chunks(names, SPILL_BATCH)]


def spill_stores(names, entry=r"\w+"):
    """ptxas -v at the library's own options (sm_90): the regex groups of ``entry`` and the
    spill store bytes, per compiled entry function (one per name)."""
    spills = []
    for future in [compile_program(**kwargs) for kwargs in _spill_programs(names)]:
        result = future.result()
        result.get()
        spills += ptxas_entries(result.log, entry)
    assert len(spills) == len(names)
    return spills


def register_cap(plan):
    """Registers a thread may use under the launch bounds of rms_norm_backward_kernel and the
    row kernel (kernels/rms_norm_backward.cu's BackwardMinBlocks)."""
    tpr, vpt = plan.threads_per_row, plan.vecs_per_thread
    blocks = (1 if plan.edges and (vpt != 1 or tpr < 256) else 1024 // tpr if tpr > 256 else 4 if tpr == 256 else 3)
    return min(255, 65536 // (max(tpr, 256) * blocks))


def one_per_cap(plans):
    """``plans`` but, of the block-wide ones (a row a block) alike in edges and vectors per
    thread and under the same register cap, only the one of most threads (every plan with
    CUPY_RMSNORM_COMPILE_ALL=1): those blocks run the same code a thread (measured at sm_90:
    the same registers at 256, 512 and 1024 threads), so they spill alike. Warp groups keep
    every size: a block of 256 threads holds a row per group, more rows for smaller groups."""
    if COMPILE_ALL:
        return list(plans)
    largest = {}
    for p in plans:
        if p.threads_per_row > 32:
            key = (p.vec, p.edges, p.vecs_per_thread, register_cap(p))
            largest[key] = max(largest.get(key, 0), p.threads_per_row)
    return [p for p in plans if p.threads_per_row <= 32
            or p.threads_per_row == largest[(p.vec, p.edges, p.vecs_per_thread, register_cap(p))]]


@functools.cache
def register_variant_plans(dtype):
    """The register plans at full width (one_per_cap), sorted."""
    plans = {(p.variant, p.template_args()): p
             for rows in (4096, 1024) for p in backward_plans(dtype, rows).values()
             if p.variant == "registers" and p.vec == max(VECS[dtype])}
    assert any(not p.edges and p.threads_per_row > 32 for p in plans.values()), "no block plan on the grid"
    return one_per_cap([plans[k] for k in sorted(plans)])


def register_variant_names(dtype):
    """float32 weights (the heaviest); float16 and bfloat16 take the plans by turns
    (helpers.spill_turns; every plan for both with CUPY_RMSNORM_COMPILE_ALL=1)."""
    plans = register_variant_plans(dtype)
    return [backward_instantiation_name(dtype, "float32", plans[i]) for i, _ in spill_turns(dtype, len(plans))]


def test_one_plan_per_register_cap():
    """The spill checks' block-wide plans: of each register cap, edges and vectors per thread
    the largest block, every cap met (blocks of 128 threads may use more registers than larger
    ones); every warp group."""
    for dtype in CUDA_TYPES:
        full = [p for rows in (4096, 1024) for p in backward_plans(dtype, rows).values()
                if p.variant == "registers" and p.vec == max(VECS[dtype])]
        chosen = register_variant_plans(dtype)
        assert {(p.edges, p.vecs_per_thread, register_cap(p)) for p in chosen if p.threads_per_row > 32} == \
            {(p.edges, p.vecs_per_thread, register_cap(p)) for p in full if p.threads_per_row > 32}
        assert {p.template_args() for p in chosen if p.threads_per_row <= 32} == \
            {p.template_args() for p in full if p.threads_per_row <= 32}
        assert {register_cap(p) for p in chosen if p.threads_per_row > 32} >= {64, 85, 255}
        assert COMPILE_ALL or {p.threads_per_row for p in chosen if p.threads_per_row > 32} == {128, 1024}
        row_full = [p for p in row_plans(dtype) if p.vec == max(VECS[dtype])]
        assert {(p.edges, register_cap(p)) for p in row_chosen(dtype) if p.vec == max(VECS[dtype])} == \
            {(p.edges, register_cap(p)) for p in row_full}


@requires_sm_90
def test_register_variants_do_not_spill():
    """ptxas -v at the library's own options (sm_90): no spill stores in the register
    variants of the heaviest weights (float32) at full width: rows with a head or tail, and
    (1024 rows, fewer than the staged kernel's) rows on the 16-byte grid, whose block plans
    keep their dweight sums in registers. float16 and bfloat16 (the same plans) by turns."""
    assert register_variant_plans("float16") == register_variant_plans("bfloat16")
    every = {", ".join(map(str, p.template_args())) + ">" for p in register_variant_plans("float16")}
    assert {n.split(", ", 2)[2] for d in ("float16", "bfloat16") for n in register_variant_names(d)} == every
    for dtype in CUDA_TYPES:
        spills = spill_stores(register_variant_names(dtype))
        assert all(n == "0" for _, n in spills), [s for s in spills if s[1] != "0"]


# -- staged rows (sm_90 bulk copies) ------------------------------------------------------------

H200_SHARED = {"shared_per_sm": 233472, "shared_per_block": 232448}
STAGED_ENTRY = r"\w+staged\w+Li(\d+)E\w{1,4}EEv\w+"   # then N, defaulted


def staged_plans(dtype):
    """Every distinct staged plan (template arguments) over hidden sizes of 65..4096 vectors
    at full width, for both ops (two or three arrays a stage)."""
    vec = 16 // ITEMSIZE[dtype]
    plans = {}
    for n in (65, 128, 129, 256, 257, 512, 513, 640, 1024, 1025, 1536, 2048, 4096):
        for arrays in (2, 3):
            p = backward_plan(16384, n * vec, ITEMSIZE[dtype], vec, SMS, edges=False, arrays=arrays, **H200_SHARED)
            if p.variant == "staged":
                plans.setdefault(p.template_args(), p)
    return plans


@functools.cache
def staged_names(dtype):
    """The staged plans with weights of x's dtype and float32 (helpers.spill_turns: by default
    every dtype and the weight types by turns, float32 too: at each plan it needs fewer
    registers than float16 and bfloat16, measured at sm_90)."""
    plans = [p for _, p in sorted(staged_plans(dtype).items())]
    return sorted({backward_instantiation_name(dtype, w, plans[i])
                   for i, weights in spill_turns(dtype, len(plans), float32_by_turns=True) for w in weights})


# the staged and row kernels' dtypes on the architectures but sm_90: neither the heaviest
# instantiations' (turn 0) nor the cross-section's there
OTHER_ARCH_TURN = 2


def other_arch_programs(dtype, names, key):
    """The architectures but sm_90 (compiled there with ptxas -v) that compile ``dtype``'s
    staged and row kernels (one dtype each, helpers.arch_dtypes), fast mode: of ``names`` one
    per ``key(name)``, by turns (another turn per architecture; every name for every
    architecture with CUPY_RMSNORM_COMPILE_ALL=1)."""
    return [dict(names=names if COMPILE_ALL else sorted(by_turns(names, key, COMPILE_ARCHS.index(arch))), arch=arch,
                 program="backward") for arch in COMPILE_ARCHS
            if arch != "sm_90" and not arch_missing(arch) and dtype in arch_dtypes(arch, OTHER_ARCH_TURN)]


def staged_key(name):
    """A staged instantiation's steps and rows a step (its last template arguments)."""
    return tuple(name[:-1].split(", ")[-2:])


@requires_sm_90
@pytest.mark.parametrize("dtype", list(CUDA_TYPES))
def test_staged_variants_compile_without_spills(dtype):
    """The staged kernel's instantiations compile for sm_90 and another architecture (before
    sm_90 to an empty body: the plan never picks it there) and, at sm_90 with ptxas -v, do not
    spill (weights and dweight sums live in registers, 16 a step; steps are capped for that):
    none at one step, the 4096-wide rows; at two steps, under 64 registers, ptxas keeps at most
    32 bytes on the stack (half x with half weights), which is allowed here."""
    plans = staged_plans(dtype).values()
    assert {p.vecs_per_thread for p in plans} >= {1, 2} and max(p.threads_per_row for p in plans) == 512
    names = staged_names(dtype)
    for future in [compile_program(**kwargs) for kwargs in other_arch_programs(dtype, names, staged_key)]:
        assert future.result().get()
    spills = spill_stores(names, STAGED_ENTRY)
    assert all(b == "0" or (steps != "1" and int(b) <= 32) for _, steps, b in spills), spills


# -- few rows (no more than the SMs: a row a block, rms_norm_backward_row_kernel) ---------------

# the row kernel's compiled-in flags: every flag and promise (dweight written directly, llama,
# the fused op's d_residual_out), dweight partials with no promise, and no weight
ROW_FLAGS = (
    row_kernel_flags(LLAMA | HAS_WEIGHT | ADD_GRAD | WEIGHT_GRAD | DIRECT_WEIGHT, True, True),
    row_kernel_flags(HAS_WEIGHT | WEIGHT_GRAD, False, False),
    row_kernel_flags(LLAMA, True, False),
)


def row_plans(dtype):
    """Every distinct "row" plan (7 rows) over VECTOR_COUNTS, at every width, with and without edges."""
    return [p for p in backward_plans(dtype, rows=7).values() if p.variant == "row"]


@functools.cache
def row_chosen(dtype):
    """The block-wide geometries at full width (one_per_cap) and a sample of the narrower widths."""
    plans = row_plans(dtype)
    widest = max(VECS[dtype])
    return one_per_cap([p for p in plans if p.vec == widest]) + [p for p in plans if p.vec != widest][::4]


@functools.cache
def row_names(dtype):
    """The chosen row plans, each with every ROW_FLAGS, with weights of x's dtype and float32
    (helpers.spill_turns: by default the 16-bit dtypes and the weight types by turns)."""
    chosen = row_chosen(dtype)
    return sorted({backward_instantiation_name(dtype, w, chosen[i], flags)
                   for i, weights in spill_turns(dtype, len(chosen)) for w in weights for flags in ROW_FLAGS})


def row_key(name):
    """A row instantiation's edges and flags (its last template arguments)."""
    return tuple(name[:-1].split(", ")[-2:])


def row_flags(name):
    return row_key(name)[1]


@requires_sm_90
@pytest.mark.parametrize("dtype", list(CUDA_TYPES))
def test_row_variants_compile_without_spills(dtype):
    """The row kernel's instantiations (the block-wide geometries of each register cap, a
    sample of the narrower widths) compile for sm_90 and another architecture and do not spill
    at sm_90 (ptxas -v)."""
    plans = row_plans(dtype)
    assert {p.threads_per_row for p in plans} >= {128, 512, 1024} and {p.edges for p in plans} == {True, False}
    names = row_names(dtype)
    assert all("rms_norm_backward_row_kernel" in n for n in names), names
    assert {n.split(", ")[1] for n in names} == {CUDA_TYPES[dtype], "float"}
    assert {row_key(n)[1] for n in names} == {str(f) for f in ROW_FLAGS}
    for future in [compile_program(**kwargs) for kwargs in other_arch_programs(dtype, names, row_flags)]:
        assert future.result().get()
    spills = spill_stores(names, r"\w+row_kernel\w+")
    assert all(n == "0" for _, n in spills), [s for s in spills if s[1] != "0"]


def test_the_16_bit_dtypes_share_the_spill_checks():
    """float16 and bfloat16 have the same backward plans: by default they take the spill
    checks' plans by turns, which together are every plan."""
    def args(name):                   # the template arguments after T and W
        return name[:-1].split(", ", 2)[2]

    assert [p.template_args() for p in row_chosen("float16")] == [p.template_args() for p in row_chosen("bfloat16")]
    assert staged_plans("float16").keys() == staged_plans("bfloat16").keys()
    sixteen = ("float16", "bfloat16")
    assert {args(n).rsplit(", ", 1)[0] for d in sixteen for n in row_names(d)} == \
        {", ".join(map(str, p.template_args())) for p in row_chosen("float16")}
    assert {args(n) for d in sixteen for n in staged_names(d)} == \
        {", ".join(map(str, a)) for a in staged_plans("float16")}
    assert staged_plans("float32").keys() == staged_plans("float16").keys()    # float32 by turns too
    assert COMPILE_ALL or \
        {args(n) for n in staged_names("float32")} < {", ".join(map(str, a)) for a in staged_plans("float32")}


def test_the_staged_and_row_kernels_compile_for_the_other_architectures():
    """Each architecture but sm_90 compiles the staged and row kernels of one dtype (neither the
    heaviest's nor the cross-section's there), each dtype on one of them."""
    others = [a for a in COMPILE_ARCHS if a != "sm_90"]
    assert {d for a in others for d in arch_dtypes(a, OTHER_ARCH_TURN)} == set(CUDA_TYPES)
    assert COMPILE_ALL or all(len({arch_dtypes(a, t)[0] for t in (0, CROSS_SECTION_TURN, OTHER_ARCH_TURN)}) == 3
                              for a in others)


def compile_jobs():
    """[(test function, its parameters, program)]: every program this module's tests compile
    (for tests/cpu/conftest.py to start those of the selected tests early)."""
    if nvrtc_missing():
        return []
    jobs = []
    for arch in COMPILE_ARCHS:
        if arch_missing(arch):
            continue
        jobs += [("test_backward_instantiations_compile", dict(arch=arch, dtype=dtype), kwargs)
                 for dtype in arch_dtypes(arch, CROSS_SECTION_TURN)
                 for _, kwargs in _instantiation_programs(arch, dtype)]
        jobs.append(("test_reductions_compile", dict(arch=arch), _reduction_program(arch)))
        jobs += [("test_heaviest_instantiations_compile_with_library_options", dict(arch=arch), kwargs)
                 for kwargs in _heaviest_programs(arch)]
    if not arch_missing("sm_90"):
        for dtype in CUDA_TYPES:
            jobs += [("test_register_variants_do_not_spill", {}, kwargs)
                     for kwargs in _spill_programs(register_variant_names(dtype))]
            staged, rows = staged_names(dtype), row_names(dtype)
            jobs += [("test_staged_variants_compile_without_spills", dict(dtype=dtype), kwargs)
                     for kwargs in _spill_programs(staged) + other_arch_programs(dtype, staged, staged_key)]
            jobs += [("test_row_variants_compile_without_spills", dict(dtype=dtype), kwargs)
                     for kwargs in _spill_programs(rows) + other_arch_programs(dtype, rows, row_flags)]
    return jobs
