"""PyTorch interop on the GPU: zero copy, streams, CUDA graphs, numerics, modules.

Every test here needs a CUDA GPU (torch tests also need torch) and skips with the reason
otherwise; torch is imported only where it is usable, so CI without torch collects this
file and skips it. (That importing the library does not import torch is checked on the CPU,
tests/cpu/test_torch_import.py.)
"""

import copy
import warnings

import ml_dtypes
import numpy as np
import pytest

import cupy_rmsnorm as rn
from helpers import (DTYPE_NAMES, TOL, requires_gpu, requires_torch_gpu, requires_two_torch_gpus,
                     torch_cuda_missing)

if torch_cuda_missing() is None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    import cupy_rmsnorm.torch as rnt

# Share of elements that must be bit-identical to an eager reference of the same formula
# (16-bit dtypes; at least two may differ): only the order of the float32 sum differs,
# which flips a 16-bit rounding very rarely.
MIN_EXACT = 0.99
SHAPES = [(1, 4096), (33, 1000), (4, 3, 256), (2, 16384), (5, 7), (3, 40000)]
SLEEP_CYCLES = 200_000_000   # about 0.1 s of torch.cuda._sleep on an H200


# -- helpers -------------------------------------------------------------------------------

def _randn(shape, dtype_name, seed, *, scale=1.0, shift=0.0, device="cuda"):
    gen = torch.Generator(device=device).manual_seed(seed)
    t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * scale + shift
    return t.to(getattr(torch, dtype_name))


def _weight(hidden, dtype_name, seed=99):
    """A weight far from one, so the two casting modes round differently."""
    return _randn((hidden,), dtype_name, seed, scale=0.5, shift=1.0)


def _eager_fp32(x, w, eps):
    """One rounding at the end (torch.nn.functional.rms_norm's formula), written out."""
    xf = x.float()
    inv = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * inv * w.float()).to(x.dtype)


def _eager_llama(x, w, eps):
    """transformers' LlamaRMSNorm.forward, with the result in x's dtype."""
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    return (w * (xf * torch.rsqrt(variance + eps)).to(x.dtype)).to(x.dtype)


def _exact_fraction(a, b):
    return (a.float() == b.float()).float().mean().item()


def _assert_matches(actual, expected, dtype_name, *, exact=True):
    """Within about two ulps; and, for 16-bit types, mostly bit-identical when ``exact``."""
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    rtol, atol = TOL[dtype_name]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol)
    if exact and dtype_name != "float32":
        differ = int((actual.float() != expected.float()).sum())
        allowed = max(2, int((1 - MIN_EXACT) * actual.numel()))
        assert differ <= allowed, (f"{differ} of {actual.numel()} elements differ from the reference "
                                   f"(at most {allowed} may, by the float32 sum order)")


def _nan_like(t):
    return torch.full_like(t, float("nan"))


