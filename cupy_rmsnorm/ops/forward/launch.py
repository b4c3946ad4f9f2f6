import numpy as np

from ... import _cache
from ..._abi import (
    CUDA_TYPES,
    HAS_WEIGHT,
    ITEMSIZES,
    LLAMA,
    PARAMS_DTYPE,
    kernel_weight_offset,
)
from ..._compile import kernel_cache, register_program
from ..._launcher import _SLOT, SlotLauncher, _apart
from ..._layout import OUT, RESIDUAL, RESIDUAL_OUT, WEIGHT, X
from ..._plan import launch_plan

# the family's kernel programs (kernels/)
register_program("forward", "rms_norm.cu")


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


_ROW_STRIDE_FIELDS = {X: "x", RESIDUAL: "residual", OUT: "out", RESIDUAL_OUT: "residual_out"}


class Launcher(SlotLauncher):
    """Launches one signature of rms_norm or fused_add_rms_norm (rms_norm_kernel and its
    cluster form); called with the five of ``Arrays``."""

    quant_form = None      # QuantLauncher: the quantized form its plans are made for
    flat = False           # QuantLauncher: whether its rows fit 32-bit offsets (fits_32_bit_offsets)

    def __init__(self, layout, scalars, kind):
        super().__init__(kind, layout.device)
        self.layout, self.fused = layout, layout.fused
        self.shape, self.itemsize, self.rows, self.hidden = layout.shape, layout.itemsize, layout.rows, layout.hidden
        row_strides = layout.row_strides
        self.given_outputs = layout.given_outputs
        self.others = (RESIDUAL, OUT, RESIDUAL_OUT) if self.fused else (OUT,)  # must follow x's alignment
        # with the pointer differences, the stride differences from x decide the vector width
        xso, xsi = row_strides[X]
        bits = 0
        for k in self.others:
            so, si = row_strides[k]
            bits |= ((so - xso) * self.itemsize) | ((si - xsi) * self.itemsize)
        self.stride_bits = bits
        # x's rows all start on its vector grid when its address and strides do (the
        # strides part is settled here; the address, per call)
        self.x_stride_bytes = (xso * self.itemsize) | ((xsi * self.itemsize) if layout.n_inner != 1 else 0)
        params = np.zeros(1, PARAMS_DTYPE)
        params["rows"], params["n_inner"], params["hidden"] = layout.rows, layout.n_inner, layout.hidden
        for k in (X,) + self.others:
            params[_ROW_STRIDE_FIELDS[k]] = row_strides[k]
        params["eps"], params["weight_offset"] = scalars.eps, kernel_weight_offset(scalars)
        params["flags"] = (LLAMA if scalars.llama else 0) | (HAS_WEIGHT if layout.weight_dtype else 0)
        self.params = params               # each plan gets a copy with its own trigger flag
        self.fresh_residual_out = self.fused and RESIDUAL_OUT not in self.given_outputs
        self._overlap_pairs = self._pairs_to_keep_apart(layout)
        self._item_mask = self.itemsize - 1                      # itemsizes are powers of two
        self._weight_mask = (layout.weight_itemsize or 1) - 1
        self._empty = kind.empty_getter(layout.row_strides[X], layout.n_inner, layout.hidden)

    def _pairs_to_keep_apart(self, layout):
        """``_apart`` of each given output against weight, the inputs and the other output;
        "the same" (same pointer, same strides) is allowed for an input."""
        ext, st = layout.extents, layout.row_strides
        pairs = []
        for o in layout.given_outputs:
            others = [WEIGHT] if layout.weight_dtype else []
            others += [i for i in ((X, RESIDUAL) if self.fused else (X,))]
            if o == RESIDUAL_OUT and OUT in layout.given_outputs:
                others.append(OUT)
            for k in others:
                same_ok = k in (X, RESIDUAL) and st[o] == st[k]
                pairs.append(_apart(_SLOT[o], ext[o], _SLOT[k], ext[k], same_ok))
        return tuple(pairs)

    def plan_and_function(self, vec, edges=True):
        """The plan and compiled kernel for a vector width (cached; compiled on first use).
        ``edges``: whether rows may have a scalar head or tail (see LaunchPlan)."""
        entry = self._by_vec.get((vec, edges))
        if entry is None:
            d = self.device
            plan = launch_plan(self.rows, self.hidden, self.itemsize, vec, d.sm_count, self.fused,
                               edges=edges, max_cluster=d.max_cluster, quant=self.quant_form,
                               **{"flat": self.flat, **_cache.plan_overrides})
            _cache.record_plan(plan)
            entry = self._by_vec[(vec, edges)] = (plan, self.function(plan))
        return entry

    def edges(self, vec, x_ptr):
        """False when every row of x starts on the vector grid and holds whole vectors."""
        return bool(self.hidden % vec or (x_ptr | self.x_stride_bytes) % (vec * self.itemsize))

    def function(self, plan):
        """The compiled kernel for a plan."""
        name = instantiation_name(self.layout.dtype, self.layout.weight_dtype, self.fused, plan)
        return kernel_cache.get(self.device.index, name)

    def _run(self, arrays, checked=False):
        # The hot path of every repeated call: the signature fixes which arrays are present,
        # so absent ones are pointer 0 and each check is one expression over the pointers.
        x, residual, weight, out, residual_out = arrays
        ptr = self._ptr
        px = ptr(x)
        pr = 0 if residual is None else ptr(residual)
        pw = 0 if weight is None else ptr(weight)
        po = 0 if out is None else ptr(out)
        pro = 0 if residual_out is None else ptr(residual_out)
        if (px | pr | po | pro) & self._item_mask or pw & self._weight_mask:
            return None
        if not checked and self._overlap_pairs and self._overlapping((px, pr, po, pro, pw)):
            return None
        if out is None:
            out = self._empty(x)
            po = ptr(out)
        if self.fused:
            if residual_out is None:
                residual_out = self._empty(x)
                pro = ptr(residual_out)
            result = out, residual_out
            bits = self.stride_bits | (pr - px) | (po - px) | (pro - px)
        else:
            result = out
            bits = self.stride_bits | (po - px)
        if self.rows:
            self._launch(bits, px, (px, pr, po, pro, pw))
        return result


