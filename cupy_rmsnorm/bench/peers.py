"""The forward report's implementations, each a zero-argument callable on one ``Case``'s inputs
(torch tensors are views of the CuPy inputs, so all read the same memory)."""

import functools

import numpy as np

from . import common
from .arrays import from_float32, poison, to_cupy, to_float32, to_torch

EPS = 1e-6
OPS = ("rms", "fused")
OP_TITLES = {"rms": "rms_norm", "fused": "fused_add_rms_norm"}

IMPLS = ("ours", "ours_torch", "cupy", "torch_eager", "F.rms_norm", "torch_compile", "liger",
         "ours_ip", "liger_ip", "copy")
OURS = ("ours", "ours_torch")
PEERS = ("cupy", "torch_eager", "F.rms_norm", "torch_compile", "liger")   # "best peer" is among these
IN_PLACE = ("ours_ip", "liger_ip")     # the fused op with out=x, residual_out=residual
IN_PLACE_PEERS = ("liger_ip",)         # "best in-place peer" is among these
COPY = "copy"                          # a device copy of the op's bytes: the floor, not a peer
SELECTABLE = ("ours_torch",) + PEERS + IN_PLACE + (COPY,)   # what --peers chooses; "ours" always runs
RUNNER_KIND = {"ours": "cupy", "cupy": "cupy", "ours_torch": "torch", "torch_eager": "torch",
               "F.rms_norm": "torch", "torch_compile": "torch", "liger": "torch",
               "ours_ip": "cupy", "liger_ip": "torch", "copy": "cupy"}
NEEDS_TRITON = ("torch_compile", "liger", "liger_ip")
NEEDS_LIGER = ("liger", "liger_ip")
DESCRIPTIONS = {
    "ours": "cupy_rmsnorm on CuPy arrays, outputs preallocated",
    "ours_torch": "cupy_rmsnorm on torch tensors, outputs allocated per call",
    "cupy": "plain CuPy: float32 mean of squares, rsqrt, casts as HF's",
    "torch_eager": "HF LlamaRMSNorm-style eager torch",
    "F.rms_norm": "torch.nn.functional.rms_norm",
    "torch_compile": "torch_eager under torch.compile(fullgraph=True), --compile tokens or static",
    "liger": "Liger-Kernel's RMSNorm functions, llama casting",
    "ours_ip": "fused only: ours in place (out=x, residual_out=residual), inputs restored per round",
    "liger_ip": "fused only: LigerFusedAddRMSNormFunction with in_place=True, llama casting; that flag "
                "makes only Liger's backward in place (dy reused for dx): its forward still writes "
                "new y and residual tensors",
    "copy": "a device copy of the op's bytes: the floor of a memory-bound op",
}


COMPILE_MODES = ("tokens", "static")


class Unsupported(Exception):
    """This implementation does not offer this op (not an error of the run)."""


def logical_bytes(op, tokens, hidden, itemsize, weight_itemsize=None):
    """Bytes one call must move: rms x and y, fused x, residual, residual_out and y; the weight once."""
    per_array = tokens * hidden * itemsize
    arrays = 2 if op == "rms" else 4
    return arrays * per_array + hidden * (weight_itemsize or itemsize)


# -- what is installed -----------------------------------------------------------------------
torch_missing = functools.lru_cache(maxsize=None)(common.torch_missing)


@functools.lru_cache(maxsize=None)
def liger_missing():
    return common.module_missing("liger_kernel.ops.rms_norm", "liger-kernel", "liger")


def availability(names):
    """(the names that can run, in IMPLS order; {name: why not, with how to install it})."""
    available, missing = [], {}
    for name in IMPLS:
        if name not in names:
            continue
        reason = None
        if RUNNER_KIND[name] == "torch":
            reason = torch_missing()
        if reason is None and name in NEEDS_TRITON:
            reason = common.triton_missing()
        if reason is None and name in NEEDS_LIGER:
            reason = liger_missing()
        if reason:
            missing[name] = reason
        else:
            available.append(name)
    return available, missing


