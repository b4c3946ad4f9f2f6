"""The LayerNorm programs ("layer_norm", "layer_norm_backward") compile with NVRTC, without a
GPU, for sm_80, sm_90, sm_100 and sm_120 (see test_compile_gated.py for the machinery).

Every launch geometry (vector width, threads per row, vectors per thread) that the
geometry rules below make, for every storage dtype, on every architecture; the other
template arguments (residual, weight, modulation and output types, the fused and modulated
forms) vary by turns over the geometries, every value of each met per dtype. The widest
register variants compile with the library's own options through ptxas -v at sm_90: no
spills (the modulated backward at 16 elements a thread aside: its numbers are pinned).

The Params structs' NumPy mirrors (ops/layer_norm/launch.py) against the C++ structs, field for
field; the plan's geometry (ops/layer_norm/plan.py) is what the compiled variants cover.
"""

import functools
import os
import re

import numpy as np
import pytest
from helpers import (COMPILE_ARCHS, FULL_ARCH, VECS, arch_missing, arch_params, check_symbols, chunks,
                     compile_program, nvrtc_missing, ptxas_entries, requires_arch)

from cupy_rmsnorm._abi import CUDA_TYPES, EARLY_TRIGGER, HAS_WEIGHT
from cupy_rmsnorm._compile import PROGRAMS, kernels_dir
from cupy_rmsnorm.ops.layer_norm import launch as L
from cupy_rmsnorm.ops.layer_norm.plan import MAX_ELEMENTS
from cupy_rmsnorm.ops.layer_norm.plan import geometry as layer_norm_geometry

pytestmark = pytest.mark.skipif(nvrtc_missing() is not None, reason=f"NVRTC compile test: {nvrtc_missing()}")

KERNEL_NAME = rb"_ZN7rmsnorm\d+layer_norm_\w+"
BATCH = 40

LAYER_NORM_FLAGS = {"kHasWeight": HAS_WEIGHT, "kEarlyTrigger": EARLY_TRIGGER, "kLnHasBias": L.LN_HAS_BIAS,
                    "kLnAddGrad": L.LN_ADD_GRAD, "kLnParamGrad": L.LN_PARAM_GRAD, "kLnModGrad": L.LN_MOD_GRAD,
                    "kLnDirectParam": L.LN_DIRECT_PARAM, "kLnDirectMod": L.LN_DIRECT_MOD}
STRUCTS = {("layer_norm.cu", "LayerNormParams"): L.LAYER_NORM_PARAMS_DTYPE,
           ("layer_norm_backward.cu", "LayerNormBackwardParams"): L.LAYER_NORM_BACKWARD_PARAMS_DTYPE,
           ("layer_norm_backward.cu", "LayerNormReduceParams"): L.LAYER_NORM_REDUCE_PARAMS_DTYPE}


def geometry(hidden, vec, kind="fwd"):
    return layer_norm_geometry(hidden, vec, backward=kind == "bwd")


@functools.cache
def geometries(dtype, kind):
    """Every (vec, threads per row, vectors per thread) of ``kind`` for ``dtype``."""
    found = set()
    for vec in VECS[dtype]:
        for hidden in range(vec, 16384 + 1, vec):
            g = geometry(hidden, vec, kind)
            if g is not None:
                found.add((vec,) + g)
    return sorted(found)


# -- the instantiations' names ------------------------------------------------------------
def forward_name(t, r, w, m, o, vec, threads, vpt, fused, modulate):
    args = ", ".join([t, r, w, m, o, str(vec), str(threads), str(vpt), str(fused).lower(), str(modulate).lower()])
    return f"rmsnorm::layer_norm_kernel<{args}>"


def backward_name(t, d, w, m, vec, threads, vpt, modulate):
    args = ", ".join([t, d, w, m, str(vec), str(threads), str(vpt), str(modulate).lower()])
    return f"rmsnorm::layer_norm_backward_kernel<{args}>"


def reduce_name(out):
    return f"rmsnorm::layer_norm_backward_reduce_kernel<{out}>"


@functools.cache
def instantiations(dtype, kind):
    """One name a geometry, the other template arguments by turns."""
    t = CUDA_TYPES[dtype]
    names = []
    for i, (vec, threads, vpt) in enumerate(geometries(dtype, kind)):
        def pick(k, i=i):
            return (t, "float")[(i >> k) % 2]
        if kind == "fwd":
            fused, modulate = bool(i % 2), bool((i >> 1) % 2)
            names.append(forward_name(t, pick(2) if fused else t, pick(3), pick(4) if modulate else t, pick(5),
                                      vec, threads, vpt, fused, modulate))
        else:
            modulate = bool(i % 2)
            names.append(backward_name(t, pick(1), pick(2), pick(3) if modulate else t, vec, threads, vpt, modulate))
    if kind == "bwd":
        names.append(reduce_name(t))
    return tuple(names)


