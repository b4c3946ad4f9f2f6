"""The kernels' ABI, mirrored on the host: the Params structs each kernel takes by value
(as NumPy record dtypes, packed field for field), the flags and enums, and the C++ names of
the instantiations NVRTC compiles. The C side is kernels/common.cuh, kernels/quant.cuh,
kernels/backward.cuh and the programs (kernels/*.cu); a CPU test reads both sides. Eight-byte
fields come first and nothing is padded, so a struct's size is the sum of its fields.
"""

import numpy as np

CUDA_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}
ITEMSIZES = {"float32": 4, "float16": 2, "bfloat16": 2}

# -- forward: enum Flags and struct Params (kernels/common.cuh, kernels/rms_norm.cu) --------------
FLAGS = {"kLlama": 1, "kHasWeight": 2, "kEarlyTrigger": 4}
LLAMA, HAS_WEIGHT, EARLY_TRIGGER = FLAGS["kLlama"], FLAGS["kHasWeight"], FLAGS["kEarlyTrigger"]
PARAMS_BYTES = 96
PARAMS_DTYPE = np.dtype([
    ("rows", "<i8"), ("n_inner", "<i8"),
    ("x", "<i8", (2,)), ("residual", "<i8", (2,)), ("out", "<i8", (2,)), ("residual_out", "<i8", (2,)),
    ("hidden", "<i4"), ("eps", "<f4"), ("weight_offset", "<f4"), ("flags", "<i4"),
])
assert PARAMS_DTYPE.itemsize == PARAMS_BYTES

# -- quantized forms: enum QuantForm, enum QuantType, struct QuantParams (kernels/quant.cuh) -----
QUANT_FORMS = {"static": 1, "per_token": 2, "per_group": 3}
QUANT_TYPES = {"float8_e4m3fn": 0, "float8_e5m2": 1, "int8": 2}
QUANT_PARAMS_BYTES = 24
QUANT_PARAMS_DTYPE = np.dtype([("scales_row", "<i8"), ("scales_group", "<i8"), ("scale_ub", "<f4"),
                               ("pad", "<i4")])
assert QUANT_PARAMS_DTYPE.itemsize == QUANT_PARAMS_BYTES

# -- backward: enum BackwardFlags, struct BackwardParams, ReduceParams (kernels/rms_norm_backward.cu)
BACKWARD_FLAGS = {"kAddGrad": 8, "kWeightGrad": 16, "kDirectWeight": 32,     # with FLAGS' kLlama and kHasWeight
                  "kUnitRows": 64, "kWeightVectors": 128}                      # the row kernel's promises
ADD_GRAD, WEIGHT_GRAD, DIRECT_WEIGHT, UNIT_ROWS, WEIGHT_VECTORS = (
    BACKWARD_FLAGS[k] for k in ("kAddGrad", "kWeightGrad", "kDirectWeight", "kUnitRows", "kWeightVectors"))
BACKWARD_PARAMS_BYTES = 112
BACKWARD_PARAMS_DTYPE = np.dtype([
    ("rows", "<i8"), ("n_inner", "<i8"), ("rows_per_block", "<i8"),
    ("dy", "<i8", (2,)), ("x", "<i8", (2,)), ("d_residual_out", "<i8", (2,)), ("dx", "<i8", (2,)),
    ("hidden", "<i4"), ("eps", "<f4"), ("weight_offset", "<f4"), ("flags", "<i4"),
    ("stages", "<i4"), ("unused", "<i4"),
])
assert BACKWARD_PARAMS_DTYPE.itemsize == BACKWARD_PARAMS_BYTES
REDUCE_PARAMS_BYTES = 16
REDUCE_PARAMS_DTYPE = np.dtype([("partials", "<i8"), ("hidden", "<i8")])
assert REDUCE_PARAMS_DTYPE.itemsize == REDUCE_PARAMS_BYTES
REDUCE_COLUMNS, REDUCE_BLOCK = 32, 256      # the reduction kernel's REDUCE_COLUMNS and block


# -- gated: enum GatedFlags, enum Activation, struct GatedParams / GatedBackwardParams ------------
# (kernels/rms_norm_gated.cu; the backward's flags also take BACKWARD_FLAGS' kWeightGrad, kDirectWeight)
GATED_FLAGS = {"kRoundProduct": 256}
ROUND_PRODUCT = GATED_FLAGS["kRoundProduct"]
ACTIVATIONS = {"silu": 0, "sigmoid": 1}
GATED_PARAMS_BYTES = 88
GATED_PARAMS_DTYPE = np.dtype([
    ("rows", "<i8"), ("n_inner", "<i8"), ("x", "<i8", (2,)), ("gate", "<i8", (2,)), ("out", "<i8", (2,)),
    ("hidden", "<i4"), ("groups", "<i4"), ("eps", "<f4"), ("weight_offset", "<f4"), ("flags", "<i4"), ("unused", "<i4"),
])
assert GATED_PARAMS_DTYPE.itemsize == GATED_PARAMS_BYTES
GATED_BACKWARD_PARAMS_BYTES = 128
GATED_BACKWARD_PARAMS_DTYPE = np.dtype([
    ("rows", "<i8"), ("n_inner", "<i8"), ("rows_per_block", "<i8"),
    ("dy", "<i8", (2,)), ("x", "<i8", (2,)), ("gate", "<i8", (2,)), ("dx", "<i8", (2,)), ("dgate", "<i8", (2,)),
    ("hidden", "<i4"), ("groups", "<i4"), ("eps", "<f4"), ("weight_offset", "<f4"), ("flags", "<i4"), ("unused", "<i4"),
])
assert GATED_BACKWARD_PARAMS_DTYPE.itemsize == GATED_BACKWARD_PARAMS_BYTES