# -- the inputs of one measurement -------------------------------------------------------------
class Case:
    """Random inputs of one (op, dtype, tokens, hidden), our outputs and a float32 reference."""

    def __init__(self, op, dtype, tokens, hidden, seed=0):
        import cupy
        self.op, self.dtype, self.tokens, self.hidden = op, dtype, tokens, hidden
        dt = np.dtype(dtype)
        rng = cupy.random.default_rng(seed)
        shape = (tokens, hidden)

        def normal(*size, mean=0.0, std=1.0):
            return from_float32(mean + std * rng.standard_normal(size, dtype=cupy.float32), dtype)
        self.x = normal(*shape)
        self.residual = normal(*shape) if op == "fused" else None
        self.weight = normal(hidden, mean=1.0, std=0.1)
        self.out = cupy.empty(shape, dtype=dt)
        self.residual_out = cupy.empty(shape, dtype=dt) if op == "fused" else None
        self._torch = None
        self._reference = None
        self._copy_buffers = None
        cupy.cuda.Device().synchronize()   # inputs ready before other streams read them

    def torch_inputs(self):
        """(x, residual or None, weight) as torch views of the CuPy inputs."""
        if self._torch is None:
            self._torch = (to_torch(self.x),
                           to_torch(self.residual) if self.residual is not None else None,
                           to_torch(self.weight))
        return self._torch

    def reference(self):
        """float32 result of the op, x + residual rounded to the dtype first (the numerics contract)."""
        if self._reference is None:
            import cupy
            import cupyx
            s32 = to_float32(self.x)
            if self.op == "fused":   # x + residual in float32, rounded as a dtype add rounds
                s32 = to_float32(from_float32(s32 + to_float32(self.residual), self.dtype))
            inv_rms = cupyx.rsqrt(cupy.mean(s32 * s32, axis=-1, keepdims=True) + EPS)
            self._reference = s32 * inv_rms * to_float32(self.weight)
        return self._reference

    def max_abs_err(self, result):
        """Largest |result - reference| of the normalized output: what was timed computes the op."""
        import cupy
        y = result[0] if isinstance(result, tuple) else result
        if not isinstance(y, cupy.ndarray):
            y = to_cupy(y)
        return float(cupy.max(cupy.abs(to_float32(y) - self.reference())))

    def poison_outputs(self):
        """NaN into our preallocated outputs, so a result read later must have been written."""
        import cupy
        for a in (self.out, self.residual_out):
            if a is not None:
                poison(a)
        cupy.cuda.Device().synchronize()

    def fresh_inputs(self):
        """New copies of x and residual, for an implementation that overwrites its inputs."""
        import cupy
        copies = tuple(cupy.empty(a.shape, a.dtype) for a in (self.x, self.residual))
        self.restore_inputs(*copies)
        cupy.cuda.Device().synchronize()   # ready before the runner's stream reads them
        return copies

    def restore_inputs(self, x, residual):
        """Rewrite copies made by ``fresh_inputs`` with the inputs (on the current stream)."""
        for dst, src in ((x, self.x), (residual, self.residual)):
            dst.data.copy_from_device_async(src.data, src.nbytes)

    def copy_buffers(self):
        """(source, destination) buffers of half the op's logical bytes each, made on first use."""
        if self._copy_buffers is None:
            import cupy
            nbytes = logical_bytes(self.op, self.tokens, self.hidden, self.x.itemsize) // 2
            self._copy_buffers = (cupy.empty(nbytes, cupy.uint8), cupy.empty(nbytes, cupy.uint8))
        return self._copy_buffers

    def release(self):
        self.x = self.residual = self.weight = self.out = self.residual_out = None
        self._torch = self._reference = self._copy_buffers = None


# -- the implementations ---------------------------------------------------------------------------
def cupy_rms_norm(x, weight, eps):
    """RMSNorm as a CuPy user writes it (HF Llama's order of casts)."""
    import cupy
    import cupyx
    x32 = x.astype(cupy.float32)
    inv_rms = cupyx.rsqrt(cupy.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * (x32 * inv_rms).astype(x.dtype)


def cupy_fused_add_rms_norm(x, residual, weight, eps):
    s = x + residual
    return cupy_rms_norm(s, weight, eps), s


@functools.lru_cache(maxsize=None)
def torch_functions():
    """The eager torch peers, made once per process."""
    import torch
    import torch.nn.functional as F

    def eager_rms(x, weight, eps):            # transformers' LlamaRMSNorm.forward
        input_dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + eps)
        return weight * h.to(input_dtype)

    def eager_fused(x, residual, weight, eps):
        s = x + residual
        return eager_rms(s, weight, eps), s

    def f_rms(x, weight, eps):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def f_fused(x, residual, weight, eps):
        s = x + residual
        return F.rms_norm(s, (s.shape[-1],), weight, eps), s

    return {"torch_eager": (eager_rms, eager_fused), "F.rms_norm": (f_rms, f_fused)}


def lift_recompile_limits():
    """Lift Dynamo's recompile limit (8) past a grid, else fullgraph=True fails on the ninth shape."""
    import torch._dynamo
    cfg = torch._dynamo.config
    for names in (("recompile_limit", "cache_size_limit"),
                  ("accumulated_recompile_limit", "accumulated_cache_size_limit")):
        for attr in names:
            if hasattr(cfg, attr):
                setattr(cfg, attr, max(getattr(cfg, attr), 4096))
                break


@functools.lru_cache(maxsize=None)
def _compiled_functions(mode):
    """torch.compile(fullgraph=True) of the eager functions, one mode per process. ``"tokens"``: the
    token axis dynamic, one compile per hidden and dtype, as a server compiles; ``"static"``: per shape."""
    import torch
    import torch._dynamo
    if mode not in COMPILE_MODES:
        raise ValueError(f"unknown compile mode {mode!r}")
    cfg = torch._dynamo.config
    lift_recompile_limits()
    if mode == "tokens":
        cfg.automatic_dynamic_shapes = False   # a new hidden size recompiles static, never generic
        options = {}
    else:
        options = {"dynamic": False}
    eager_rms, eager_fused = torch_functions()["torch_eager"]
    return (torch.compile(eager_rms, fullgraph=True, **options),
            torch.compile(eager_fused, fullgraph=True, **options))


