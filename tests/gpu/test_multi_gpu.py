"""Two GPUs: arrays on device 1 run there, mixed devices are refused before any
launch, each device compiles its kernels once, and two threads can drive the two GPUs
at once. Every test skips with the reason when fewer than two GPUs are present.
"""

import collections
import threading

import numpy as np
import pytest

import cupy_rmsnorm as rn
from cupy_rmsnorm import _cache
from helpers import TOL, requires_two_gpus, requires_two_torch_gpus


def _host_inputs(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(dtype)
    r = rng.standard_normal(shape).astype(dtype)
    w = (1.0 + 0.5 * rng.standard_normal(shape[-1])).astype(dtype)
    return x, r, w


def _assert_close(got, want):
    rtol, atol = TOL[np.dtype(want.dtype).name]
    np.testing.assert_allclose(np.asarray(got, dtype=np.float32), want.astype(np.float32), rtol=rtol, atol=atol)


def _on_device(device, *host_arrays):
    import cupy
    with cupy.cuda.Device(device):
        return [cupy.asarray(a) for a in host_arrays]


@pytest.fixture
def fresh_kernel_cache(monkeypatch):
    """An empty kernel cache (and no remembered launchers) that counts compiles per (device, expr)."""
    from cupy_rmsnorm import _compile, _launcher
    monkeypatch.setattr(_compile.kernel_cache, "_functions", {})
    _cache.clear()                   # launchers hold kernels: start without any
    compiles = collections.Counter()
    real_compile = _compile._compile

    def counting_compile(device_id, name):
        compiles[(device_id, name)] += 1
        return real_compile(device_id, name)

    monkeypatch.setattr(_compile, "_compile", counting_compile)
    yield compiles
    _cache.clear()


# -- arrays on device 1 while device 0 is current --------------------------------------------

@requires_two_gpus
@pytest.mark.parametrize("dtype", (np.float32, np.float16))
def test_cupy_arrays_on_device_1_run_there(dtype):
    import cupy
    xh, rh, wh = _host_inputs((24, 1536), dtype, 1)
    x, r, w = _on_device(1, xh, rh, wh)
    with cupy.cuda.Device(1):
        out = cupy.full(xh.shape, np.nan, dtype=dtype)
    with cupy.cuda.Device(0):
        y = rn.rms_norm(x, w)
        y_out = rn.rms_norm(x, w, out=out, casting_mode="llama")
        y2, s2 = rn.fused_add_rms_norm(x, r, w)
        assert cupy.cuda.runtime.getDevice() == 0, "the call left another device current"
    for a in (y, y2, s2):
        assert a.device.id == 1, "a result was allocated on another device"
    assert y_out is out
    cupy.cuda.Device(1).synchronize()
    _assert_close(y.get(), rn.rms_norm_reference(xh, wh))
    _assert_close(out.get(), rn.rms_norm_reference(xh, wh, casting_mode="llama"))
    ref2, refs = rn.fused_add_rms_norm_reference(xh, rh, wh)
    _assert_close(y2.get(), ref2)
    assert np.array_equal(s2.get(), refs)


@requires_two_gpus
def test_cupy_on_device_1_follows_device_1s_current_stream():
    import cupy
    xh, _, wh = _host_inputs((8, 4096), np.float32, 2)
    x, w = _on_device(1, xh, wh)
    with cupy.cuda.Device(1):
        stream = cupy.cuda.Stream(non_blocking=True)
        out = cupy.full(xh.shape, np.nan, dtype=np.float32)
        rn.rms_norm(x, w, out=out)                    # compile outside the capture
        cupy.cuda.Device(1).synchronize()
        # Capture on device 1's stream while device 0 is current: a launch on any other
        # stream would run at once (or break the capture) instead of landing in the graph.
        with stream:
            stream.begin_capture()
            with cupy.cuda.Device(0):
                rn.rms_norm(x, w, out=out)
            graph = stream.end_capture()
        out.fill(np.nan)   # whatever ran outside the graph is wiped: only a replay can fill it
        cupy.cuda.Device(1).synchronize()
        graph.launch(stream=stream)
        stream.synchronize()
    _assert_close(out.get(), rn.rms_norm_reference(xh, wh))


@requires_two_torch_gpus
def test_torch_tensors_on_device_1_run_there():
    import torch
    import torch.nn.functional as F
    with torch.cuda.device(0):
        gen = torch.Generator(device="cuda:1").manual_seed(3)
        x = torch.randn(16, 2048, generator=gen, device="cuda:1").to(torch.bfloat16)
        r = torch.randn(16, 2048, generator=gen, device="cuda:1").to(torch.bfloat16)
        w = (1.0 + 0.5 * torch.randn(2048, generator=gen, device="cuda:1")).to(torch.bfloat16)
        y = rn.rms_norm(x, w)
        y2, s2 = rn.fused_add_rms_norm(x, r, w)
        out = torch.full_like(x, float("nan"))
        assert rn.rms_norm(x, w, out=out) is out
        assert torch.cuda.current_device() == 0
    for t in (y, y2, s2):
        assert t.device == torch.device("cuda", 1)
    torch.cuda.synchronize(1)
    rtol, atol = TOL["bfloat16"]
    torch.testing.assert_close(y.float(), F.rms_norm(x, (2048,), w, 1e-6).float(), rtol=rtol, atol=atol)
    assert torch.equal(out, y)
    assert torch.equal(s2, x + r)
    torch.testing.assert_close(y2.float(), F.rms_norm(x + r, (2048,), w, 1e-6).float(), rtol=rtol, atol=atol)


# -- mixed devices ---------------------------------------------------------------------------

def _launch_spy(monkeypatch):
    """Record every launch through the array kinds (the one place kernels are launched)."""
    from cupy_rmsnorm import _interop
    launches = []
    for kind in (_interop.CupyKind, _interop.TorchKind):
        raw = kind.__dict__.get("launch")      # a staticmethod or a classmethod object
        if raw is None:
            continue

        def spy(*args, _fn=raw.__func__, _kind=kind, _takes_cls=isinstance(raw, classmethod), **kwargs):
            launches.append(_kind.name)
            return _fn(_kind, *args, **kwargs) if _takes_cls else _fn(*args, **kwargs)

        monkeypatch.setattr(kind, "launch", staticmethod(spy))
    return launches


MISPLACED = ["weight", "residual", "out", "residual_out"]


@requires_two_gpus
@pytest.mark.parametrize("misplaced", MISPLACED)
def test_cupy_arrays_on_two_devices_are_refused_before_launch(misplaced, monkeypatch):
    import cupy
    xh, rh, wh = _host_inputs((8, 1024), np.float32, 4)
    arrays = dict(zip(("x", "residual", "weight"), _on_device(0, xh, rh, wh)))
    with cupy.cuda.Device(0):
        arrays["out"], arrays["residual_out"] = (cupy.full(xh.shape, np.nan, np.float32) for _ in range(2))
    with cupy.cuda.Device(1):    # the same values, on the other GPU
        arrays[misplaced] = cupy.asarray(arrays[misplaced].get())
    launches = _launch_spy(monkeypatch)
    with pytest.raises(ValueError, match="device"):
        rn.fused_add_rms_norm(arrays["x"], arrays["residual"], arrays["weight"],
                              out=arrays["out"], residual_out=arrays["residual_out"])
    assert launches == []
    for k in ("out", "residual_out"):
        assert np.isnan(arrays[k].get()).all(), f"{k} was written"
    np.testing.assert_array_equal(arrays["x"].get(), xh)
    np.testing.assert_array_equal(arrays["residual"].get(), rh)
    # the single-array op refuses a weight on the other device too
    if misplaced in ("weight", "out"):
        with pytest.raises(ValueError, match="device"):
            rn.rms_norm(arrays["x"], arrays["weight"], out=arrays["out"])
        assert launches == [] and np.isnan(arrays["out"].get()).all()


@requires_two_torch_gpus
@pytest.mark.parametrize("misplaced", MISPLACED)
def test_torch_tensors_on_two_devices_are_refused_before_launch(misplaced, monkeypatch):
    import torch
    gen = torch.Generator(device="cuda:0").manual_seed(5)
    t = {k: torch.randn(8, 1024, generator=gen, device="cuda:0") for k in ("x", "residual")}
    t["weight"] = torch.ones(1024, device="cuda:0")
    t["out"], t["residual_out"] = torch.full_like(t["x"], float("nan")), torch.full_like(t["x"], float("nan"))
    t[misplaced] = t[misplaced].to("cuda:1")
    before = {k: v.clone() for k, v in t.items()}
    launches = _launch_spy(monkeypatch)
    with pytest.raises(ValueError, match="device"):
        rn.fused_add_rms_norm(t["x"], t["residual"], t["weight"], out=t["out"], residual_out=t["residual_out"])
    assert launches == []
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    for k, v in t.items():
        assert torch.equal(v.nan_to_num(7.0), before[k].nan_to_num(7.0)), f"{k} was written"


# -- one compile per device ------------------------------------------------------------------

@requires_two_gpus
def test_each_device_compiles_each_kernel_once(fresh_kernel_cache):
    import cupy
    from cupy_rmsnorm import _compile
    compiles = fresh_kernel_cache
    per_device = {}
    for device in (0, 1, 0, 1, 1, 0):          # back and forth, and again
        xh, rh, wh = _host_inputs((16, 2048), np.float16, 6)
        x, r, w = _on_device(device, xh, rh, wh)
        with cupy.cuda.Device(1 - device):    # the other device current: still runs on the arrays'
            y = rn.rms_norm(x, w)
            y2, _ = rn.fused_add_rms_norm(x, r, w)
        cupy.cuda.Device(device).synchronize()
        _assert_close(y.get(), rn.rms_norm_reference(xh, wh))
        _assert_close(y2.get(), rn.fused_add_rms_norm_reference(xh, rh, wh)[0])
        per_device.setdefault(device, set()).update(e for d, e in compiles if d == device)
    assert compiles, "nothing was compiled: the cache was not fresh"
    assert all(n == 1 for n in compiles.values()), f"compiled more than once: {dict(compiles)}"
    assert per_device[0] == per_device[1] and len(per_device[0]) == 2   # the plain and the fused kernel
    # one cache entry per (device, instantiation), each bound to its own device
    assert set(_compile.kernel_cache._functions) == set(compiles)
    for name in per_device[0]:
        assert _compile.kernel_cache.get(0, name) is not _compile.kernel_cache.get(1, name)
    assert sum(compiles.values()) == len(compiles)


# -- two threads, two GPUs -------------------------------------------------------------------

ITERATIONS = 50


def _drive_cupy(device, host, barrier, results):
    import cupy
    xh, rh, wh = host
    with cupy.cuda.Device(device):
        x, r, w = (cupy.asarray(a) for a in host)
        barrier.wait()
        ys, y2s = [], []
        for _ in range(ITERATIONS):
            ys.append(rn.rms_norm(x, w))
            y2s.append(rn.fused_add_rms_norm(x, r, w)[0])
        cupy.cuda.Device(device).synchronize()
        results[device] = ([a.get() for a in ys], [a.get() for a in y2s],
                           {a.device.id for a in ys + y2s})


def _drive_torch(device, host, barrier, results):
    import torch
    torch.cuda.set_device(device)     # per thread, like CuPy's current device
    x, r, w = (torch.from_numpy(a).to(f"cuda:{device}") for a in host)
    barrier.wait()
    ys, y2s = [], []
    for _ in range(ITERATIONS):
        ys.append(rn.rms_norm(x, w))
        y2s.append(rn.fused_add_rms_norm(x, r, w)[0])
    torch.cuda.synchronize(device)
    results[device] = ([a.cpu().numpy() for a in ys], [a.cpu().numpy() for a in y2s],
                       {a.device.index for a in ys + y2s})


@pytest.mark.parametrize("kind", [pytest.param("cupy", marks=requires_two_gpus),
                                  pytest.param("torch", marks=requires_two_torch_gpus)])
def test_two_threads_drive_two_gpus_at_once(kind, fresh_kernel_cache):
    drive = _drive_cupy if kind == "cupy" else _drive_torch
    hosts = {d: _host_inputs((64, 4096), np.float32, 10 + d) for d in (0, 1)}   # different data per GPU
    barrier = threading.Barrier(2)
    results, errors = {}, []

    def run(device):
        try:
            drive(device, hosts[device], barrier, results)
        except Exception as e:  # noqa: BLE001 - reported below, with the device
            errors.append((device, repr(e)))
            barrier.abort()

    threads = [threading.Thread(target=run, args=(d,)) for d in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors
    for device in (0, 1):
        xh, rh, wh = hosts[device]
        ys, y2s, devices = results[device]
        assert devices == {device}
        _assert_close(ys[0], rn.rms_norm_reference(xh, wh))
        _assert_close(y2s[0], rn.fused_add_rms_norm_reference(xh, rh, wh)[0])
        for a, b in zip(ys, y2s):     # every iteration gave the same bits
            assert np.array_equal(a, ys[0]) and np.array_equal(b, y2s[0])
    assert all(n == 1 for n in fresh_kernel_cache.values()), dict(fresh_kernel_cache)