def _peak_extra_bytes(fn):
    """Peak torch memory above the starting point while ``fn`` runs (transient copies show)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    keep = fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, keep


def _to_numpy_bits(t):
    """A torch CUDA tensor as a NumPy array with the very same bits (bfloat16 via ml_dtypes)."""
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)
    return t.cpu().numpy()


# -- what comes back -----------------------------------------------------------------------

@requires_torch_gpu
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_results_are_torch_tensors_of_the_input_dtype_and_device(dtype):
    x, r, w = _randn((6, 512), dtype, 1), _randn((6, 512), dtype, 2), _weight(512, dtype)
    y = rn.rms_norm(x, w)
    y2, s2 = rn.fused_add_rms_norm(x, r, w)
    for t in (y, y2, s2):
        assert type(t) is torch.Tensor
        assert t.dtype == x.dtype and t.device == x.device and t.shape == x.shape
        assert t.is_contiguous()
    assert not y.requires_grad


@requires_torch_gpu
def test_bfloat16_round_trip_matches_the_numpy_reference():
    x, r, w = _randn((17, 2048), "bfloat16", 3), _randn((17, 2048), "bfloat16", 4), _weight(2048, "bfloat16")
    x_bits = x.clone()
    for mode in ("fp32", "llama"):
        y = rn.rms_norm(x, w, 1e-5, casting_mode=mode)
        y2, s2 = rn.fused_add_rms_norm(x, r, w, 1e-5, casting_mode=mode)
        assert y.dtype == torch.bfloat16
        xn, rn_, wn = _to_numpy_bits(x), _to_numpy_bits(r), _to_numpy_bits(w)
        ref = rn.rms_norm_reference(xn, wn, 1e-5, casting_mode=mode)
        ref2, refs = rn.fused_add_rms_norm_reference(xn, rn_, wn, 1e-5, casting_mode=mode)
        for got, want in ((y, ref), (y2, ref2), (s2, refs)):
            got_np = _to_numpy_bits(got)
            assert got_np.dtype == want.dtype
            np.testing.assert_allclose(got_np.astype(np.float32), want.astype(np.float32),
                                       rtol=TOL["bfloat16"][0], atol=TOL["bfloat16"][1])
            assert np.mean(got_np.view(np.int16) == want.view(np.int16)) >= MIN_EXACT
        # the residual sum is one rounding of x + residual: exactly the reference's
        assert np.array_equal(_to_numpy_bits(s2).view(np.int16), refs.view(np.int16))
    assert torch.equal(x.view(torch.int16), x_bits.view(torch.int16)), "an input was written"


# -- numerics against torch ----------------------------------------------------------------

@requires_torch_gpu
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fp32_mode_matches_torch_rms_norm(dtype, shape):
    eps = 1e-6
    x, w = _randn(shape, dtype, 5), _weight(shape[-1], dtype)
    y = rn.rms_norm(x, w, eps)
    _assert_matches(y, F.rms_norm(x, (shape[-1],), w, eps), dtype, exact=False)
    _assert_matches(y, _eager_fp32(x, w, eps), dtype)
    _assert_matches(rn.rms_norm(x, None, eps), F.rms_norm(x, (shape[-1],), None, eps), dtype)


@requires_torch_gpu
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_llama_mode_matches_hf_llama_eager(dtype, shape):
    eps = 1e-5
    x, w = _randn(shape, dtype, 6), _weight(shape[-1], dtype)
    y = rn.rms_norm(x, w, eps, casting_mode="llama")
    _assert_matches(y, _eager_llama(x, w, eps), dtype)
    if dtype != "float32" and x.numel() >= 1000:
        # the check above can tell the modes apart: fp32 rounding disagrees far more often
        assert _exact_fraction(y, _eager_fp32(x, w, eps)) < MIN_EXACT


@requires_torch_gpu
@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
def test_llama_mode_with_a_float32_weight(dtype):
    # HF returns float32 here (weight promotes); ours stays in x's dtype: the same value rounded.
    x, w = _randn((9, 1536), dtype, 7), _weight(1536, "float32")
    y = rn.rms_norm(x, w, 1e-6, casting_mode="llama")
    assert y.dtype == x.dtype
    _assert_matches(y, _eager_llama(x, w, 1e-6).to(x.dtype), dtype)


@requires_torch_gpu
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("mode", ("fp32", "llama"))
def test_fused_equals_torch_add_then_norm(dtype, mode):
    x, r, w = _randn((24, 3072), dtype, 8), _randn((24, 3072), dtype, 9), _weight(3072, dtype)
    y, s = rn.fused_add_rms_norm(x, r, w, 1e-6, casting_mode=mode)
    summed = x + r   # torch rounds the sum to the dtype once, as the contract says
    assert torch.equal(s, summed)
    ref = _eager_llama(summed, w, 1e-6) if mode == "llama" else _eager_fp32(summed, w, 1e-6)
    _assert_matches(y, ref, dtype)
    if mode == "fp32":
        _assert_matches(y, F.rms_norm(summed, (3072,), w, 1e-6), dtype, exact=False)


# -- zero copy -----------------------------------------------------------------------------

@requires_torch_gpu
def test_out_tensor_is_the_result():
    x, w = _randn((8, 1024), "bfloat16", 10), _weight(1024, "bfloat16")
    out = _nan_like(x)
    y = rn.rms_norm(x, w, out=out)
    assert y is out and y.data_ptr() == out.data_ptr()
    _assert_matches(out, _eager_fp32(x, w, 1e-6), "bfloat16")
    out2, res_out = _nan_like(x), _nan_like(x)
    r = _randn((8, 1024), "bfloat16", 11)
    a, b = rn.fused_add_rms_norm(x, r, w, out=out2, residual_out=res_out)
    assert a is out2 and b is res_out
    assert torch.equal(res_out, x + r)


@requires_torch_gpu
def test_fused_in_place_writes_the_callers_tensors():
    x, r, w = _randn((32, 4096), "bfloat16", 12), _randn((32, 4096), "bfloat16", 13), _weight(4096, "bfloat16")
    x0, r0 = x.clone(), r.clone()
    ptrs = (x.data_ptr(), r.data_ptr())
    y, s = rn.fused_add_rms_norm(x, r, w, out=x, residual_out=r, casting_mode="llama")
    assert y is x and s is r and (x.data_ptr(), r.data_ptr()) == ptrs
    assert torch.equal(r, x0 + r0)
    _assert_matches(x, _eager_llama(x0 + r0, w, 1e-6), "bfloat16")


def _qkv(T=6, H=4, D=128, seed=14):
    qkv = _randn((T, 3 * H * D), "bfloat16", seed)
    return qkv, qkv.view(T, 3, H, D)


# name -> (x, whether the call gets an out= tensor); every x is a view the kernel can
# address as it is, without a copy
def _views():
    wide = _randn((16, 2 * 1024), "bfloat16", 15)
    _, heads = _qkv()
    return {
        "contiguous": (_randn((16, 1024), "bfloat16", 16), True),
        "column slice x[:, :K]": (wide[:, :1024], True),
        "query heads of a QKV buffer": (heads[:, 0], True),
        "key heads, heads first": (heads[:, 1].transpose(0, 1), True),
        "contiguous, new output": (_randn((16, 1024), "bfloat16", 17), False),
    }


@requires_torch_gpu
@pytest.mark.parametrize("case", ["contiguous", "column slice x[:, :K]", "query heads of a QKV buffer",
                                  "key heads, heads first", "contiguous, new output"])
def test_no_hidden_copies(case):
    import cupy
    x, given_out = _views()[case]
    w = _weight(x.shape[-1], "bfloat16")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if given_out else None
    rn.rms_norm(x, w, out=out)   # first call: compiles; measured again below anyway
    pool = cupy.get_default_memory_pool()
    cupy_before = pool.total_bytes()
    extra, y = _peak_extra_bytes(lambda: [rn.rms_norm(x, w, out=out) for _ in range(2)])
    # torch's allocator rounds to 512-byte blocks; these outputs are multiples of that
    expected = 0 if given_out else 2 * x.numel() * x.element_size()
    assert extra == expected, f"{extra} bytes allocated beyond the outputs ({expected})"
    assert pool.total_bytes() == cupy_before, "CuPy's memory pool grew: a copy went through CuPy"
    _assert_matches(y[-1], _eager_fp32(x.contiguous(), w, 1e-6), "bfloat16")


@requires_torch_gpu
def test_no_hidden_copies_in_place_fused():
    x, r, w = _randn((64, 2048), "bfloat16", 18), _randn((64, 2048), "bfloat16", 19), _weight(2048, "bfloat16")
    rn.fused_add_rms_norm(x.clone(), r.clone(), w, out=None)
    extra, _ = _peak_extra_bytes(lambda: rn.fused_add_rms_norm(x, r, w, out=x, residual_out=r))
    assert extra == 0


@requires_torch_gpu
@pytest.mark.parametrize("mode", ("fp32", "llama"))
def test_strided_views_give_the_contiguous_answer(mode):
    ref = _eager_llama if mode == "llama" else _eager_fp32
    for case, (x, _) in _views().items():
        w = _weight(x.shape[-1], "bfloat16")
        y = rn.rms_norm(x, w, casting_mode=mode)
        assert y.shape == x.shape, case
        _assert_matches(y, ref(x.contiguous(), w, 1e-6), "bfloat16")


@requires_torch_gpu
def test_per_head_norm_in_place_inside_a_qkv_buffer():
    # Qwen3-style q_norm / k_norm over head_dim, written straight back into the QKV buffer.
    qkv, heads = _qkv(T=5, H=8, D=128, seed=20)
    before = qkv.clone()
    wq, wk = _weight(128, "bfloat16", 21), _weight(128, "bfloat16", 22)
    q, k = heads[:, 0], heads[:, 1]
    q_ref, k_ref = _eager_llama(q.contiguous(), wq, 1e-6), _eager_llama(k.contiguous(), wk, 1e-6)
    assert rn.rms_norm(q, wq, out=q, casting_mode="llama") is q
    assert rn.rms_norm(k, wk, out=k, casting_mode="llama") is k
    after = qkv.view(5, 3, 8, 128)
    _assert_matches(after[:, 0], q_ref, "bfloat16")
    _assert_matches(after[:, 1], k_ref, "bfloat16")
    assert torch.equal(after[:, 2], before.view(5, 3, 8, 128)[:, 2]), "the value heads were written"


# -- streams and graphs --------------------------------------------------------------------

@requires_torch_gpu
def test_runs_on_torchs_current_stream_without_synchronizing():
    shape = (64, 4096)
    src, r, w = _randn(shape, "bfloat16", 23), _randn(shape, "bfloat16", 24), _weight(4096, "bfloat16")
    x = torch.zeros_like(src)   # what a kernel that ran before the producer would read
    out = _nan_like(src)
    side = torch.cuda.Stream()
    # Warm up these exact calls on the side stream: nothing below compiles, and torch's
    # allocator has blocks cached for that stream (no cudaMalloc in the timed part).
    with torch.cuda.stream(side):
        rn.rms_norm(src, w, out=out)
        rn.rms_norm(src, w) * 2
        rn.fused_add_rms_norm(src, r, w)
    torch.cuda.synchronize()
    out.fill_(float("nan"))
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)    # a long producer kernel ...
        x.copy_(src)                       # ... whose output the calls below must wait for
        y = rn.rms_norm(x, w)
        rn.rms_norm(x, w, out=out)
        y2, s2 = rn.fused_add_rms_norm(x, r, w)
        doubled = y * 2                    # a consumer on the same stream
        still_running = not side.query()
    torch.cuda.synchronize()
    assert still_running, ("the side stream was idle right after the calls: something synchronized "
                           "(or SLEEP_CYCLES is too short for this GPU)")
    ref = _eager_fp32(src, w, 1e-6)
    _assert_matches(y, ref, "bfloat16")
    _assert_matches(out, ref, "bfloat16")
    assert torch.equal(doubled, y * 2)
    assert torch.equal(s2, src + r)
    _assert_matches(y2, _eager_fp32(src + r, w, 1e-6), "bfloat16")


@requires_torch_gpu
def test_torch_cuda_graph_capture_and_replay_with_new_inputs():
    shape = (16, 2048)
    static_x, static_r = _randn(shape, "bfloat16", 25), _randn(shape, "bfloat16", 26)
    inplace_x, inplace_r = torch.empty_like(static_x), torch.empty_like(static_r)
    w = _weight(2048, "bfloat16")

    def step():
        y = rn.rms_norm(static_x, w, casting_mode="llama")
        y2, s2 = rn.fused_add_rms_norm(static_x, static_r, w)
        rn.fused_add_rms_norm(inplace_x, inplace_r, w, out=inplace_x, residual_out=inplace_r)
        return y, y2, s2

    # Warm up on a side stream, as torch's docs ask before capture (this also compiles).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, y2, s2 = step()       # outputs come from torch's allocator: the graph's pool
    for seed in (100, 200, 300):
        new_x, new_r = _randn(shape, "bfloat16", seed), _randn(shape, "bfloat16", seed + 1)
        static_x.copy_(new_x)
        static_r.copy_(new_r)
        inplace_x.copy_(new_x)
        inplace_r.copy_(new_r)
        for t in (y, y2, s2):
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _assert_matches(y, _eager_llama(new_x, w, 1e-6), "bfloat16")
        assert torch.equal(s2, new_x + new_r)
        _assert_matches(y2, _eager_fp32(new_x + new_r, w, 1e-6), "bfloat16")
        assert torch.equal(inplace_r, new_x + new_r)
        _assert_matches(inplace_x, _eager_fp32(new_x + new_r, w, 1e-6), "bfloat16")


@requires_gpu
def test_cupy_stream_capture_replays_with_new_inputs():
    import cupy
    rng = np.random.default_rng(27)
    shape, dtype = (16, 1024), np.float16

    def host():
        return rng.standard_normal(shape).astype(dtype)

    x, r = cupy.asarray(host()), cupy.asarray(host())
    wh = (1.0 + 0.5 * rng.standard_normal(1024)).astype(dtype)
    w = cupy.asarray(wh)
    y, y2, s2 = (cupy.empty(shape, dtype) for _ in range(3))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        rn.rms_norm(x, w, out=y, casting_mode="llama")     # the same calls outside the capture:
        rn.fused_add_rms_norm(x, r, w, out=y2, residual_out=s2)  # compiling is no capturable work
        stream.synchronize()
        stream.begin_capture()
        rn.rms_norm(x, w, out=y, casting_mode="llama")
        rn.fused_add_rms_norm(x, r, w, out=y2, residual_out=s2)
        graph = stream.end_capture()
    for _ in range(3):
        xh, rh = host(), host()
        x.set(xh)
        r.set(rh)
        for a in (y, y2, s2):
            a.fill(np.nan)
        cupy.cuda.Device().synchronize()
        graph.launch(stream=stream)
        stream.synchronize()
        ref = rn.rms_norm_reference(xh, wh, casting_mode="llama")
        ref2, refs = rn.fused_add_rms_norm_reference(xh, rh, wh)
        for got, want in ((y, ref), (y2, ref2), (s2, refs)):
            np.testing.assert_allclose(got.get().astype(np.float32), want.astype(np.float32),
                                       rtol=TOL["float16"][0], atol=TOL["float16"][1])
        assert np.array_equal(s2.get(), refs)


# -- errors --------------------------------------------------------------------------------

@requires_torch_gpu
def test_requires_grad_goes_through_autograd_and_no_grad_stays_direct():
    """With grad mode on, a tensor that requires grad makes the call an autograd node whose
    gradients are the backward functions'; under no_grad / inference_mode the same call has
    no grad_fn (the direct path)."""
    x, w = _randn((4, 256), "float16", 28), _weight(256, "float16")
    dy = _randn((4, 256), "float16", 29)
    xg = x.clone().requires_grad_(True)
    y = rn.rms_norm(xg, w)
    assert y.grad_fn is not None and y.requires_grad
    _assert_matches(y.detach(), _eager_fp32(x, w, 1e-6), "float16")
    y.backward(dy)
    want_dx, _ = rn.rms_norm_backward(dy, x, w)
    assert torch.equal(xg.grad, want_dx)
    with torch.no_grad():
        y0 = rn.rms_norm(xg, w)
    assert y0.grad_fn is None and torch.equal(y0, y.detach())
    assert rn.rms_norm(xg, w).grad_fn is not None      # also once a fast path exists
    wp = nn.Parameter(w.clone())   # a module's weight: requires grad
    rn.rms_norm(x, wp).backward(dy)
    assert torch.equal(wp.grad, rn.rms_norm_backward(dy, x, w)[1])
    with torch.inference_mode():
        y2 = rn.rms_norm(x, wp)
    assert torch.equal(y2, y.detach())
    xr, rr = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y3, s3 = rn.fused_add_rms_norm(xr, rr, wp)
    assert torch.equal(s3.detach(), x + x)
    (y3.float().sum() + s3.float().sum()).backward()
    assert xr.grad is not None and torch.equal(xr.grad, rr.grad)
    with pytest.raises(RuntimeError, match="forward-only"):     # the in-place form
        a, b = x.clone(), x.clone()
        rn.fused_add_rms_norm(a, b, wp, out=a, residual_out=b)


@requires_torch_gpu
def test_cpu_tensors_run_the_reference_and_devices_do_not_mix():
    x, w = torch.randn(4, 64), torch.ones(64)
    # the reference's float32 arithmetic, within the kernels' (docs/numerics.md: kernels and the reference)
    torch.testing.assert_close(rn.rms_norm(x, w), rn.rms_norm(x.cuda(), w.cuda()).cpu(), rtol=2e-6, atol=1e-7)
    with pytest.raises(ValueError, match=r"^weight is a torch tensor on cpu; pass tensors of one device"):
        rn.rms_norm(x.cuda(), w)
    with pytest.raises(ValueError, match=r"^out is a torch tensor on cpu; pass tensors of one device"):
        rn.rms_norm(x.cuda(), w.cuda(), out=torch.empty(4, 64))
    with pytest.raises(ValueError, match=r"^weight is a torch tensor on cuda:0, and x is on the CPU"):
        rn.rms_norm(x, w.cuda())


@requires_torch_gpu
def test_torch_mixed_with_cupy_is_a_type_error():
    import cupy
    x = _randn((4, 64), "float32", 29)
    w_cupy = cupy.ones(64, dtype=np.float32)
    with pytest.raises(TypeError, match="same kind"):
        rn.rms_norm(x, w_cupy)
    with pytest.raises(TypeError, match="same kind"):
        rn.rms_norm(cupy.ones((4, 64), dtype=np.float32), torch.ones(64, device="cuda"))


class _DLPackOnly:
    """A foreign CUDA array that offers nothing but the DLPack protocol (like JAX or Numba)."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, *args, **kwargs):
        return self._array.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