def _mark_token_axis_dynamic(*tensors):
    import torch._dynamo
    mark = getattr(torch._dynamo, "maybe_mark_dynamic", None)
    for t in tensors:
        if t is None:
            continue
        if mark is not None:
            mark(t, 0)                      # a hint: a one-token shape may still specialize
        elif t.shape[0] > 1:
            torch._dynamo.mark_dynamic(t, 0)


def _liger_functions(op):
    if op == "rms":
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        return LigerRMSNormFunction.apply
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
    except ImportError as e:
        raise Unsupported(f"this liger-kernel has no fused add rms norm ({e})") from None
    return LigerFusedAddRMSNormFunction.apply


def _in_place(case, make):
    """An implementation that overwrites its inputs (``make(x, residual)`` -> callable), timed on
    copies restored before each round, since repeated calls drift (float16 overflows)."""
    x, residual = case.fresh_inputs()
    fn = make(x, residual)

    def check(run):
        err = case.max_abs_err(run(make(*case.fresh_inputs()), 1))
        run(fn)
        return err
    fn.check = check
    fn.restore_inputs = lambda: case.restore_inputs(x, residual)
    return fn


def _copy(case):
    """A device copy of the op's bytes (``Case.copy_buffers``), checked by its destination."""
    import cupy
    src, dst = case.copy_buffers()
    src_ptr, dst_ptr, nbytes = src.data, dst.data, src.nbytes

    def fn():
        dst_ptr.copy_from_device_async(src_ptr, nbytes)   # cudaMemcpyAsync, current stream
        return dst

    def check(run):
        src.fill(0x5A)
        dst.fill(0xA5)                      # every byte differs until the copy writes it
        cupy.cuda.Device().synchronize()
        run(fn, 1)
        if not bool((dst == src).all()):
            raise RuntimeError("copy check: the destination differs from the source after a copy")
        run(fn)
        return None                         # a copy is not the op: no error to report
    fn.check = check
    return fn


def warm_up_and_check(case, fn, run):
    """Warm ``fn`` up and return its largest error against the reference (None for the copy);
    ``run(callable, calls)`` runs on the runner's stream. ``fn.check``, where set, replaces this."""
    own = getattr(fn, "check", None)
    return own(run) if own is not None else case.max_abs_err(run(fn))


def build(name, case, compile_mode="tokens"):
    """A zero-argument callable of ``name`` on ``case``'s inputs, returning y or (y, residual_out); it may
    carry ``fn.check(run)`` and ``fn.restore_inputs()`` (run before each timing round)."""
    import cupy_rmsnorm as rn
    fused = case.op == "fused"
    if name in IN_PLACE and not fused:
        raise Unsupported("in place is a form of the fused op (out=x, residual_out=residual)")
    if name == COPY:
        return _copy(case)
    if name == "ours_ip":
        w = case.weight
        return _in_place(case, lambda x, r: lambda: rn.fused_add_rms_norm(x, r, w, EPS, out=x, residual_out=r))
    if name == "ours":
        x, r, w, y, s = case.x, case.residual, case.weight, case.out, case.residual_out
        if fused:
            return lambda: rn.fused_add_rms_norm(x, r, w, EPS, out=y, residual_out=s)
        return lambda: rn.rms_norm(x, w, EPS, out=y)
    if name == "cupy":
        x, r, w = case.x, case.residual, case.weight
        if fused:
            return lambda: cupy_fused_add_rms_norm(x, r, w, EPS)
        return lambda: cupy_rms_norm(x, w, EPS)

    x, r, w = case.torch_inputs()
    if name == "ours_torch":
        if fused:
            return lambda: rn.fused_add_rms_norm(x, r, w, EPS)
        return lambda: rn.rms_norm(x, w, EPS)
    if name == "liger":
        apply = _liger_functions(case.op)
        if fused:
            return lambda: apply(x, r, w, EPS)
        return lambda: apply(x, w, EPS)
    if name == "liger_ip":
        apply = _liger_functions(case.op)

        def make(own_x, own_r):   # apply(X, R, W, eps, offset, casting_mode, in_place)
            tx, tr = to_torch(own_x), to_torch(own_r)
            return lambda: apply(tx, tr, w, EPS, 0.0, "llama", True)
        return _in_place(case, make)
    if name in ("torch_eager", "F.rms_norm", "torch_compile"):
        if name == "torch_compile":
            rms_fn, fused_fn = _compiled_functions(compile_mode)
            if compile_mode == "tokens":
                _mark_token_axis_dynamic(x, r)
        else:
            rms_fn, fused_fn = torch_functions()[name]
        if fused:
            return lambda: fused_fn(x, r, w, EPS)
        return lambda: rms_fn(x, w, EPS)
    raise ValueError(f"unknown implementation {name!r}")
