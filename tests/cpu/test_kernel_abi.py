"""The kernels' Params structs, flags and enums against their Python mirror (_abi), read
from the CUDA sources, so the two sides cannot drift apart unnoticed."""

import os
import re

from cupy_rmsnorm import _abi
from cupy_rmsnorm import _compile
from cupy_rmsnorm.ops.backward import launch as backward_launch
from cupy_rmsnorm.ops.backward import plan as backward_plan
from cupy_rmsnorm.ops.qk_rope import launch as qk_rope_launch
from cupy_rmsnorm.ops.quant import launch as quant_launch
from cupy_rmsnorm.ops.quant import reference as quant_reference


def kernel_source(program=None):
    """Every file of kernels/ (headers and programs) as one text: each struct and enum is
    defined once, in whichever file it lives."""
    return "\n".join(_compile.kernel_file(n) for n in sorted(os.listdir(_compile.kernels_dir()))
                     if n.endswith(_compile.KERNEL_SUFFIXES))

_SIZES = {"long long": 8, "int": 4, "float": 4, "RowStrides": 16}


def _struct_fields(source, name):
    body = re.search(r"struct %s \{(.*?)\};" % name, source, re.S).group(1)
    fields = []
    for line in body.split(";"):
        line = line.split("//")[0].strip()
        if not line:
            continue
        m = re.match(r"(long long|int|float|RowStrides)\s+(.*)", line)
        assert m, f"unexpected Params line: {line!r}"
        fields += [(f.strip(), m.group(1)) for f in m.group(2).split(",")]
    return fields


def test_params_match_the_kernel():
    src = kernel_source()
    size = int(re.search(r"static_assert\(sizeof\(Params\) == (\d+)", src).group(1))
    assert size == _abi.PARAMS_BYTES == _abi.PARAMS_DTYPE.itemsize
    fields = _struct_fields(src, "Params")
    dtype = _abi.PARAMS_DTYPE
    assert [f for f, _ in fields] == list(dtype.names)
    for name, ctype in fields:
        assert dtype.fields[name][0].itemsize == _SIZES[ctype], name
    assert [f for f, _ in _struct_fields(src, "RowStrides")] == ["outer", "inner"]
    offsets = [dtype.fields[n][1] for n in dtype.names]
    assert offsets == sorted(offsets) and sum(_SIZES[t] for _, t in fields) == size   # no padding


def test_flags_match_the_kernel():
    body = re.search(r"enum Flags \{(.*?)\};", kernel_source(), re.S).group(1)
    flags = {k.strip(): int(v) for k, v in (item.split("=") for item in body.split(","))}
    assert flags == _abi.FLAGS


def test_backward_params_match_the_kernel():
    src = kernel_source("backward")
    for struct, size_attr, dtype, module in (
            ("BackwardParams", "BACKWARD_PARAMS_BYTES", backward_launch.BACKWARD_PARAMS_DTYPE, backward_launch),
            ("ReduceParams", "REDUCE_PARAMS_BYTES", _abi.REDUCE_PARAMS_DTYPE, _abi)):
        size = int(re.search(r"static_assert\(sizeof\(%s\) == (\d+)" % struct, src).group(1))
        assert size == getattr(module, size_attr) == dtype.itemsize, struct
        fields = _struct_fields(src, struct)
        assert [f for f, _ in fields] == list(dtype.names), struct
        for name, ctype in fields:
            assert dtype.fields[name][0].itemsize == _SIZES[ctype], (struct, name)
        offsets = [dtype.fields[n][1] for n in dtype.names]
        assert offsets == sorted(offsets) and sum(_SIZES[t] for _, t in fields) == size, struct


def test_backward_flags_match_the_kernel():
    body = re.search(r"enum BackwardFlags \{(.*?)\};", kernel_source("backward"), re.S).group(1)
    flags = {k.strip(): int(v) for k, v in (item.split("=") for item in body.split(","))}
    assert flags == _abi.BACKWARD_FLAGS
    assert not set(flags.values()) & set(_abi.FLAGS.values())     # one Params.flags word


def test_row_kernel_flags():
    L = _abi
    every = L.LLAMA | L.HAS_WEIGHT | L.ADD_GRAD | L.WEIGHT_GRAD | L.DIRECT_WEIGHT
    assert L.row_kernel_flags(every, True, True) == every | L.UNIT_ROWS | L.WEIGHT_VECTORS
    assert L.row_kernel_flags(every, False, False) == every
    # llama only matters to dweight; no weight, no promise about it
    assert L.row_kernel_flags(L.LLAMA | L.HAS_WEIGHT, True, True) == L.HAS_WEIGHT | L.UNIT_ROWS | L.WEIGHT_VECTORS
    assert L.row_kernel_flags(L.LLAMA | L.ADD_GRAD, False, True) == L.ADD_GRAD


def test_reduce_geometry_matches_the_kernel():
    src = kernel_source("backward")
    m = re.search(r"constexpr int REDUCE_COLUMNS = (\d+), REDUCE_SLICES = (\d+);", src)
    assert int(m.group(1)) == _abi.REDUCE_COLUMNS
    # four columns a thread across, REDUCE_SLICES threads down
    assert "REDUCE_ACROSS = REDUCE_COLUMNS / 4;" in src
    assert int(m.group(1)) // 4 * int(m.group(2)) == _abi.REDUCE_BLOCK


