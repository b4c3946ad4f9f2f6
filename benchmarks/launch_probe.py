"""Host cost of a launch and of its neighbours in a call (1 x 4096 bf16, torch tensors under
inference mode): which way of launching is cheapest from Python, and what the allocation and
a capture query would cost. Each case alone (median of 5 x 2000 back-to-back calls), then the
launch alternatives in alternating pairs against the library's launch (timing.paired_host_ratio).

    python benchmarks/launch_probe.py [--out launch_probe.json]   (the cupy_rmsnorm on PYTHONPATH)
"""
import argparse
import ctypes
import functools
import json
import os
import sys

import cupy
import torch
import torch.nn.functional as F
from cupy_backends.cuda.api import driver

import cupy_rmsnorm as rn
from cupy_rmsnorm import _driver
from cupy_rmsnorm.bench.timing import host_times, paired_host_ratio

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_overhead import _capture_launch  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="write the results as JSON to this path")
    args = p.parse_args(argv)

    def sync():
        torch.cuda.synchronize()

    with torch.inference_mode():
        x = torch.randn(1, 4096, device="cuda").to(torch.bfloat16)
        w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(x)
        dev, kernel, stream, argv = _capture_launch(lambda: rn.rms_norm(x, w, out=out))
        library = functools.partial(_driver.launch, dev, kernel, stream, argv)
        no_attribute = _driver.KernelLaunch(kernel.fn_ptr, kernel.grid, kernel.block, kernel.shared)
        _driver._CONFIG.pack_into(no_attribute._buffer, 0, kernel.grid[0], kernel.grid[1], 1, kernel.block, 1, 1,
                                  kernel.shared, stream, ctypes.addressof(no_attribute._attribute), 0)
        no_attribute.stream = stream
        cases = {
            "ctypes cuLaunchKernelEx, PDL (library)": library,
            "ctypes cuLaunchKernelEx, PDL, no Python frame": functools.partial(
                _driver._launch_ex, kernel.ptr, kernel._fn_arg, argv, None),
            "ctypes cuLaunchKernelEx, no attribute": functools.partial(_driver.launch, dev, no_attribute, stream, argv),
            "cupy Cython cuLaunchKernel (plain)": functools.partial(
                driver.launchKernel, kernel.fn_ptr, kernel.grid[0], kernel.grid[1], 1, kernel.block, 1, 1,
                kernel.shared, stream, argv.value, 0),
            "cudaStreamIsCapturing (cupy)": functools.partial(cupy.cuda.runtime.streamIsCapturing, stream),
            "torch.cuda.is_current_stream_capturing": torch.cuda.is_current_stream_capturing,
            "torch raw stream": functools.partial(torch._C._cuda_getCurrentRawStream, 0),
            "torch.empty_like": functools.partial(torch.empty_like, x),
            "F.rms_norm": functools.partial(F.rms_norm, x, (4096,), w, 1e-6),
            "rn.rms_norm": functools.partial(rn.rms_norm, x, w),
            "rn.rms_norm out=": functools.partial(rn.rms_norm, x, w, out=out),
        }
        single = {}
        for name, fn in cases.items():
            single[name] = host_times(fn, sync, 2000, 5, 200)["host_us"]
            print(f"{name:<48} {single[name]:7.2f} us")
        pairs = {}
        for name in ("ctypes cuLaunchKernelEx, no attribute", "cupy Cython cuLaunchKernel (plain)",
                     "ctypes cuLaunchKernelEx, PDL, no Python frame"):
            m = pairs[name] = paired_host_ratio(cases[name], library, sync, 2000, 12, 200)
            print(f"pair {name:<44} / library launch: {m['ratio_median']:.3f} ({m['ratio_min']:.3f}-"
                  f"{m['ratio_max']:.3f}) {m['host_us_median']:.2f} vs {m['other_host_us_median']:.2f} us")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"benchmark": "launch_probe", "shape": [1, 4096], "dtype": "bfloat16",
                       "single_host_us": single, "pairs": pairs}, f, indent=1)


if __name__ == "__main__":
    main()
