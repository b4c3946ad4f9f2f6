"""Launch heuristics: the one place that decides how a call is split over the GPU.

``launch_plan`` is a pure function of the problem (rows, hidden size, element size),
the vector width the arrays' alignment allows, and the device's multiprocessor
count. It returns a frozen ``LaunchPlan`` that the launcher uses as is and that the
tests and benchmarks print.
"""

from dataclasses import dataclass

VECTOR_BYTES = 16          # one 128-bit load or store per thread and step
MAX_VECS_PER_THREAD = 4    # past this the row does not fit in registers without spills
TARGET_VECS_PER_THREAD = 2 # enough loads in flight per thread, rows still split wide
WARP = 32
MAX_BLOCK = 1024
WARP_VARIANT_BLOCK = 256   # block size when several rows share a block
BLOCKS_PER_SM_CAP = 32     # grid cap; the kernel loops over the remaining rows


@dataclass(frozen=True)
class LaunchPlan:
    """How one call is launched.

    variant: ``"warp"`` (a group of at most 32 threads per row, several rows per
      block, shuffle reduction), ``"block"`` (a block per row, the row kept in
      registers) or ``"stream"`` (a block per row, too long for registers: the
      second pass re-reads it, mostly from L2).
    vec: elements per vector access (16 bytes' worth when alignment allows, else less).
    threads_per_row: the group of threads that owns one row (a power of two).
    vecs_per_thread: vectors each thread keeps in registers (0 for ``"stream"``).
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
        """The kernel template's VEC, G and NV."""
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


def launch_plan(rows, hidden, itemsize, vec, sm_count):
    """Choose the variant and geometry for ``rows`` rows of ``hidden`` elements.

    - Short rows (at most 32 threads x 4 vectors): a group of 8, 16 or 32 threads per
      row, about two vectors each, 256-thread blocks holding several rows.
    - Longer rows: a block per row, as many threads as give about two vectors each
      (64 to 1024), the row kept in registers.
    - Rows past 1024 threads x 4 vectors: a 1024-thread block streams the row twice.
    The grid covers every row group, capped at BLOCKS_PER_SM_CAP blocks per SM
    (the kernel loops over rows beyond that).
    """
    if rows < 0 or hidden < 1 or vec < 1 or sm_count < 1:
        raise ValueError("launch_plan needs rows >= 0, hidden >= 1, vec >= 1, sm_count >= 1")
    n_body = hidden // vec            # vectors per row at most (head and tail aside)
    threads = _pow2_ceil(_ceil_div(max(n_body, 1), TARGET_VECS_PER_THREAD))
    if n_body <= WARP * MAX_VECS_PER_THREAD:
        g = min(max(threads, 8), WARP)
        variant, block = "warp", WARP_VARIANT_BLOCK
        rows_per_block = block // g
    elif n_body <= MAX_BLOCK * MAX_VECS_PER_THREAD:
        g = min(max(threads, 2 * WARP), MAX_BLOCK)
        variant, block, rows_per_block = "block", g, 1
    else:
        g = MAX_BLOCK
        variant, block, rows_per_block = "stream", g, 1
    nv = 0 if variant == "stream" else min(_pow2_ceil(_ceil_div(max(n_body, 1), g)), MAX_VECS_PER_THREAD)
    grid = max(1, min(_ceil_div(rows, rows_per_block), sm_count * BLOCKS_PER_SM_CAP))
    return LaunchPlan(variant, vec, g, nv, rows_per_block, block, grid)