@requires_gpu
def test_generic_dlpack_producer_works_without_copies():
    import cupy
    rng = np.random.default_rng(30)
    xh = rng.standard_normal((12, 768)).astype(np.float16)
    rh = rng.standard_normal((12, 768)).astype(np.float16)
    wh = (1.0 + 0.5 * rng.standard_normal(768)).astype(np.float16)
    x, r, w = cupy.asarray(xh), cupy.asarray(rh), cupy.asarray(wh)
    y = rn.rms_norm(_DLPackOnly(x), _DLPackOnly(w))
    assert isinstance(y, cupy.ndarray)
    np.testing.assert_allclose(y.get().astype(np.float32), rn.rms_norm_reference(xh, wh).astype(np.float32),
                               rtol=TOL["float16"][0], atol=TOL["float16"][1])
    out = cupy.full((12, 768), np.nan, dtype=np.float16)
    y2 = rn.rms_norm(_DLPackOnly(x), _DLPackOnly(w), out=_DLPackOnly(out))
    assert y2.data.ptr == out.data.ptr           # a view of the producer's memory, written in place
    assert not np.isnan(out.get()).any()
    # in place through the protocol: both of the producer's buffers are written
    y3, s3 = rn.fused_add_rms_norm(_DLPackOnly(x), _DLPackOnly(r), _DLPackOnly(w),
                                   out=_DLPackOnly(x), residual_out=_DLPackOnly(r))
    assert y3.data.ptr == x.data.ptr and s3.data.ptr == r.data.ptr
    ref2, refs = rn.fused_add_rms_norm_reference(xh, rh, wh)
    assert np.array_equal(r.get(), refs)
    np.testing.assert_allclose(x.get().astype(np.float32), ref2.astype(np.float32),
                               rtol=TOL["float16"][0], atol=TOL["float16"][1])


