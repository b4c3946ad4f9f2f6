"""The quantized kernels' instantiations compile with NVRTC, without a GPU (see test_compile.py).

By default a representative set for sm_90: per op and quantized form one plan of each (plan
kind, edges) at full vector width, and per form one of each plan kind at a narrower width
(the widths and the ops by turns: the form's own code, kernels/quant.cuh, takes no op, and
the forward set has every (op, width, plan kind)), the quant dtypes and the weight types by
turns. float32 compiles all of it (65); float16 and bfloat16 (the same templates and plans,
other conversions) split theirs, each about half the groups of every (op, form, plan kind)
(helpers.sixteen_bit_share; 130 in all). For sm_80 (no clusters; FP8 conversions in
software), sm_100 and sm_120 a cross-section of it for one storage dtype each
(helpers.arch_dtypes: each dtype on one of them): one of each (form, plan kind), the ops,
widths, edges, quant dtypes and weight types by turns (15 each). The heaviest plan of each
form and op compiles with the library's own options for sm_90, every dtype; for each other
architecture one dtype by turns (neither the cross-section's nor the forward's
cross-section's: each dtype's kernels compile for every architecture), of each form one op,
by turns (what the op changes is the forward kernels' code). ``CUPY_RMSNORM_COMPILE_ALL=1``
compiles every (plan, form) with every quant dtype for every dtype and architecture.
The heaviest register variants (most vectors per thread for each block size, full width, with
edges) are also compiled with ptxas -v at the library's own options: they must not spill (the
per-token form's plan rule is there for that), but for the dynamic forms on the vector grid
in a block of 64-256 threads a row, held to 48 registers (a spill of up to 16 bytes allowed).
float16 and bfloat16 take those plans by turns, float32 every one (by turns too where held to
48 registers: it needs no more than they do there); the static form's plans that the
per-token form has too are checked in that form only (it runs the static form's code plus a
pass for the row's max).
"""

import functools
import re

import pytest
from helpers import (COMPILE_ALL, COMPILE_ARCHS, FULL_ARCH, HIDDEN_SIZES, ITEMSIZE, MANGLED, MAX_CLUSTER, PLAN_KINDS,
                     ROWS, SIXTEEN_BIT, SMS, VECS, arch_dtype_params, arch_dtypes, arch_missing, arch_params, by_turns,
                     check_symbols, chunks, compile_program, library_options_programs, nvrtc_missing, plan_kind,
                     ptxas_entries, sixteen_bit_share, spill_turns, template_ints)

from cupy_rmsnorm import launch_plan
from cupy_rmsnorm._abi import CUDA_TYPES
from cupy_rmsnorm.ops.quant.launch import QUANT_FORM_IDS as QUANT_FORMS, QUANT_TYPES, quant_instantiation_name
from cupy_rmsnorm._plan import QUANT_GROUP

pytestmark = pytest.mark.skipif(nvrtc_missing() is not None, reason=f"NVRTC compile test: {nvrtc_missing()}")
requires_sm_90 = pytest.mark.skipif(arch_missing("sm_90") is not None,
                                    reason=f"NVRTC compile test (sm_90): {arch_missing('sm_90')}")

KERNEL_SYMBOL = rb"_ZN7rmsnorm\d+rms_norm_quant\w+"
BATCH = 33          # instantiations per program (a quantized instantiation costs about twice a forward one)
SPILL_BATCH = 11
# the cross-sections' dtypes (helpers.arch_dtypes): on each architecture neither the heaviest
# instantiations' (turn 0) nor the forward cross-section's (test_compile.py, turn 1)
CROSS_SECTION_TURN = 2


@functools.cache
def quant_plans(dtype, fused, form):
    """Every distinct plan the launcher makes for a quantized form over HIDDEN_SIZES (the
    per-group form: hidden sizes of whole groups, rows of whole vectors), 32-bit offsets or not."""
    plans = {}
    for vec in VECS[dtype]:
        for h in HIDDEN_SIZES:
            if form == "per_group" and h % QUANT_GROUP:
                continue
            for rows in ROWS:
                for edges in ((False,) if form == "per_group" else (True, False) if h % vec == 0 else (True,)):
                    for flat in (False, True):
                        p = launch_plan(rows, h, ITEMSIZE[dtype], vec, SMS, fused, edges=edges,
                                        max_cluster=MAX_CLUSTER, quant=form, flat=flat)
                        plans.setdefault((p.template_args(), p.flat), p)
    return plans


