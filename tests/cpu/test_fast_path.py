"""The pieces of a repeated call's fast path that need no GPU: the overlap test of given
outputs (``_launcher._apart`` / ``Launcher._overlapping``) against the plain interval
definition, and the torch signature against its per-tensor definition."""

import itertools
import types

import pytest

from cupy_rmsnorm import _cache, _interop, _launcher, _pipeline
from cupy_rmsnorm.ops.forward import launch as forward_launch

SPECS = {False: _pipeline.REGISTRY["rms_norm"], True: _pipeline.REGISTRY["fused_add_rms_norm"]}


class _GenericSpec:
    """A spec the torch signature keys tensor by tensor (any spec but the forward's five arrays)."""
    def __init__(self, outputs):
        self.outputs = tuple(outputs)         # equal to the forward's, but not the same object

    def __eq__(self, other):
        return True

    def __hash__(self):
        return 0


def _overlaps(pa, extent_a, pb, extent_b):
    """[pa + lo_a, pa + hi_a) and [pb + lo_b, pb + hi_b) share a byte."""
    return pa + extent_a[0] < pb + extent_b[1] and pb + extent_b[0] < pa + extent_a[1]


@pytest.mark.parametrize("same_ok", [False, True])
def test_overlap_test_is_the_interval_definition(same_ok):
    extents = [(0, 8), (0, 1), (-16, 4), (4, 12), (-3, -1)]
    pointers = range(0, 40, 3)
    checked = 0
    for ea, eb in itertools.product(extents, repeat=2):
        pair = _launcher._apart(0, ea, 1, eb, same_ok)
        launcher = types.SimpleNamespace(_overlap_pairs=(pair,))
        for pa, pb in itertools.product(pointers, repeat=2):
            expected = _overlaps(pa, ea, pb, eb) and not (same_ok and pa == pb)
            assert forward_launch.Launcher._overlapping(launcher, (pa, pb)) is expected, (ea, eb, pa, pb)
            checked += 1
    assert checked == len(extents) ** 2 * len(pointers) ** 2


def test_overlap_test_checks_every_pair():
    """The answer is True as soon as one pair of several overlaps, and only then."""
    apart = _launcher._apart(0, (0, 8), 1, (0, 8), False)
    same = _launcher._apart(0, (0, 8), 2, (0, 8), True)
    launcher = types.SimpleNamespace(_overlap_pairs=(same, apart))
    assert not forward_launch.Launcher._overlapping(launcher, (100, 200, 100))    # same array: allowed
    assert forward_launch.Launcher._overlapping(launcher, (100, 104, 100))        # the second pair
    assert forward_launch.Launcher._overlapping(launcher, (100, 200, 104))        # the first pair


def test_torch_signature_is_the_per_tensor_keys():
    """_torch_signature writes the per-tensor keys out inline (one call fewer per tensor);
    it must be exactly those keys, with whether autograd must record the call, and tell
    apart what they tell apart."""
    torch = pytest.importorskip("torch")
    x = torch.zeros(3, 8, dtype=torch.bfloat16)
    r = torch.zeros(3, 8, dtype=torch.bfloat16)
    w = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    o, ro = torch.empty_like(x), torch.empty_like(x)
    configurations = [(x, None, None, None, None), (x, None, w, None, None), (x, None, w, o, None),
                      (x, r, w, None, None), (x, r, w, o, ro), (x, r, None, None, ro), (x[:, :4], None, w[:4], None, None),
                      (x.t(), None, None, None, None), (x.float(), None, w, None, None), (x, None, w.detach(), None, None)]
    keys = set()
    for fused, arrays in itertools.product((False, True), configurations):
        spec = SPECS[fused]
        key = _interop.signature_of(spec, arrays, (1e-6, 0.0, "fp32", None))
        a, *rest = arrays
        inputs = [None if t is None else _interop._torch_input_key(t) for t in rest[:2]]
        outputs = [None if t is None else _interop._torch_output_key(t) for t in rest[2:]]
        autograd = any(t is not None and t.requires_grad for t in arrays)     # grad mode is on here
        assert _interop.autograd_records(arrays) is autograd
        assert key == (_interop.TorchKind, spec, (1e-6, 0.0, "fp32", None), autograd, *_interop._torch_input_key(a),
                       *inputs, *outputs)
        generic = _interop._torch_signature(_GenericSpec(spec.outputs), arrays, (1e-6, 0.0, "fp32", None))
        assert generic[3:] == key[3:]      # the forward's inline keys are the per-tensor keys
        keys.add(key)
    assert len(keys) == 2 * len(configurations)


