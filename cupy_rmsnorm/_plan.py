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
MAX_GRID_X = 2 ** 31 - 1   # CUDA's grid limits
MAX_GRID_Y = 65535
GRID_ROW = 1 << 16         # blocks per grid row when one row is not enough
# Past these, the row no longer fits in registers without spills (ptxas -v, sm_90).
MAX_VECS_PER_THREAD = 4
MAX_VECS_PER_THREAD_FUSED = 2
# The per-token quantized form keeps its row through a second reduction (max |y|): in blocks of
# 512 threads and more (64 registers a thread) two vectors a thread at most.
MAX_VECS_PER_THREAD_PER_TOKEN_LARGE_BLOCK = 2
QUANT_FORMS = (None, "static", "per_token", "per_group")
QUANT_GROUP = 128          # elements per scale of the per-group form
# The choices below were measured on an H200 (docs/design.md gives the evidence).
FEW_ROWS = 256             # up to here latency rules: one vector per thread, clusters for long rows
FEW_ROWS_BLOCK = 512       # ... in blocks of up to 512 threads (then two vectors a thread: 1024-thread
                           # blocks reduce the canonical tree over 32 warps, measured slower)
ONE_BLOCK_VECTORS = 512    # few rows longer than this get a cluster of blocks each (sm_90)
CLUSTER_MIN_VECTORS = 128  # ... as large as fits one wave, each block keeping at least this many
MAX_CLUSTER = 8            # the portable cluster size limit
CLUSTER_MIN_MAJOR = 9      # thread-block clusters: sm_90 and later
# The quantized kernels' 32-bit row offsets (FLAT): fewer instructions a row, measured 0.90-0.96 of
# the time at 256 x 4096 and 0.93-1.00 past it, but 1.00-1.07 at one row a call (where the 64-bit
# index work before the wait for the previous kernel was hidden): only for grids of more blocks
# than SMs; and not for the fused per-token form, 0.97-1.05 (launch_plan).
FLAT_OFFSET_LIMIT = 2 ** 31

@dataclass(frozen=True)
class LaunchPlan:
    """How one call is launched.

    variant: ``"registers"`` (each element read once into registers, then written) or
      ``"stream"`` (rows too long for registers: the second pass re-reads the row,
      mostly from L2).
    vec: elements per vector access (16 bytes' worth when alignment allows, else less).
    threads_per_row: the group of threads that owns one row, or its share of a row with
      a cluster (a power of two, >= 8); groups of up to 32 threads share a block, several
      rows per block, and reduce with warp shuffles; larger groups get a block each.
    vecs_per_thread: vectors of a row each thread holds (0 for ``"stream"``).
    edges: rows may have a scalar head or tail (a row off x's vector grid, or a hidden
      size that is not a multiple of vec); False compiles the kernel without them.
    cluster: blocks per row (a thread-block cluster reducing through distributed shared
      memory, sm_90); 1 otherwise.
    flat: the quantized kernel addresses rows with 32-bit offsets (launch_plan says where).
    rows_per_block, block, grid: the launch geometry (grid counts blocks; grid_dims()
      lays them out).
    """

    variant: str
    vec: int
    threads_per_row: int
    vecs_per_thread: int
    rows_per_block: int
    block: int
    grid: int
    edges: bool = True
    cluster: int = 1
    flat: bool = False

    def template_args(self):
        """The kernel template's arguments after <T, W, FUSED>: VEC, THREADS_PER_ROW,
        VECS_PER_THREAD, EDGES (and CLUSTER)."""
        args = (self.vec, self.threads_per_row, self.vecs_per_thread, "true" if self.edges else "false")
        return args + (self.cluster,) if self.cluster > 1 else args

    def grid_dims(self):
        """(x, y) grid extents: one row of blocks while it fits, else rows of 2**16 blocks
        (a multiple of any cluster size; surplus blocks find no row and return)."""
        if self.grid <= MAX_GRID_X:
            return self.grid, 1
        return GRID_ROW, _ceil_div(self.grid, GRID_ROW)


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


def max_cluster_for(cc_major):
    """The largest cluster launch_plan may use on a device of this compute capability."""
    return MAX_CLUSTER if cc_major >= CLUSTER_MIN_MAJOR else 1