def _mangled(dtype, weight, fused, plan, form, quant_dtype):
    name = quant_instantiation_name(dtype, weight, fused, plan, form, quant_dtype)
    kernel = name.split("<")[0].split("::")[-1]
    t, w = CUDA_TYPES[dtype], CUDA_TYPES[weight]
    w_code = MANGLED[w] if (w == "float" or w != t) else "S1_"
    flat = () if plan.cluster > 1 else ("true" if plan.flat else "false",)
    ints = template_ints(plan.template_args() + (QUANT_FORMS[form], QUANT_TYPES[quant_dtype]) + flat)
    return f"_ZN7rmsnorm{len(kernel)}{kernel}I{MANGLED[t]}{w_code}Lb{int(fused)}E{ints}".encode()   # then the defaulted type R


@functools.cache
def plan_groups(dtype):
    """[(fused, form, group, plans)]: the representative set's groups, per op and form those of
    each (plan kind, edges) at full vector width, ("full", kind, edges), and per form those of
    each plan kind at the narrower widths, ("narrow", kind), for one op, the ops by turns."""
    groups = []
    for fused in (False, True):
        for i, form in enumerate(QUANT_FORMS):
            full, narrow = {}, {}
            for p in sorted(quant_plans(dtype, fused, form).values(), key=lambda p: p.template_args()):
                if p.vec == max(VECS[dtype]):
                    full.setdefault(("full", plan_kind(p), p.edges), []).append(p)
                else:
                    narrow.setdefault(("narrow", plan_kind(p)), []).append(p)
            groups += [(fused, form, k, full[k]) for k in sorted(full)] + \
                      [(fused, form, k, narrow[k]) for j, k in enumerate(sorted(narrow)) if (i + j + fused) % 2 == 0]
    return groups


@functools.cache
def dtype_groups(dtype):
    """The groups sm_90 compiles for ``dtype``: all for float32; float16 and bfloat16 split
    those of each (op, form, plan kind) (helpers.sixteen_bit_share)."""
    return sixteen_bit_share(dtype, plan_groups(dtype), lambda g: (g[0], g[1], g[2][1]))


@functools.cache
def representative_choices(dtype):
    """[(fused, form, plan, weight, quant dtype)] of the representative set: of each of the
    dtype's groups one plan, the plans, weight types and quant dtypes by turns (every plan
    with every quant dtype and both weight types with CUPY_RMSNORM_COMPILE_ALL=1)."""
    if COMPILE_ALL:
        return [(fused, form, p, w, q) for fused in (False, True) for form in QUANT_FORMS
                for p in quant_plans(dtype, fused, form).values() for w in (dtype, "float32") for q in QUANT_TYPES]
    return [(fused, form, plans[turn % len(plans)], ("float32", dtype)[turn % 2], list(QUANT_TYPES)[turn % 3])
            for turn, (fused, form, _, plans) in enumerate(dtype_groups(dtype), 1)]


@functools.cache
def cross_section_choices(dtype, arch):
    """For an architecture other than FULL_ARCH: per form and plan kind one choice of the
    representative set (the ops, widths, edges, quant dtypes and weights by turns, another
    turn per architecture)."""
    return by_turns(representative_choices(dtype), lambda c: (c[1], plan_kind(c[2])), COMPILE_ARCHS.index(arch))


def _pairs(dtype, choices):
    return sorted({(quant_instantiation_name(dtype, w, f, p, form, q), _mangled(dtype, w, f, p, form, q))
                   for f, form, p, w, q in choices})


@functools.cache
def instantiations(dtype, arch=FULL_ARCH):
    """(name expression, mangled prefix) pairs to compile for one storage dtype and architecture."""
    if COMPILE_ALL or arch == FULL_ARCH:
        return _pairs(dtype, representative_choices(dtype))
    return _pairs(dtype, cross_section_choices(dtype, arch))


def _instantiation_programs(arch, dtype):
    return [(chunk, dict(names=[e for e, _ in chunk], arch=arch))
            for chunk in chunks(instantiations(dtype, arch), BATCH)]


