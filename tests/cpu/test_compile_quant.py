"""The quantized kernels' instantiations compile with NVRTC, without a GPU (see test_compile.py).

By default a representative set: per storage dtype, op and quantized form, one plan of each
(plan kind, edges) at full vector width and one of each plan kind at a narrower width (the
widths by turns), taking the quant dtypes and the weight types by turns (about 240 in all),
for sm_90; for sm_80 (no clusters; FP8 conversions in software), sm_100 and sm_120 a
cross-section of it: per storage dtype one of each (form, plan kind), the ops, widths, edges,
quant dtypes and weight types by turns (45 each). The heaviest plan of each form and op
compiles with the library's own options for every architecture.
``CUPY_RMSNORM_COMPILE_ALL=1`` compiles every (plan, form) with every quant dtype for every
architecture. The heaviest register variants (most vectors per thread for each block size,
full width, with edges) are also compiled with ptxas -v at the library's own options: they
must not spill (the per-token form's plan rule is there for that), but for the dynamic forms
on the vector grid in a block of 64-256 threads a row, held to 48 registers (a spill of up to
16 bytes allowed).
"""

import functools
import re

import pytest
from helpers import (COMPILE_ALL, COMPILE_ARCHS, FULL_ARCH, HIDDEN_SIZES, ITEMSIZE, MANGLED, MAX_CLUSTER, ROWS, SMS,
                     VECS, arch_missing, arch_params, by_turns, check_symbols, chunks, compile_program, heaviest_dtypes,
                     nvrtc_missing, plan_kind, ptxas_entries, spill_turns, template_ints)

from cupy_rmsnorm import launch_plan
from cupy_rmsnorm._abi import CUDA_TYPES, QUANT_FORMS, QUANT_TYPES, quant_instantiation_name
from cupy_rmsnorm._plan import QUANT_GROUP

pytestmark = pytest.mark.skipif(nvrtc_missing() is not None, reason=f"NVRTC compile test: {nvrtc_missing()}")
requires_sm_90 = pytest.mark.skipif(arch_missing("sm_90") is not None,
                                    reason=f"NVRTC compile test (sm_90): {arch_missing('sm_90')}")

KERNEL_SYMBOL = rb"_ZN7rmsnorm\d+rms_norm_quant\w+"
BATCH = 20          # instantiations per program (a quantized instantiation costs about twice a forward one)
SPILL_BATCH = 8


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
def representative_choices(dtype):
    """[(fused, form, plan, weight, quant dtype)] of the representative set (every plan with
    every quant dtype and both weight types with CUPY_RMSNORM_COMPILE_ALL=1)."""
    choices, turn = [], 0
    for fused in (False, True):
        for form in QUANT_FORMS:
            plans = quant_plans(dtype, fused, form).values()
            if COMPILE_ALL:
                choices += [(fused, form, p, w, q) for p in plans for w in (dtype, "float32") for q in QUANT_TYPES]
                continue
            full, narrow = {}, {}
            for p in sorted(plans, key=lambda p: p.template_args()):
                if p.vec == max(VECS[dtype]):
                    full.setdefault((plan_kind(p), p.edges), []).append(p)
                else:
                    narrow.setdefault(plan_kind(p), []).append(p)
            for group in [full[k] for k in sorted(full)] + [narrow[k] for k in sorted(narrow)]:
                turn += 1
                p = group[turn % len(group)]
                choices.append((fused, form, p, ("float32", dtype)[turn % 2], list(QUANT_TYPES)[turn % 3]))
    return choices


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


@pytest.mark.parametrize("dtype", list(CUDA_TYPES))
@pytest.mark.parametrize("arch", arch_params())
def test_quant_instantiations_compile(arch, dtype):
    programs = _instantiation_programs(arch, dtype)
    futures = [compile_program(**kwargs) for _, kwargs in programs]
    for (pairs, _), future in zip(programs, futures):
        check_symbols(future.result().get(), pairs, KERNEL_SYMBOL)


