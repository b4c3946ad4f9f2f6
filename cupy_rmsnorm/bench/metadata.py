"""What a run's JSON says about where and how it ran: device, versions, git checkout,
arguments, timings."""

import os
import subprocess
import sys
import time

from . import peers, timing


def git_info(path):
    """(commit, dirty) of the git checkout holding ``path``, or (None, None)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, capture_output=True,
                                text=True, timeout=10)
        if commit.returncode != 0:
            return None, None
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=path,
                                capture_output=True, text=True, timeout=10)
        return commit.stdout.strip(), bool(status.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return None, None


def nvidia_driver_version():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def run_metadata(args, info, copy_gbps, copy_samples, impls, missing, warmup_s, started, interrupted):
    """The ``meta`` of a run's payload: ``info`` (timing.device_info()) and the rest;
    ``started``: the run's time.perf_counter() at its start."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    commit, dirty = git_info(root)
    return dict(info, driver_version=nvidia_driver_version(), copy_GBps=copy_gbps,
                copy_GBps_samples=copy_samples, copy_bytes=timing.COPY_BYTES,
                scratch_bytes=timing.SCRATCH_BYTES, versions=peers.versions(), git_commit=commit,
                git_dirty=dirty, date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                argv=sys.argv[1:], ops=args.ops, dtypes=args.dtypes, modes=args.modes,
                shapes=[list(s) for s in args.shapes], repeats=args.repeats, compile_mode=args.compile,
                implementations={n: peers.DESCRIPTIONS[n] for n in impls}, left_out=missing,
                warmup_seconds=warmup_s, seconds=time.perf_counter() - started, interrupted=interrupted)