@pytest.mark.parametrize("arch,dtype", arch_dtype_params(CROSS_SECTION_TURN))
def test_quant_instantiations_compile(arch, dtype):
    """The representative set on sm_90 (float16 and bfloat16 splitting theirs), a
    cross-section of it on the other architectures, one dtype each."""
    programs = _instantiation_programs(arch, dtype)
    futures = [compile_program(**kwargs) for _, kwargs in programs]
    for (pairs, _), future in zip(programs, futures):
        check_symbols(future.result().get(), pairs, KERNEL_SYMBOL)


@pytest.mark.skipif(COMPILE_ALL, reason="CUPY_RMSNORM_COMPILE_ALL=1: every instantiation on every architecture")
def test_cross_sections_cover_every_form_and_plan_kind():
    """Each architecture but sm_90 compiles one storage dtype, each dtype on one of them; its
    cross-section has every (form, plan kind), both ops, every quant dtype and both weight
    types; and nothing the dtype's representative set lacks."""
    others = [a for a in COMPILE_ARCHS if a != FULL_ARCH]
    compiled = [(a, d) for a in others for d in arch_dtypes(a, CROSS_SECTION_TURN)]
    assert len(compiled) == len(others) and {d for _, d in compiled} == set(CUDA_TYPES)
    for arch, dtype in compiled:
        section = cross_section_choices(dtype, arch)
        assert sorted((form, plan_kind(p)) for _, form, p, _, _ in section) == \
            sorted((form, k) for form in QUANT_FORMS for k in PLAN_KINDS)
        assert {f for f, *_ in section} == {False, True}
        assert {q for *_, q in section} == set(QUANT_TYPES)
        assert {CUDA_TYPES[w] for _, _, _, w, _ in section} == {CUDA_TYPES[dtype], "float"}
        assert set(_pairs(dtype, section)) <= set(instantiations(dtype))
    assert all(arch_dtypes(a, CROSS_SECTION_TURN) != arch_dtypes(a, t) for a in others for t in (0, 1))


def _form_and_type(name):
    """(FORM, QTYPE) of an instantiation name: its last arguments, or before FLAT where it has one."""
    args = name[:-1].split(", ")
    return tuple(args[-2:] if "cluster" in name else args[-3:-1])


def test_the_groups_cover_every_op_form_kind_and_width():
    """Per op and form every (plan kind, edges) at full width; per form every plan kind at the
    narrower widths, with both ops over them."""
    for dtype in CUDA_TYPES:
        groups = plan_groups(dtype)
        for fused in (False, True):
            for form in QUANT_FORMS:
                full = {(plan_kind(p), p.edges) for p in quant_plans(dtype, fused, form).values()
                        if p.vec == max(VECS[dtype])}
                assert {k[1:] for f, fo, k, _ in groups if (f, fo, k[0]) == (fused, form, "full")} == full
        narrow = [(fo, k[1], f) for f, fo, k, _ in groups if k[0] == "narrow"]
        assert sorted((fo, k) for fo, k, _ in narrow) == sorted((fo, k) for fo in QUANT_FORMS for k in PLAN_KINDS)
        assert {f for *_, f in narrow} == {False, True}


@pytest.mark.skipif(COMPILE_ALL, reason="CUPY_RMSNORM_COMPILE_ALL=1: every plan of every form")
def test_float16_and_bfloat16_split_the_groups():
    """float32 takes every group of the representative set; float16 and bfloat16 (the same
    plans) about half each, together every one, each every (form, plan kind) and every (op,
    form, plan kind) of two groups or more."""
    def keys(dtype):
        return [(f, form, k) for f, form, k, _ in dtype_groups(dtype)]

    every = [(f, form, k) for f, form, k, _ in plan_groups("float16")]
    assert every == [(f, form, k) for f, form, k, _ in plan_groups("bfloat16")]
    assert keys("float32") == [(f, form, k) for f, form, k, _ in plan_groups("float32")]
    assert sorted(keys("float16") + keys("bfloat16")) == sorted(every)
    sizes = {}
    for f, form, k in every:
        sizes[(f, form, k[1])] = sizes.get((f, form, k[1]), 0) + 1
    for dtype in SIXTEEN_BIT:
        assert abs(len(keys(dtype)) - len(every) / 2) <= 2, dtype
        met = {(f, form, k[1]) for f, form, k in keys(dtype)}
        assert met >= {key for key, n in sizes.items() if n >= 2}, dtype
        assert {key[1:] for key in met} == {key[1:] for key in sizes}, dtype


