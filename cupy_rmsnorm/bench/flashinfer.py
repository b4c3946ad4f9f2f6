"""FlashInfer's quantized RMSNorm kernels for the quant sub-command: the headers they need, taken
from a flashinfer-python wheel or installed package, built with nvcc behind the ``extern "C"``
entry points of ``flashinfer_quant.cu``, loaded with ctypes.

FlashInfer's ``include/flashinfer/norm.cuh`` holds the RMSNorm kernels (``RMSNormQuant``,
``FusedAddRMSNormQuant``, ``FusedAddRMSNormFP8BlockQuant``) and, after them, LayerNorm code
from TensorRT-LLM whose headers want cuBLAS and cuRAND. ``norm_rms.cuh`` is norm.cuh up to
that LayerNorm code (the RMSNorm kernels verbatim), without the TensorRT-LLM includes and
using-directive; with it come the few headers it includes (under 200 KB in all).

Where the GPU machine cannot download, extract the headers where it can and carry the folder:

    pip download flashinfer-python --no-deps -d /tmp/fi
    python -m cupy_rmsnorm.bench.flashinfer /tmp/fi/flashinfer_python-*.whl    # -> .flashinfer/
    python -m cupy_rmsnorm.bench quant --flashinfer .flashinfer                 # on the GPU machine
"""

import argparse
import ctypes
import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

HEADERS = ("utils.cuh", "exception.h", "math.cuh", "vec_dtypes.cuh")
WHEEL_PREFIX = "flashinfer/data/include/flashinfer/"
CUT = "template <typename Tf, typename T>\n__inline__ __device__ Tf compute_layernorm"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flashinfer_quant.cu")
ENTRY_POINTS = ("fi_rmsnorm_quant", "fi_fused_add_rmsnorm_quant", "fi_fused_add_rmsnorm_fp8_block_quant")
LIBRARY = "libfiquant.so"


def trimmed_norm(src):
    """norm.cuh up to the LayerNorm code, without the TensorRT-LLM includes."""
    if CUT not in src:
        raise ValueError("norm.cuh: the LayerNorm section was not found (another FlashInfer version?)")
    body = "\n".join(line for line in src[:src.index(CUT)].split("\n")
                     if "flashinfer/trtllm/" not in line and "tensorrt_llm" not in line)
    return body + "\n}  // namespace norm\n\n}  // namespace flashinfer\n\n#endif  // FLASHINFER_NORM_CUH_\n"


def write_headers(read, version, out):
    """The headers into ``out/include/flashinfer`` (``read(name)``: the bytes of one header of
    FlashInfer's include/flashinfer), and ``out/include/VERSION``. Returns the include folder."""
    include = os.path.join(out, "include")
    dest = os.path.join(include, "flashinfer")
    os.makedirs(dest, exist_ok=True)
    for name in HEADERS:
        with open(os.path.join(dest, name), "wb") as f:
            f.write(read(name))
    with open(os.path.join(dest, "norm_rms.cuh"), "w", encoding="utf-8") as f:
        f.write(trimmed_norm(read("norm.cuh").decode()))
    with open(os.path.join(include, "VERSION"), "w", encoding="utf-8") as f:
        f.write(version + "\n")
    return include


def headers_from_wheel(wheel, out):
    with zipfile.ZipFile(wheel) as whl:
        version = next((n.split("/")[0][:-len(".dist-info")].split("-")[1] for n in whl.namelist()
                        if n.endswith(".dist-info/METADATA")), "unknown")
        return write_headers(lambda name: whl.read(WHEEL_PREFIX + name), version, out)


def installed_include():
    """(include/flashinfer folder of the installed flashinfer-python, its version), or None."""
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = os.path.join(list(spec.submodule_search_locations)[0], "data", "include", "flashinfer")
    if not os.path.isfile(os.path.join(folder, "norm.cuh")):
        return None
    from importlib import metadata
    try:
        version = metadata.version("flashinfer-python")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return folder, version


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def find_nvcc():
    found = shutil.which("nvcc")
    return found or next(iter(sorted(glob.glob("/usr/local/cuda*/bin/nvcc"), reverse=True)), None)


def build(include, out_dir, arch):
    """``flashinfer_quant.cu`` built against ``include`` for sm_``arch`` into ``out_dir``
    (reused when there already); the library's path."""
    lib = os.path.join(out_dir, f"sm{arch}", LIBRARY)
    inputs = [SOURCE] + glob.glob(os.path.join(include, "flashinfer", "*"))
    if os.path.isfile(lib) and os.path.getmtime(lib) >= max(os.path.getmtime(p) for p in inputs):
        return lib
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc is not on PATH (a CUDA toolkit builds FlashInfer's kernels)")
    os.makedirs(os.path.dirname(lib), exist_ok=True)
    cmd = [nvcc, "-O3", "-std=c++17", f"-arch=sm_{arch}", "-shared", "-Xcompiler", "-fPIC", "-I", include,
           SOURCE, "-o", lib]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed: {' '.join(proc.stderr.strip().splitlines()[-3:])}")
    return lib


def load(path):
    lib = ctypes.CDLL(path)
    for name in ENTRY_POINTS:
        getattr(lib, name).restype = ctypes.c_int
    return lib


def library(spec, arch):
    """(the loaded library, None) or (None, why not) for ``--flashinfer``'s ``spec``: a built
    library (.so), a folder of extracted headers (with include/flashinfer/norm_rms.cuh), a
    flashinfer_python wheel, None for the installed flashinfer-python, or "none"."""
    if spec == "none":
        return None, "--flashinfer none"
    try:
        if spec and spec.endswith(".so"):
            return load(spec), None
        cache = os.path.join(tempfile.gettempdir(), "cupy_rmsnorm_flashinfer")
        if spec and os.path.isdir(spec):
            include = os.path.join(spec, "include")
            if not os.path.isfile(os.path.join(include, "flashinfer", "norm_rms.cuh")):
                return None, f"{spec} has no include/flashinfer/norm_rms.cuh (python -m {__name__} WHEEL)"
            return load(build(include, spec, arch)), None
        if spec:
            out = os.path.join(cache, os.path.basename(spec).rsplit(".", 1)[0])
            return load(build(headers_from_wheel(spec, out), out, arch)), None
        installed = installed_include()
        if installed is None:
            return None, ("flashinfer-python is not installed (pip install flashinfer-python: its headers are "
                          "used, with nvcc on PATH; or --flashinfer)")
        folder, version = installed
        out = os.path.join(cache, version)
        include = write_headers(lambda name: _read(os.path.join(folder, name)), version, out)
        return load(build(include, out, arch)), None
    except (OSError, RuntimeError, ValueError, KeyError, zipfile.BadZipFile, subprocess.SubprocessError) as e:
        return None, f"{type(e).__name__}: {e}"


def main(argv=None):
    p = argparse.ArgumentParser(prog=f"python -m {__name__}", description=__doc__.split("\n\n")[0])
    p.add_argument("wheel", help="a flashinfer_python-*.whl")
    p.add_argument("--out", default=".flashinfer", help="folder to write include/ to (default: .flashinfer)")
    args = p.parse_args(argv)
    include = headers_from_wheel(args.wheel, args.out)
    print(f"FlashInfer headers in {include}; then: python -m cupy_rmsnorm.bench quant --flashinfer {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