def _in_x_bytes(pointer, shift):
    """An address of an array of another itemsize as the address of x's element at the same
    index (``shift``: log2 of x's itemsize less the array's): their difference from x's address
    is then a multiple of x's vector exactly when the two line up element for element."""
    return pointer << shift if shift >= 0 else pointer >> -shift


def _shift(itemsize, other_itemsize):
    return (itemsize.bit_length() - 1) - (other_itemsize.bit_length() - 1)


class MixedLauncher(Launcher):
    """A Launcher for mixed precision: a float32 residual stream (residual and residual_out
    float32 with x of another dtype) or an output of another dtype (out_dtype); rms_norm_kernel's
    R and O. Pointers of another itemsize are lined up with x's element by element."""

    def __init__(self, layout, scalars, kind, residual_dtype, out_dtype):
        self.residual_dtype, self.out_dtype = residual_dtype, out_dtype
        super().__init__(layout, scalars, kind)
        r_size, o_size = ITEMSIZES[residual_dtype], ITEMSIZES[out_dtype]
        self._r_shift, self._o_shift = _shift(self.itemsize, r_size), _shift(self.itemsize, o_size)
        self._r_mask, self._o_mask = r_size - 1, o_size - 1
        shape = layout.shape
        self._new_out = lambda x: kind.empty_of(x, shape, out_dtype)
        self._new_residual_out = lambda x: kind.empty_of(x, shape, residual_dtype)
        sizes = {X: self.itemsize, RESIDUAL: r_size, RESIDUAL_OUT: r_size, OUT: o_size}
        slot_size = {_SLOT[k]: s for k, s in sizes.items()}
        # the very same array only if it is also of the same itemsize
        self._overlap_pairs = tuple((a, b, lo, hi, same and slot_size[a] == slot_size.get(b))
                                    for a, b, lo, hi, same in self._overlap_pairs)

    def function(self, plan):
        name = instantiation_name(self.layout.dtype, self.layout.weight_dtype, self.fused, plan, self.residual_dtype,
                                  self.out_dtype)
        return kernel_cache.get(self.device.index, name)

    def _run(self, arrays, checked=False):
        x, residual, weight, out, residual_out = arrays
        ptr = self._ptr
        px = ptr(x)
        pr = 0 if residual is None else ptr(residual)
        pw = 0 if weight is None else ptr(weight)
        po = 0 if out is None else ptr(out)
        pro = 0 if residual_out is None else ptr(residual_out)
        if px & self._item_mask or (pr | pro) & self._r_mask or po & self._o_mask or pw & self._weight_mask:
            return None
        if not checked and self._overlap_pairs and self._overlapping((px, pr, po, pro, pw)):
            return None
        if out is None:
            out = self._new_out(x)
            po = ptr(out)
        bits = self.stride_bits | (_in_x_bytes(po, self._o_shift) - px)
        if self.fused:
            if residual_out is None:
                residual_out = self._new_residual_out(x)
                pro = ptr(residual_out)
            bits |= (_in_x_bytes(pr, self._r_shift) - px) | (_in_x_bytes(pro, self._r_shift) - px)
            result = out, residual_out
        else:
            result = out
        if self.rows:
            self._launch(bits, px, (px, pr, po, pro, pw))
        return result
