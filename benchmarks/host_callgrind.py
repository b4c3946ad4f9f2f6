"""Instructions per call of the torch fast path on the CPU (no GPU needed), for callgrind.

    valgrind --tool=callgrind --callgrind-out-file=OUT python3 benchmarks/host_callgrind.py CASE CALLS

Torch CPU tensors (1 x 4096 bf16); the cache holds a stand-in entry for the call's signature,
so each call runs everything the library does on a repeated torch call (the signature, the
last-hit compare or the dict lookup) except the Launcher's own run. Run it twice with
different CALLS and take the slope of the total instruction counts: that removes the import's
cost. CASE: "rms" (allocating), "out" (out=), "fused", or "autograd" (the full path's test of
whether autograd must record a call, with a weight that requires grad).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import cupy_rmsnorm as rn  # noqa: E402
from cupy_rmsnorm import _interop, _launcher  # noqa: E402


def main(case, calls):
    x = torch.zeros(1, 4096, dtype=torch.bfloat16)
    r = torch.zeros(1, 4096, dtype=torch.bfloat16)
    w = torch.ones(4096, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    if case == "autograd":
        arrays = (x, None, torch.nn.Parameter(w), None, None)
        # the full path's test: _api._needs_autograd before, _interop.autograd_records after
        test = getattr(_interop, "autograd_records", None) or sys.modules["cupy_rmsnorm._api"]._needs_autograd
        for _ in range(calls):
            test(arrays)
        return
    fused, arrays, call = {
        "rms": (False, (x, None, w, None, None), lambda: rn.rms_norm(x, w)),
        "out": (False, (x, None, w, y, None), lambda: rn.rms_norm(x, w, out=y)),
        "fused": (True, (x, r, w, None, None), lambda: rn.fused_add_rms_norm(x, r, w)),
    }[case]
    _launcher.launches[_interop.signature(fused, arrays, 1e-6, 0.0, "fp32")] = lambda a: a   # the stand-in
    with torch.inference_mode():
        for _ in range(calls):
            call()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