# -- devices -------------------------------------------------------------------------------

@requires_two_torch_gpus
def test_tensors_on_the_second_gpu_run_there():
    with torch.cuda.device(0):
        x = _randn((8, 1024), "bfloat16", 31, device="cuda:1")
        r = _randn((8, 1024), "bfloat16", 32, device="cuda:1")
        w = _weight(1024, "bfloat16").to("cuda:1")
        y = rn.rms_norm(x, w)
        y2, s2 = rn.fused_add_rms_norm(x, r, w)
        assert torch.cuda.current_device() == 0
    for t in (y, y2, s2):
        assert t.device == torch.device("cuda", 1)
    torch.cuda.synchronize(1)
    _assert_matches(y, _eager_fp32(x, w, 1e-6), "bfloat16")
    assert torch.equal(s2, x + r)
    _assert_matches(y2, _eager_fp32(x + r, w, 1e-6), "bfloat16")


# -- modules -------------------------------------------------------------------------------

@requires_torch_gpu
def test_rmsnorm_module():
    hidden, eps = 1024, 0.1     # inputs of mean square ~0.09: eps weighs in, so it must be passed
    m = rnt.RMSNorm(hidden, eps, casting_mode="llama", dtype=torch.bfloat16, device="cuda")
    assert isinstance(m.weight, nn.Parameter) and m.weight.requires_grad
    assert m.weight.shape == (hidden,) and torch.equal(m.weight, torch.ones_like(m.weight))
    assert list(m.state_dict()) == ["weight"] and m.variance_epsilon == eps
    with torch.no_grad():
        m.weight.copy_(_weight(hidden, "bfloat16"))
    x = _randn((8, hidden), "bfloat16", 33, scale=0.3)
    with torch.no_grad():
        y = m(x)
    _assert_matches(y, _eager_llama(x, m.weight.detach(), eps), "bfloat16")
    trained = m(x)                           # grad mode on, the weight requires grad: autograd
    assert torch.equal(trained.detach(), y)
    dy = _randn((8, hidden), "bfloat16", 40)
    trained.backward(dy)
    want = rn.rms_norm_backward(dy, x, m.weight.detach(), eps, casting_mode="llama")[1]
    assert m.weight.grad is not None and torch.equal(m.weight.grad, want)
    m.weight.requires_grad_(False)
    assert torch.equal(m(x), y)

    gemma = rnt.RMSNorm(hidden, 1e-6, weight_offset=1.0, dtype=torch.bfloat16, device="cuda")
    assert torch.equal(gemma.weight, torch.zeros_like(gemma.weight))   # effective scale starts at one
    with torch.no_grad():
        g = gemma(x)
        gemma.weight.normal_(0.0, 0.3)
        g2 = gemma(x)
    _assert_matches(g, F.rms_norm(x, (hidden,), None, 1e-6), "bfloat16", exact=False)
    w1 = gemma.weight.detach().float() + 1.0
    _assert_matches(g2, _eager_fp32(x, w1, 1e-6), "bfloat16")
    with pytest.raises(ValueError):
        rnt.RMSNorm(hidden, casting_mode="gemma")


