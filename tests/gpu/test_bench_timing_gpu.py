"""The harness's timers on a GPU: what cold mode times."""

import time

from helpers import requires_gpu


@requires_gpu
def test_cold_mode_times_the_gpu_not_the_host():
    """A call whose host side sleeps 1 ms before its one small kernel: cold mode times the
    kernel (the GPU idles after the flush until the call is issued), not the sleep."""
    import cupy

    from cupy_rmsnorm.bench import timing
    runner = timing.CupyRunner()
    x = cupy.zeros(1024, dtype=cupy.float32)

    def slow_host_call():
        time.sleep(0.001)
        x.fill(2.0)

    us = timing.timed_us(runner, slow_host_call, "cold", 1, 5, timing.Scratch())
    assert 0 < us < 300, us
    assert float(x[0]) == 2.0
