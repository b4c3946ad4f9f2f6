"""The gated op's plans, forward and backward; pure functions, tested on a CPU."""

from dataclasses import dataclass

from ..._plan import (
    WARP,
    WARP_VARIANT_BLOCK,
    _ceil_div,
    _chunks,
    _pow2_ceil,
    launch_plan,
)
from ..backward.plan import BACKWARD_THREADS_PER_SM


def gated_plan(rows, hidden, itemsize, vec, sm_count, **forced):
    """The gated forward's plan for ``rows`` groups of ``hidden`` elements: launch_plan's
    geometry with the fused op's register limits (a thread keeps x and the gate of its
    vectors), rows on the vector grid (the launcher picks a vec that divides every group: no
    head or tail) and a block or a group of threads a row (no cluster). ``forced``:
    threads_per_row= / vecs_per_thread= as in launch_plan."""
    return launch_plan(rows, hidden, itemsize, vec, sm_count, True, edges=False, max_cluster=1, **forced)


GATED_BACKWARD_GROUP_VECTORS = 64      # up to here: groups of 8..32 threads share a block of 256
GATED_BACKWARD_ONE_VECTOR = 512        # up to here: a block of one vector a thread (64 registers)
GATED_BACKWARD_THREADS = 512           # past that: 512 threads, two vectors each, then streamed


@dataclass(frozen=True)
class GatedBackwardPlan:
    """How one gated backward call is launched (kernels/rms_norm_gated.cu).

    variant: "registers" (the group's dy, x and gate kept for the second pass) or "stream".
    vec, threads_per_row, vecs_per_thread: as in ``LaunchPlan``. row_groups: groups of
    threads a block (256 / threads_per_row for groups of up to 32 threads, else 1), each on
    its own row at a time. Block b takes group position b % groups of ``rows_per_block``
    consecutive rows of the caller's arrays; ``chunks`` such runs cover the rows, so the
    grid is chunks x groups and each chunk writes one partial row of dweight, which the
    reduction adds in a fixed order (the bits depend only on the plan).
    """

    variant: str
    vec: int
    threads_per_row: int
    vecs_per_thread: int
    row_groups: int
    block: int
    rows_per_block: int
    chunks: int
    grid: int

    def template_args(self):
        return self.vec, self.threads_per_row, self.vecs_per_thread


def gated_backward_geometry(hidden, vec):
    """(threads per row, vectors per thread) of the gated backward for groups of ``hidden``
    elements in vectors of ``vec``: a thread keeps dy, x and the gate of its vectors and their
    weights, which a block of 1024 threads cannot fit in its 64 registers a thread."""
    n = max(hidden // vec, 1)
    if n <= GATED_BACKWARD_GROUP_VECTORS:
        threads = min(max(_pow2_ceil(_ceil_div(n, 2)), 8), WARP)
        return threads, _pow2_ceil(_ceil_div(n, threads))
    if n <= GATED_BACKWARD_ONE_VECTOR:
        return max(_pow2_ceil(n), 2 * WARP), 1
    if n <= 2 * GATED_BACKWARD_THREADS:
        return GATED_BACKWARD_THREADS, 2
    return GATED_BACKWARD_THREADS, 0


def gated_backward_plan(rows, groups, hidden, itemsize, vec, sm_count, *, max_blocks_per_sm=None,
                        threads_per_row=None, vecs_per_thread=None):
    """The gated backward's plan for ``rows`` groups of ``hidden`` elements, ``groups`` of them a
    row of the caller's arrays: gated_backward_geometry (or the forced threads_per_row /
    vecs_per_thread), and about BACKWARD_THREADS_PER_SM resident threads an SM (at most
    ``max_blocks_per_sm`` blocks, the kernel's occupancy) in blocks of equal runs of rows."""
    if rows < 0 or groups < 1 or rows % groups or hidden < 1 or vec < 1 or hidden % vec or sm_count < 1:
        raise ValueError("gated_backward_plan needs rows a multiple of groups >= 1, hidden a multiple of vec")
    threads, vecs = gated_backward_geometry(hidden, vec)
    threads, vecs = threads_per_row or threads, (vecs if vecs_per_thread is None else vecs_per_thread)
    if vecs and threads * vecs < hidden // vec:
        raise ValueError(f"{threads} threads x {vecs} vectors of {vec} elements do not cover a group of {hidden}")
    row_groups = WARP_VARIANT_BLOCK // threads if threads <= WARP else 1
    if vecs == 0 and row_groups > 1:
        raise ValueError("a streamed row needs more than 32 threads per row")
    block = threads * row_groups
    per_sm = max(1, BACKWARD_THREADS_PER_SM // block)
    if max_blocks_per_sm is not None:
        per_sm = max(1, min(per_sm, max_blocks_per_sm))
    chunk, chunks = _chunks(rows // groups, _ceil_div(sm_count * per_sm, groups), row_groups)
    return GatedBackwardPlan("registers" if vecs else "stream", vec, threads, vecs, row_groups, block, chunk, chunks,
                             chunks * groups)
