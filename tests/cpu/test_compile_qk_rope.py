"""The QK norm + RoPE kernels' instantiations compile with NVRTC, without a GPU (see test_compile.py).

qk_rope_plan and qk_rope_backward_plan over head sizes 2 to 512 (64, 128 and 256 the common
ones, 80 and 96 whose NeoX halves are no power of two) and rotary dims (full, half, a quarter,
one pair), NeoX and GPT-J: at each dtype's widest vector every (geometry, where a channel's
partner lies: the same vector, another lane, another vector of the thread, or shared memory;
interleaved or not) they make, the narrower vectors' by turns; the angles' convention, their
dtype and the weights' dtype vary by turns (every value of each is met). The widest vectors'
backward instantiations and the forward's of 16 elements a thread, with float32 weights and
angles (the most registers), compile with the library's own options through ptxas -v: no
spills. With CUPY_RMSNORM_COMPILE_ALL=1 every vector width takes every key.
"""

import functools
import itertools

import pytest
from helpers import (COMPILE_ALL, FULL_ARCH, ITEMSIZE, VECS, arch_missing, check_symbols, chunks, compile_program,
                     nvrtc_missing, ptxas_entries, requires_arch)

from cupy_rmsnorm._abi import CUDA_TYPES
from cupy_rmsnorm.ops.qk_rope.launch import qk_rope_backward_instantiation_name, qk_rope_instantiation_name
from cupy_rmsnorm.ops.qk_rope.plan import qk_rope_backward_plan, qk_rope_plan

pytestmark = [pytest.mark.skipif(nvrtc_missing() is not None, reason=f"NVRTC compile test: {nvrtc_missing()}"),
              requires_arch(FULL_ARCH)]

KERNEL_NAME = rb"_ZN7rmsnorm\d+qk_norm_rope_\w+"
HEAD_DIMS = (2, 64, 80, 96, 128, 256, 512)
BATCH = 24
SMS = 132