def test_backward_groups_match_the_plan():
    """The kernel's GROUPS (rows in flight per block) is backward_plan's groups_per_block."""
    src = kernel_source("backward")
    assert "constexpr int GROUPS = THREADS_PER_ROW <= 32 ? 256 / THREADS_PER_ROW : 1;" in src
    from cupy_rmsnorm import _plan
    assert backward_plan.BACKWARD_GROUPS_BLOCK == 256 and _plan.WARP == 32


def test_forward_rows_per_block_match_the_plan():
    """norm_row's compile-time rows a block is launch_plan's rows_per_block: one past 32
    threads a row, else groups sharing WARP_VARIANT_BLOCK threads."""
    src = kernel_source()
    assert "constexpr int ROWS_PER_BLOCK = THREADS_PER_ROW > 32 ? 1 : 256 / THREADS_PER_ROW;" in src
    from cupy_rmsnorm import _plan
    assert _plan.WARP_VARIANT_BLOCK == 256 and _plan.WARP == 32
    for n in (8, 64, 512, 4096):
        p = _plan.launch_plan(1000, n * 8, 2, 8, 132)
        assert p.rows_per_block == (1 if p.threads_per_row > 32 else 256 // p.threads_per_row)


def test_zero_weight_offset_reaches_the_kernels_as_negative_zero():
    """w + -0 is w for every w: an offset of 0 leaves the weights as they are (_reference)."""
    import math
    from types import SimpleNamespace
    for off in (0.0, -0.0):
        v = _abi.kernel_weight_offset(SimpleNamespace(weight_offset=off))
        assert v == 0 and math.copysign(1.0, v) == -1.0
    assert _abi.kernel_weight_offset(SimpleNamespace(weight_offset=1.0)) == 1.0


def test_quant_params_match_the_kernel():
    src = kernel_source()
    size = int(re.search(r"static_assert\(sizeof\(QuantParams\) == (\d+)", src).group(1))
    dtype = quant_launch.QUANT_PARAMS_DTYPE
    assert size == quant_launch.QUANT_PARAMS_BYTES == dtype.itemsize
    fields = _struct_fields(src, "QuantParams")
    assert [f for f, _ in fields] == list(dtype.names)
    for name, ctype in fields:
        assert dtype.fields[name][0].itemsize == _SIZES[ctype], name
    offsets = [dtype.fields[n][1] for n in dtype.names]
    assert offsets == sorted(offsets) and sum(_SIZES[t] for _, t in fields) == size


def _enum(name):
    body = re.search(r"enum %s \{(.*?)\};" % name, kernel_source(), re.S).group(1)
    return {k.strip(): int(v) for k, v in (item.split("=") for item in body.split(","))}


def test_quant_enums_and_constants_match():
    """QuantForm / QuantType against _abi's names, and the constants of the contract
    (QMAX per type, the group size, the minimum scale's divisor) against _reference / _plan."""
    from cupy_rmsnorm import _plan, _reference
    forms = _enum("QuantForm")
    assert forms.pop("kPlain") == 0
    assert forms == {"kStatic": quant_launch.QUANT_FORM_IDS["static"], "kPerToken": quant_launch.QUANT_FORM_IDS["per_token"],
                     "kPerGroup": quant_launch.QUANT_FORM_IDS["per_group"]}
    types = _enum("QuantType")
    assert types == {"kE4M3": quant_launch.QUANT_TYPES["float8_e4m3fn"], "kE5M2": quant_launch.QUANT_TYPES["float8_e5m2"],
                     "kInt8": quant_launch.QUANT_TYPES["int8"]}
    src = kernel_source()
    for kname, qname in (("kE4M3", "float8_e4m3fn"), ("kE5M2", "float8_e5m2"), ("kInt8", "int8")):
        value = re.search(r"struct QuantMax<%s> \{ static constexpr float value = ([\d.]+)f; \};" % kname, src)
        assert float(value.group(1)) == quant_reference.quant_max(qname)
    assert int(re.search(r"constexpr int kGroupSize = (\d+);", src).group(1)) == _plan.QUANT_GROUP
    assert quant_reference.GROUP_SIZES == (_plan.QUANT_GROUP,)
    divisor = float(re.search(r"constexpr float kMinScaleDivisor = ([\d.]+)f;", src).group(1))
    assert divisor == quant_reference.MIN_SCALE_DIVISOR


def test_qk_rope_params_and_flags_match_the_kernel():
    src = kernel_source()
    for struct, size_attr, dtype, module in (
            ("QkRopeParams", "QK_ROPE_PARAMS_BYTES", qk_rope_launch.QK_ROPE_PARAMS_DTYPE, qk_rope_launch),
            ("QkRopeBackwardParams", "QK_ROPE_BACKWARD_PARAMS_BYTES", qk_rope_launch.QK_ROPE_BACKWARD_PARAMS_DTYPE,
             qk_rope_launch)):
        size = int(re.search(r"static_assert\(sizeof\(%s\) == (\d+)" % struct, src).group(1))
        assert size == getattr(module, size_attr) == dtype.itemsize, struct
        fields = _struct_fields(src, struct)
        assert [f for f, _ in fields] == list(dtype.names), struct
        for name, ctype in fields:
            assert dtype.fields[name][0].itemsize == _SIZES[ctype], (struct, name)
        offsets = [dtype.fields[n][1] for n in dtype.names]
        assert offsets == sorted(offsets) and sum(_SIZES[t] for _, t in fields) == size, struct
    flags = _enum("QkRopeFlags")
    assert flags == qk_rope_launch.QK_ROPE_FLAGS
    used = set(_abi.FLAGS.values()) | set(_abi.BACKWARD_FLAGS.values())
    assert not set(flags.values()) & used           # one Params.flags word
