"""Bad inputs on the GPU: the CuPy path refuses them as the NumPy path does (the same
error type and message) and writes nothing, also once a launcher exists for the
signature (its fast path).

Needs a CUDA GPU; skipped, with the reason shown, everywhere else.
"""

import re

import numpy as np
import pytest
from helpers import DTYPES, gpu_missing, requires_gpu, seed

import cupy_rmsnorm as rn

if gpu_missing() is None:
    import cupy as cp
    import gpu_reference as G

pytestmark = [requires_gpu, pytest.mark.usefixtures("free_gpu_memory")]

K = 64


def _bad_cases():
    """name -> (expected error, build(make, xp, r) -> (function, args, kwargs, watched)).

    ``make`` turns a NumPy array into the kind under test, ``r(shape, dtype)`` makes
    random NumPy data (the same for both kinds), ``watched`` are whole buffers that must
    come out unchanged.
    """
    rms = rn.rms_norm

    def x_only(make, r, **kw):
        x = make(r((4, K)))
        return rms, (x,), kw, [x]

    def with_out(make, r, out):
        x = make(r((4, K)))
        return rms, (x,), {"out": out}, [x, out]

    cases = {
        "x float64": (TypeError, lambda m, xp, r: (rms, (m(r((4, K), np.float64)),), {}, [])),
        "x int32": (TypeError, lambda m, xp, r: (rms, (m(np.arange(4 * K, dtype=np.int32).reshape(4, K)),), {}, [])),
        "x 0-d": (ValueError, lambda m, xp, r: (rms, (m(r((), np.float32)),), {}, [])),
        "hidden size 0": (ValueError, lambda m, xp, r: (rms, (m(r((4, 0))),), {}, [])),
        "eps nan": (ValueError, lambda m, xp, r: x_only(m, r, eps=float("nan"))),
        "eps negative": (ValueError, lambda m, xp, r: x_only(m, r, eps=-1e-6)),
        "eps None": (TypeError, lambda m, xp, r: x_only(m, r, eps=None)),
        "casting_mode": (ValueError, lambda m, xp, r: x_only(m, r, casting_mode="bf16")),
        "weight_offset without weight": (ValueError, lambda m, xp, r: x_only(m, r, weight_offset=1.0)),
        "weight shape": (ValueError, lambda m, xp, r: x_only(m, r, weight=m(r((K + 1,))))),
        "weight dtype": (TypeError, lambda m, xp, r: x_only(m, r, weight=m(r((K,), np.float64)))),
        "weight_offset nan": (ValueError, lambda m, xp, r: x_only(m, r, weight=m(r((K,))),
                                                                   weight_offset=float("nan"))),
        "out dtype": (TypeError, lambda m, xp, r: with_out(m, r, m(r((4, K), np.float32)))),
        "out shape": (ValueError, lambda m, xp, r: with_out(m, r, m(r((4, K + 1))))),
        "out strided last axis": (ValueError, lambda m, xp, r: _strided_out(m, r)),
        "out rows overlap each other": (ValueError, lambda m, xp, r: _broadcast_out(m, xp, r)),
        "out partially overlaps x": (ValueError, lambda m, xp, r: _partial_overlap(m, r)),
        "out overlaps weight": (ValueError, lambda m, xp, r: _out_is_weight(m, r)),
        "residual dtype": (TypeError, lambda m, xp, r: _fused(m, r, res=m(r((4, K), np.float16)))),
        "residual shape": (ValueError, lambda m, xp, r: _fused(m, r, res=m(r((4, K - 1))))),
        "residual_out dtype": (TypeError, lambda m, xp, r: _fused(m, r, residual_out=m(r((4, K), np.float32)))),
        "residual_out partially overlaps residual": (ValueError, lambda m, xp, r: _res_out_partial(m, r)),
        "out is residual_out": (ValueError, lambda m, xp, r: _out_is_res_out(m, r)),
    }
    return cases


def _fused(make, r, res=None, **kw):
    x = make(r((4, K)))
    res = make(r((4, K))) if res is None else res
    return rn.fused_add_rms_norm, (x, res), kw, [x, res] + [v for v in kw.values()]


def _strided_out(make, r):
    x, ob = make(r((4, K))), make(r((4, 2 * K)))
    return rn.rms_norm, (x,), {"out": ob[:, ::2]}, [x, ob]


def _broadcast_out(make, xp, r):
    # a writeable zero-stride view (NumPy's broadcast_to is read-only, refused for that first)
    x, ob = make(r((4, K))), make(r((1, K)))
    out = xp.lib.stride_tricks.as_strided(ob, (4, K), (0, ob.strides[1]))
    return rn.rms_norm, (x,), {"out": out}, [x, ob]


def _partial_overlap(make, r):
    buf = make(r((5, K)))
    return rn.rms_norm, (buf[:4],), {"out": buf[1:]}, [buf]


def _out_is_weight(make, r):
    x, o = make(r((4, K))), make(r((4, K)))
    return rn.rms_norm, (x, o[1]), {"out": o}, [x, o]


