"""Launch heuristics: the one place that decides how a call is split over the GPU.

``launch_plan`` is a pure function of the problem (rows, hidden size, element size),
the vector width the arrays' alignment allows, and the device's multiprocessor
count. It returns a frozen ``LaunchPlan`` that the launcher uses as is and that the
tests and benchmarks print.
"""

from dataclasses import dataclass

VECTOR_BYTES = 16          # one 128-bit load or store per thread and step
WARP = 32
MAX_BLOCK = 1024
WARP_VARIANT_BLOCK = 256   # block size when groups of <= 32 threads share a block
BLOCKS_PER_SM_CAP = 32     # grid cap; the kernel loops over the remaining rows
# Past these, the row no longer fits in registers without spills (ptxas -v, sm_90).
MAX_VECS_PER_THREAD = 4
MAX_VECS_PER_THREAD_FUSED = 2
# Choices below were measured on an H200 (benchmarks/NOTES.md, benchmarks/results/sweep_plans.csv).
FEW_ROWS = 256             # up to here latency rules: spread a row over more threads
MANY_VECTORS = 1 << 20     # rows x vectors from here: rms_norm keeps 4 vectors per thread in flight


@dataclass(frozen=True)
class LaunchPlan:
    """How one call is launched.

    variant: ``"registers"`` (each element read once into registers, then written) or
      ``"stream"`` (rows too long for registers: the second pass re-reads the row,
      mostly from L2).
    vec: elements per vector access (16 bytes' worth when alignment allows, else less).
    threads_per_row: the group of threads that owns one row (a power of two, >= 8);
      groups of up to 32 threads share a block, several rows per block, and reduce with
      warp shuffles; larger groups get a block each.
    vecs_per_thread: vectors of a row each thread holds (0 for ``"stream"``).
    rows_per_block, block, grid: the launch geometry.
    """

    variant: str
    vec: int
    threads_per_row: int
    vecs_per_thread: int
    rows_per_block: int
    block: int
    grid: int

    def template_args(self):
        """The kernel template's VEC, G and NV (after <T, W, FUSED>)."""
        return self.vec, self.threads_per_row, self.vecs_per_thread


def _pow2_ceil(n):
    return 1 << max(0, (int(n) - 1).bit_length())


def _ceil_div(a, b):
    return -(-a // b)


def vector_width(itemsize, pointers, stride_diffs_bytes):
    """Widest vector (in elements, a power of two up to 16 bytes) that every array can use.

    The kernel aligns each row on x's first 16-byte boundary (a short scalar head, then
    vectors), so the other arrays qualify when their addresses differ from x's by a
    multiple of the vector size, row by row: ``pointers`` are the other arrays' base
    addresses minus x's, ``stride_diffs_bytes`` their row strides minus x's, in bytes.
    """
    bits = 0
    for d in list(pointers) + list(stride_diffs_bytes):
        bits |= d
    return vector_width_from_bits(itemsize, bits)


def vector_width_from_bits(itemsize, bits):
    """``vector_width`` given the bitwise OR of all those differences (the launcher's hot path)."""
    bits |= VECTOR_BYTES
    return max(1, (bits & -bits) // itemsize)   # largest power of two dividing every difference


def vecs_per_thread_target(rows, n_body, fused):
    """How many vectors of a row one thread should hold (before rounding to the group)."""
    if n_body <= 2 * WARP:
        return 1                                   # warp groups (launch_plan): one vector each, up to 32
    if rows <= FEW_ROWS:                           # latency: one vector each up to 512 threads
        return 1 if n_body <= 512 else 2 if n_body <= 2048 else 4
    if not fused and rows * n_body >= MANY_VECTORS and n_body >= 256:
        return 4                                   # bandwidth: more bytes in flight per thread
    return 2


def launch_plan(rows, hidden, itemsize, vec, sm_count, fused=False, *,
                threads_per_row=None, vecs_per_thread=None):
    """Choose the variant and geometry for ``rows`` rows of ``hidden`` elements.

    With n = hidden // vec vectors per row:
    - n <= 64: a group of 8, 16 or 32 threads per row (one vector each, two past 32),
      256-thread blocks holding several rows;
    - otherwise a block per row, threads_per_row = n / vecs_per_thread_target(), 64 to 1024;
    - rows longer than 1024 threads x 4 vectors (2 for the fused op, whose second array
      needs the registers) are streamed.
    The grid covers every row group, capped at BLOCKS_PER_SM_CAP blocks per SM (the kernel
    loops over the rest). threads_per_row / vecs_per_thread force a choice (for sweeps;
    vecs_per_thread=0 forces streaming).
    """
    if rows < 0 or hidden < 1 or vec < 1 or sm_count < 1:
        raise ValueError("launch_plan needs rows >= 0, hidden >= 1, vec >= 1, sm_count >= 1")
    n = max(hidden // vec, 1)           # vectors per row at most (head and tail aside)
    max_nv = MAX_VECS_PER_THREAD_FUSED if fused else MAX_VECS_PER_THREAD
    if threads_per_row:
        g = threads_per_row
    elif n <= 2 * WARP:
        g = min(max(_pow2_ceil(n), 8), WARP)
    else:
        g = min(max(_pow2_ceil(_ceil_div(n, vecs_per_thread_target(rows, n, fused))), 2 * WARP), MAX_BLOCK)
    if vecs_per_thread is not None:
        nv = vecs_per_thread
    else:
        nv = _pow2_ceil(_ceil_div(n, g))
        if nv > max_nv:                 # too long for registers: a full block streams it
            g, nv = MAX_BLOCK, (_pow2_ceil(_ceil_div(n, MAX_BLOCK)) if n <= MAX_BLOCK * max_nv else 0)
    rows_per_block = WARP_VARIANT_BLOCK // g if g <= WARP else 1
    grid = max(1, min(_ceil_div(rows, rows_per_block), sm_count * BLOCKS_PER_SM_CAP))
    return LaunchPlan("registers" if nv else "stream", vec, g, nv, rows_per_block, g * rows_per_block, grid)
