"""``python -m cupy_rmsnorm.bench quant`` and the FlashInfer peers on the CPU: arguments, bytes,
the table and the files, the header extraction (the include closure of the headers the wrappers
include, and FlashInfer's libcudacxx), what ``--flashinfer`` accepts, and (where nvcc and the
extracted headers are here) that both FlashInfer wrappers compile."""

import csv
import os
import subprocess
import zipfile

import pytest
from helpers import ROOT

from cupy_rmsnorm.bench import cli, common, flashinfer, quant


def test_arguments():
    args = cli.parse_args(["quant", "--shapes", "1x4096", "4096x7168", "--cases", "static,fused per_group",
                           "--flashinfer", ".flashinfer", "--modes", "graph,cold"])
    assert args.shapes == [(1, 4096), (4096, 7168)] and args.cases == ["static", "fused per_group"]
    assert args.flashinfer == ".flashinfer" and args.modes == ["graph", "cold"]
    default = cli.parse_args(["quant"])
    assert default.shapes == list(quant.SHAPES) and default.cases == list(quant.CASES)
    assert (default.dtypes, default.modes, default.repeats, default.flashinfer) == (["bfloat16"], ["graph"], 7, None)


def test_moved_bytes():
    n = 4096 * 4096
    assert quant.moved_bytes("static", 4096, 4096) == 3 * n
    assert quant.moved_bytes("per_token", 4096, 4096) == 3 * n + 4 * 4096
    assert quant.moved_bytes("fused per_group", 4096, 4096) == 7 * n + 4 * 4096 * 32
    assert quant.moved_bytes("static", 1, 8, itemsize=4) == 8 * 4 + 8


def test_the_contracts_fp8_constants():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    import numpy as np
    assert quant.FP8_MAX == float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
    import cupy_rmsnorm as rn     # an all-zero row: the reference's scale is the floor
    _, scales = rn.rms_norm_quant_reference(np.zeros((1, 128), np.float32), np.ones(128, np.float32))
    assert float(scales[0, 0]) == pytest.approx(quant.MIN_SCALE, rel=1e-6)


def test_report_and_files(tmp_path):
    n = 4096 * 4096
    rows = [{"case": "fused static", "dtype": "bfloat16", "mode": "graph", "rows": 4096, "hidden": 4096,
             "bytes": 7 * n, "agree": 0.9999, "us": {"ours": 30.0, "flashinfer": 40.0, "torch.compile": 37.5,
                                                     "copy": 28.0}},
            {"case": "per_token", "dtype": "bfloat16", "mode": "graph", "rows": 1, "hidden": 4096, "bytes": 3 * 4096,
             "agree": None, "us": {"ours": 2.0, "flashinfer": None, "torch.compile": 1.6, "copy": 1.0}}]
    payload = {"meta": {"command": "quant", "commit": None, "note": "n", "device": {"gpu": "G"},
                        "copy_GBps": 4000.0, "flashinfer": ".flashinfer"},
               "results": rows, "errors": [], "skipped": {"flashinfer": "nvcc is not on PATH"}}
    assert quant.table_rows(rows)[0][-2] == f"{7 * n / 30e3:.0f}"        # ours' GB/s
    text = quant.format_report(payload)
    assert "fused static, graph mode, bfloat16" in text and "per_token, graph mode, bfloat16" in text
    assert "geomean ours / best peer: 1.250 over 1 cases" in text           # per_token: 2.0 / 1.6
    common.write_report(quant, payload, str(tmp_path), "q", charts=False)
    with open(tmp_path / "q.csv", newline="") as f:
        got = list(csv.DictReader(f))
    assert list(got[0]) == ["case", "dtype", "mode", "rows", "hidden", "bytes", "ours_us", "flashinfer_us",
                            "torch.compile_us", "copy_us", "agree"]
    assert got[0]["agree"] == "0.999900" and got[1]["flashinfer_us"] == "" and got[1]["agree"] == ""