@requires_torch_gpu
def test_fused_add_rmsnorm_module():
    hidden = 2048
    m = rnt.FusedAddRMSNorm(hidden, 1e-5, casting_mode="llama", dtype=torch.float16, device="cuda")
    m.weight.requires_grad_(False)
    with torch.no_grad():
        m.weight.copy_(_weight(hidden, "float16"))
    x, r = _randn((16, hidden), "float16", 34), _randn((16, hidden), "float16", 35)
    out, res = m(x, r)
    assert torch.equal(res, x + r)
    _assert_matches(out, _eager_llama(x + r, m.weight, 1e-5), "float16")
    x0, r0 = x.clone(), r.clone()
    a, b = m(x, r, out=x, residual_out=r)
    assert a is x and b is r and torch.equal(r, x0 + r0) and torch.equal(x, out)


def _hf_style_norms():
    """Stand-ins with transformers' exact forwards (the real classes are checked in test_hf_llama)."""

    class LlamaRMSNorm(nn.Module):
        def __init__(self, hidden_size, eps=1e-6):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(hidden_size))
            self.variance_epsilon = eps

        def forward(self, hidden_states):
            input_dtype = hidden_states.dtype
            hidden_states = hidden_states.to(torch.float32)
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
            return self.weight * hidden_states.to(input_dtype)

    class GemmaRMSNorm(nn.Module):
        def __init__(self, dim, eps=1e-6):
            super().__init__()
            self.eps = eps
            self.weight = nn.Parameter(torch.zeros(dim))

        def forward(self, x):
            output = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
            output = output * (1.0 + self.weight.float())
            return output.type_as(x)

    class OddRMSNorm(nn.Module):   # named like one, computes something else
        def __init__(self, dim, eps=1e-6):
            super().__init__()
            self.eps = eps
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x):
            return x.abs() * self.weight

    return LlamaRMSNorm, GemmaRMSNorm, OddRMSNorm