PROGRAM_OF = {"fwd": "layer_norm", "bwd": "layer_norm_backward"}


def _programs(arch, dtype, kind):
    return [dict(names=chunk, arch=arch, program=PROGRAM_OF[kind])
            for chunk in chunks(instantiations(dtype, kind), BATCH)]


def _widest(dtype, kind):
    """The geometries of the most elements a thread (the most registers)."""
    return [g for g in geometries(dtype, kind) if g[0] * g[2] == MAX_ELEMENTS]


def _register_variants(kind):
    """The spill check's names: every widest geometry of each dtype, float32 weights,
    residual and modulation (the most registers), fused and modulated (forward)."""
    names = []
    for dtype, t in CUDA_TYPES.items():
        for vec, threads, vpt in _widest(dtype, kind):
            if kind == "fwd":
                names.append(forward_name(t, "float", "float", "float", t, vec, threads, vpt, True, True))
            else:
                for modulate in (False, True):
                    names.append(backward_name(t, t, "float", "float" if modulate else t, vec, threads, vpt, modulate))
    return names


def _spill_program(kind):
    return dict(names=_register_variants(kind), arch=FULL_ARCH, program=PROGRAM_OF[kind], fast=False,
                extra_options=("-Xptxas=-v",))


def compile_jobs():
    """[(test function, its parameters, program)] for tests/cpu/conftest.py."""
    jobs = [("test_layer_norm_instantiations_compile", dict(arch=arch, dtype=dtype, kind=kind), kw)
            for arch in COMPILE_ARCHS if not arch_missing(arch) for dtype in CUDA_TYPES for kind in PROGRAM_OF
            for kw in _programs(arch, dtype, kind)]
    if not arch_missing(FULL_ARCH):
        jobs += [("test_register_variants", dict(kind=kind), _spill_program(kind)) for kind in PROGRAM_OF]
    return jobs


# -- tests --------------------------------------------------------------------------------
def test_programs_are_registered():
    assert PROGRAMS["layer_norm"] == "layer_norm.cu"
    assert PROGRAMS["layer_norm_backward"] == "layer_norm_backward.cu"


def _fields(source, struct):
    """(name, NumPy format, count) of each field of a C++ struct of the kernels."""
    body = re.search(rf"struct {struct} {{(.*?)}};", source, re.S).group(1)
    kinds = {"long long": ("<i8", 1), "RowStrides": ("<i8", 2), "int": ("<i4", 1), "float": ("<f4", 1)}
    fields = []
    for decl in body.split(";"):
        decl = " ".join(decl.split())
        if not decl:
            continue
        ctype = next(k for k in kinds if decl.startswith(k + " "))
        fmt, count = kinds[ctype]
        fields += [(name.strip(), fmt, count) for name in decl[len(ctype):].split(",")]
    return fields


@pytest.mark.parametrize("where", list(STRUCTS), ids=lambda w: w[1])
def test_params_mirror_the_structs(where):
    program, struct = where
    with open(os.path.join(kernels_dir(), program), encoding="utf-8") as f:
        source = f.read()
    dtype = STRUCTS[where]
    mirrored = [(name, dtype.fields[name][0].base.str, int(np.prod(dtype.fields[name][0].shape) or 1))
                for name in dtype.names]
    assert _fields(source, struct) == mirrored
    size = re.search(rf"sizeof\({struct}\) == (\d+)", source).group(1)
    assert dtype.itemsize == int(size)
    offsets = [dtype.fields[name][1] for name in dtype.names]
    assert offsets == sorted(offsets) and all(o % dtype.fields[n][0].base.itemsize == 0
                                              for o, n in zip(offsets, dtype.names))


def test_flags_mirror_the_enum():
    with open(os.path.join(kernels_dir(), "layer_norm.cuh"), encoding="utf-8") as f:
        header = f.read()
    found = {k: int(v) for k, v in re.findall(r"(kLn\w+) = (\d+)", header)}
    assert found == {k: v for k, v in LAYER_NORM_FLAGS.items() if k.startswith("kLn")}


