"""The gated kernels' instantiations compile with NVRTC, without a GPU (see test_compile.py).

Every (threads per row, vectors per thread) geometry that gated_plan and gated_backward_plan
make, for every storage dtype at its widest vector, and the narrower vectors by turns; the
orders, activations, weight types and output types vary by turns over them (every value of
each is met). The register variants of the widest vectors compile with the library's own options through
ptxas -v: no spills. With CUPY_RMSNORM_COMPILE_ALL=1 every vector width takes every geometry.
"""

import functools
import itertools

import pytest
from helpers import (COMPILE_ALL, FULL_ARCH, ITEMSIZE, SMS, VECS, arch_missing, check_symbols, chunks,
                     compile_program, nvrtc_missing, ptxas_entries, requires_arch)

from cupy_rmsnorm._abi import CUDA_TYPES, gated_backward_instantiation_name, gated_instantiation_name
from cupy_rmsnorm._plan import gated_backward_plan, gated_plan

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
def instantiations(dtype):
    """The names this run compiles for ``dtype``: the widest vector's every geometry, the others'
    by turns (all with CUPY_RMSNORM_COMPILE_ALL=1), the variations taken by turns."""
    widest = max(VECS[dtype])
    names = []
    for i, (key, plan) in enumerate(sorted(_geometries(dtype).items())):
        if not (COMPILE_ALL or key[1] == widest or i % 3 == 0):
            continue
        norm_before_gate, activation = bool(i % 2), ("silu", "sigmoid")[(i // 2) % 2]
        weight = (dtype, "float32", None)[i % 3]
        if key[0] == "fwd":
            out = (dtype, "float32")[(i // 3) % 2]
            names.append(gated_instantiation_name(dtype, weight, out, plan, norm_before_gate, activation))
        else:
            dy = (dtype, "float32")[(i // 3) % 2]
            names.append(gated_backward_instantiation_name(dtype, dy, weight, plan, norm_before_gate, activation))
    return sorted(set(names))


def _programs(dtype):
    return [dict(names=chunk, arch=FULL_ARCH, program="gated") for chunk in chunks(instantiations(dtype), BATCH)]


def _register_variants():
    """The spill check's instantiations: per dtype and pass every register geometry of the
    widest vector (the most registers), a float32 weight, the order by turns."""
    names = []
    for dtype in CUDA_TYPES:
        keys = sorted(k for k in _geometries(dtype) if k[1] == max(VECS[dtype]) and k[3] > 0)
        for i, key in enumerate(keys):
            plan = _geometries(dtype)[key]
            if key[0] == "fwd":
                names.append(gated_instantiation_name(dtype, "float32", dtype, plan, bool(i % 2), "silu"))
            else:
                names.append(gated_backward_instantiation_name(dtype, dtype, "float32", plan, bool(i % 2), "silu"))
    return names


def _spill_program():
    return dict(names=_register_variants(), arch=FULL_ARCH, program="gated", fast=False, extra_options=("-Xptxas=-v",))


def compile_jobs():
    """[(test function, its parameters, program)] for tests/cpu/conftest.py."""
    if arch_missing(FULL_ARCH):
        return []
    jobs = [("test_gated_instantiations_compile", dict(dtype=dtype), kwargs)
            for dtype in CUDA_TYPES for kwargs in _programs(dtype)]
    return jobs + [("test_gated_register_variants_do_not_spill", {}, _spill_program())]


def test_every_geometry_and_variation_is_compiled():
    for dtype in CUDA_TYPES:
        names = instantiations(dtype)
        text = " ".join(names)
        for key in _geometries(dtype):
            if key[1] == max(VECS[dtype]):
                kernel = "rms_norm_gated_kernel" if key[0] == "fwd" else "rms_norm_gated_backward_kernel"
                assert f"{kernel}<" in text and f", {key[1]}, {key[2]}, {key[3]}, " in text, (dtype, key)
        for part in ("true, 0>", "false, 0>", "true, 1>", "false, 1>", ", float, "):
            assert part in text, (dtype, part)


@pytest.mark.parametrize("dtype", list(CUDA_TYPES))
def test_gated_instantiations_compile(dtype):
    programs = _programs(dtype)
    futures = [compile_program(**kwargs) for kwargs in programs]
    for kwargs, future in zip(programs, futures):
        check_symbols(future.result().get(), [(n, b"_ZN7rmsnorm") for n in kwargs["names"]], KERNEL_NAME)


def test_gated_register_variants_do_not_spill():
    program = _spill_program()
    result = compile_program(**program).result()
    result.get()
    entries = ptxas_entries(result.log)
    assert len(entries) == len(program["names"]), result.log[-2000:]
    spilling = [name for name, spill in entries if int(spill)]
    assert not spilling, spilling
