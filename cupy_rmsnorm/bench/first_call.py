"""The first two calls of an op in this process, timed (run by timing.first_call_latency
in a fresh process with a kernel cache of its own):

    python -m cupy_rmsnorm.bench.first_call {rms,fused} DTYPE TOKENS HIDDEN

Inputs are uploaded from the host (no CuPy kernel compiles before the clock starts); the
clock covers the first call (kernel source, NVRTC compile or disk-cache load, module
load, launch) up to a device synchronize, then the same for a second call. Prints
``FIRST_CALL_SECONDS first second``.
"""

import sys
import time

MARK = "FIRST_CALL_SECONDS"


def main(argv=None):
    import cupy
    import numpy as np

    import cupy_rmsnorm as rn
    from cupy_rmsnorm.bench.arrays import BFLOAT16

    op, dtype, tokens, hidden = argv if argv is not None else sys.argv[1:]
    tokens, hidden = int(tokens), int(hidden)
    dt = BFLOAT16 if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(0)

    def host(*shape):
        return rng.standard_normal(shape, dtype=np.float32).astype(dt)

    x, r, w = cupy.asarray(host(tokens, hidden)), cupy.asarray(host(tokens, hidden)), cupy.asarray(host(hidden))
    call = (lambda: rn.rms_norm(x, w)) if op == "rms" else (lambda: rn.fused_add_rms_norm(x, r, w))
    times = []
    for _ in range(2):
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        call()
        cupy.cuda.Device().synchronize()
        times.append(time.perf_counter() - t0)
    print(MARK, times[0], times[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
