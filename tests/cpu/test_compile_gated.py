"""The gated kernels' instantiations compile with NVRTC, without a GPU (see test_compile.py).

Every (threads per row, vectors per thread) geometry that gated_plan and gated_backward_plan
make at the widest vector, and the narrower vectors by turns, for sm_90: all of them for
float32, while float16 and bfloat16 (the same templates and plans, other conversions) take
them by turns (helpers.sixteen_bit_share), together every one; the orders, activations,
weight types and output types vary by turns over each dtype's (every value of each is met).
The register variants of the widest vectors compile with the library's own options through
ptxas -v: no spills (float16 and bfloat16 by turns, float32 by turns too: at each geometry it
needs no more registers than they do, measured at sm_90). With CUPY_RMSNORM_COMPILE_ALL=1
every dtype and vector width takes every geometry, and every dtype every spill check.
"""

import functools
import itertools

import pytest
from helpers import (COMPILE_ALL, FULL_ARCH, ITEMSIZE, SIXTEEN_BIT, SMS, VECS, arch_missing, check_symbols, chunks,
                     compile_program, nvrtc_missing, ptxas_entries, requires_arch, sixteen_bit_share)

from cupy_rmsnorm._abi import CUDA_TYPES
from cupy_rmsnorm.ops.gated.launch import gated_backward_instantiation_name, gated_instantiation_name
from cupy_rmsnorm.ops.gated.plan import gated_backward_plan, gated_plan

pytestmark = [pytest.mark.skipif(nvrtc_missing() is not None, reason=f"NVRTC compile test: {nvrtc_missing()}"),
              requires_arch(FULL_ARCH)]

KERNEL_NAME = rb"_ZN7rmsnorm\d+rms_norm_gated_\w+"
# vectors per group at each boundary of the two plans (warp groups, one or two vectors a
# thread, a block, streaming), times the vector width, and the row counts of each regime
VECTOR_COUNTS = (1, 8, 16, 17, 32, 64, 65, 128, 256, 257, 512, 513, 1024, 2048, 2049, 4096, 100_000)
ROWS = (1, 32, 300, 4096)
BATCH = 30


@functools.cache
def _geometries(dtype):
    """{(vec, threads per row, vectors per thread): (forward plan or None, backward plan or None)}."""
    found = {}
    for vec in VECS[dtype]:
        for n, rows in itertools.product(VECTOR_COUNTS, ROWS):
            hidden = n * vec
            plan = gated_plan(rows, hidden, ITEMSIZE[dtype], vec, SMS)
            back = gated_backward_plan(rows, 1, hidden, ITEMSIZE[dtype], vec, SMS)
            found.setdefault(("fwd",) + plan.template_args()[:3], plan)
            found.setdefault(("bwd",) + back.template_args(), back)
    return found


@functools.cache
def geometries(dtype):
    """The geometries this run compiles for ``dtype``: the widest vector's every one, the
    others' by turns (all with CUPY_RMSNORM_COMPILE_ALL=1); float16 and bfloat16 take them by
    turns (helpers.sixteen_bit_share)."""
    widest = max(VECS[dtype])
    keys = [key for i, key in enumerate(sorted(_geometries(dtype))) if COMPILE_ALL or key[1] == widest or i % 3 == 0]
    return sixteen_bit_share(dtype, keys)