def test_the_set_covers_every_form_and_plan_kind():
    for dtype in CUDA_TYPES:
        names = [e for e, _ in instantiations(dtype)]
        for fused in (False, True):
            for form, code in QUANT_FORMS.items():
                plans = quant_plans(dtype, fused, form).values()
                kinds = {plan_kind(p) for p in plans}
                assert kinds == {"warp group", "block", "stream", "block cluster", "stream cluster"}, (form, kinds)
                assert {p.flat for p in plans} == ({False} if fused and form == "per_token" else {False, True})
                assert any(f"{'true' if fused else 'false'}, " in e and _form_and_type(e) == (str(code), "0")
                           for e in names)
        assert {_form_and_type(e)[1] for e in names} == {str(c) for c in QUANT_TYPES.values()}
        assert {e.rsplit(", ", 1)[1] for e in names if "cluster" not in e} == {"false>", "true>"}


def test_per_group_plans_keep_groups_in_a_block():
    """Each plan of the per-group form holds a group at one step within a block, or (short
    rows) over consecutive vectors of the same threads; streamed rows have blocks of a group."""
    for dtype in CUDA_TYPES:
        for fused in (False, True):
            for p in quant_plans(dtype, fused, "per_group").values():
                group = QUANT_GROUP // p.vec
                assert not p.edges
                if p.threads_per_row < group:
                    assert p.cluster == 1 and p.vecs_per_thread % (group // p.threads_per_row) == 0, p


def held_to_48(plan, form):
    """kernels/rms_norm.cu's quant_min_blocks_of_256: the plans held to 48 registers."""
    return (form in ("per_token", "per_group") and plan.variant == "registers" and plan.cluster == 1
            and not plan.edges and 32 < plan.threads_per_row <= 256)


def register_budget(plan):
    """Registers a thread may use under the kernels' launch bounds."""
    if plan.cluster > 1:
        return min(255, 65536 // plan.block)
    return 85 if plan.block <= 256 else 64          # 3 blocks of 256, or 1024 threads, per SM


def heaviest(dtype, fused, form):
    """Per plan kind and register budget, the register plan at full width with the most vectors
    per thread, edges as the form allows (with, where it can)."""
    best = {}
    for p in quant_plans(dtype, fused, form).values():
        if p.variant == "registers" and p.vec == max(VECS[dtype]):
            key = (plan_kind(p), register_budget(p), p.flat)
            if key not in best or (p.vecs_per_thread, p.edges) > (best[key].vecs_per_thread, best[key].edges):
                best[key] = p
    return list(best.values())


def _spill_programs(names):
    """ptxas -v at the library's own options (sm_90), in programs of up to SPILL_BATCH."""
    return [dict(names=chunk, arch="sm_90", fast=False, extra_options=("-Xptxas=-v",))
            for chunk in chunks(names, SPILL_BATCH)]


def _ptxas_reports(names, registers=False):
    found = []
    for future in [compile_program(**kwargs) for kwargs in _spill_programs(names)]:
        result = future.result()
        result.get()
        found += ptxas_entries(result.log, registers=registers)
    return found


SPILL_QUANT = {"static": "int8", "per_token": "float8_e4m3fn", "per_group": "float8_e4m3fn"}


def spill_plans(dtype, fused, form):
    """The heaviest plans of a storage dtype, op and form that are not held to 48 registers."""
    return sorted((p for p in heaviest(dtype, fused, form) if not held_to_48(p, form)),
                  key=lambda p: (p.template_args(), p.flat))


def spill_check_plans(dtype, fused):
    """[(form, plan)]: the spill_plans of each form, but the static form's that the per-token
    form has too (CUPY_RMSNORM_COMPILE_ALL=1 keeps them). At the same plan the per-token form
    does what the static form does (kernels/quant.cuh: the same loop of quantized stores) after
    a pass for the row's max |y|, keeping y in registers on the vector grid: it needs at least
    the static form's registers (every such pair measured at sm_90: the same or more)."""
    per_token = {(p.template_args(), p.flat) for p in spill_plans(dtype, fused, "per_token")}
    return [(form, p) for form in QUANT_FORMS for p in spill_plans(dtype, fused, form)
            if COMPILE_ALL or form != "static" or (p.template_args(), p.flat) not in per_token]


@functools.cache
def spill_check_names():
    """spill_check_plans of each storage dtype and op, e4m3 (int8, the longest conversion, for
    the static form), with weights of x's dtype and float32 (helpers.spill_turns: by default
    the 16-bit dtypes and the weight types by turns)."""
    names = set()
    for dtype in CUDA_TYPES:
        plans = [(fused, form, p) for fused in (False, True) for form, p in spill_check_plans(dtype, fused)]
        for i, weights in spill_turns(dtype, len(plans)):
            fused, form, p = plans[i]
            names |= {quant_instantiation_name(dtype, w, fused, p, form, SPILL_QUANT[form]) for w in weights}
    return sorted(names)


@requires_sm_90
def test_register_variants_do_not_spill():
    """ptxas -v at the library's own options (sm_90) for the heaviest plans, with weights of
    x's dtype and float32, e4m3 (int8, the longest conversion, for the static form): no spills."""
    names = spill_check_names()
    assert {n.split(", ")[1] for n in names} == {"float", "__half", "__nv_bfloat16"}
    def plan_part(name):                 # the kernel and its arguments after T and W
        return name.split("<")[0] + "<" + name.split(", ", 2)[2]

    def every(dtype):
        return {plan_part(quant_instantiation_name(dtype, "float32", f, p, form, SPILL_QUANT[form]))
                for f in (False, True) for form, p in spill_check_plans(dtype, f)}

    for dtype in CUDA_TYPES:             # every form's heaviest plans, the static form's in it or in the per-token form
        for f in (False, True):
            checked = {(form, p.template_args(), p.flat) for form, p in spill_check_plans(dtype, f)}
            for form in QUANT_FORMS:
                for p in spill_plans(dtype, f, form):
                    assert {(form, p.template_args(), p.flat), ("per_token", p.template_args(), p.flat)} & checked
            assert any(form == "static" for form, _, _ in checked)

    assert every("float16") == every("bfloat16")     # the same plans: the 16-bit dtypes take them by turns
    assert {plan_part(n) for n in names if n.split("<")[1].startswith(("__half", "__nv_bfloat16"))} == every("float16")
    assert {plan_part(n) for n in names if n.split("<")[1].startswith("float,")} == every("float32")
    spills = _ptxas_reports(names)
    assert len(spills) == len(names)
    assert all(n == "0" for _, n in spills), [s for s in spills if s[1] != "0"]


@functools.cache
def held_to_48_names(form):
    """Per storage dtype and op, the heaviest plan of each block size held to 48 registers, e4m3,
    weights of x's dtype and float32 (helpers.spill_turns: by default every dtype and the weight
    types by turns, float32 too: at each plan it needs no more registers than float16 and
    bfloat16, measured at sm_90)."""
    names = set()
    for dtype in CUDA_TYPES:
        plans = []
        for fused in (False, True):
            best = {}
            for p in quant_plans(dtype, fused, form).values():
                if held_to_48(p, form) and p.vec == max(VECS[dtype]):
                    if p.block not in best or p.vecs_per_thread > best[p.block].vecs_per_thread:
                        best[p.block] = p
            plans += [(fused, best[b]) for b in sorted(best)]
        names |= {quant_instantiation_name(dtype, w, *plans[i], form, "float8_e4m3fn")
                  for i, weights in spill_turns(dtype, len(plans), float32_by_turns=True) for w in weights}
    return sorted(names)


@requires_sm_90
@pytest.mark.parametrize("form", ["per_token", "per_group"])
def test_dynamic_forms_on_the_vector_grid_are_held_to_48_registers(form):
    """kernels/rms_norm.cu's quant_min_blocks_of_256: the dynamic forms without edges in a
    block of 64-256 threads a row (their y kept in registers) compile to at most 48 registers,
    so 10 blocks of 128 share an SM, with at most 16 bytes of spill (up to 12 seen; measured
    faster, benchmarks/NOTES.md 29, 30). Their heaviest plans, weights of x's dtype and float32."""
    names = held_to_48_names(form)
    assert any("128, 4" in n for n in names), sorted(names)    # the 4096-wide rows' plan is there
    assert {n.split(", ")[1] for n in names} == {"float", "__half", "__nv_bfloat16"}
    found = _ptxas_reports(names, registers=True)
    assert len(found) == len(names)
    assert all(int(regs) <= 48 and int(spill) <= 16 for _, spill, regs in found), found


def heaviest_ops(arch, form):
    """The ops whose heaviest plan of ``form`` compiles with the library's options for ``arch``:
    both on sm_90 (and with CUPY_RMSNORM_COMPILE_ALL=1), one on each other architecture, by
    turns over the forms and architectures (what the op changes is the forward's code, whose
    heaviest compile for both ops on every architecture: test_compile.py)."""
    if COMPILE_ALL or arch == FULL_ARCH:
        return (False, True)
    others = [a for a in COMPILE_ARCHS if a != FULL_ARCH]
    return ((list(QUANT_FORMS).index(form) + others.index(arch)) % 2 == 1,)


def _heaviest_names(arch):
    """Per storage dtype, op and form, the register plan with the most vectors per thread at
    full width (int8 / e4m3), float32 weights: the library's own options (every dtype on
    sm_90, one by turns on the other architectures, and there the ops by turns)."""
    names = set()
    for dtype in arch_dtypes(arch):
        for form in QUANT_FORMS:
            for fused in heaviest_ops(arch, form):
                p = max(heaviest(dtype, fused, form), key=lambda p: (p.vecs_per_thread, p.block, p.edges, p.flat))
                names.add(quant_instantiation_name(dtype, "float32", fused, p, form, SPILL_QUANT[form]))
    return sorted(names)


def _heaviest_programs(arch):
    """The programs that compile _heaviest_names(arch): on sm_90 the spill checks' hold some."""
    spill = [] if arch_missing("sm_90") else _spill_programs(spill_check_names()) + \
        [kw for form in ("per_token", "per_group") for kw in _spill_programs(held_to_48_names(form))]
    return library_options_programs(_heaviest_names(arch), arch, "forward", spill)


@pytest.mark.parametrize("arch", arch_params())
def test_heaviest_instantiations_compile_with_library_options(arch):
    """The same NVRTC options the library uses at run time (no fast-compile mode)."""
    names = _heaviest_names(arch)
    assert len(names) == len(arch_dtypes(arch)) * len(QUANT_FORMS) * (2 if COMPILE_ALL or arch == FULL_ARCH else 1)
    programs = _heaviest_programs(arch)
    assert sorted(n for kw in programs for n in kw["names"] if n in names) == names
    for kwargs in programs:
        cubin = compile_program(**kwargs).result().get()
        assert len(set(re.findall(KERNEL_SYMBOL, cubin))) == len(kwargs["names"]), "one kernel per name expression"


def test_every_form_and_op_compiles_with_library_options_on_other_architectures_too():
    """Over the architectures but sm_90 each form's heaviest plan compiles for both ops, each
    of them for one op (every dtype, one on each: helpers.arch_dtypes)."""
    others = [a for a in COMPILE_ARCHS if a != FULL_ARCH]
    for form in QUANT_FORMS:
        assert {f for a in others for f in heaviest_ops(a, form)} == {False, True}
        assert all(len(heaviest_ops(a, form)) == (2 if COMPILE_ALL else 1) for a in others)
    assert {d for a in others for d in arch_dtypes(a)} == set(CUDA_TYPES)


def compile_jobs():
    """[(test function, its parameters, program)]: every program this module's tests compile
    (for tests/cpu/conftest.py to start those of the selected tests early)."""
    if nvrtc_missing():
        return []
    jobs = []
    for arch in COMPILE_ARCHS:
        if arch_missing(arch):
            continue
        jobs += [("test_quant_instantiations_compile", dict(arch=arch, dtype=dtype), kwargs)
                 for dtype in arch_dtypes(arch, CROSS_SECTION_TURN)
                 for _, kwargs in _instantiation_programs(arch, dtype)]
        jobs += [("test_heaviest_instantiations_compile_with_library_options", dict(arch=arch), kwargs)
                 for kwargs in _heaviest_programs(arch)]
    if not arch_missing("sm_90"):
        jobs += [("test_register_variants_do_not_spill", {}, kwargs) for kwargs in _spill_programs(spill_check_names())]
        jobs += [("test_dynamic_forms_on_the_vector_grid_are_held_to_48_registers", dict(form=form), kwargs)
                 for form in ("per_token", "per_group") for kwargs in _spill_programs(held_to_48_names(form))]
    return jobs
