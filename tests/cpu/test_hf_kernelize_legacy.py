"""cupy_rmsnorm.hf with kernels up to 0.10 (what transformers 4.x allows: 0.9 with transformers
4.57): repositories whose ``load()`` returns a module with ``layers``, and no CPU entries in a
mapping. On the CPU the CUDA entry is used with kernels' capability query answered by hand, so
the swapped forward runs here (CPU tensors run the library's reference). Skips unless torch,
transformers and a kernels before 0.11 are installed (the current ones: test_hf_kernelize.py)."""

import copy
import importlib.metadata

import pytest
from helpers import tiny_llama

torch = pytest.importorskip("torch", reason="HF kernelize tests: torch is not installed")
pytest.importorskip("transformers", reason="HF kernelize tests: transformers is not installed")
kernels = pytest.importorskip("kernels", reason="HF kernelize tests: kernels is not installed")

import cupy_rmsnorm.hf as rnhf  # noqa: E402
import cupy_rmsnorm.torch as rnt  # noqa: E402
from transformers.utils import is_kernels_available  # noqa: E402

KERNELS = importlib.metadata.version("kernels")   # kernels 0.9 has no __version__

if not is_kernels_available():   # then transformers marks no module for kernels
    pytest.skip(f"transformers {__import__('transformers').__version__} does not take kernels {KERNELS}",
                allow_module_level=True)

if rnhf._kernels_version() >= (0, 11):
    pytest.skip(f"kernels {KERNELS} is current: test_hf_kernelize.py", allow_module_level=True)


def test_the_mapping_is_cuda_only_with_modules_of_layers():
    mapping = rnhf.kernel_mapping()
    assert set(mapping) == {"RMSNorm", "RMSNormGated", "RMSNormZeroCentered"}
    for name, by_device in mapping.items():
        assert set(by_device) == {"cuda"}
        repo = by_device["cuda"]
        assert repo.layer_name == name and getattr(repo.load().layers, name) is getattr(rnhf, name)
    with pytest.raises(ValueError, match=r"^device='cpu': kernels .* maps no CPU layers \(kernels 0\.11 on does\)"):
        rnhf.kernel_mapping("cpu")


def test_kernelize_refuses_a_cpu_model():
    with pytest.raises(ValueError, match=r"maps no CPU layers"):
        rnhf.kernelize(tiny_llama(1, 64, 100, device="cpu", dtype="float32"))


def test_the_cuda_entry_swaps_llama_norms_for_the_patched_numerics(monkeypatch):
    from kernels import layer as kernels_layer
    monkeypatch.setattr(kernels_layer, "_find_capability", lambda *args: 90)   # no GPU here: an H100's answer
    original = tiny_llama(2, 64, 100, device="cpu", dtype="bfloat16")
    ids = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    model = copy.deepcopy(original)
    with kernels.use_kernel_mapping(rnhf.kernel_mapping("cuda"), inherit_mapping=False):
        kernels.kernelize(model, mode=kernels.Mode.INFERENCE, device="cuda")
    norms = [m for m in model.modules() if type(m).__name__ == "LlamaRMSNorm"]
    assert len(norms) == 5 and all(m.forward.__func__ is rnhf.RMSNorm.forward for m in norms)
    patched = copy.deepcopy(original)
    assert rnt.patch_hf_rmsnorm(patched) == 5
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, patched(input_ids=ids).logits)
    assert norms[0].__dict__[rnhf._FOUND][2] == dict(casting_mode="llama", weight_offset=0.0)