# -- FlashInfer --------------------------------------------------------------------------------------
NORM = ('#ifndef FLASHINFER_NORM_CUH_\n#define FLASHINFER_NORM_CUH_\n#include "flashinfer/trtllm/common/x.cuh"\n'
        '#include "math.cuh"\nnamespace flashinfer {\nnamespace norm {\nusing namespace tensorrt_llm::common;\n'
        'template <typename T> void RMSNormQuant() {}\n' + flashinfer.CUT + '() {}\n}\n}\n#endif\n')


def test_trimmed_norm_keeps_the_rmsnorm_kernels_only():
    out = flashinfer.trimmed_norm(NORM)
    assert "RMSNormQuant" in out and "compute_layernorm" not in out and "trtllm" not in out
    assert "tensorrt_llm" not in out and '#include "math.cuh"' in out
    assert out.rstrip().endswith("#endif  // FLASHINFER_NORM_CUH_")
    with pytest.raises(ValueError, match="LayerNorm section"):
        flashinfer.trimmed_norm("namespace flashinfer {}")


# a small FlashInfer: norm.cuh and pos_enc.cuh and what they include, a header nobody includes, and
# a file of its libcudacxx
FAKE_HEADERS = {"norm.cuh": NORM.replace('#include "math.cuh"', '#include "math.cuh"\n#include "flashinfer/utils.cuh"'),
                "pos_enc.cuh": '#include <cmath>\n#include "page.cuh"\n#include "math.cuh"\n',
                "page.cuh": '#include "fastdiv.cuh"\n#include "utils.cuh"\n', "fastdiv.cuh": "#include <cuda/cmath>\n",
                "utils.cuh": '#include "exception.h"\n', "exception.h": "// exception.h\n", "math.cuh": "// math\n",
                "sampling.cuh": '#include "math.cuh"\n'}
EXTRACTED = ["exception.h", "fastdiv.cuh", "math.cuh", "norm_rms.cuh", "page.cuh", "pos_enc.cuh", "utils.cuh"]


def fake_wheel(path, headers=FAKE_HEADERS):
    with zipfile.ZipFile(path, "w") as whl:
        for name, text in headers.items():
            whl.writestr(flashinfer.WHEEL_PREFIX + name, text)
        whl.writestr(flashinfer.WHEEL_CCCL_PREFIX + "cuda/cmath", "// libcudacxx's cuda/cmath\n")
        whl.writestr("flashinfer_python-0.7.4.dist-info/METADATA", "Name: flashinfer-python\n")
    return path


def test_headers_from_a_wheel_are_the_include_closure(tmp_path):
    assert flashinfer.main([str(fake_wheel(tmp_path / "fi.whl")), "--out", str(tmp_path / "fi")]) == 0
    include = tmp_path / "fi" / "include"
    assert sorted(os.listdir(include / "flashinfer")) == EXTRACTED          # sampling.cuh: nobody includes it
    assert (include / "VERSION").read_text() == "0.7.4\n"
    assert "RMSNormQuant" in (include / "flashinfer" / "norm_rms.cuh").read_text()
    assert (include / "flashinfer" / "page.cuh").read_text() == FAKE_HEADERS["page.cuh"]
    assert (tmp_path / "fi" / "cccl" / "cuda" / "cmath").read_text() == "// libcudacxx's cuda/cmath\n"


def test_an_unchanged_header_keeps_its_time(tmp_path):
    """A second extraction rewrites nothing it would write the same, so a built library stays."""
    wheel = fake_wheel(tmp_path / "fi.whl")
    header = tmp_path / "fi" / "include" / "flashinfer" / "page.cuh"
    flashinfer.headers_from_wheel(str(wheel), str(tmp_path / "fi"))
    os.utime(header, (1, 1))
    flashinfer.headers_from_wheel(str(wheel), str(tmp_path / "fi"))
    assert os.path.getmtime(header) == 1


def test_a_header_missing_from_the_closure_says_which():
    headers = dict(FAKE_HEADERS)
    del headers["fastdiv.cuh"]
    with pytest.raises(ValueError, match="fastdiv.cuh is missing"):
        flashinfer.header_closure(lambda name: headers[name].encode())