def cluster_size(rows, n, sm_count, max_cluster):
    """Blocks per row for few long rows: the largest power of two up to ``max_cluster``
    that keeps the whole call in one block per SM and CLUSTER_MIN_VECTORS per block."""
    if n <= ONE_BLOCK_VECTORS:
        return 1
    c = 1
    while c * 2 <= max_cluster and rows * c * 2 <= sm_count and n >= c * 2 * CLUSTER_MIN_VECTORS:
        c *= 2
    return c


def group_and_cluster(rows, n, fused, sm_count, max_cluster, cluster=None):
    """(threads per row group before the register limit, blocks per row) for n vectors a
    row; ``cluster`` forces the blocks per row."""
    if n <= (2 if fused else 4) * WARP:   # short rows: groups of 8..32 threads, rows share a block
        per_thread = 4 if n > 2 * WARP and not fused else 2
        return min(max(_pow2_ceil(_ceil_div(n, per_thread)), 8), WARP), 1
    if rows <= FEW_ROWS:           # latency: one vector per thread, a cluster per row when long
        c = cluster or cluster_size(rows, n, sm_count, max_cluster)
        return min(max(_pow2_ceil(_ceil_div(n, c)), 2 * WARP), FEW_ROWS_BLOCK), c
    # bandwidth: 4 vectors per thread in flight for rms_norm rows past 256 vectors, else 2
    per_thread = 4 if n > 256 and not fused else 2
    return min(max(_pow2_ceil(_ceil_div(n, per_thread)), 2 * WARP), MAX_BLOCK), 1


def _is_power_of_two(v):
    return v >= 1 and v & (v - 1) == 0


def _check_forced(threads_per_row, vecs_per_thread, cluster):
    """Forced choices split the row in powers of two, as the kernel's summation tree does."""
    if threads_per_row is not None and not (_is_power_of_two(threads_per_row) and threads_per_row <= MAX_BLOCK):
        raise ValueError(f"threads_per_row must be a power of two up to {MAX_BLOCK}, got {threads_per_row}")
    if vecs_per_thread is not None and vecs_per_thread != 0 and not _is_power_of_two(vecs_per_thread):
        raise ValueError(f"vecs_per_thread must be a power of two (or 0: streaming), got {vecs_per_thread}")
    if cluster is not None and not (_is_power_of_two(cluster) and cluster <= MAX_CLUSTER):
        raise ValueError(f"cluster must be a power of two up to {MAX_CLUSTER}, got {cluster}")


def early_trigger(grid, sm_count, blocks_per_sm):
    """Whether the kernel lets the next kernel launch as soon as it starts (programmatic
    dependent launch) rather than as each block finishes. Early overlaps the most, but when
    this grid fills less than a wave yet more than one block per SM, the next kernel's
    blocks would crowd onto the SMs that free up first (H200: up to 35% slower when the
    kernel fits more blocks per SM than it needs)."""
    return grid <= sm_count or grid >= blocks_per_sm * sm_count


def fits_32_bit_offsets(rows, hidden, n_inner, outer_strides, scales_strides=(0, 0), groups=1):
    """Whether every row of a call is reached with 32-bit offsets, the FLAT quantized kernels'
    arithmetic (kernels/rms_norm.cu, row_offset): one row stride per array (``n_inner == 1``;
    ``outer_strides`` in elements, one per array) and every offset a row reaches, ``(rows - 1)
    * |stride| + hidden`` (the scales: ``(rows - 1) * |row| + (groups - 1) * |group|``), below
    2**31."""
    if n_inner != 1:
        return False
    last = max(rows - 1, 0)
    scales_row, scales_group = scales_strides
    return (all(last * abs(s) + hidden < FLAT_OFFSET_LIMIT for s in outer_strides)
            and last * abs(scales_row) + (groups - 1) * abs(scales_group) < FLAT_OFFSET_LIMIT)