def test_geometries():
    """The rules' reach and shapes: powers of two, every hidden size covered up to the limit."""
    for kind, limit in (("fwd", 16384), ("bwd", 8192)):
        for dtype in CUDA_TYPES:
            for vec in VECS[dtype]:
                for hidden in (vec, 255 * vec, 768, 1152, 4096, 8192, limit, limit + vec):
                    if hidden % vec:
                        continue
                    g = geometry(hidden, vec, kind)
                    if hidden > limit:
                        assert g is None
                        continue
                    threads, vpt = g
                    assert threads * vpt * vec >= hidden and vpt * vec <= MAX_ELEMENTS
                    assert threads & (threads - 1) == 0 and vpt & (vpt - 1) == 0
    assert geometry(64, 8) == (8, 1) and geometry(8192, 8) == (512, 2) and geometry(16384, 1) == (1024, 16)
    assert geometry(8192, 1, "bwd") == (512, 16) and geometry(8200, 8, "bwd") is None


def test_every_geometry_and_variation_is_compiled():
    for dtype, t in CUDA_TYPES.items():
        for kind in PROGRAM_OF:
            names = instantiations(dtype, kind)
            assert len(set(names)) == len(names) == len(geometries(dtype, kind)) + (kind == "bwd")
            text = " ".join(names)
            if kind == "fwd":
                for flags in ("false, false>", "true, false>", "false, true>", "true, true>"):
                    assert flags in text, (dtype, flags)
            if dtype != "float32":
                kernel = "layer_norm_kernel" if kind == "fwd" else "layer_norm_backward_kernel"
                lists = [n.split("<")[1].split(", ") for n in names if kernel in n]
                slots = range(1, 5) if kind == "fwd" else range(1, 4)
                for k in slots:   # each type argument takes x's type and float32 somewhere
                    assert {a[k] for a in lists} == {t, "float"}, (dtype, kind, k)


@pytest.mark.parametrize("kind", list(PROGRAM_OF))
@pytest.mark.parametrize("dtype", list(CUDA_TYPES))
@pytest.mark.parametrize("arch", arch_params())
def test_layer_norm_instantiations_compile(arch, dtype, kind):
    programs = _programs(arch, dtype, kind)
    futures = [compile_program(**kw) for kw in programs]
    for kw, future in zip(programs, futures):
        check_symbols(future.result().get(), [(n, b"_ZN7rmsnorm") for n in kw["names"]], KERNEL_NAME)


# The modulated backward at 16 elements a thread keeps 4 x 16 column sums in registers, over
# the 128 a thread of a 512-thread block may have: it spills a little (sm_90, measured).
MODULATED_BACKWARD_SPILLS = 400   # bytes, at most


@requires_arch(FULL_ARCH)
@pytest.mark.parametrize("kind", list(PROGRAM_OF))
def test_register_variants(kind):
    program = _spill_program(kind)
    result = compile_program(**program).result()
    result.get()
    entries = ptxas_entries(result.log)
    assert len(entries) == len(program["names"]), result.log[-2000:]
    for symbol, spill in entries:
        modulated = kind == "bwd" and symbol.split("EEEv")[0].endswith("Lb1")
        assert int(spill) <= (MODULATED_BACKWARD_SPILLS if modulated else 0), (symbol, spill)


def test_the_launcher_names_the_compiled_instantiations():
    """The launcher's name expressions (dtype names in, CUDA types out) are the ones compiled here."""
    from cupy_rmsnorm.ops.layer_norm.plan import layer_norm_backward_plan, layer_norm_plan
    plan = layer_norm_plan(4, 768, 8)
    assert L.forward_name("bfloat16", "float32", "float32", "bfloat16", "bfloat16", plan, True, True) == \
        forward_name("__nv_bfloat16", "float", "float", "__nv_bfloat16", "__nv_bfloat16", 8, plan.threads_per_row,
                     plan.vecs_per_thread, True, True)
    assert L.forward_name("float16", None, None, None, None, plan, False, False) == \
        forward_name("__half", "__half", "__half", "__half", "__half", 8, plan.threads_per_row, plan.vecs_per_thread,
                     False, False)
    bplan = layer_norm_backward_plan(64, 768, 8, 64, 132)
    assert L.backward_name("bfloat16", "float32", "float32", None, bplan, False) == \
        backward_name("__nv_bfloat16", "float", "float", "__nv_bfloat16", 8, bplan.threads_per_row,
                      bplan.vecs_per_thread, False)
    assert L.reduce_name("float16") == reduce_name("__half")