@functools.cache
def instantiations(dtype):
    """The names this run compiles for ``dtype``: its geometries, the variations taken by turns."""
    names = []
    for i, key in enumerate(geometries(dtype)):
        plan = _geometries(dtype)[key]
        norm_before_gate, activation = bool(i % 2), ("silu", "sigmoid")[(i // 2) % 2]
        weight = (dtype, "float32", None)[i % 3]
        if key[0] == "fwd":
            out = (dtype, "float32")[(i // 3) % 2]
            names.append(gated_instantiation_name(dtype, weight, out, plan, norm_before_gate, activation))
        else:
            dy = (dtype, "float32")[(i // 3) % 2]
            names.append(gated_backward_instantiation_name(dtype, dy, weight, plan, norm_before_gate, activation))
    return sorted(set(names))


def _program(name):
    """The program that holds an instantiation: the forward's or the backward's."""
    return "gated_backward" if "backward" in name else "gated"


def _programs(dtype):
    return [dict(names=chunk, arch=FULL_ARCH, program=program) for program in ("gated", "gated_backward")
            for chunk in chunks([n for n in instantiations(dtype) if _program(n) == program], BATCH)]


def _register_variants():
    """The spill check's instantiations: per pass every register geometry of the widest vector
    (the most registers) for float16 or bfloat16, half of them for float32 (by turns:
    helpers.sixteen_bit_share), a float32 weight, the order by turns."""
    names = []
    for dtype in CUDA_TYPES:
        keys = sorted(k for k in _geometries(dtype) if k[1] == max(VECS[dtype]) and k[3] > 0)
        for i, key in enumerate(sixteen_bit_share(dtype, keys, float32_by_turns=True)):
            plan = _geometries(dtype)[key]
            if key[0] == "fwd":
                names.append(gated_instantiation_name(dtype, "float32", dtype, plan, bool(i % 2), "silu"))
            else:
                names.append(gated_backward_instantiation_name(dtype, dtype, "float32", plan, bool(i % 2), "silu"))
    return names


def _spill_programs():
    return [dict(names=names, arch=FULL_ARCH, program=program, fast=False, extra_options=("-Xptxas=-v",))
            for program in ("gated", "gated_backward")
            for names in [[n for n in _register_variants() if _program(n) == program]]]


def compile_jobs():
    """[(test function, its parameters, program)] for tests/cpu/conftest.py."""
    if arch_missing(FULL_ARCH):
        return []
    jobs = [("test_gated_instantiations_compile", dict(dtype=dtype), kwargs)
            for dtype in CUDA_TYPES for kwargs in _programs(dtype)]
    return jobs + [("test_gated_register_variants_do_not_spill", {}, kwargs) for kwargs in _spill_programs()]


def _geometry(name):
    """fwd or bwd and the vector width, threads per row and vectors per thread of a name."""
    args = name[:-1].split("<")[1].split(", ")
    return ("bwd" if "backward" in name else "fwd",) + tuple(map(int, args[3:6]))


def test_every_geometry_and_variation_is_compiled():
    """Every geometry of the widest vector (float32's alone, float16's and bfloat16's together:
    the same plans, each about half of them) and every variation for each dtype."""
    assert set(_geometries("float16")) == set(_geometries("bfloat16"))
    for dtypes in (("float32",), SIXTEEN_BIT):
        found = {_geometry(n) for d in dtypes for n in instantiations(d)}
        widest = {k for k in _geometries(dtypes[0]) if k[1] == max(VECS[dtypes[0]])}
        assert widest <= found <= set(_geometries(dtypes[0])), dtypes
    for dtype in CUDA_TYPES:
        text = " ".join(instantiations(dtype))
        for part in ("true, 0>", "false, 0>", "true, 1>", "false, 1>", ", float, "):
            assert part in text, (dtype, part)
    halves = [geometries(d) for d in SIXTEEN_BIT]
    assert COMPILE_ALL or (not set(halves[0]) & set(halves[1]) and abs(len(halves[0]) - len(halves[1])) <= 1)
    assert all({k[0] for k in half} == {"fwd", "bwd"} for half in halves)


@pytest.mark.parametrize("dtype", list(CUDA_TYPES))
def test_gated_instantiations_compile(dtype):
    programs = _programs(dtype)
    futures = [compile_program(**kwargs) for kwargs in programs]
    for kwargs, future in zip(programs, futures):
        check_symbols(future.result().get(), [(n, b"_ZN7rmsnorm") for n in kwargs["names"]], KERNEL_NAME)


def test_gated_register_variants_do_not_spill():
    """Every register geometry of the widest vector for float16 and bfloat16 together, half
    of them for float32 (the same geometries)."""
    widest = {d: {k for k in _geometries(d) if k[1] == max(VECS[d]) and k[3] > 0} for d in CUDA_TYPES}
    assert {k[:1] + k[2:] for k in widest["float32"]} == {k[:1] + k[2:] for k in widest["float16"]}

    def taken(dtypes):
        return {_geometry(n) for n in _register_variants() if n.split("<")[1].split(", ")[0]
                in {CUDA_TYPES[d] for d in dtypes}}

    assert taken(SIXTEEN_BIT) == widest["float16"]
    assert taken(["float32"]) <= widest["float32"]
    assert len(taken(["float32"])) == (len(widest["float32"]) if COMPILE_ALL else len(widest["float32"]) // 2)
    programs = _spill_programs()
    for program, future in zip(programs, [compile_program(**kwargs) for kwargs in programs]):
        result = future.result()
        result.get()
        entries = ptxas_entries(result.log)
        assert len(entries) == len(program["names"]), result.log[-2000:]
        spilling = [name for name, spill in entries if int(spill)]
        assert not spilling, spilling
