"""The quantized forms' registered torch ops on the CPU: schemas, fake implementations (dtypes,
shapes, the scales' strides, the real path's checks) and tracing of the public functions as
one op under torch.compile(fullgraph=True). The GPU side (opcheck, compiled against eager,
CUDA graphs) is in tests/gpu/test_gpu_quant.py."""

import pytest
from helpers import op_calls as _op_calls
from helpers import trace_graphs as _trace

torch = pytest.importorskip("torch", reason="torch op tests: torch is not installed")

import cupy_rmsnorm as rn  # noqa: E402
import cupy_rmsnorm.torch  # noqa: E402,F401 - registers the ops
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

OPS = torch.ops.cupy_rmsnorm
TAIL = ("float eps, float weight_offset, str casting_mode, SymInt? group_size, float? scale_ub, "
        "str quant_dtype)")
SCHEMAS = {
    "rms_norm_quant": "cupy_rmsnorm::rms_norm_quant(Tensor x, Tensor? weight, Tensor? scale, " + TAIL
                      + " -> (Tensor, Tensor)",
    "fused_add_rms_norm_quant": "cupy_rmsnorm::fused_add_rms_norm_quant(Tensor x, Tensor residual, Tensor? weight, "
                                "Tensor? scale, " + TAIL + " -> (Tensor, Tensor, Tensor)",
    "fused_add_rms_norm_quant_inplace": "cupy_rmsnorm::fused_add_rms_norm_quant_inplace(Tensor x, Tensor(a1!) "
                                        "residual, Tensor? weight, Tensor? scale, " + TAIL + " -> (Tensor, Tensor)",
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schema(name):
    # an int annotation reads SymInt in newer torch, int in older
    assert str(getattr(OPS, name).default._schema).replace("int? group_size", "SymInt? group_size") \
        .replace("SymSymInt", "SymInt") == SCHEMAS[name]


def test_fake_outputs():
    with FakeTensorMode():
        x = torch.empty(6, 7, 512, dtype=torch.bfloat16)[:, 1:]          # strided rows, 36 of them
        w = torch.empty(512, dtype=torch.float32)
        q, s = OPS.rms_norm_quant(x, w, None, 1e-6, 0.0, "llama", None, None, "float8_e4m3fn")
        assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and q.is_contiguous()
        assert s.dtype == torch.float32 and s.shape == (6, 6, 1) and s.is_contiguous()
        q, s = OPS.rms_norm_quant(x, None, None, 1e-6, 0.0, "fp32", 128, 10.0, "float8_e5m2")
        assert q.dtype == torch.float8_e5m2 and s.shape == (6, 6, 4)
        assert s.stride() == (6, 1, 36)                                   # column-major: 36 rows a column
        q, r, s = OPS.fused_add_rms_norm_quant(x, x, w, torch.empty(1), 1e-6, 0.0, "fp32", None, None, "int8")
        assert q.dtype == torch.int8 and r.dtype == torch.bfloat16 and r.is_contiguous() and s.shape == (0,)
        q, s = OPS.fused_add_rms_norm_quant_inplace(x, x, None, None, 1e-6, 0.0, "fp32", 128, None, "float8_e4m3fn")
        assert q.shape == x.shape and s.stride() == (6, 1, 36)
        q, s = OPS.rms_norm_quant(torch.empty(5, 128), None, None, 1e-6, 0.0, "fp32", 128, None, "float8_e4m3fn")
        assert s.shape == (5, 1) and s.stride() == (1, 8)                 # 5 rows padded to 8


def test_fake_implementations_check_like_the_real_path():
    with FakeTensorMode():
        x = torch.empty(2, 200, dtype=torch.float16)
        with pytest.raises(ValueError, match=r"^group_size=128 needs a hidden size that is a multiple"):
            OPS.rms_norm_quant(x, None, None, 1e-6, 0.0, "fp32", 128, None, "float8_e4m3fn")
        with pytest.raises(ValueError, match=r"^quant_dtype must be one of"):
            OPS.rms_norm_quant(x, None, None, 1e-6, 0.0, "fp32", None, None, "float8_e4m3fnuz")
        with pytest.raises(TypeError, match=r"^scale must be a float32 array"):
            OPS.rms_norm_quant(x, None, torch.empty(1, dtype=torch.float16), 1e-6, 0.0, "fp32", None, None, "int8")
        with pytest.raises(TypeError, match=r"^residual must have dtype float16 \(x's dtype or float32\)"):
            OPS.fused_add_rms_norm_quant(x, torch.empty(2, 200, dtype=torch.bfloat16), None, None, 1e-6, 0.0, "fp32",
                                         None, None, "int8")
        q, s, scales = OPS.fused_add_rms_norm_quant(x, torch.empty(2, 200), None, None, 1e-6, 0.0, "fp32", None,
                                                    None, "int8")
        assert s.dtype == torch.float32           # a float32 residual stream


CASES = ["token", "static", "group", "token out=", "fused", "fused in place", "fused out=", "group scales_out="]


@pytest.mark.parametrize("case", CASES)
def test_public_functions_trace_as_one_op(case):
    x, r, w = torch.randn(4, 256), torch.randn(4, 256), torch.randn(256)
    scale = torch.full((1,), 0.05)

    def fn(x, r, w):
        if case == "token":
            return rn.rms_norm_quant(x, w, casting_mode="llama", scale_ub=20.0)
        if case == "static":
            return rn.rms_norm_quant(x, w, scale=scale, quant_dtype=torch.float8_e5m2)
        if case == "group":
            return rn.rms_norm_quant(x, None, group_size=128)
        if case == "token out=":
            return rn.rms_norm_quant(x, w, out=torch.empty(4, 256, dtype=torch.uint8))
        if case == "fused":
            return rn.fused_add_rms_norm_quant(x, r, w, quant_dtype="int8")
        if case == "fused in place":
            return rn.fused_add_rms_norm_quant(x, r, w, scale=scale, residual_out=r)
        if case == "fused out=":
            return rn.fused_add_rms_norm_quant(x, r, w, group_size=128, residual_out=torch.empty_like(r))
        return rn.rms_norm_quant(x, w, group_size=128, scales_out=torch.empty(4, 2))

    calls = _op_calls(_trace(fn, x, r, w))
    want = {"fused": "fused_add_rms_norm_quant", "fused in place": "fused_add_rms_norm_quant_inplace",
            "fused out=": "fused_add_rms_norm_quant"}.get(case, "rms_norm_quant")
    assert calls == [f"cupy_rmsnorm.{want}.default"], calls


def test_traced_arguments_are_checked_at_trace_time():
    with pytest.raises(Exception, match="group_size must be None"):
        _trace(lambda x: rn.rms_norm_quant(x, group_size=64), torch.randn(2, 128))