# -- QK norm + RoPE: enum QkRopeFlags, struct QkRopeParams / QkRopeBackwardParams -----------------
# (kernels/qk_norm_rope.cu; the backward's flags also take BACKWARD_FLAGS' kWeightGrad, kDirectWeight)
QK_ROPE_FLAGS = {"kInt64Positions": 512}
INT64_POSITIONS = QK_ROPE_FLAGS["kInt64Positions"]
QK_ROPE_PARAMS_BYTES = 208
QK_ROPE_PARAMS_DTYPE = np.dtype([
    ("tokens", "<i8"), ("n_inner", "<i8"),
    ("q", "<i8", (2,)), ("k", "<i8", (2,)), ("out_q", "<i8", (2,)), ("out_k", "<i8", (2,)),
    ("cos", "<i8", (2,)), ("sin", "<i8", (2,)), ("positions", "<i8", (2,)),
    ("q_head", "<i8"), ("k_head", "<i8"), ("out_q_head", "<i8"), ("out_k_head", "<i8"),
    ("cache_row", "<i8"), ("max_position", "<i8"),
    ("q_heads", "<i4"), ("k_heads", "<i4"), ("head_dim", "<i4"), ("rotary_dim", "<i4"),
    ("eps", "<f4"), ("weight_offset", "<f4"), ("flags", "<i4"), ("unused", "<i4"),
])
assert QK_ROPE_PARAMS_DTYPE.itemsize == QK_ROPE_PARAMS_BYTES
QK_ROPE_BACKWARD_PARAMS_BYTES = 264
QK_ROPE_BACKWARD_PARAMS_DTYPE = np.dtype([
    ("tokens", "<i8"), ("n_inner", "<i8"), ("items_per_block", "<i8"),
    ("dq_out", "<i8", (2,)), ("dk_out", "<i8", (2,)), ("q", "<i8", (2,)), ("k", "<i8", (2,)),
    ("dq", "<i8", (2,)), ("dk", "<i8", (2,)), ("cos", "<i8", (2,)), ("sin", "<i8", (2,)),
    ("positions", "<i8", (2,)),
    ("dq_out_head", "<i8"), ("dk_out_head", "<i8"), ("q_head", "<i8"), ("k_head", "<i8"), ("dq_head", "<i8"),
    ("dk_head", "<i8"), ("cache_row", "<i8"), ("max_position", "<i8"),
    ("q_heads", "<i4"), ("k_heads", "<i4"), ("head_dim", "<i4"), ("rotary_dim", "<i4"),
    ("eps", "<f4"), ("weight_offset", "<f4"), ("flags", "<i4"), ("unused", "<i4"),
])
assert QK_ROPE_BACKWARD_PARAMS_DTYPE.itemsize == QK_ROPE_BACKWARD_PARAMS_BYTES


def kernel_weight_offset(scalars):
    """The offset the kernels add to the weights: -0 for an offset of 0, since w + -0 is w for
    every w (-0 included), so the weight is used as it is (_reference.offset_weight)."""
    return scalars.weight_offset or -0.0


def row_kernel_flags(flags, unit_rows, weight_vectors):
    """The template FLAGS of rms_norm_backward_row_kernel for a call's BackwardParams flags:
    kLlama only where it matters (dweight), and the promises that hold: ``unit_rows`` (n_inner
    is 1) and ``weight_vectors`` (rows without edges and a weight aligned to its vectors)."""
    if not flags & WEIGHT_GRAD:
        flags &= ~LLAMA
    if unit_rows:
        flags |= UNIT_ROWS
    if weight_vectors and flags & HAS_WEIGHT:
        flags |= WEIGHT_VECTORS
    return flags


# -- the instantiations' names (NVRTC's name expressions) ------------------------------------------
def instantiation_name(dtype, weight_dtype, fused, plan, residual_dtype=None, out_dtype=None):
    """The C++ name of the instantiation a LaunchPlan needs, as NVRTC's name_expressions want it.
    ``residual_dtype`` / ``out_dtype`` (mixed precision; x's dtype when None) become the
    kernel's R and O, named only where they differ from x's."""
    t = CUDA_TYPES[dtype]
    w = CUDA_TYPES[weight_dtype or dtype]
    args = ", ".join(str(a) for a in plan.template_args())
    kernel = "rms_norm_cluster_kernel" if plan.cluster > 1 else "rms_norm_kernel"
    mixed = ""
    if (residual_dtype or dtype) != dtype or (out_dtype or dtype) != dtype:
        mixed = f", {CUDA_TYPES[residual_dtype or dtype]}, {CUDA_TYPES[out_dtype or dtype]}"
    return f"rmsnorm::{kernel}<{t}, {w}, {'true' if fused else 'false'}, {args}{mixed}>"


