"""benchmarks/quant.py and its FlashInfer peer on the CPU: arguments, bytes, the table and the
files, a clear message without a GPU, the header extraction, and (where nvcc and the extracted
headers are here) that the FlashInfer wrapper compiles."""

import glob
import json
import os
import shutil
import subprocess

import pytest
from helpers import load_benchmark

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_load = load_benchmark


def test_arguments_bytes_table_and_files(tmp_path):
    b = _load("quant")
    args = b.parse_args(["--out", str(tmp_path), "--shapes", "1x4096,4096x7168", "--cases", "static,fused per_group"])
    assert args.shapes == [(1, 4096), (4096, 7168)] and args.cases == ["static", "fused per_group"]
    assert [tuple(s) for s in b.parse_args(["--out", "x"]).shapes] == list(b.SHAPES)
    with pytest.raises(SystemExit):
        b.parse_args(["--out", "x", "--cases", "per_block"])
    n = 4096 * 4096
    assert b.moved_bytes("static", 4096, 4096) == 3 * n
    assert b.moved_bytes("per_token", 4096, 4096) == 3 * n + 4 * 4096
    assert b.moved_bytes("fused per_group", 4096, 4096) == 7 * n + 4 * 4096 * 32
    row = {"case": "fused static", "rows": 4096, "hidden": 4096, "bytes": 7 * n, "agree": 0.9999,
           "us": {"ours": 30.0, "flashinfer": 40.0, "torch.compile": 37.5, "copy": 28.0}}
    text = b.table([row])
    assert "0.800" in text and "1.071" in text and "4096x4096" in text    # ours / best, ours / copy
    b.write(args, {"results": [row]})
    assert json.load(open(tmp_path / "quant.json"))["results"][0]["us"]["ours"] == 30.0
    lines = open(tmp_path / "quant.csv").read().splitlines()
    assert lines[0] == "case,rows,hidden,bytes,ours_us,flashinfer_us,torch.compile_us,copy_us,agree"
    assert lines[1].startswith("fused static,4096,4096,")


def test_without_a_gpu_says_why(tmp_path, capsys):
    from helpers import gpu_missing
    if gpu_missing() is None:
        pytest.skip("a GPU is present: the benchmark would run")
    assert _load("quant").main(["--out", str(tmp_path)]) == 2
    assert "no GPU run" in capsys.readouterr().out


def test_trimmed_norm_keeps_the_rmsnorm_kernels_only():
    h = _load("flashinfer_headers")
    src = ('#ifndef FLASHINFER_NORM_CUH_\n#define FLASHINFER_NORM_CUH_\n#include "flashinfer/trtllm/common/x.cuh"\n'
           '#include "math.cuh"\nnamespace flashinfer {\nnamespace norm {\nusing namespace tensorrt_llm::common;\n'
           'template <typename T> void RMSNormQuant() {}\n' + h.CUT + '() {}\n}\n}\n#endif\n')
    out = h.trimmed_norm(src)
    assert "RMSNormQuant" in out and "compute_layernorm" not in out and "trtllm" not in out
    assert "tensorrt_llm" not in out and '#include "math.cuh"' in out
    assert out.rstrip().endswith("#endif  // FLASHINFER_NORM_CUH_")


NVCC = shutil.which("nvcc") or next(iter(sorted(glob.glob("/usr/local/cuda*/bin/nvcc"))), None)
HEADERS = os.path.join(ROOT, ".flashinfer", "include", "flashinfer", "norm_rms.cuh")


@pytest.mark.skipif(NVCC is None or not os.path.isfile(HEADERS),
                    reason="FlashInfer wrapper compile: needs nvcc and .flashinfer/include "
                           "(python benchmarks/flashinfer_headers.py WHEEL)")
def test_flashinfer_wrapper_compiles(tmp_path):
    cmd = [NVCC, "-std=c++17", "-arch=sm_90", "-c", "-I", os.path.join(ROOT, ".flashinfer", "include"),
           os.path.join(ROOT, "benchmarks", "flashinfer_quant.cu"), "-o", str(tmp_path / "fi.o")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