def _res_out_partial(make, r):
    x, rb = make(r((4, K))), make(r((5, K)))
    return rn.fused_add_rms_norm, (x, rb[:4]), {"residual_out": rb[1:]}, [x, rb]


def _out_is_res_out(make, r):
    x, res, o = make(r((4, K))), make(r((4, K))), make(r((4, K)))
    return rn.fused_add_rms_norm, (x, res), {"out": o, "residual_out": o}, [x, res, o]


BAD_CASE_NAMES = tuple(_bad_cases())


def _raw(a, xp):
    return xp.ascontiguousarray(a).reshape(-1).view(xp.uint8).copy()


def _outcome(name, xp):
    """(exception or None, list of watched buffers that changed) for one kind."""
    expected, build = _bad_cases()[name]
    rng = np.random.default_rng(seed("bad", name))

    def r(shape, dtype=DTYPES["bfloat16"]):
        return np.asarray(rng.standard_normal(shape) + 0.5).astype(dtype)

    make = (lambda a: a) if xp is np else G.to_device
    fn, args, kwargs, watched = build(make, xp, r)
    before = [_raw(a, xp) for a in watched]
    err = None
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - compared below
        err = e
    if xp is not np:
        cp.cuda.Device().synchronize()
    changed = [i for i, (a, b) in enumerate(zip(watched, before)) if not bool((_raw(a, xp) == b).all())]
    return expected, err, changed


def _normalized(err):
    return re.sub(r"0x[0-9a-fA-F]+", "0x?", str(err))


@pytest.mark.parametrize("name", BAD_CASE_NAMES)
def test_bad_inputs_cupy_matches_numpy(name):
    expected, np_err, np_changed = _outcome(name, np)
    _, cp_err, cp_changed = _outcome(name, cp)
    assert isinstance(np_err, expected), f"NumPy path: expected {expected.__name__}, got {np_err!r}"
    assert isinstance(cp_err, expected), f"CuPy path: expected {expected.__name__}, got {cp_err!r}"
    assert type(cp_err) is type(np_err) and _normalized(cp_err) == _normalized(np_err), \
        f"CuPy and NumPy paths disagree:\n  NumPy: {np_err!r}\n  CuPy:  {cp_err!r}"
    assert not cp_changed, f"the failing CuPy call wrote into watched buffers {cp_changed}"
    assert not np_changed, f"the failing NumPy call wrote into watched buffers {np_changed}"


def test_mixed_array_kinds_rejected():
    dtype = DTYPES["bfloat16"]
    host = (np.random.default_rng(0).standard_normal((4, K)) + 0.5).astype(dtype)
    x = G.to_device(host)
    before = _raw(x, cp)
    with pytest.raises(TypeError, match="weight"):
        rn.rms_norm(x, np.ones(K, dtype))
    with pytest.raises(TypeError, match="out"):
        rn.rms_norm(x, out=np.empty((4, K), dtype))
    with pytest.raises(TypeError, match="residual"):
        rn.fused_add_rms_norm(host, x)
    cp.cuda.Device().synchronize()
    assert bool((_raw(x, cp) == before).all())


def test_launcher_fast_path_still_rejects_overlap():
    """A valid call leaves a launcher for its signature; a later call with the same
    shapes and strides but overlapping memory must still be refused, writing nothing."""
    dtype = DTYPES["bfloat16"]
    rng = np.random.default_rng(seed("fast path overlap"))

    def arr(shape):
        return G.to_device((rng.standard_normal(shape) + 0.5).astype(dtype))

    # out partially overlapping x
    buf, other = arr((5, K)), arr((5, K))
    rn.rms_norm(buf[:4], out=other[1:])                 # valid: leaves the launcher
    buf_before = _raw(buf, cp)
    with pytest.raises(ValueError, match="partially overlaps"):
        rn.rms_norm(buf[:4], out=buf[1:])
    # out overlapping the weight
    x1, o1, w1 = arr((4, K)), arr((4, K)), arr((K,))
    rn.rms_norm(x1, w1, out=o1)
    o1_before = _raw(o1, cp)
    with pytest.raises(ValueError, match="weight"):
        rn.rms_norm(x1, o1[1], out=o1)
    # out and residual_out sharing memory
    x2, r2, o2, ro2 = arr((4, K)), arr((4, K)), arr((4, K)), arr((4, K))
    rn.fused_add_rms_norm(x2, r2, out=o2, residual_out=ro2)
    o2_before, x2_before, r2_before = _raw(o2, cp), _raw(x2, cp), _raw(r2, cp)
    with pytest.raises(ValueError, match="share memory"):
        rn.fused_add_rms_norm(x2, r2, out=o2, residual_out=o2)
    cp.cuda.Device().synchronize()
    assert bool((_raw(buf, cp) == buf_before).all()), "a refused call wrote into x / out"
    assert bool((_raw(o1, cp) == o1_before).all()), "a refused call wrote into out / weight"
    for a, before in ((o2, o2_before), (x2, x2_before), (r2, r2_before)):
        assert bool((_raw(a, cp) == before).all()), "a refused fused call wrote"
