"""Extract the FlashInfer headers the quant benchmark's peer needs from a flashinfer-python wheel.

    pip download flashinfer-python --no-deps -d /tmp/fi
    python benchmarks/flashinfer_headers.py /tmp/fi/flashinfer_python-*.whl   # -> .flashinfer/include

FlashInfer's ``include/flashinfer/norm.cuh`` holds the RMSNorm kernels (``RMSNormQuant``,
``FusedAddRMSNormQuant``, ``FusedAddRMSNormFP8BlockQuant``) and, after them, LayerNorm code
from TensorRT-LLM whose headers want cuBLAS and cuRAND. ``norm_rms.cuh`` is norm.cuh up to
that LayerNorm code (the RMSNorm kernels verbatim), without the TensorRT-LLM includes and
using-directive; with it come the few headers it includes (under 200 KB in all). ``.flashinfer/`` is git-ignored:
carry it to the GPU machine, where ``benchmarks/flashinfer_quant.cu`` is built with nvcc
against it (scripts/quant_device.sh).
"""

import argparse
import os
import sys
import zipfile

HEADERS = ("utils.cuh", "exception.h", "math.cuh", "vec_dtypes.cuh")
PREFIX = "flashinfer/data/include/flashinfer/"
CUT = "template <typename Tf, typename T>\n__inline__ __device__ Tf compute_layernorm"


def trimmed_norm(src):
    """norm.cuh up to the LayerNorm code, without the TensorRT-LLM includes."""
    if CUT not in src:
        raise SystemExit("norm.cuh: the LayerNorm section was not found (another FlashInfer version?)")
    body = "\n".join(line for line in src[:src.index(CUT)].split("\n")
                     if "flashinfer/trtllm/" not in line and "tensorrt_llm" not in line)
    return body + "\n}  // namespace norm\n\n}  // namespace flashinfer\n\n#endif  // FLASHINFER_NORM_CUH_\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("wheel", help="a flashinfer_python-*.whl")
    p.add_argument("--out", default=".flashinfer/include", help="include folder to write (default .flashinfer/include)")
    args = p.parse_args(argv)
    dest = os.path.join(args.out, "flashinfer")
    os.makedirs(dest, exist_ok=True)
    with zipfile.ZipFile(args.wheel) as whl:
        for name in HEADERS:
            with open(os.path.join(dest, name), "wb") as f:
                f.write(whl.read(PREFIX + name))
        with open(os.path.join(dest, "norm_rms.cuh"), "w") as f:
            f.write(trimmed_norm(whl.read(PREFIX + "norm.cuh").decode()))
        version = next((n.split("/")[0][:-len(".dist-info")].split("-")[1] for n in whl.namelist()
                        if n.endswith(".dist-info/METADATA")), "unknown")
    with open(os.path.join(args.out, "VERSION"), "w") as f:
        f.write(version + "\n")
    print(f"FlashInfer {version} headers in {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