def _tiny_model(hidden=512):
    LlamaRMSNorm, GemmaRMSNorm, OddRMSNorm = _hf_style_norms()

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm = LlamaRMSNorm(hidden, 1e-5)
            self.post_attention_layernorm = LlamaRMSNorm(hidden, 1e-5)
            self.extra_norm = GemmaRMSNorm(hidden, 1e-6)

        def forward(self, x):
            return self.extra_norm(self.post_attention_layernorm(self.input_layernorm(x)) * 1.5)

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Layer() for _ in range(3)])
            self.norm = LlamaRMSNorm(hidden, 1e-5)
            self.final = self.norm          # one module under two names
            self.odd = OddRMSNorm(hidden)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.odd(self.final(self.norm(x)))

    torch.manual_seed(36)
    model = Tiny().to(dtype=torch.bfloat16)
    with torch.no_grad():
        for name, m in model.named_modules():
            if name.startswith("layers.2."):
                continue                    # layer 2 keeps the initial weights (ones, zeros)
            if isinstance(m, LlamaRMSNorm):
                m.weight.copy_(1.0 + 0.5 * torch.randn(hidden))
            elif isinstance(m, GemmaRMSNorm):
                m.weight.copy_(0.5 * torch.randn(hidden))
    return model


@requires_torch_gpu
def test_patch_hf_rmsnorm_replaces_with_matching_numerics():
    model = _tiny_model().cuda().eval()
    original = copy.deepcopy(model)
    weights = {name: m.weight for name, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")}
    state_before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    x = _randn((4, 7, 512), "bfloat16", 37)

    with pytest.warns(UserWarning, match="odd"):
        replaced = rnt.patch_hf_rmsnorm(model)
    assert replaced == 3 * 3 + 1     # two Llama + one Gemma per layer, the shared final norm once
    for name, w in weights.items():
        m = model.get_submodule(name)
        if name == "odd":
            assert type(m).__name__ == "OddRMSNorm"
            continue
        assert isinstance(m, rnt.RMSNorm), name
        assert m.weight is w, f"{name}: the weight Parameter was not shared"
        if name.endswith("extra_norm"):
            assert (m.casting_mode, m.weight_offset) == ("fp32", 1.0), name
        else:
            assert (m.casting_mode, m.weight_offset) == ("llama", 0.0), name
    assert model.final is model.norm
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == state_before

    with torch.no_grad():
        want, got = original(x), model(x)
    _assert_matches(got, want, "bfloat16")
    # per module too, where the comparison is not diluted by the chain
    with torch.no_grad():
        for name in ("layers.0.input_layernorm", "layers.1.extra_norm", "layers.2.extra_norm", "norm"):
            _assert_matches(model.get_submodule(name)(x), original.get_submodule(name)(x), "bfloat16")

    with pytest.warns(UserWarning, match="odd"):
        assert rnt.patch_hf_rmsnorm(model) == 0     # already patched


@requires_torch_gpu
def test_patch_hf_rmsnorm_patches_a_cpu_model():
    model = _tiny_model()
    assert rnt.patch_hf_rmsnorm(model) > 0        # CPU tensors run the reference
    assert isinstance(model.norm, rnt.RMSNorm)
