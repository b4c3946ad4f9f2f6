"""The kernels' ABI that several families share, mirrored on the host: the forward's Params
(kernels/rms_norm.cu; the quantized and gated launchers take it too), the dweight reduction's
(kernels/backward.cuh), the flags and the weight offset. Each family's own structs and
instantiation names are in its ``ops/<family>/launch.py``; a CPU test reads both sides. Eight-byte
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


# -- backward: enum BackwardFlags, struct BackwardParams, ReduceParams (kernels/rms_norm_backward.cu)
BACKWARD_FLAGS = {"kAddGrad": 8, "kWeightGrad": 16, "kDirectWeight": 32,     # with FLAGS' kLlama and kHasWeight
                  "kUnitRows": 64, "kWeightVectors": 128}                      # the row kernel's promises
ADD_GRAD, WEIGHT_GRAD, DIRECT_WEIGHT, UNIT_ROWS, WEIGHT_VECTORS = (
    BACKWARD_FLAGS[k] for k in ("kAddGrad", "kWeightGrad", "kDirectWeight", "kUnitRows", "kWeightVectors"))
REDUCE_PARAMS_BYTES = 16
REDUCE_PARAMS_DTYPE = np.dtype([("partials", "<i8"), ("hidden", "<i8")])
assert REDUCE_PARAMS_DTYPE.itemsize == REDUCE_PARAMS_BYTES
REDUCE_COLUMNS, REDUCE_BLOCK = 32, 256      # the reduction kernel's REDUCE_COLUMNS and block


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


def reduce_instantiation_name(weight_dtype):
    """The name expression of the dweight reduction writing ``weight_dtype`` (program "backward")."""
    return f"rmsnorm::rms_norm_backward_reduce_kernel<{CUDA_TYPES[weight_dtype]}>"