@pytest.mark.skipif(COMPILE_ALL, reason="CUPY_RMSNORM_COMPILE_ALL=1: every instantiation on every architecture")
def test_cross_sections_cover_every_form_and_plan_kind():
    """Each architecture's cross-section has, per storage dtype, every (form, plan kind), both
    ops, every quant dtype and both weight types; and nothing the representative set lacks."""
    for dtype in CUDA_TYPES:
        for arch in COMPILE_ARCHS:
            if arch == FULL_ARCH:
                continue
            section = cross_section_choices(dtype, arch)
            assert sorted((form, plan_kind(p)) for _, form, p, _, _ in section) == \
                sorted((form, k) for form in QUANT_FORMS
                       for k in ("warp group", "block", "stream", "block cluster", "stream cluster"))
            assert {f for f, *_ in section} == {False, True}
            assert {q for *_, q in section} == set(QUANT_TYPES)
            assert {CUDA_TYPES[w] for _, _, _, w, _ in section} == {CUDA_TYPES[dtype], "float"}
            assert set(_pairs(dtype, section)) <= set(instantiations(dtype))


def _form_and_type(name):
    """(FORM, QTYPE) of an instantiation name: its last arguments, or before FLAT where it has one."""
    args = name[:-1].split(", ")
    return tuple(args[-2:] if "cluster" in name else args[-3:-1])


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


@functools.cache
def spill_check_names():
    """The heaviest plans of each storage dtype, op and form not held to 48 registers, e4m3
    (int8, the longest conversion, for the static form), with weights of x's dtype and float32
    (helpers.spill_turns: by default the 16-bit dtypes and the weight types by turns)."""
    names = set()
    for dtype in CUDA_TYPES:
        plans = [(fused, form, p) for fused in (False, True) for form in QUANT_FORMS
                 for p in spill_plans(dtype, fused, form)]
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
                for f in (False, True) for form in QUANT_FORMS for p in spill_plans(dtype, f, form)}

    assert every("float16") == every("bfloat16")     # the same plans: the 16-bit dtypes take them by turns
    assert {plan_part(n) for n in names if n.split("<")[1].startswith(("__half", "__nv_bfloat16"))} == every("float16")
    assert {plan_part(n) for n in names if n.split("<")[1].startswith("float,")} == every("float32")
    spills = _ptxas_reports(names)
    assert len(spills) == len(names)
    assert all(n == "0" for _, n in spills), [s for s in spills if s[1] != "0"]


@functools.cache
def held_to_48_names(form):
    """Per storage dtype and op, the heaviest plan of each block size held to 48 registers, e4m3,
    weights of x's dtype and float32 (helpers.spill_turns: by default the 16-bit dtypes and the
    weight types by turns)."""
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
                  for i, weights in spill_turns(dtype, len(plans)) for w in weights}
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


def _heaviest_program(arch):
    """Per storage dtype, op and form, the register plan with the most vectors per thread at
    full width (int8 / e4m3), float32 weights: the library's own options (every dtype on
    sm_90, one by turns on the other architectures)."""
    names = set()
    for dtype in heaviest_dtypes(arch):
        for fused in (False, True):
            for form in QUANT_FORMS:
                p = max(heaviest(dtype, fused, form), key=lambda p: (p.vecs_per_thread, p.block, p.edges, p.flat))
                names.add(quant_instantiation_name(dtype, "float32", fused, p, form, SPILL_QUANT[form]))
    return dict(names=sorted(names), arch=arch, fast=False)


@pytest.mark.parametrize("arch", arch_params())
def test_heaviest_instantiations_compile_with_library_options(arch):
    """The same NVRTC options the library uses at run time (no fast-compile mode)."""
    program = _heaviest_program(arch)
    assert len(program["names"]) == len(heaviest_dtypes(arch)) * 2 * len(QUANT_FORMS)
    cubin = compile_program(**program).result().get()
    assert len(set(re.findall(KERNEL_SYMBOL, cubin))) == len(program["names"]), "one kernel per name expression"


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
                 for dtype in CUDA_TYPES for _, kwargs in _instantiation_programs(arch, dtype)]
        jobs.append(("test_heaviest_instantiations_compile_with_library_options", dict(arch=arch),
                     _heaviest_program(arch)))
    if not arch_missing("sm_90"):
        jobs += [("test_register_variants_do_not_spill", {}, kwargs) for kwargs in _spill_programs(spill_check_names())]
        jobs += [("test_dynamic_forms_on_the_vector_grid_are_held_to_48_registers", dict(form=form), kwargs)
                 for form in ("per_token", "per_group") for kwargs in _spill_programs(held_to_48_names(form))]
    return jobs
