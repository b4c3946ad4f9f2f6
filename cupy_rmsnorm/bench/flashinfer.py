"""FlashInfer's RMSNorm-quant and rope kernels for quant and qk_rope: their headers taken from a
flashinfer-python wheel or package (norm.cuh trimmed before its TensorRT-LLM LayerNorm code), built
with nvcc behind the ``extern "C"`` wrappers flashinfer_*.cu and loaded with ctypes.

Offline GPU machine: ``python -m cupy_rmsnorm.bench.flashinfer WHEEL`` writes .flashinfer/, then
``--flashinfer .flashinfer``.
"""

import argparse
import ctypes
import functools
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from typing import NamedTuple

# The wrappers' headers; the rest extracted is their #include closure.
ROOTS = ("norm.cuh", "pos_enc.cuh")
TRIMMED = {"norm.cuh": "norm_rms.cuh"}
WHEEL_PREFIX = "flashinfer/data/include/flashinfer/"
CCCL = ("data", "cccl", "libcudacxx", "include")     # FlashInfer's libcudacxx, in its package
WHEEL_CCCL_PREFIX = "flashinfer/" + "/".join(CCCL) + "/"
CUT = "template <typename Tf, typename T>\n__inline__ __device__ Tf compute_layernorm"
HERE = os.path.dirname(os.path.abspath(__file__))
QUOTED_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


class Wrapper(NamedTuple):
    """One ``extern "C"`` wrapper: source, library, the header it needs, {entry point: (restype, argtypes)}."""
    source: str
    library: str
    header: str
    entry_points: dict


_p, _u, _s, _i = ctypes.c_void_p, ctypes.c_uint, ctypes.c_size_t, ctypes.c_int
QUANT = Wrapper(os.path.join(HERE, "flashinfer_quant.cu"), "libfiquant.so", "norm_rms.cuh",
                dict.fromkeys(("fi_rmsnorm_quant", "fi_fused_add_rmsnorm_quant",
                               "fi_fused_add_rmsnorm_fp8_block_quant"), (_i, None)))
ROPE = Wrapper(os.path.join(HERE, "flashinfer_rope.cu"), "libfirope.so", "pos_enc.cuh",
               {"fi_rope_pos_ids_cos_sin_cache": (_i, [_p, _p, _p, _p, _u, _u, _u, _u, _u, _s, _s, _s, _s, _i, _i, _p]),
                "fi_rope_last_error": (ctypes.c_char_p, [])})


def trimmed_norm(src):
    """norm.cuh up to the LayerNorm code, without the TensorRT-LLM includes."""
    if CUT not in src:
        raise ValueError("norm.cuh: the LayerNorm section was not found (another FlashInfer version?)")
    body = "\n".join(line for line in src[:src.index(CUT)].split("\n")
                     if "flashinfer/trtllm/" not in line and "tensorrt_llm" not in line)
    return body + "\n}  // namespace norm\n\n}  // namespace flashinfer\n\n#endif  // FLASHINFER_NORM_CUH_\n"


def quoted_includes(text):
    """The FlashInfer headers ``text`` includes by quoted name, relative to include/flashinfer."""
    return [name[len("flashinfer/"):] if name.startswith("flashinfer/") else name
            for name in QUOTED_INCLUDE.findall(text)]


def header_closure(read, roots=ROOTS):
    """{name: text} of ``roots`` and the FlashInfer headers they include; norm.cuh trimmed, as norm_rms.cuh."""
    texts, todo = {}, list(roots)
    while todo:
        name = todo.pop(0)
        if TRIMMED.get(name, name) in texts:
            continue
        try:
            text = read(name).decode("utf-8", "surrogateescape")     # the bytes as they are, written back
        except (KeyError, FileNotFoundError):
            raise ValueError(f"FlashInfer's {name} is missing (another FlashInfer version?)") from None
        if name == "norm.cuh":
            text = trimmed_norm(text)
        texts[TRIMMED.get(name, name)] = text
        todo += [n for n in quoted_includes(text) if TRIMMED.get(n, n) not in texts]
    return texts


def _write_if_changed(path, data):
    """``data`` into ``path`` unless already there: an unchanged header keeps its mtime (no rebuild)."""
    try:
        with open(path, "rb") as f:
            if f.read() == data:
                return
    except OSError:
        pass
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def write_headers(read, version, out, cccl=()):
    """``header_closure(read)`` and VERSION into ``out/include``, ``cccl`` into ``out/cccl``; the include folder."""
    include = os.path.join(out, "include")
    for name, text in header_closure(read).items():
        _write_if_changed(os.path.join(include, "flashinfer", name), text.encode("utf-8", "surrogateescape"))
    _write_if_changed(os.path.join(include, "VERSION"), (version + "\n").encode())
    for relative, read_file in cccl:
        _write_if_changed(os.path.join(out, "cccl", *relative.split("/")), read_file())
    return include