def rotary_dims(head_dim):
    """Full, a half and a quarter (even), and NeoX's smallest halves: 8 (within a vector) and 2."""
    return sorted({head_dim, head_dim // 2 - head_dim // 2 % 2, head_dim // 4 - head_dim // 4 % 2, 8, 2} - {0}
                  - set(range(head_dim + 1, 9)))


def pairing(plan):
    """Where a plan's channel finds its partner (the kernel's code path) and whether pairs interleave."""
    p, vec, lanes = plan.pairs, plan.vec, plan.threads_per_head
    where = "shared" if p == 0 else "vector" if p < vec else "lane" if p < vec * lanes else "thread"
    return where, p == 1


_heaviest = {}     # dtype -> {(pass, vec, elements a thread, pairing): the last (most threads) plan}


@functools.cache
def _plans(dtype):
    """{(pass, vec, vectors a thread, pairing): a plan} over the head sizes and rotary dims (the
    first found: the fewest threads a head; the spill check's heaviest are of its own)."""
    found = {}
    for vec in VECS[dtype]:
        for head_dim in HEAD_DIMS:
            if head_dim % vec:
                continue
            for rd, neox in itertools.product(rotary_dims(head_dim), (True, False)):
                for direction, plan in (("fwd", qk_rope_plan(100, 40, head_dim, rd, neox, vec)),
                                        ("bwd", qk_rope_backward_plan(100, 40, head_dim, rd, neox, vec, SMS))):
                    key = (direction, vec, plan.vecs_per_thread) + pairing(plan)
                    found.setdefault(key, plan)
                    heavy = (direction, vec, plan.vecs_per_thread * vec) + pairing(plan)
                    if plan.vecs_per_thread * vec >= 8:
                        _heaviest.setdefault(dtype, {})[heavy] = plan
    return found


def _name(dtype, key, plan, weight, table, cache):
    make = qk_rope_instantiation_name if key[0] == "fwd" else qk_rope_backward_instantiation_name
    return make(dtype, weight, table, plan, cache)


@functools.cache
def instantiations(dtype):
    """The names this run compiles for ``dtype``: the widest vector's every key, the others' by
    turns (all with CUPY_RMSNORM_COMPILE_ALL=1), the variations taken by turns."""
    widest = max(VECS[dtype])
    names = []
    for i, (key, plan) in enumerate(sorted(_plans(dtype).items())):
        if not (COMPILE_ALL or key[1] == widest or i % 5 == 0):
            continue
        weight = (dtype, "float32", None)[i % 3]
        table = ("float32", dtype)[(i // 3) % 2]
        names.append(_name(dtype, key, plan, weight, table, bool((i // 2) % 2)))
    return sorted(set(names))


def _program(name):
    """The program that holds an instantiation: the forward's or the backward's."""
    return "qk_rope_backward" if "backward" in name else "qk_rope"


def _programs(dtype):
    return [dict(names=chunk, arch=FULL_ARCH, program=program) for program in ("qk_rope", "qk_rope_backward")
            for chunk in chunks([n for n in instantiations(dtype) if _program(n) == program], BATCH)]


def _register_variants():
    """The spill check's instantiations, float32 weights and angles (the most registers), the
    convention by turns: of each dtype's widest vector, every pairing with 8 or more elements a
    thread (the backward's sums are then 107-191 registers), float16 and bfloat16 (the same
    16-bit registers) by turns."""
    names = []
    for n, dtype in enumerate(CUDA_TYPES):
        _plans(dtype)
        widest = max(VECS[dtype])
        keys = sorted(k for k in _heaviest[dtype] if k[1] == widest)
        for i, key in enumerate(keys):
            if dtype == "float32" or i % 2 == n % 2:
                names.append(_name(dtype, key, _heaviest[dtype][key], "float32", "float32", bool(i % 2)))
    return names


def _spill_programs():
    return [dict(names=chunk, arch=FULL_ARCH, program=program, fast=False, extra_options=("-Xptxas=-v",))
            for program in ("qk_rope", "qk_rope_backward")
            for chunk in chunks([n for n in _register_variants() if _program(n) == program], BATCH)]


def compile_jobs():
    """[(test function, its parameters, program)] for tests/cpu/conftest.py."""
    if arch_missing(FULL_ARCH):
        return []
    jobs = [("test_qk_rope_instantiations_compile", dict(dtype=dtype), kwargs)
            for dtype in CUDA_TYPES for kwargs in _programs(dtype)]
    return jobs + [("test_qk_rope_register_variants_do_not_spill", {}, kwargs) for kwargs in _spill_programs()]


def test_every_code_path_and_variation_is_compiled():
    for dtype in CUDA_TYPES:
        text = " ".join(instantiations(dtype))
        wheres = {key[3:] for key in _plans(dtype) if key[1] == max(VECS[dtype])}
        assert {("thread", False), ("lane", False), ("shared", False), ("vector", True)} <= wheres, (dtype, wheres)
        for part in ("qk_norm_rope_kernel<", "qk_norm_rope_backward_kernel<", ", 0, true>", ", 1, false>",
                     ", float, float, ", f", {CUDA_TYPES[dtype]}, {CUDA_TYPES[dtype]}, "):
            assert part in text, (dtype, part)
    narrow = {key[3:] for dtype in CUDA_TYPES for key in _plans(dtype) if key[1] == 1}
    assert ("lane", True) in narrow                  # interleaved pairs across lanes (one element a vector)
    assert ITEMSIZE["float32"] * max(VECS["float32"]) == 16


@pytest.mark.parametrize("dtype", list(CUDA_TYPES))
def test_qk_rope_instantiations_compile(dtype):
    programs = _programs(dtype)
    futures = [compile_program(**kwargs) for kwargs in programs]
    for kwargs, future in zip(programs, futures):
        check_symbols(future.result().get(), [(n, b"_ZN7rmsnorm") for n in kwargs["names"]], KERNEL_NAME)


def test_qk_rope_register_variants_do_not_spill():
    programs = _spill_programs()
    futures = [compile_program(**kwargs) for kwargs in programs]
    for kwargs, future in zip(programs, futures):
        result = future.result()
        result.get()
        entries = ptxas_entries(result.log)
        assert len(entries) == len(kwargs["names"]), result.log[-2000:]
        spilling = [name for name, spill in entries if int(spill)]
        assert not spilling, spilling
