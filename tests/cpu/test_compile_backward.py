"""The backward kernels' instantiations compile with NVRTC, without a GPU (see test_compile.py).

By default a representative set: per storage dtype, every geometry backward_plan makes
(warp groups of 8..32 threads with one or two vectors, blocks of 128..1024 threads, the
streamed block) at full vector width with edges, and a sample at the narrower widths and
without edges, with weights of x's dtype and float32; and the three dweight reductions.
``CUPY_RMSNORM_COMPILE_ALL=1`` compiles every instantiation the launcher can make.
The register variants are also compiled with ptxas -v at the library's options: they must
not spill (the plan's geometry was chosen for that).
"""

import functools
import os
import re

import pytest
from test_compile import ARCHS, ITEMSIZE, MANGLED, NVRTC_MISSING, VECS, _check_batch, _compile_batches

from cupy_rmsnorm import _compile, backward_plan
from cupy_rmsnorm._abi import CUDA_TYPES, backward_instantiation_name, reduce_instantiation_name
from cupy_rmsnorm._abi import ADD_GRAD, DIRECT_WEIGHT, HAS_WEIGHT, LLAMA, WEIGHT_GRAD, row_kernel_flags

pytestmark = pytest.mark.skipif(NVRTC_MISSING is not None, reason=f"NVRTC compile test: {NVRTC_MISSING}")

COMPILE_ALL = os.environ.get("CUPY_RMSNORM_COMPILE_ALL") == "1"
# vectors per row at each boundary of backward_geometry, times each vec
VECTOR_COUNTS = (1, 8, 9, 16, 17, 32, 33, 64, 65, 128, 129, 256, 257, 512, 513, 1024, 1025, 5000)
SMS = 132
KERNEL_SYMBOL = re.compile(rb"_ZN7rmsnorm\d+rms_norm_backward\w+")


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
    ints = "".join(f"Lb{int(a == 'true')}E" if a in ("true", "false") else f"Li{a}E" for a in plan.template_args())
    return f"_ZN7rmsnorm24rms_norm_backward_kernelI{MANGLED[t]}{w_code}{ints}".encode()   # then the defaulted type N


@functools.cache
def instantiations(dtype):
    """(name expression, mangled prefix) pairs to compile for one storage dtype."""
    plans = backward_plans(dtype).values()
    if not COMPILE_ALL:
        widest = max(VECS[dtype])
        geometries = {}
        for p in plans:                    # every geometry at full width, with edges
            if p.vec == widest and p.edges:
                geometries[(p.threads_per_row, p.vecs_per_thread)] = p
        narrow = [p for p in plans if p.vec == 1 and p.edges] + [p for p in plans if not p.edges][:3]
        plans = list(geometries.values()) + narrow[::3]
    pairs = set()
    for p in plans:
        for weight in (dtype, "float32"):
            pairs.add((backward_instantiation_name(dtype, weight, p), _mangled(dtype, weight, p)))
    return sorted(pairs)


def _reductions():
    return sorted((reduce_instantiation_name(w), f"_ZN7rmsnorm31rms_norm_backward_reduce_kernelI{MANGLED[c]}EE".encode())
                  for w, c in CUDA_TYPES.items())


def _check(result, pairs):
    _check_batch(result, pairs, lambda binary: set(KERNEL_SYMBOL.findall(binary)))


def _backward_batches(batches, fast):
    with pytest.MonkeyPatch.context() as mp:   # the backward program, not the forward's
        plain = _compile.compile_offline
        mp.setattr(_compile, "compile_offline", lambda names, arch: plain(names, arch, "backward"))
        return _compile_batches(batches, fast)


@pytest.fixture(scope="module")
def compiled():
    batches = []
    for arch in ARCHS:
        for dtype in CUDA_TYPES:
            batches.append(((arch, dtype), [e for e, _ in instantiations(dtype)], arch))
        batches.append(((arch, "reduce"), [e for e, _ in _reductions()], arch))
    return _backward_batches(batches, fast=COMPILE_ALL)


@pytest.mark.parametrize("dtype", list(CUDA_TYPES))
@pytest.mark.parametrize("arch", ARCHS)
def test_backward_instantiations_compile(compiled, arch, dtype):
    _check(compiled[(arch, dtype)], instantiations(dtype))


