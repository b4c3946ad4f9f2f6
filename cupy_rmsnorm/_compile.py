"""Compiling the CUDA templates: the programs, NVRTC's options, and the per-device cache of
compiled kernels.

Each program is one file of ``kernels/``, a family's forward in ``<family>.cu`` and its
backward in ``<family>_backward.cu``, registered under a key by the family that launches it
(``register_program``), which includes the shared device code (``*.cuh``) through NVRTC's
include path. Each (storage type, weight type, plan, ...) is an instantiation, compiled
the first time a call needs it on a device and kept in ``kernel_cache`` as a launchable
function. CuPy's disk cache keeps the binaries
across processes; its key covers a program's own text and the options, not the headers it
includes, so the options carry a digest of every file in ``kernels/``: a changed header
never brings back a stale binary.
"""

import functools
import glob
import hashlib
import os
import threading

# -default-device: NVRTC takes a generic lambda's call operator for host code unless unannotated
# functions default to the device (kernels/rms_norm_backward.cu passes the backward's flags to
# one as compile-time constants); every function of the kernels is annotated anyway.
NVRTC_OPTIONS = ("--std=c++17", "-default-device")
_HEADER = "cuda_bf16.h"

PROGRAMS = {}   # key -> file of kernels/, as the families register them
KERNEL_SUFFIXES = (".cu", ".cuh")


def register_program(key, filename):
    """A family's program: ``kernel_cache.get(device, name, key)`` compiles from ``filename``."""
    if PROGRAMS.setdefault(key, filename) != filename:
        raise ValueError(f"program {key!r} is {PROGRAMS[key]!r} already")
    return key


@functools.lru_cache(maxsize=None)
def kernels_dir():
    """The folder of the CUDA sources: the installed package's ``cupy_rmsnorm/kernels``, or
    the source tree's ``kernels/``."""
    here = os.path.dirname(os.path.abspath(__file__))
    for folder in (os.path.join(here, "kernels"), os.path.join(os.path.dirname(here), "kernels")):
        if os.path.isfile(os.path.join(folder, "common.cuh")):
            return folder
    raise FileNotFoundError("cupy_rmsnorm: the kernels folder is missing from the installation")


@functools.lru_cache(maxsize=None)
def kernel_file(name):
    """The text of one file of kernels/ (a program or a header)."""
    with open(os.path.join(kernels_dir(), name), encoding="utf-8") as f:
        return f.read()


def kernel_source(program="forward"):
    """The CUDA source text of a program (its file; the headers come through the include path)."""
    return kernel_file(PROGRAMS[program])


@functools.lru_cache(maxsize=None)
def kernels_digest():
    """A digest of every source file in kernels/, names and contents (see the module docstring)."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(kernels_dir())):
        if name.endswith(KERNEL_SUFFIXES):
            h.update(name.encode() + b"\0" + kernel_file(name).encode() + b"\0")
    return h.hexdigest()[:16]


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
    """The library's NVRTC options: its own, the kernels folder and the CUDA headers on the
    include path, and the kernels' digest (a define no source reads: it keys the disk cache)."""
    return (NVRTC_OPTIONS + ("-I" + kernels_dir(), f"-DCUPY_RMSNORM_KERNELS={kernels_digest()}")
            + tuple("-I" + d for d in cuda_include_dirs(nvrtc_major)))


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
    prog = nvrtc.createProgram(kernel_source(program), PROGRAMS[program], [], [])
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
