"""The quantized kernels' instantiations compile with NVRTC, without a GPU (see test_compile.py).

By default a representative set: per storage dtype, op and quantized form, one plan of each
(plan kind, edges) at full vector width and one of each plan kind at a narrower width (the
widths by turns), taking the quant dtypes and the weight types by turns (about 240 in all),
for sm_90; for sm_80 (no clusters; FP8 conversions in software) every fourth of them.
``CUPY_RMSNORM_COMPILE_ALL=1`` compiles every (plan, form) with every quant dtype. The
heaviest register variants (most vectors per thread for each block size, full width, with
edges) are also compiled with ptxas -v at the library's own options: they must not spill
(the per-token form's plan rule is there for that), but for the dynamic forms on the vector
grid in a block of 64-256 threads a row, held to 48 registers (a spill of up to 16 bytes allowed).
"""

import functools
import os
import re

import pytest
from test_compile import (ARCHS, HIDDEN_SIZES, ITEMSIZE, MANGLED, MAX_CLUSTER, NVRTC_MISSING, ROWS, SMS, VECS,
                          _check_batch, _compile_batches, plan_kind)

from cupy_rmsnorm import _compile, launch_plan
from cupy_rmsnorm._abi import CUDA_TYPES, QUANT_FORMS, QUANT_TYPES, quant_instantiation_name
from cupy_rmsnorm._plan import QUANT_GROUP

pytestmark = pytest.mark.skipif(NVRTC_MISSING is not None, reason=f"NVRTC compile test: {NVRTC_MISSING}")

COMPILE_ALL = os.environ.get("CUPY_RMSNORM_COMPILE_ALL") == "1"
KERNEL_SYMBOL = re.compile(rb"_ZN7rmsnorm\d+rms_norm_quant\w+")


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
    ints = "".join(f"Lb{int(a == 'true')}E" if a in ("true", "false") else f"Li{a}E"
                   for a in plan.template_args() + (QUANT_FORMS[form], QUANT_TYPES[quant_dtype]) + flat)
    return f"_ZN7rmsnorm{len(kernel)}{kernel}I{MANGLED[t]}{w_code}Lb{int(fused)}E{ints}".encode()   # then the defaulted type R


@functools.cache
def instantiations(dtype):
    """(name expression, mangled prefix) pairs to compile for one storage dtype."""
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
    return sorted({(quant_instantiation_name(dtype, w, f, p, form, q), _mangled(dtype, w, f, p, form, q))
                   for f, form, p, w, q in choices})


def _chunks(pairs, size=60):
    return [pairs[i:i + size] for i in range(0, len(pairs), size)]


def _check(result, pairs):
    _check_batch(result, pairs, lambda binary: set(KERNEL_SYMBOL.findall(binary)))


def arch_instantiations(arch, dtype):
    pairs = instantiations(dtype)
    return pairs if arch == "sm_90" or COMPILE_ALL else pairs[::4]


@pytest.fixture(scope="module")
def compiled():
    batches = [((arch, dtype, i), [e for e, _ in chunk], arch) for arch in ARCHS for dtype in CUDA_TYPES
               for i, chunk in enumerate(_chunks(arch_instantiations(arch, dtype), 40))]
    return _compile_batches(batches, fast=True)


@pytest.mark.parametrize("dtype", list(CUDA_TYPES))
@pytest.mark.parametrize("arch", ARCHS)
def test_quant_instantiations_compile(compiled, arch, dtype):
    for i, chunk in enumerate(_chunks(arch_instantiations(arch, dtype), 40)):
        _check(compiled[(arch, dtype, i)], chunk)


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


def _spills(names):
    log = []
    _compile.compile_offline(names, "sm_90", "forward", ("-Xptxas=-v",), log)
    text = log[0].replace("\0", "")
    return re.findall(r"Compiling entry function '(\w+)'.*?(\d+) bytes spill stores", text, re.S)


def test_register_variants_do_not_spill():
    """ptxas -v at the library's own options (sm_90) for the heaviest plans, with weights of
    x's dtype and float32, e4m3 (int8, the longest conversion, for the static form): no spills."""
    import concurrent.futures
    names = sorted({quant_instantiation_name(dtype, w, fused, p, form, "int8" if form == "static" else "float8_e4m3fn")
                    for dtype in CUDA_TYPES for fused in (False, True) for form in QUANT_FORMS
                    for p in heaviest(dtype, fused, form) if not held_to_48(p, form) for w in (dtype, "float32")})
    with concurrent.futures.ThreadPoolExecutor(max(2, os.cpu_count() or 2)) as pool:
        spills = [s for part in pool.map(_spills, _chunks(names, 12)) for s in part]
    assert len(spills) == len(names)
    assert all(n == "0" for _, n in spills), [s for s in spills if s[1] != "0"]


@pytest.mark.parametrize("form", ["per_token", "per_group"])
def test_dynamic_forms_on_the_vector_grid_are_held_to_48_registers(form):
    """kernels/rms_norm.cu's quant_min_blocks_of_256: the dynamic forms without edges in a
    block of 64-256 threads a row (their y kept in registers) compile to at most 48 registers,
    so 10 blocks of 128 share an SM, with at most 16 bytes of spill (up to 12 seen; measured
    faster, benchmarks/NOTES.md 29, 30). Their heaviest plans, weights of x's dtype and float32."""
    import concurrent.futures
    names = set()
    for dtype in CUDA_TYPES:
        for fused in (False, True):
            best = {}
            for p in quant_plans(dtype, fused, form).values():
                if held_to_48(p, form) and p.vec == max(VECS[dtype]):
                    if p.block not in best or p.vecs_per_thread > best[p.block].vecs_per_thread:
                        best[p.block] = p
            names |= {quant_instantiation_name(dtype, w, fused, p, form, "float8_e4m3fn")
                      for p in best.values() for w in (dtype, "float32")}
    assert any("128, 4" in n for n in names), sorted(names)    # the 4096-wide rows' plan is there

    def used(chunk):
        log = []
        _compile.compile_offline(chunk, "sm_90", "forward", ("-Xptxas=-v",), log)
        text = log[0].replace("\0", "")
        return re.findall(r"Compiling entry function '(\w+)'.*?(\d+) bytes spill stores.*?Used (\d+) registers",
                          text, re.S)

    with concurrent.futures.ThreadPoolExecutor(max(2, os.cpu_count() or 2)) as pool:
        found = [f for part in pool.map(used, _chunks(sorted(names), 12)) for f in part]
    assert len(found) == len(names)
    assert all(int(regs) <= 48 and int(spill) <= 16 for _, spill, regs in found), found