def quant_instantiation_name(dtype, weight_dtype, fused, plan, form, quant_dtype, residual_dtype=None):
    """The name expression of the quantized kernel (``form`` a QUANT_FORMS key, ``quant_dtype`` a
    QUANT_TYPES key) a LaunchPlan needs; ``residual_dtype`` its R (a float32 residual stream)."""
    args = ", ".join(str(a) for a in plan.template_args())
    kernel = "rms_norm_quant_cluster_kernel" if plan.cluster > 1 else "rms_norm_quant_kernel"
    flat = "" if plan.cluster > 1 else ", true" if plan.flat else ", false"     # FLAT: not with clusters
    mixed = f", {CUDA_TYPES[residual_dtype]}" if (residual_dtype or dtype) != dtype else ""
    return (f"rmsnorm::{kernel}<{CUDA_TYPES[dtype]}, {CUDA_TYPES[weight_dtype or dtype]}, "
            f"{'true' if fused else 'false'}, {args}, {QUANT_FORMS[form]}, {QUANT_TYPES[quant_dtype]}{flat}{mixed}>")


def backward_instantiation_name(dtype, weight_dtype, plan, flags=None, llama_dtype=None):
    """The name expression of the backward kernel a BackwardPlan needs (program "backward");
    the row kernel's also has its ``flags`` (``row_kernel_flags``) compiled in. ``llama_dtype``:
    the kernel's N, the dtype the llama mode rounds xhat to (x's when None)."""
    args = ", ".join(str(a) for a in plan.template_args())
    if plan.variant == "row":
        if flags is None:
            raise ValueError("the row kernel's instantiation needs its flags")
        args += f", {flags}"
    if (llama_dtype or dtype) != dtype:
        args += f", {CUDA_TYPES[llama_dtype]}"
    kernel = {"staged": "rms_norm_backward_staged_kernel", "row": "rms_norm_backward_row_kernel"}.get(
        plan.variant, "rms_norm_backward_kernel")
    return f"rmsnorm::{kernel}<{CUDA_TYPES[dtype]}, {CUDA_TYPES[weight_dtype or dtype]}, {args}>"


def reduce_instantiation_name(weight_dtype):
    """The name expression of the dweight reduction writing ``weight_dtype`` (program "backward")."""
    return f"rmsnorm::rms_norm_backward_reduce_kernel<{CUDA_TYPES[weight_dtype]}>"


def gated_instantiation_name(dtype, weight_dtype, out_dtype, plan, norm_before_gate, activation):
    """The name expression of the gated forward kernel (program "gated") a LaunchPlan needs."""
    return (f"rmsnorm::rms_norm_gated_kernel<{CUDA_TYPES[dtype]}, {CUDA_TYPES[weight_dtype or dtype]}, "
            f"{CUDA_TYPES[out_dtype]}, {plan.vec}, {plan.threads_per_row}, {plan.vecs_per_thread}, "
            f"{'false' if norm_before_gate else 'true'}, {ACTIVATIONS[activation]}>")


def gated_backward_instantiation_name(dtype, dy_dtype, weight_dtype, plan, norm_before_gate, activation):
    """The name expression of the gated backward kernel (program "gated") a GatedBackwardPlan needs."""
    return (f"rmsnorm::rms_norm_gated_backward_kernel<{CUDA_TYPES[dtype]}, {CUDA_TYPES[dy_dtype]}, "
            f"{CUDA_TYPES[weight_dtype or dtype]}, {plan.vec}, {plan.threads_per_row}, {plan.vecs_per_thread}, "
            f"{'false' if norm_before_gate else 'true'}, {ACTIVATIONS[activation]}>")


def qk_rope_instantiation_name(dtype, weight_dtype, table_dtype, plan, cache):
    """The name expression of the QK norm + RoPE forward kernel (program "qk_rope") a QkRopePlan
    needs: ``table_dtype`` the cos / sin (or cos_sin_cache) dtype, ``cache`` the positions and
    cos_sin_cache convention."""
    args = ", ".join(str(a) for a in plan.template_args())
    return (f"rmsnorm::qk_norm_rope_kernel<{CUDA_TYPES[dtype]}, {CUDA_TYPES[weight_dtype or dtype]}, "
            f"{CUDA_TYPES[table_dtype]}, {args}, {'true' if cache else 'false'}>")


def qk_rope_backward_instantiation_name(dtype, weight_dtype, table_dtype, plan, cache):
    """The name expression of the QK norm + RoPE backward kernel (program "qk_rope") a
    QkRopeBackwardPlan needs."""
    args = ", ".join(str(a) for a in plan.template_args())
    return (f"rmsnorm::qk_norm_rope_backward_kernel<{CUDA_TYPES[dtype]}, {CUDA_TYPES[weight_dtype or dtype]}, "
            f"{CUDA_TYPES[table_dtype]}, {args}, {'true' if cache else 'false'}>")