def headers_from_wheel(wheel, out):
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
        version = next((n.split("/")[0][:-len(".dist-info")].split("-")[1] for n in names
                        if n.endswith(".dist-info/METADATA")), "unknown")
        cccl = [(n[len(WHEEL_CCCL_PREFIX):], functools.partial(whl.read, n)) for n in names
                if n.startswith(WHEEL_CCCL_PREFIX) and not n.endswith("/")]
        return write_headers(lambda name: whl.read(WHEEL_PREFIX + name), version, out, cccl)


def _folder_files(folder):
    """(relative path with / separators, reader) of every file under ``folder``."""
    return [(os.path.relpath(os.path.join(root, n), folder).replace(os.sep, "/"),
             functools.partial(_read, os.path.join(root, n)))
            for root, _, files in os.walk(folder) for n in files]


def installed_package():
    """(the installed flashinfer package's folder, its version), or None."""
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or not spec.submodule_search_locations:
        return None
    package = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(package, "data", "include", "flashinfer", "norm.cuh")):
        return None
    from importlib import metadata
    try:
        version = metadata.version("flashinfer-python")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return package, version


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def find_nvcc():
    found = shutil.which("nvcc")
    return found or next(iter(sorted(glob.glob("/usr/local/cuda*/bin/nvcc"), reverse=True)), None)


def build(include, out_dir, arch, wrapper=QUANT):
    """``wrapper`` built for sm_``arch`` into ``out_dir`` (reused while newer than its inputs); its path."""
    lib = os.path.join(out_dir, f"sm{arch}", wrapper.library)
    inputs = [wrapper.source] + glob.glob(os.path.join(include, "flashinfer", "*"))
    if os.path.isfile(lib) and os.path.getmtime(lib) >= max(os.path.getmtime(p) for p in inputs):
        return lib
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc is not on PATH (a CUDA toolkit builds FlashInfer's kernels)")
    os.makedirs(os.path.dirname(lib), exist_ok=True)
    cccl = os.path.join(os.path.dirname(include), "cccl")
    cccl_flags = ["-I", cccl] if os.path.isdir(cccl) else []     # ahead of the toolkit's copy, as FlashInfer's JIT
    cmd = [nvcc, "-O3", "-std=c++17", f"-arch=sm_{arch}", "-shared", "-Xcompiler", "-fPIC", *cccl_flags,
           "-I", include, wrapper.source, "-o", lib]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed: {' '.join(proc.stderr.strip().splitlines()[-3:])}")
    return lib


def load(path, wrapper=QUANT):
    lib = ctypes.CDLL(path)
    for name, (restype, argtypes) in wrapper.entry_points.items():
        fn = getattr(lib, name)
        fn.restype = restype
        if argtypes is not None:
            fn.argtypes = argtypes
    return lib


def library(spec, arch, wrapper=QUANT):
    """(library, None) or (None, why not) of ``--flashinfer``: a .so, a header folder, a wheel, None or 'none'."""
    if spec == "none":
        return None, "--flashinfer none"
    try:
        if spec and spec.endswith(".so"):
            return load(spec, wrapper), None
        cache = os.path.join(tempfile.gettempdir(), "cupy_rmsnorm_flashinfer")
        if spec and os.path.isdir(spec):
            include = os.path.join(spec, "include")
            if not os.path.isfile(os.path.join(include, "flashinfer", wrapper.header)):
                return None, f"{spec} has no include/flashinfer/{wrapper.header} (python -m {__name__} WHEEL)"
            return load(build(include, spec, arch, wrapper), wrapper), None
        if spec:
            out = os.path.join(cache, os.path.basename(spec).rsplit(".", 1)[0])
            return load(build(headers_from_wheel(spec, out), out, arch, wrapper), wrapper), None
        installed = installed_package()
        if installed is None:
            return None, ("flashinfer-python is not installed (pip install flashinfer-python: its headers are "
                          "used, with nvcc on PATH; or --flashinfer)")
        package, version = installed
        out = os.path.join(cache, version)
        folder, cccl = os.path.join(package, "data", "include", "flashinfer"), os.path.join(package, *CCCL)
        include = write_headers(lambda name: _read(os.path.join(folder, name)), version, out,
                                _folder_files(cccl) if os.path.isdir(cccl) else ())
        return load(build(include, out, arch, wrapper), wrapper), None
    except (OSError, RuntimeError, ValueError, KeyError, AttributeError, zipfile.BadZipFile,
            subprocess.SubprocessError) as e:
        return None, f"{type(e).__name__}: {e}"


def main(argv=None):
    p = argparse.ArgumentParser(prog=f"python -m {__name__}", description=__doc__.split("\n\n")[0])
    p.add_argument("wheel", help="a flashinfer_python-*.whl")
    p.add_argument("--out", default=".flashinfer", help="folder to write include/ to")
    args = p.parse_args(argv)
    include = headers_from_wheel(args.wheel, args.out)
    print(f"FlashInfer headers in {include}; then: python -m cupy_rmsnorm.bench quant (or qk_rope) "
          f"--flashinfer {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
