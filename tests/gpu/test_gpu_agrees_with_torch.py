"""Agreement on the GPU with PyTorch and Hugging Face: casting_mode="fp32" against
torch.nn.functional.rms_norm, casting_mode="llama" against HF LlamaRMSNorm, and
weight_offset=1 against HF GemmaRMSNorm, on CuPy views of the same CUDA memory.

Needs a CUDA GPU and torch with CUDA; skipped, with the reason shown, everywhere else.
"""

import pytest
from helpers import DTYPE_NAMES, EPS, FUSED, OPS, requires_torch_gpu, seed, torch_cuda_missing

from cupy_rmsnorm.bench.arrays import to_cupy

if torch_cuda_missing() is None:
    import cupy as cp
    import gpu_reference as G

pytestmark = [requires_torch_gpu, pytest.mark.usefixtures("free_gpu_memory")]


def _agreement(ours, theirs_t, dtype_name, ulps):
    """None when ours is within ``ulps`` of torch's result and, for 16-bit dtypes, at
    least 90% bit-identical (both compute in float32 and round the same way, so only
    float32 sum-order noise may flip a rounding), else why not."""
    import torch
    torch.cuda.synchronize()
    theirs = to_cupy(theirs_t.contiguous())
    msg = G.compare(ours, G.to_float64(theirs).reshape(-1, ours.shape[-1]), dtype_name, ulps=ulps)
    if msg:
        return msg
    if dtype_name != "float32":
        same = float(cp.mean(G.bits(ours) == G.bits(theirs)))
        if same < 0.9:
            return f"only {same:.1%} of elements bit-identical"
    return None


def _hf_norms(torch):
    """transformers' LlamaRMSNorm and GemmaRMSNorm forwards when transformers is there,
    else line-for-line copies of them."""
    try:
        from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
    except Exception:  # noqa: BLE001 - any import problem: use the copies
        LlamaRMSNorm = GemmaRMSNorm = None

    def llama(h, weight, eps):
        if LlamaRMSNorm is not None:
            m = LlamaRMSNorm(h.shape[-1], eps=eps).to(device=h.device, dtype=weight.dtype)
            with torch.no_grad():
                m.weight.copy_(weight)
                return m(h)
        dtype = h.dtype
        h = h.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + eps)
        return weight * h.to(dtype)

    def gemma(h, weight, eps):   # output * (1 + weight): weight_offset=1, rounded once
        if GemmaRMSNorm is not None:
            m = GemmaRMSNorm(h.shape[-1], eps=eps).to(device=h.device, dtype=weight.dtype)
            with torch.no_grad():
                m.weight.copy_(weight)
                return m(h)
        out = h.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + eps)
        return (out * (1.0 + weight.float())).type_as(h)

    return llama, gemma


def _torch_inputs(torch, dtype_name, hidden, seed, rows=33):
    g = torch.Generator(device="cuda").manual_seed(seed)
    tdt = getattr(torch, dtype_name)
    xt = (torch.randn(rows, hidden, device="cuda", generator=g) * 3).to(tdt)
    rt = (torch.randn(rows, hidden, device="cuda", generator=g) * 3).to(tdt)
    wt = (1 + 0.5 * torch.randn(hidden, device="cuda", generator=g)).to(tdt)
    return xt, rt, wt


@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
@pytest.mark.parametrize("op", OPS)
def test_agrees_with_torch_rms_norm(op, dtype_name):
    """casting_mode="fp32" against torch.nn.functional.rms_norm (fused: on x + residual
    added by torch in the dtype, which residual_out must equal bit for bit)."""
    import torch
    for hidden in (7, 4096, 5120, 65536):
        xt, rt, wt = _torch_inputs(torch, dtype_name, hidden, seed("torch", op, dtype_name, hidden))
        st = xt + rt if op == FUSED else xt
        torch.cuda.synchronize()
        x, res = to_cupy(xt), to_cupy(rt)
        for weight_t in (None, wt):
            want = torch.nn.functional.rms_norm(st, (hidden,), weight_t, EPS)
            w = None if weight_t is None else to_cupy(weight_t)
            y, s = G.call(op, x, res, w, "fp32")
            if op == FUSED:
                torch.cuda.synchronize()
                msg = G.same_bits(s, to_cupy(st))
                assert msg is None, f"hidden={hidden}: residual_out vs torch's x + residual: {msg}"
            msg = _agreement(y, want, dtype_name, ulps=2)
            assert msg is None, f"hidden={hidden} weight={weight_t is not None}: {msg}"


@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
@pytest.mark.parametrize("op", OPS)
def test_agrees_with_hf_llama_and_gemma_rms_norm(op, dtype_name):
    """casting_mode="llama" against HF LlamaRMSNorm; casting_mode="fp32" with
    weight_offset=1 against HF GemmaRMSNorm (weights stored as w - 1)."""
    import torch
    llama, gemma = _hf_norms(torch)
    for hidden in (7, 4096, 5120, 65536):
        xt, rt, wt = _torch_inputs(torch, dtype_name, hidden, seed("hf", op, dtype_name, hidden))
        st = xt + rt if op == FUSED else xt
        torch.cuda.synchronize()
        x, res, w = to_cupy(xt), to_cupy(rt), to_cupy(wt)
        with torch.no_grad():
            want_llama = llama(st, wt, EPS)
            want_gemma = gemma(st, wt - 1, EPS)
        torch.cuda.synchronize()
        w_gemma = to_cupy((wt - 1).contiguous())
        y, _ = G.call(op, x, res, w, "llama")
        msg = _agreement(y, want_llama, dtype_name, ulps=2)
        assert msg is None, f"hidden={hidden} llama: {msg}"
        y, _ = G.call(op, x, res, w_gemma, "fp32", weight_offset=1.0)
        msg = _agreement(y, want_gemma, dtype_name, ulps=2)
        assert msg is None, f"hidden={hidden} gemma: {msg}"
