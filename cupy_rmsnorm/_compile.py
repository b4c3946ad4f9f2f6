"""Compiling the CUDA templates: the source, NVRTC's options, and the per-device cache
of compiled kernels.

Two programs: ``"forward"`` is ``kernels/rms_norm.cu`` (two templates: a block or a group
per row, and a cluster per row); ``"backward"`` is that file followed by
``kernels/rms_norm_backward.cu`` (the backward kernels, register and staged, and the dweight reduction, which use
the forward's helpers). Each (storage type, weight type, fused, vector width, threads per
row, vectors per thread, edges, cluster size) is an instantiation, compiled the first time
a call needs it on a device (CuPy's disk cache keeps the binary across processes) and kept
in ``kernel_cache`` as a launchable function.
"""

import functools
import glob
import os
import threading

CUDA_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}
# kernels/rms_norm.cu: enum QuantForm and enum QuantType, the quantized kernels' FORM and QTYPE
# (a CPU test reads both sides)
QUANT_FORMS = {"static": 1, "per_token": 2, "per_group": 3}
QUANT_TYPES = {"float8_e4m3fn": 0, "float8_e5m2": 1, "int8": 2}
# -default-device: NVRTC takes a generic lambda's call operator for host code unless unannotated
# functions default to the device (kernels/rms_norm_backward.cu passes the backward's flags to
# one as compile-time constants); every function of the kernels is annotated anyway.
NVRTC_OPTIONS = ("--std=c++17", "-default-device")
_HEADER = "cuda_bf16.h"


PROGRAMS = {"forward": ("rms_norm.cu",), "backward": ("rms_norm.cu", "rms_norm_backward.cu")}


def _read_kernel_file(name):
    """One file of kernels/, from the installed package or the source tree."""
    here = os.path.dirname(os.path.abspath(__file__))
    for folder in (os.path.join(here, "kernels"), os.path.join(os.path.dirname(here), "kernels")):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return f.read()
    raise FileNotFoundError(f"cupy_rmsnorm: kernels/{name} is missing from the installation")


@functools.lru_cache(maxsize=None)
def kernel_source(program="forward"):
    """The CUDA source text of a program (its files joined in order)."""
    return "\n".join(_read_kernel_file(name) for name in PROGRAMS[program])


def instantiation_name(dtype, weight_dtype, fused, plan):
    """The C++ name of the instantiation a LaunchPlan needs, as NVRTC's name_expressions want it."""
    t = CUDA_TYPES[dtype]
    w = CUDA_TYPES[weight_dtype or dtype]
    args = ", ".join(str(a) for a in plan.template_args())
    kernel = "rms_norm_cluster_kernel" if plan.cluster > 1 else "rms_norm_kernel"
    return f"rmsnorm::{kernel}<{t}, {w}, {'true' if fused else 'false'}, {args}>"


def quant_instantiation_name(dtype, weight_dtype, fused, plan, form, quant_dtype):
    """The name expression of the quantized kernel (``form`` a QUANT_FORMS key, ``quant_dtype`` a
    QUANT_TYPES key) a LaunchPlan needs."""
    args = ", ".join(str(a) for a in plan.template_args())
    kernel = "rms_norm_quant_cluster_kernel" if plan.cluster > 1 else "rms_norm_quant_kernel"
    flat = "" if plan.cluster > 1 else ", true" if plan.flat else ", false"     # FLAT: not with clusters
    return (f"rmsnorm::{kernel}<{CUDA_TYPES[dtype]}, {CUDA_TYPES[weight_dtype or dtype]}, "
            f"{'true' if fused else 'false'}, {args}, {QUANT_FORMS[form]}, {QUANT_TYPES[quant_dtype]}{flat}>")


def backward_instantiation_name(dtype, weight_dtype, plan, flags=None):
    """The name expression of the backward kernel a BackwardPlan needs (program "backward");
    the row kernel's also has its ``flags`` (``_launcher.row_kernel_flags``) compiled in."""
    args = ", ".join(str(a) for a in plan.template_args())
    if plan.variant == "row":
        if flags is None:
            raise ValueError("the row kernel's instantiation needs its flags")
        args += f", {flags}"
    kernel = {"staged": "rms_norm_backward_staged_kernel", "row": "rms_norm_backward_row_kernel"}.get(
        plan.variant, "rms_norm_backward_kernel")
    return f"rmsnorm::{kernel}<{CUDA_TYPES[dtype]}, {CUDA_TYPES[weight_dtype or dtype]}, {args}>"


def reduce_instantiation_name(weight_dtype):
    """The name expression of the dweight reduction writing ``weight_dtype`` (program "backward")."""
    return f"rmsnorm::rms_norm_backward_reduce_kernel<{CUDA_TYPES[weight_dtype]}>"


def _has_header(folder):
    return bool(folder) and os.path.isfile(os.path.join(folder, _HEADER))