def test_what_flashinfer_accepts(tmp_path, monkeypatch):
    assert flashinfer.library("none", "90") == (None, "--flashinfer none")
    lib, why = flashinfer.library(str(tmp_path), "90")
    assert lib is None and "has no include/flashinfer/norm_rms.cuh" in why
    lib, why = flashinfer.library(str(tmp_path), "90", flashinfer.ROPE)
    assert lib is None and "has no include/flashinfer/pos_enc.cuh" in why
    lib, why = flashinfer.library(str(tmp_path / "missing.so"), "90")
    assert lib is None and why.startswith("OSError")
    monkeypatch.setattr(flashinfer, "find_nvcc", lambda: None)
    monkeypatch.setattr(flashinfer.tempfile, "gettempdir", lambda: str(tmp_path / "cache"))
    for wrapper in (flashinfer.QUANT, flashinfer.ROPE):
        lib, why = flashinfer.library(str(fake_wheel(tmp_path / "fi.whl")), "90", wrapper)   # extracted, no nvcc
        assert lib is None and "nvcc is not on PATH" in why
    cached = tmp_path / "cache" / "cupy_rmsnorm_flashinfer" / "fi" / "include" / "flashinfer"
    assert (cached / "norm_rms.cuh").is_file() and (cached / "pos_enc.cuh").is_file()
    monkeypatch.setattr(flashinfer, "installed_package", lambda: None)
    lib, why = flashinfer.library(None, "90")
    assert lib is None and "pip install flashinfer-python" in why


@pytest.mark.parametrize("wrapper", [flashinfer.QUANT, flashinfer.ROPE], ids=["quant", "rope"])
def test_build_runs_nvcc_once(wrapper, tmp_path, monkeypatch):
    calls = []

    def fake_nvcc(cmd, capture_output, text, timeout):
        calls.append(cmd)
        open(cmd[-1], "w").close()
        return subprocess.CompletedProcess(cmd, 0, "", "")
    monkeypatch.setattr(flashinfer, "find_nvcc", lambda: "/opt/cuda/bin/nvcc")
    monkeypatch.setattr(flashinfer.subprocess, "run", fake_nvcc)
    include = str(tmp_path / "include")
    lib = flashinfer.build(include, str(tmp_path), "90", wrapper)
    assert lib == str(tmp_path / "sm90" / wrapper.library)
    assert flashinfer.build(include, str(tmp_path), "90", wrapper) == lib
    (cmd,) = calls                                             # the second call reused the library
    assert cmd[0] == "/opt/cuda/bin/nvcc" and "-arch=sm_90" in cmd and cmd[cmd.index("-I") + 1] == include
    assert wrapper.source in cmd and os.path.isfile(wrapper.source)
    os.makedirs(tmp_path / "cccl")                             # FlashInfer's libcudacxx, first on the path
    os.remove(lib)
    flashinfer.build(include, str(tmp_path), "90", wrapper)
    assert len(calls) == 2
    assert [calls[1][i + 1] for i, w in enumerate(calls[1]) if w == "-I"] == [str(tmp_path / "cccl"), include]


EXTRACTED_INCLUDE = os.path.join(ROOT, ".flashinfer", "include")


@pytest.mark.skipif(flashinfer.find_nvcc() is None or not os.path.isfile(os.path.join(EXTRACTED_INCLUDE, "flashinfer",
                                                                                      "pos_enc.cuh")),
                    reason="FlashInfer wrapper compile: needs nvcc and .flashinfer/include "
                           "(python -m cupy_rmsnorm.bench.flashinfer WHEEL)")
@pytest.mark.parametrize("wrapper", [flashinfer.QUANT, flashinfer.ROPE], ids=["quant", "rope"])
def test_flashinfer_wrapper_compiles(wrapper, tmp_path):
    cccl = os.path.join(os.path.dirname(EXTRACTED_INCLUDE), "cccl")
    cmd = [flashinfer.find_nvcc(), "-std=c++17", "-arch=sm_90", "-c", *(["-I", cccl] if os.path.isdir(cccl) else []),
           "-I", EXTRACTED_INCLUDE, wrapper.source, "-o", str(tmp_path / "fi.o")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