def launch_plan(rows, hidden, itemsize, vec, sm_count, fused=False, *, edges=True, max_cluster=1,
                threads_per_row=None, vecs_per_thread=None, cluster=None, quant=None, flat=False):
    """Choose the variant and geometry for ``rows`` rows of ``hidden`` elements.

    With n = ceil(hidden / vec) vectors per row, a partial last one included (group_and_cluster):
    - n <= 64 (128 for rms_norm): a group of 8, 16 or 32 threads per row holding 2
      vectors each (4 for rms_norm past 64 vectors), 256-thread blocks holding several rows;
    - few rows (<= 256): a block per row, one vector per thread up to 512 threads (then
      more vectors per thread); rows past 512 vectors are split over a cluster of blocks
      (cluster_size(); where the device has clusters, ``max_cluster`` > 1) of up to 512
      threads each;
    - many rows: a block per row of n / 4 threads (rms_norm, rows past 256 vectors) or
      n / 2 (otherwise), 64 to 1024;
    - then vectors per thread = what covers the row (or the block's share of it); rows
      longer than 1024 threads x 4 vectors (2 for the fused op, whose second array needs
      the registers) per block are streamed.
    The grid has a block per row group (times the cluster). ``edges``: whether rows may
    have a head or tail (see LaunchPlan). threads_per_row / vecs_per_thread / cluster force
    a choice (for sweeps; vecs_per_thread=0 forces streaming): powers of two (the kernel's
    canonical summation tree splits the row in powers of two), covering the row. ``quant``:
    the quantized output form (QUANT_FORMS), the same geometry but for "per_token" in blocks
    of 512+ threads (MAX_VECS_PER_THREAD_PER_TOKEN_LARGE_BLOCK); "per_group" needs rows of
    whole vectors (edges=False) and whole groups. ``flat``: the call fits 32-bit offsets
    (fits_32_bit_offsets); the quantized kernel then takes them where its blocks outnumber the
    SMs and a row has a block (or a group) of its own, not a cluster, but for the fused
    per-token form (FLAT_OFFSET_LIMIT's note).
    """
    if rows < 0 or hidden < 1 or vec < 1 or sm_count < 1:
        raise ValueError("launch_plan needs rows >= 0, hidden >= 1, vec >= 1, sm_count >= 1")
    if not edges and hidden % vec:
        raise ValueError("edges=False needs hidden to be a multiple of vec (rows of whole vectors)")
    if quant not in QUANT_FORMS:
        raise ValueError(f"quant must be one of {QUANT_FORMS}, got {quant!r}")
    if quant == "per_group" and (edges or hidden % QUANT_GROUP):
        raise ValueError(f"quant='per_group' needs edges=False and hidden a multiple of {QUANT_GROUP}")
    _check_forced(threads_per_row, vecs_per_thread, cluster)
    n = _ceil_div(hidden, vec)          # vectors per row: the tail's partial vector has an owner
    max_vecs = MAX_VECS_PER_THREAD_FUSED if fused else MAX_VECS_PER_THREAD
    threads, c = group_and_cluster(rows, n, fused, sm_count, max_cluster, cluster)
    threads, c = threads_per_row or threads, cluster or c
    m = _ceil_div(n, c)                 # vectors per block
    if vecs_per_thread is not None:
        vecs = vecs_per_thread
    else:
        vecs = _pow2_ceil(_ceil_div(m, threads))
        if quant == "per_token" and (threads >= 512 or vecs > max_vecs):
            max_vecs = min(max_vecs, MAX_VECS_PER_THREAD_PER_TOKEN_LARGE_BLOCK)
        if vecs > max_vecs:                 # too long for registers: a full block streams it
            threads, vecs = MAX_BLOCK, (_pow2_ceil(_ceil_div(m, MAX_BLOCK)) if m <= MAX_BLOCK * max_vecs else 0)
    if c > 1 and threads <= WARP:
        raise ValueError("a cluster per row needs more than 32 threads per row")
    if vecs == 0 and threads <= WARP:
        raise ValueError("a streamed row needs more than 32 threads per row")
    if vecs and threads * vecs * c < n:
        raise ValueError(f"{threads} threads x {vecs} vectors x {c} blocks do not cover a row of {n} vectors")
    rows_per_block = WARP_VARIANT_BLOCK // threads if threads <= WARP else 1
    grid = max(1, _ceil_div(rows, rows_per_block)) * c
    if grid > GRID_ROW * MAX_GRID_Y:
        raise ValueError(f"x has too many rows for one launch ({rows})")
    flat = bool(flat) and quant is not None and not (fused and quant == "per_token") and c == 1 and grid > sm_count
    return LaunchPlan("registers" if vecs else "stream", vec, threads, vecs, rows_per_block, threads * rows_per_block, grid,
                      bool(edges), c, flat)


def _chunks(rows, target_grid, groups=1):
    """(rows per block, blocks): equal contiguous chunks, a multiple of ``groups``, for about
    ``target_grid`` blocks."""
    chunk = _ceil_div(max(_ceil_div(rows, target_grid), 1), groups) * groups
    return chunk, max(1, _ceil_div(rows, chunk))


# -- gated -------------------------------------------------------------------------------------