def _header_major(folder):
    """The CUDA major version of a header folder (CUDART_VERSION), or None."""
    try:
        with open(os.path.join(folder, "cuda_runtime_api.h"), encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("#define CUDART_VERSION"):
                    return int(line.split()[2]) // 1000
    except (OSError, ValueError, IndexError):
        pass
    return None


def _pathfinder_dir():
    try:
        from cuda.pathfinder import find_nvidia_header_directory
        return find_nvidia_header_directory("cudart")
    except Exception:  # noqa: BLE001 - absent or too old (CuPy 14 installs it): the list below
        return None


@functools.lru_cache(maxsize=None)
def cuda_include_dirs(nvrtc_major=None):
    """A folder with the CUDA headers (cuda_fp16.h, cuda_bf16.h) for NVRTC.

    NVRTC finds none by itself. Candidates, in order: what ``cuda.pathfinder`` finds
    for the CUDA runtime (CuPy 14 installs it; it looks at the NVIDIA wheels, conda,
    CUDA_PATH / CUDA_HOME), CUDA_PATH / CUDA_HOME and the toolkit CuPy found, the
    NVIDIA wheels (``nvidia-cuda-runtime-cu12`` lays them in ``nvidia/cuda_runtime/include``,
    the CUDA 13 wheels in ``nvidia/cu13/include``) and /usr/local/cuda. The first one of
    NVRTC's own major version wins (another major's headers may not compile with it);
    failing that, the first one with the headers.
    """
    candidates = [_pathfinder_dir()]
    for var in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "include"))
    try:
        import cupy
        path = cupy.cuda.get_cuda_path()
        if path:
            candidates.append(os.path.join(path, "include"))
    except Exception:  # noqa: BLE001 - CuPy without a usable CUDA: the wheels below may still do
        pass
    try:
        import nvidia
        for root in nvidia.__path__:
            candidates.extend(sorted(glob.glob(os.path.join(root, "cu*", "include"))))
            candidates.append(os.path.join(root, "cuda_runtime", "include"))
    except ImportError:
        pass
    candidates.append("/usr/local/cuda/include")
    found = [c for c in dict.fromkeys(candidates) if _has_header(c)]
    if nvrtc_major is not None:
        found.sort(key=lambda c: _header_major(c) != nvrtc_major)   # stable: order kept otherwise
    return tuple(found[:1])


def nvrtc_options(nvrtc_major=None):
    return NVRTC_OPTIONS + tuple("-I" + d for d in cuda_include_dirs(nvrtc_major))


class KernelCache:
    """Compiled kernels per (device, program, instantiation); thread-safe, compiled once."""

    def __init__(self):
        self._functions = {}
        self._lock = threading.Lock()

    def get(self, device_id, name, program="forward"):
        key = (device_id, name, program)
        fn = self._functions.get(key)
        if fn is None:
            with self._lock:
                fn = self._functions.get(key)
                if fn is None:
                    fn = self._functions[key] = _compile(device_id, name, program)
        return fn

    def __len__(self):
        return len(self._functions)


def _compile(device_id, name, program="forward"):
    import cupy
    from cupy_backends.cuda.libs import nvrtc
    with cupy.cuda.Device(device_id):
        module = cupy.RawModule(code=kernel_source(program), options=nvrtc_options(nvrtc.getVersion()[0]),
                                name_expressions=[name])
        return module.get_function(name).kernel  # the cupy.cuda.Function, bound to this device


kernel_cache = KernelCache()


def compile_offline(names, arch, program="forward", extra_options=(), log=None):
    """Compile instantiations of ``program`` with NVRTC for ``arch`` (e.g. "sm_90") without a
    GPU or driver; ``extra_options`` are added to the library's (e.g. "-Xptxas=-v"), and
    NVRTC's log is appended to the list ``log`` if one is given.

    Used by the CPU tests: CuPy's own compile path asks the device for its
    architecture, its low-level NVRTC binding does not. Returns the cubin (bytes);
    raises RuntimeError with NVRTC's log on a compile error.
    """
    from cupy_backends.cuda.libs import nvrtc
    prog = nvrtc.createProgram(kernel_source(program), PROGRAMS[program][-1], [], [])
    try:
        for name in names:
            nvrtc.addNameExpression(prog, name)
        opts = list(nvrtc_options(nvrtc.getVersion()[0])) + [f"-arch={arch}", "-ftz=true", *extra_options]
        try:
            nvrtc.compileProgram(prog, opts)
        except Exception as err:
            raise RuntimeError(f"NVRTC failed for {arch}: {err}\n{nvrtc.getProgramLog(prog)}") from None
        for name in names:
            nvrtc.getLoweredName(prog, name)  # raises if the expression did not instantiate
        if log is not None:
            log.append(nvrtc.getProgramLog(prog))
        return nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
