"""The launch itself, and the per-signature cache that keeps repeated calls thin.

A ``Launcher`` holds everything about a call that does not depend on the arrays'
addresses: row layout, kernel parameters, memory extents relative to each base
pointer. The first call with a given signature (kinds, shapes, strides, dtypes,
device, scalars) goes through the full validation in ``_api`` and leaves a Launcher
behind; later calls with that signature only read the pointers, check what depends
on them (vector width, overlap of outputs with inputs), allocate missing outputs and
launch. Anything the cheap checks cannot settle returns ``None`` and the caller falls
back to the full path.
"""

import threading

import numpy as np

from ._kernels import kernels, name_expression
from ._plan import launch_plan, vector_width_from_bits

LLAMA, HAS_WEIGHT = 1, 2   # kernels/rms_norm.cu: enum Flags

# kernels/rms_norm.cu: struct Params (eight-byte fields first, so no padding).
PARAMS_DTYPE = np.dtype([
    ("rows", "<i8"), ("n_inner", "<i8"),
    ("x_so", "<i8"), ("x_si", "<i8"), ("r_so", "<i8"), ("r_si", "<i8"),
    ("y_so", "<i8"), ("y_si", "<i8"), ("ro_so", "<i8"), ("ro_si", "<i8"),
    ("hidden", "<i4"), ("eps", "<f4"), ("w_offset", "<f4"), ("flags", "<i4"),
])
ARRAYS = ("x", "residual", "out", "residual_out")
_PARAM_PREFIX = {"x": "x", "residual": "r", "out": "y", "residual_out": "ro"}

_sm_counts = {}


def sm_count(device):
    n = _sm_counts.get(device)
    if n is None:
        import cupy
        n = _sm_counts[device] = cupy.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"]
    return n


class Launcher:
    """Launches one call signature; see the module docstring."""

    def __init__(self, kind, fused, device, shape, dtype, itemsize, weight_dtype, weight_itemsize,
                 rows, n_inner, row_strides, extents, given_outputs, eps, weight_offset, llama, grad_check):
        self.kind, self.fused, self.device, self.shape = kind, fused, device, shape
        self.dtype, self.itemsize = dtype, itemsize
        self.weight_dtype, self.weight_itemsize = weight_dtype, weight_itemsize
        self.rows, self.hidden = rows, shape[-1]
        self.given_outputs = given_outputs
        self.extents = extents      # name -> (lo, hi) bytes relative to the array's pointer
        self.grad_check = grad_check
        names = ARRAYS if fused else ("x", "out")
        xso, xsi = row_strides["x"]
        # stride differences from x decide, with the pointer differences, the vector width
        bits = 0
        for k in names[1:]:
            so, si = row_strides[k]
            bits |= ((so - xso) * itemsize) | ((si - xsi) * itemsize)
        self.stride_bits = bits
        self.row_strides = row_strides
        p = np.zeros(1, PARAMS_DTYPE)
        p["rows"], p["n_inner"], p["hidden"] = rows, n_inner, self.hidden
        for k in names:
            p[_PARAM_PREFIX[k] + "_so"], p[_PARAM_PREFIX[k] + "_si"] = row_strides[k]
        p["eps"], p["w_offset"] = eps, weight_offset
        p["flags"] = (LLAMA if llama else 0) | (HAS_WEIGHT if weight_dtype else 0)
        self.params = p             # never written after this: safe to share across threads
        self._by_vec = {}
        self._lock = threading.Lock()

    def plan_and_function(self, vec):
        entry = self._by_vec.get(vec)
        if entry is None:
            with self._lock:
                plan = launch_plan(self.rows, self.hidden, self.itemsize, vec, sm_count(self.device))
                expr = name_expression(self.dtype, self.weight_dtype, self.fused, *plan.template_args())
                entry = self._by_vec[vec] = (plan, kernels.get(self.device, expr))
        return entry

    def _overlap_settled(self, ptrs):
        """True when the outputs the caller gave provably do not overlap what they must not:
        apart from weight, from each other, and from each input unless they are that very input."""
        ext, st = self.extents, self.row_strides

        def apart(a, b):
            return ptrs[a] + ext[a][1] <= ptrs[b] + ext[b][0] or ptrs[b] + ext[b][1] <= ptrs[a] + ext[a][0]

        for o in self.given_outputs:
            if "weight" in ptrs and not apart(o, "weight"):
                return False
            for i in (("x", "residual") if self.fused else ("x",)):
                if not apart(o, i) and not (ptrs[o] == ptrs[i] and st[o] == st[i]):
                    return False
        return len(self.given_outputs) < 2 or apart("out", "residual_out")

    def __call__(self, arrays, checked=False):
        """Launch on ``arrays`` (name -> array, outputs optional); None if the full path must decide.

        ``checked``: the caller has already validated these very arrays (first call).
        """
        kind = self.kind
        if self.grad_check and kind.grad_enabled():
            return None
        ptr = kind.ptr
        ptrs = {k: ptr(a) for k, a in arrays.items()}
        itemsize = self.itemsize
        misaligned = 0
        for k, p in ptrs.items():
            misaligned |= p % (self.weight_itemsize if k == "weight" else itemsize)
        if misaligned or (not checked and self.given_outputs and not self._overlap_settled(ptrs)):
            return None
        px = ptrs["x"]
        bits = self.stride_bits
        for k in (("residual", "out", "residual_out") if self.fused else ("out",)):
            if k in ptrs:
                bits |= ptrs[k] - px
        if "out" not in arrays:
            arrays["out"] = o = kind.empty(self.shape, arrays["x"])
            bits |= ptr(o) - px
        if self.fused and "residual_out" not in arrays:
            arrays["residual_out"] = o = kind.empty(self.shape, arrays["x"])
            bits |= ptr(o) - px
        result = (arrays["out"], arrays["residual_out"]) if self.fused else arrays["out"]
        if self.rows == 0:
            return result
        plan, fn = self.plan_and_function(vector_width_from_bits(itemsize, bits))
        arg, get = kind.arg, arrays.get
        args = (arg(arrays["x"]), arg(get("residual")), arg(arrays["out"]),
                arg(get("residual_out")), arg(get("weight")), self.params)
        kind.launch(self.device, fn, plan.grid, plan.block, args)
        return result
