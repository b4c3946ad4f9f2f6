"""The signature cache: what a repeated call reuses, and the plan overrides for sweeps and tests.

A call's signature is everything about it but the arrays' addresses (the op's spec, the kinds,
shapes, strides, dtypes, devices and scalars; ``_interop.signature_of``). The first call of a
signature goes through the full path and leaves its launch entry here (``remember``); a later
call of the same signature finds it (``lookup``, or its inlined copy in ``_pipeline.call``) and
only reads the pointers. Keys of different ops never collide: each holds its op's spec.
"""

import contextlib

MAX_ENTRIES = 1024       # past this the cache starts over (a process with that many signatures is rare)
launches = {}            # signature -> the launcher's entry (never rebound: _pipeline holds launches.get)
last_hit = (None, None)  # (signature, entry) of the latest lookup that found one: compared first
                         # (decode's norms share a signature), which skips the hash; one tuple, so a
                         # thread never reads one call's signature with another's entry
plan_overrides = {}      # forced_plan(): launch_plan keyword arguments for new forward plans
backward_overrides = {}  # forced_backward_plan(): backward_plan keyword arguments
plan_record = None       # forced_plan(record=...): a list each new plan is appended to


def lookup(signature):
    """The entry remembered for ``signature``, or None (also for None and for an unhashable
    signature: an odd eps, say, gets no fast path)."""
    global last_hit
    last_signature, entry = last_hit
    try:
        if signature != last_signature:
            entry = launches.get(signature)
            if entry is not None:
                last_hit = signature, entry
    except Exception:        # an odd part that cannot be hashed or compared
        return None
    return entry


def remember(signature, entry):
    """Keep ``entry`` (a launcher's bound method: calling it skips the lookup that calling the
    object does) for calls of ``signature``; nothing for None or an unhashable signature."""
    if signature is None:
        return
    try:
        hash(signature)
    except TypeError:
        return
    if len(launches) >= MAX_ENTRIES:
        launches.clear()
    launches[signature] = entry


def clear():
    """Forget every launcher (each next call validates and plans anew)."""
    global last_hit
    last_hit = (None, None)
    launches.clear()


@contextlib.contextmanager
def _overriding(target, overrides, record):
    global plan_record
    saved = dict(target), plan_record
    target.clear()
    target.update(overrides)
    plan_record = record
    clear()
    try:
        yield
    finally:
        target.clear()
        target.update(saved[0])
        plan_record = saved[1]
        clear()


def forced_plan(record=None, **overrides):
    """Within the block, every new forward plan gets ``overrides`` as launch_plan keyword
    arguments (threads_per_row=, vecs_per_thread=, cluster=, flat=) and is appended to
    ``record`` if given. The cache is cleared on entry and exit, so calls plan anew."""
    return _overriding(plan_overrides, overrides, record)


def forced_backward_plan(record=None, **overrides):
    """forced_plan for the backward: new backward plans get ``overrides`` as backward_plan
    keyword arguments (threads_per_row=, vecs_per_thread=, staged=, stages=, rows_per_step=,
    max_blocks_per_sm=: a cap below the kernel's occupancy)."""
    return _overriding(backward_overrides, overrides, record)


def record_plan(plan):
    """Append a new plan to the record of the forced_plan block around it, if any."""
    if plan_record is not None:
        plan_record.append(plan)