@pytest.mark.parametrize("arch", ARCHS)
def test_reductions_compile(compiled, arch):
    _check(compiled[(arch, "reduce")], _reductions())


def test_every_geometry_is_covered():
    """The representative set meets every (threads per row, vectors per thread) of the full one."""
    for dtype in CUDA_TYPES:
        full = {(p.threads_per_row, p.vecs_per_thread) for p in backward_plans(dtype).values()}
        assert {(8, 1), (32, 2), (128, 1), (1024, 1), (512, 0)} <= full
        names = {e for e, _ in instantiations(dtype)}
        for g, nv in full:
            assert any(f", {g}, {nv}, " in e for e in names), (dtype, g, nv)


def spill_stores(names, entry=r"\w+"):
    """ptxas -v at the library's own options (sm_90): the regex groups of ``entry`` and the
    spill store bytes, per compiled entry function (one per name)."""
    log = []
    _compile.compile_offline(names, "sm_90", "backward", ("-Xptxas=-v",), log)
    text = log[0].replace("\0", "")
    spills = re.findall(rf"Compiling entry function '({entry})'.*?(\d+) bytes spill stores", text, re.S)
    assert len(spills) == len(names)
    return spills


def test_register_variants_do_not_spill():
    """ptxas -v at the library's own options (sm_90): no spill stores in the register
    variants of the heaviest weights (float32) at full width: rows with a head or tail, and
    (1024 rows, fewer than the staged kernel's) rows on the 16-byte grid, whose block plans
    keep their dweight sums in registers."""
    for dtype in CUDA_TYPES:
        plans = {(p.variant, p.template_args()): p
                 for rows in (4096, 1024) for p in backward_plans(dtype, rows).values()
                 if p.variant == "registers" and p.vec == max(VECS[dtype])}
        assert any(not p.edges and p.threads_per_row > 32 for p in plans.values()), "no block plan on the grid"
        spills = spill_stores([backward_instantiation_name(dtype, "float32", p) for p in plans.values()])
        assert all(n == "0" for _, n in spills), [s for s in spills if s[1] != "0"]


# -- staged rows (sm_90 bulk copies) ------------------------------------------------------------

H200_SHARED = {"shared_per_sm": 233472, "shared_per_block": 232448}


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


@pytest.mark.parametrize("dtype", list(CUDA_TYPES))
def test_staged_variants_compile_without_spills(dtype):
    """The staged kernel's instantiations compile for every architecture (before sm_90 to an
    empty body: the plan never picks it there) and, at sm_90 with ptxas -v, do not spill
    (weights and dweight sums live in registers, 16 a step; steps are capped for that): none
    at one step, the 4096-wide rows; at two steps, under 64 registers, ptxas keeps at most 32
    bytes on the stack (half x with half weights), which is allowed here."""
    plans = staged_plans(dtype).values()
    assert {p.vecs_per_thread for p in plans} >= {1, 2} and max(p.threads_per_row for p in plans) == 512
    names = sorted({backward_instantiation_name(dtype, w, p) for p in plans for w in (dtype, "float32")})
    for arch in ARCHS:
        assert _compile.compile_offline(names, arch, "backward")
    spills = spill_stores(names, r"\w+staged\w+Li(\d+)E\w{1,4}EEv\w+")   # then N, defaulted
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


@pytest.mark.parametrize("dtype", list(CUDA_TYPES))
def test_row_variants_compile_without_spills(dtype):
    """The row kernel's instantiations (every block-wide geometry, a sample of the narrower
    widths) compile for every architecture and do not spill at sm_90 (ptxas -v)."""
    plans = row_plans(dtype)
    assert {p.threads_per_row for p in plans} >= {128, 512, 1024} and {p.edges for p in plans} == {True, False}
    widest = max(VECS[dtype])
    chosen = [p for p in plans if p.vec == widest] + [p for p in plans if p.vec != widest][::4]
    names = sorted({backward_instantiation_name(dtype, w, p, flags) for p in chosen for w in (dtype, "float32")
                    for flags in ROW_FLAGS})
    assert all("rms_norm_backward_row_kernel" in n for n in names), names
    for arch in ARCHS:
        assert _compile.compile_offline(names, arch, "backward")
    spills = spill_stores(names, r"\w+row_kernel\w+")
    assert all(n == "0" for _, n in spills), [s for s in spills if s[1] != "0"]
