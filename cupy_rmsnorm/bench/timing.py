"""Timing primitives shared by the sub-commands and benchmarks/host_overhead.py: streams, CUDA graphs,
the three modes, copy bandwidth, first-call latency. GPU times come from CUDA (CuPy) events on the
stream the work runs on; ``host_times`` is the one wall clock. ``CupyRunner`` and ``TorchRunner`` own
a stream each (torch's graphs through ``torch.cuda.CUDAGraph``, so its allocator knows the capture).
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

# The library's device record and GPU check (private names: see gpu_missing, device_info).
from .. import _driver

MODES = ("graph", "cold", "hot")
MODE_TITLES = {"graph": "graph: GPU time per call (calls captured in one CUDA graph, replayed)",
               "cold": "cold: one call after a 512 MiB write flushed L2 (events around the call, which the host "
                       "issued while the GPU waited)",
               "hot": "hot: back-to-back calls from Python (host overhead shows here)"}
GRAPH_TARGET_US = 5000.0   # aim for ~5 ms per replay: long against launch jitter, short overall
COPY_BYTES = 1 << 30       # per buffer of the bandwidth copy: far past L2, so it measures HBM
SCRATCH_BYTES = 512 << 20  # written before each cold call: several times the L2 (H200: 60 MB)
# After the flush the GPU idles this long, so that a cold call's whole host side (forward +
# backward through autograd: up to hundreds of microseconds) is issued before its first
# kernel runs, and the events time the GPU's work rather than the host's.
HOLD_NS = 2_000_000
HOLD_SOURCE = r"""
extern "C" __global__ void hold(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
"""
WARMUP_CALLS = 3


def gpu_missing():
    """None when CuPy sees a CUDA GPU, else a one-line reason (never raises)."""
    return _driver.gpu_missing()


def median(values):
    return statistics.median(values)


def calls_for(nbytes, bandwidth_gbps, lo, hi, target_us=GRAPH_TARGET_US):
    """How many calls to time together: about ``target_us`` of work at the copy bandwidth (+2 us each), in [lo, hi]."""
    est_us = nbytes / (bandwidth_gbps * 1e3) + 2.0
    return int(max(lo, min(hi, round(target_us / est_us))))


def device_info():
    """Name, SM count, L2 size, compute capability and CUDA versions of the current device."""
    import cupy
    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)

    def version(v):
        return f"{v // 1000}.{v % 1000 // 10}"
    return {"device_id": dev.id, "gpu": name, "sm_count": props["multiProcessorCount"],
            "l2_bytes": props.get("l2CacheSize"), "memory_bytes": props.get("totalGlobalMem"),
            "compute_capability": f"{props['major']}.{props['minor']}",
            "max_cluster": _driver.device(dev.id).max_cluster,
            "pdl": _driver.device(dev.id).pdl,
            "cuda_driver_api": version(cupy.cuda.runtime.driverGetVersion()),
            "cuda_runtime": version(cupy.cuda.runtime.runtimeGetVersion())}


# -- runners ---------------------------------------------------------------------------
class CupyRunner:
    """Runs CuPy callables on its own non-blocking stream (graph capture needs one)."""

    kind = "cupy"

    def __init__(self):
        import cupy
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.event_stream = self.stream

    def context(self):
        return self.stream            # `with stream:` makes it CuPy's current stream

    def synchronize(self):
        self.stream.synchronize()

    def capture(self, fn, calls):
        """``calls`` calls of ``fn`` (already run on this stream) captured in one graph; returns a replay function.
        Nothing else allocates on this stream while the graph lives, so replays write only memory nobody holds."""
        stream = self.stream
        with stream:
            stream.begin_capture()
            try:
                for _ in range(calls):
                    fn()
            except BaseException:
                try:
                    stream.end_capture()
                except Exception:  # noqa: BLE001 - the first error is the one to report
                    pass
                raise
            graph = stream.end_capture()
        graph.upload(stream)
        return lambda: graph.launch(stream)


class _StreamHandle:
    """A torch stream in the CUDA stream protocol (kept alive by the CuPy stream)."""

    def __init__(self, torch_stream):
        self.torch_stream = torch_stream

    def __cuda_stream__(self):
        return (0, self.torch_stream.cuda_stream)


class TorchRunner:
    """Runs torch callables on a torch side stream; graphs through torch.cuda.CUDAGraph."""

    kind = "torch"

    def __init__(self):
        import cupy
        import torch
        self.torch = torch
        self.stream = torch.cuda.Stream()
        # the same CUDA stream seen by CuPy, for the events and the cold-mode flush
        self.event_stream = cupy.cuda.Stream.from_external(_StreamHandle(self.stream))

    def context(self):
        return self.torch.cuda.stream(self.stream)

    def synchronize(self):
        self.stream.synchronize()

    def capture(self, fn, calls):
        torch = self.torch
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self.stream):
            for _ in range(calls):
                fn()
        stream = self.stream

        def replay():
            with torch.cuda.stream(stream):   # replay() launches on the current stream
                graph.replay()
        return replay


def warm_up(runner, fn, calls=WARMUP_CALLS):
    """Run ``fn`` a few times on the runner's stream (compiles, fills pools); returns the last result."""
    result = None
    with runner.context():
        for _ in range(calls):
            result = fn()
    runner.synchronize()
    return result


# -- the three modes ---------------------------------------------------------------------
class _Timer:
    """One timing round at a time: ``round()`` runs, synchronizes, returns (and keeps) microseconds per call."""

    mode = None

    def __init__(self, runner, calls):
        import cupy
        self.runner, self.calls = runner, calls
        self._start, self._end = cupy.cuda.Event(), cupy.cuda.Event()
        self._elapsed_ms = cupy.cuda.get_elapsed_time
        self.samples = []

    def _finish(self):
        self._end.synchronize()
        us = self._elapsed_ms(self._start, self._end) * 1e3 / self.calls
        self.samples.append(us)
        return us

    def close(self):
        pass


class GraphTimer(_Timer):
    """GPU time: ``calls`` calls captured in one CUDA graph, events around a replay."""

    mode = "graph"

    def __init__(self, runner, fn, calls):
        super().__init__(runner, calls)
        self._replay = runner.capture(fn, calls)
        with runner.context():
            self._replay()              # the first launch of a graph pays one-time setup
        runner.synchronize()

    def round(self):
        es = self.runner.event_stream
        with self.runner.context():
            self._start.record(es)
            self._replay()
            self._end.record(es)
        return self._finish()

    def close(self):
        self.runner.synchronize()
        self._replay = None             # drops the graph (and torch's private pool)


class ColdTimer(_Timer):
    """One call with L2 flushed: a large buffer written first, events around the call."""

    mode = "cold"

    def __init__(self, runner, fn, scratch):
        super().__init__(runner, 1)
        self.fn, self.scratch = fn, scratch

    def round(self):
        es = self.runner.event_stream
        with self.runner.context():
            self.scratch.write(es)
            self._start.record(es)
            self.fn()
            self._end.record(es)
        return self._finish()


class HotTimer(_Timer):
    """Back-to-back calls from Python, events around all: small shapes show the host cost, large the GPU time."""

    mode = "hot"

    def __init__(self, runner, fn, calls):
        super().__init__(runner, calls)
        self.fn = fn

    def round(self):
        es, fn = self.runner.event_stream, self.fn
        with self.runner.context():
            self._start.record(es)
            for _ in range(self.calls):
                fn()
            self._end.record(es)
        return self._finish()


class Scratch:
    """The cold-mode flush: a buffer several times the L2 rewritten, then a no-memory kernel holding the stream."""

    def __init__(self, nbytes=SCRATCH_BYTES, hold_ns=HOLD_NS):
        import cupy
        import numpy
        self.buf = cupy.empty(nbytes // 4, dtype=cupy.uint32)
        self._value = 0
        self._hold = cupy.RawKernel(HOLD_SOURCE, "hold")
        self._hold_args = (numpy.uint64(hold_ns),)

    def write(self, stream):
        self._value = (self._value + 1) & 0xFFFF    # a changing value: never a no-op
        with stream:
            self.buf.fill(self._value)
            self._hold((1,), (1,), self._hold_args)


def make_timer(mode, runner, fn, calls, scratch):
    if mode == "graph":
        return GraphTimer(runner, fn, calls)
    if mode == "cold":
        return ColdTimer(runner, fn, scratch)
    if mode == "hot":
        return HotTimer(runner, fn, calls)
    raise ValueError(f"unknown mode {mode!r}")


def measure(timer, repeats, before_round=None):
    """Median microseconds per call over ``repeats`` rounds (after one unrecorded); ``before_round`` runs untimed."""
    for i in range(repeats + 1):
        if before_round is not None:
            with timer.runner.event_stream:     # CuPy's current stream: the one the round runs on
                before_round()
            timer.runner.synchronize()          # each round starts on an idle GPU, as without
        timer.round()
        if i == 0:
            timer.samples.clear()
    return median(timer.samples)


def timed_us(runner, fn, mode, calls, repeats, scratch=None):
    """Median microseconds per call of ``fn`` in ``mode`` (``make_timer``'s), after a warm-up."""
    warm_up(runner, fn)
    timer = make_timer(mode, runner, fn, calls, scratch)
    try:
        return measure(timer, repeats)
    finally:
        timer.close()


def _timed_block(fn, sync, calls, clock):
    """``calls`` back-to-back calls of ``fn``: (us per call to issue them, to the end of ``sync()``)."""
    t0 = clock()
    for _ in range(calls):
        fn()
    t1 = clock()
    sync()
    t2 = clock()
    return (t1 - t0) / calls * 1e6, (t2 - t0) / calls * 1e6


def host_times(fn, sync, calls, repeats, warmup):
    """Host cost per call in microseconds (host: issuing; total: to the final ``sync()``): medians, every repeat."""
    for _ in range(warmup):
        fn()
    sync()
    host, total = [], []
    for _ in range(repeats):
        h, t = _timed_block(fn, sync, calls, time.perf_counter)
        host.append(h)
        total.append(t)
    return {"host_us": statistics.median(host), "total_us": statistics.median(total),
            "host_us_repeats": host, "total_us_repeats": total}


def paired_host_ratio(fn, other, sync, calls, rounds, warmup, clock=time.perf_counter):
    """``fn``'s host cost over ``other``'s in alternating blocks, so that the machine's drift falls on both alike."""
    for _ in range(warmup):
        fn()
        other()
    sync()

    def block(f):
        return _timed_block(f, sync, calls, clock)[0]

    mine, theirs = [], []
    for r in range(rounds):
        if r % 2:
            theirs.append(block(other))
            mine.append(block(fn))
        else:
            mine.append(block(fn))
            theirs.append(block(other))
    ratios = [a / b for a, b in zip(mine, theirs)]
    return {"ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "host_us_median": statistics.median(mine), "other_host_us_median": statistics.median(theirs),
            "host_us_rounds": mine, "other_host_us_rounds": theirs}


# -- the ceiling ---------------------------------------------------------------------------
def copy_bandwidth_gbps(nbytes=COPY_BYTES, repeats=10):
    """Copy bandwidth (read + written): the faster of cudaMemcpyAsync and a 16-byte copy kernel; (GB/s, samples)."""
    import cupy
    rt = cupy.cuda.runtime
    src = cupy.empty(nbytes, dtype=cupy.uint8)
    dst = cupy.empty(nbytes, dtype=cupy.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        src.fill(1)
    src16, dst16 = src.view(cupy.complex128), dst.view(cupy.complex128)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    args = (dst.data.ptr, src.data.ptr, nbytes, rt.memcpyDeviceToDevice, stream.ptr)
    ways = {"memcpy": lambda: rt.memcpyAsync(*args), "kernel": lambda: cupy.copyto(dst16, src16)}
    best = None
    for copy in ways.values():
        with stream:
            for _ in range(2):
                copy()
            rates = []
            for _ in range(repeats):
                start.record(stream)
                copy()
                end.record(stream)
                end.synchronize()
                rates.append(2 * nbytes / (cupy.cuda.get_elapsed_time(start, end) * 1e-3) / 1e9)
        if best is None or median(rates) > median(best):
            best = rates
    del src, dst, src16, dst16
    cupy.get_default_memory_pool().free_all_blocks()   # 2 GiB back for the sweep
    return median(best), best


# -- first call in a fresh process ------------------------------------------------------------
def first_call_child(op, dtype, tokens, hidden):
    """In the fresh process: the first two calls of ``op``, each timed to a synchronize; prints them as JSON."""
    import cupy
    import numpy as np

    import cupy_rmsnorm as rn
    from cupy_rmsnorm.bench.arrays import BFLOAT16
    tokens, hidden = int(tokens), int(hidden)
    dt = BFLOAT16 if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(0)

    def upload(*shape):
        return cupy.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dt))
    x, r, w = upload(tokens, hidden), upload(tokens, hidden), upload(hidden)
    call = (lambda: rn.rms_norm(x, w)) if op == "rms" else (lambda: rn.fused_add_rms_norm(x, r, w))
    times = []
    for _ in range(2):
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        call()
        cupy.cuda.Device().synchronize()
        times.append(time.perf_counter() - t0)
    print(json.dumps(times))


FIRST_CALL_CODE = ("import sys; from cupy_rmsnorm.bench.timing import first_call_child; "
                   "first_call_child(*sys.argv[1:])")


def first_call_env(cache_dir, package_root, base_env=None):
    """The fresh process's environment: its own CuPy kernel cache, this source tree first on the path."""
    env = dict(os.environ if base_env is None else base_env)
    env["CUPY_CACHE_DIR"] = cache_dir
    env.pop("CUPY_CACHE_IN_MEMORY", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env


def _first_call_once(cache_dir, op, dtype, tokens, hidden, timeout):
    import cupy_rmsnorm
    root = os.path.dirname(os.path.dirname(os.path.abspath(cupy_rmsnorm.__file__)))
    proc = subprocess.run([sys.executable, "-c", FIRST_CALL_CODE, op, dtype, str(tokens), str(hidden)],
                          env=first_call_env(cache_dir, root), capture_output=True, text=True, timeout=timeout)
    try:
        first, second = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        first = None
    if proc.returncode != 0 or first is None:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"first-call subprocess failed (exit {proc.returncode}): {tail}")
    return first, second


def first_call_latency(op, dtype="bfloat16", tokens=4096, hidden=4096, timeout=600):
    """First-call milliseconds of ``op`` in a fresh process, with an empty kernel cache, then with the one it left."""
    with tempfile.TemporaryDirectory(prefix="cupy_rmsnorm_kcache_") as cache:
        cold = _first_call_once(cache, op, dtype, tokens, hidden, timeout)
        warm = _first_call_once(cache, op, dtype, tokens, hidden, timeout)
    return {"op": op, "dtype": dtype, "tokens": tokens, "hidden": hidden,
            "empty_cache_ms": cold[0] * 1e3, "warm_cache_ms": warm[0] * 1e3,
            "second_call_ms": warm[1] * 1e3}