def test_torch_signature_holds_the_modes():
    """Grad mode and inference mode decide the call as much as the tensors do: whether autograd
    must record it, and whether an inference tensor can be written."""
    torch = pytest.importorskip("torch")
    x = torch.zeros(3, 8, dtype=torch.bfloat16)
    w = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    o = torch.empty_like(x)

    def key(*arrays):
        return _interop.signature_of(SPECS[False], arrays + (None,) * (5 - len(arrays)), (1e-6, 0.0, "fp32", None))

    assert key(x, None, w) != key(x, None, w.detach())       # grad mode on: autograd records the first
    with torch.no_grad():
        assert key(x, None, w) == key(x, None, w.detach())   # off: requires_grad does not matter
    with torch.inference_mode():
        inference_out = torch.empty_like(x)
        assert key(x, None, w, inference_out) == key(x, None, w, o)    # both writeable here
    assert key(x, None, w, inference_out) != key(x, None, w, o)        # not the inference tensor here
    assert _interop._torch_output_key(inference_out)[-1] is False
    assert _interop.TorchKind.meta(inference_out).writeable is False
    with torch.inference_mode():
        assert _interop._torch_output_key(inference_out)[-1] is True
        assert _interop.TorchKind.meta(inference_out).writeable is True
    with torch.no_grad():
        assert _interop.autograd_records((x, None, w, None, None)) is False


def test_repeated_call_takes_the_last_hit_until_the_cache_is_cleared():
    """The cache's entry for a signature runs a repeated call; the latest hit is found again
    without the dict, and clear_cache forgets it too. (CPU tensors, a stand-in entry: the
    plumbing only; the GPU tests launch for real.)"""
    torch = pytest.importorskip("torch")
    import numpy as np

    import cupy_rmsnorm as rn
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    w = torch.ones(8, dtype=torch.bfloat16)
    signature = _interop.signature_of(SPECS[False], (x, None, w, None, None), (1e-6, 0.0, "fp32", None))
    seen = []

    def entry(arrays):
        seen.append(arrays)
        return "launched"

    _cache.clear()
    try:
        _cache.launches[signature] = entry
        assert rn.rms_norm(x, w) == "launched"
        assert _cache.last_hit == (signature, entry)
        del _cache.launches[signature]
        assert rn.rms_norm(x, w) == "launched"           # the last hit, no dict lookup
        assert seen == [(x, None, w, None, None)] * 2
        with pytest.raises(TypeError, match="eps"):      # an eps no signature can compare: the full path says
            rn.rms_norm(x, w, eps=np.array([1e-6, 1e-6]))
        _cache.clear()
        assert _cache.last_hit == (None, None)
        y = rn.rms_norm(x, w)                            # the full path again: CPU tensors, the reference
        assert isinstance(y, torch.Tensor) and len(seen) == 2
    finally:
        _cache.clear()


def test_a_call_autograd_records_is_remembered_like_an_eager_one():
    """The second call of an autograd signature takes the fast path: no checks, the same op."""
    torch = pytest.importorskip("torch")
    import cupy_rmsnorm as rn
    x, w = torch.randn(2, 8), torch.ones(8, requires_grad=True)
    _cache.clear()
    try:
        first = rn.rms_norm(x, w)
        signature = _interop.signature_of(SPECS[False], (x, None, w, None, None), (1e-6, 0.0, "fp32", None))
        assert _cache.launches.get(signature) is not None
        second = rn.rms_norm(x, w)
        assert _cache.last_hit[0] == signature and second.requires_grad and torch.equal(first, second)
        second.sum().backward()
        assert w.grad is not None
        with torch.no_grad():                  # another signature: grad mode off, the direct path
            assert not rn.rms_norm(x, w).requires_grad
    finally:
        _cache.clear()
