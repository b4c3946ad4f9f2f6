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


# -- backward --------------------------------------------------------------------------------
# The backward keeps two arrays of the row (dy and x) and this thread's dweight sums in
# registers: one vector per thread in block-per-row groups (two measured 80-126 registers
# with ptxas -v, sm_90, bf16), two in the warp groups of short rows.
BACKWARD_MAX_VECS_PER_THREAD = 2     # warp groups (rows of up to 64 vectors)
BACKWARD_GROUP_VECTORS = 64          # rows up to here: groups of 8..32 threads share a block
BACKWARD_STREAM_THREADS = 512        # rows past MAX_BLOCK vectors stream through blocks this size
# Resident threads per SM the grid aims for: 2 x 16 bytes in flight per thread is enough
# bytes in flight to stream (H200), and each block adds a row of partial sums to reduce.
BACKWARD_THREADS_PER_SM = 1024
BACKWARD_GROUPS_BLOCK = WARP_VARIANT_BLOCK   # the kernel's block when groups share it (GROUPS)
# Staged rows (sm_90 bulk copies into a ring of shared-memory stages; 16-byte vectors on the
# 16-byte grid): blocks of up to STAGED_THREADS threads, one vector each per step, and
# 2..BACKWARD_MAX_STAGES rows a block in flight, as many as its share of the SM's shared
# memory holds.
BACKWARD_STAGED_THREADS = 512
# Stages a block keeps: as many as fit, up to BACKWARD_MAX_STAGES; fewer blocks an SM rather
# than fewer stages (bf16, 8192-wide rows: one block of four stages 66.1 us at 4096 rows,
# 212.3 at 16384, against two blocks of three, 69.8 and 228.4).
BACKWARD_MAX_STAGES = 4
# Staged only from this many rows per SM: with fewer, the ring has little to hide and the
# register kernel was faster (bf16, rms: 1024 x 4096, 7.8 rows an SM, 14.4
# vs 18.3 us; 2048 x 4096, 15.5 an SM, 26.4 staged vs 30.1; 4096 rows, 31 an SM: 40.8 vs
# 53.3 at hidden 4096, 14.7 vs 17.5 at 1024). Between the two measured points: 12.
BACKWARD_STAGED_MIN_ROWS_PER_SM = 12
BACKWARD_STAGED_MAX_VECS = 4         # steps per row (registers: weights and sums, 16 a step; 8 spill)
# Rows staged two at a time (their sums share the block's barriers): the staged geometry
# (threads, steps) -> the geometry that takes them in pairs, from so many rows an SM.
# - 512 x 1 (257-512 vectors) -> half the threads with two steps each: two blocks of 256 an
#   SM, four stages. Against two blocks of 512 with a row a step (A/B): 0.95-0.99 of the time
#   at 4096-16384 x 4096 bf16 and fp16, 0.91-0.98 for fp32 at 2048; 0.89-0.98 at
#   hidden 2560-3584 bf16 but fused at 3072, 1.01-1.02; at 2048 x 4096 (15.5 rows an SM)
#   0.99-1.04, hence from 24 rows an SM. Blocks of 512 a pair at a time, one an SM, were
#   1.03-1.11x slower for rms_norm at 2048-16384 x 4096.
# - 128 x 1 (65-128 vectors) -> the same geometry, four blocks an SM, six stages
#   (BACKWARD_PAIRED_STAGES), wherever rows are staged.
BACKWARD_PAIRED_GEOMETRY = {(BACKWARD_STAGED_THREADS, 1): (256, 2), (128, 1): (128, 1)}
BACKWARD_PAIRED_MIN_ROWS_PER_SM = {(BACKWARD_STAGED_THREADS, 1): 24, (128, 1): BACKWARD_STAGED_MIN_ROWS_PER_SM}
# The stages of a block taking rows in pairs, by its geometry (others: BACKWARD_MAX_STAGES),
# and (BACKWARD_PAIRED_FEW_ROWS_STAGES) the fewer stages of blocks with at most so many rows:
# 128 x 1 pairs with four stages took 0.95-0.98 of six's time at 5-10 rows a block (A/B, bf16,
# fp16 and fp32), 0.97-1.05 at 12, 1.02-1.09x from 16.
BACKWARD_PAIRED_STAGES = {(128, 1): 6}
BACKWARD_PAIRED_FEW_ROWS_STAGES = {(128, 1): (10, 4)}
SHARED_RESERVED_PER_BLOCK = 1024     # what CUDA keeps of each block's shared memory
BACKWARD_STATIC_SHARED = 256         # the staged kernel's static shared memory (row_sums) a row a step, rounded up
STAGE_BARRIER_BYTES = 8


@dataclass(frozen=True)
class BackwardPlan:
    """How one backward call is launched (kernels/rms_norm_backward.cu).

    variant: "registers" / "stream" (rms_norm_backward_kernel), "row" (registers with a
      block-wide group and no more rows than SMs, so one row a block:
      rms_norm_backward_row_kernel, whose blocks write their dy * xhat as their partials
      without summing them in shared memory) or "staged" (rms_norm_backward_staged_kernel:
      rows brought into shared memory by bulk copies).
    vec, threads_per_row, vecs_per_thread, edges: as in ``LaunchPlan`` (staged: vectors
      per thread are the steps of a row, read from shared memory).
    groups_per_block: row groups per block (``256 / threads_per_row`` for groups of <= 32
      threads, else 1), each on its own row at a time.
    rows_per_block: the contiguous rows each block handles, looping; a multiple of
      groups_per_block. grid: blocks, ``ceil(rows / rows_per_block)``; each writes one row
      of dweight partial sums, so ``grid`` is also the number of partial rows the
      reduction kernel adds (in a fixed order: the bits depend only on the plan).
    stages, shared_bytes: staged only: rows in flight per block, and the dynamic shared
      memory they take (the stages, then an mbarrier each).
    rows_per_step: staged only: rows a block takes at once (1 or 2: a pair's sums share
      the block's barriers).
    """

    variant: str
    vec: int
    threads_per_row: int
    vecs_per_thread: int
    groups_per_block: int
    block: int
    rows_per_block: int
    grid: int
    edges: bool = True
    stages: int = 0
    shared_bytes: int = 0
    rows_per_step: int = 1

    def template_args(self):
        """The kernel's template arguments after <T, W>: VEC, THREADS_PER_ROW, VECS_PER_THREAD,
        EDGES (staged: THREADS_PER_ROW, VECS_PER_THREAD, ROWS)."""
        if self.variant == "staged":
            return self.threads_per_row, self.vecs_per_thread, self.rows_per_step
        return self.vec, self.threads_per_row, self.vecs_per_thread, "true" if self.edges else "false"

    @property
    def partials(self):
        return self.grid


def backward_geometry(hidden, vec):
    """(threads per row, vectors per thread) for rows of ``hidden`` elements in vectors of
    ``vec``: groups of 8..32 threads with up to two vectors each for rows of up to 64
    vectors; one vector per thread in a block of 128..1024 for up to 1024 vectors; past
    that a streamed row (no vectors kept) per block of BACKWARD_STREAM_THREADS."""
    n = max(hidden // vec, 1)
    if n <= BACKWARD_GROUP_VECTORS:
        threads = min(max(_pow2_ceil(_ceil_div(n, BACKWARD_MAX_VECS_PER_THREAD)), 8), WARP)
        return threads, _pow2_ceil(_ceil_div(n, threads))
    if n <= MAX_BLOCK:
        return max(_pow2_ceil(n), 2 * WARP), 1
    return BACKWARD_STREAM_THREADS, 0


def staged_geometry(hidden, vec):
    """(threads per row, steps) of a staged row: one vector per thread and step, blocks of
    64..BACKWARD_STAGED_THREADS threads."""
    n = hidden // vec
    threads = min(max(_pow2_ceil(n), 2 * WARP), BACKWARD_STAGED_THREADS)
    return threads, _ceil_div(n, threads)


def stage_bytes(hidden, itemsize, arrays):
    """Shared memory of one stage: ``arrays`` rows (dy, x and for the fused op d_residual_out)."""
    return arrays * hidden * itemsize


def backward_plan(rows, hidden, itemsize, vec, sm_count, *, edges=True, max_blocks_per_sm=None,
                  threads_per_row=None, vecs_per_thread=None, arrays=2, shared_per_sm=0,
                  shared_per_block=0, staged=None, stages=None, rows_per_step=None):
    """Choose the backward's geometry for ``rows`` rows of ``hidden`` elements.

    Staged (rows in shared memory, ``staged_geometry``) where the device has the bulk
    copies (the launcher passes its ``shared_per_sm`` / ``shared_per_block``; 0: not
    sm_90+), rows take 16-byte vectors on the 16-byte grid (``not edges`` and
    ``vec * itemsize == 16``), rows are longer than BACKWARD_GROUP_VECTORS vectors, two
    stages of ``arrays`` rows fit a block and there are BACKWARD_STAGED_MIN_ROWS_PER_SM rows
    per SM or more. Otherwise threads per row and vectors per thread: ``backward_geometry``
    (a block-wide group with no more rows than SMs: the "row" variant, one row a block at
    any occupancy). The grid aims at BACKWARD_THREADS_PER_SM resident threads per SM (at
    most ``max_blocks_per_sm`` blocks per SM, what the kernel's registers and shared memory
    allow: the launcher asks the driver), every block looping over an equal contiguous
    chunk of rows: a function of (rows, the geometry, sm_count,
    max_blocks_per_sm) only, so the same call reduces in the same order every time.
    ``itemsize`` is x's. ``staged`` True / False requires or refuses the staged kernel
    (the launcher keeps the first plan's kernel when it replans for that kernel's
    occupancy); threads_per_row / vecs_per_thread force the register kernel's geometry, or
    with ``staged`` / ``stages`` the staged one; ``stages`` forces the ring's depth
    (``stages=0``: not staged), ``rows_per_step`` the staged rows a block takes at once
    (``max_blocks_per_sm`` then counts those blocks). For sweeps and tests.
    """
    if rows < 0 or hidden < 1 or vec < 1 or itemsize < 1 or sm_count < 1:
        raise ValueError("backward_plan needs rows >= 0, hidden >= 1, vec >= 1, itemsize >= 1, sm_count >= 1")
    if not edges and hidden % vec:
        raise ValueError("edges=False needs hidden to be a multiple of vec (rows of whole vectors)")
    plan = _staged_plan(rows, hidden, itemsize, vec, sm_count, edges, max_blocks_per_sm, threads_per_row,
                        vecs_per_thread, arrays, shared_per_sm, shared_per_block, staged, stages, rows_per_step)
    if plan is not None:
        return plan
    threads, vecs = backward_geometry(hidden, vec)
    threads, vecs = threads_per_row or threads, (vecs if vecs_per_thread is None else vecs_per_thread)
    if vecs and threads * vecs < hidden // vec:
        raise ValueError(f"{threads} threads x {vecs} vectors of {vec} elements do not cover a row of {hidden}")
    groups = BACKWARD_GROUPS_BLOCK // threads if threads <= WARP else 1
    if vecs == 0 and groups > 1:
        raise ValueError("a streamed row needs more than 32 threads per row")
    block = threads * groups
    per_sm = max(1, BACKWARD_THREADS_PER_SM // block)
    if max_blocks_per_sm is not None:
        per_sm = max(1, min(per_sm, max_blocks_per_sm))
    chunk, grid = _chunks(rows, sm_count * per_sm, groups)
    # no more rows than SMs: one row a block at any occupancy, so the plan fitted to the
    # kernel's occupancy keeps this kernel
    one_row = vecs and groups == 1 and 1 <= rows <= sm_count
    variant = "row" if one_row else "registers" if vecs else "stream"
    return BackwardPlan(variant, vec, threads, vecs, groups, block, chunk, grid, bool(edges))


def backward_refit_keywords(plan):
    """backward_plan keywords that keep ``plan``'s kernel when the launcher plans again for
    that kernel's occupancy: its kind, and for the staged kernel its template arguments."""
    if plan.variant != "staged":
        return {"staged": False}
    return {"staged": True, "threads_per_row": plan.threads_per_row, "vecs_per_thread": plan.vecs_per_thread,
            "rows_per_step": plan.rows_per_step}


def _chunks(rows, target_grid, groups=1):
    """(rows per block, blocks): equal contiguous chunks, a multiple of ``groups``, for about
    ``target_grid`` blocks."""
    chunk = _ceil_div(max(_ceil_div(rows, target_grid), 1), groups) * groups
    return chunk, max(1, _ceil_div(rows, chunk))


def _staged_plan(rows, hidden, itemsize, vec, sm_count, edges, max_blocks_per_sm, threads_per_row,
                 vecs_per_thread, arrays, shared_per_sm, shared_per_block, staged, stages, rows_per_step):
    """backward_plan's staged plan, or None where rows are not staged."""
    n = hidden // vec
    forced_registers = threads_per_row is not None or vecs_per_thread is not None
    if staged is False or stages == 0 or (staged is None and stages is None and rows_per_step is None
                                          and forced_registers):
        return None
    if rows_per_step not in (None, 1, 2):
        raise ValueError(f"rows_per_step must be 1 or 2, not {rows_per_step!r}")
    want = bool(staged or stages or rows_per_step)   # staged required (else: where the heuristic finds it pays)

    def refuse(why):
        if want:
            raise ValueError(f"staged rows need {why}")
        return None

    if edges or vec * itemsize != 16 or not shared_per_sm or n <= BACKWARD_GROUP_VECTORS:
        return refuse("sm_90 shared memory, rows of 16-byte vectors on the 16-byte grid and more than "
                      f"{BACKWARD_GROUP_VECTORS} vectors a row")
    threads, vecs = staged_geometry(hidden, vec)
    if threads_per_row is not None:
        threads = threads_per_row
        vecs = _ceil_div(n, threads) if vecs_per_thread is None else vecs_per_thread
    if threads <= WARP or threads * vecs < n:
        raise ValueError(f"a staged row needs blocks of more than {WARP} threads covering it ({threads} x {vecs} "
                         f"vectors for {n})")
    if vecs > BACKWARD_STAGED_MAX_VECS:
        return refuse(f"at most {BACKWARD_STAGED_MAX_VECS} vectors a thread")
    if (rows_per_step is None and threads_per_row is None and (threads, vecs) in BACKWARD_PAIRED_GEOMETRY
            and rows >= BACKWARD_PAIRED_MIN_ROWS_PER_SM[(threads, vecs)] * sm_count):
        (threads, vecs), rows_per_step = BACKWARD_PAIRED_GEOMETRY[(threads, vecs)], 2
    step = rows_per_step or 1
    stage = stage_bytes(hidden, itemsize, arrays) + STAGE_BARRIER_BYTES
    static = BACKWARD_STATIC_SHARED * step
    # blocks of `step` rows at once: as many as make BACKWARD_THREADS_PER_SM threads an SM
    # with one row a step
    per_sm = max(1, BACKWARD_THREADS_PER_SM // threads // step)
    if max_blocks_per_sm is not None:
        per_sm = max(1, min(per_sm, max_blocks_per_sm))

    def fitting(blocks):      # stages that fit one of `blocks` blocks on an SM
        share = shared_per_sm // blocks - SHARED_RESERVED_PER_BLOCK - static
        return min(share, shared_per_block - static) // stage

    if not want and rows < BACKWARD_STAGED_MIN_ROWS_PER_SM * sm_count:
        return None
    least = 2 * step          # a step's rows and the next step's in flight
    wanted = stages or (step == 2 and BACKWARD_PAIRED_STAGES.get((threads, vecs))) or BACKWARD_MAX_STAGES
    while per_sm > 1 and fitting(per_sm) < wanted:
        per_sm -= 1
    if fitting(per_sm) < max(stages or 0, least):
        return refuse(f"{max(stages or 0, least)} stages of {stage} bytes in a block's shared memory")
    chunk, grid = _chunks(rows, sm_count * per_sm)
    if chunk >= 2 ** 31:                  # the kernel counts a block's rows in an int
        return refuse("fewer than 2^31 rows a block")
    few_rows, few_stages = BACKWARD_PAIRED_FEW_ROWS_STAGES.get((threads, vecs), (0, 0)) if step == 2 else (0, 0)
    if chunk <= few_rows:
        wanted = min(wanted, few_stages)
    k = stages or min(fitting(per_sm), wanted)
    if k < min(least, chunk):
        raise ValueError(f"a block that loops over rows {step} at a time needs {least} stages or more"
                         if step > 1 else "a block that loops over rows needs two stages or more")
    k = min(k, chunk)        # no more stages than rows (one stage for one row: nothing to refill)
    return BackwardPlan("staged", vec, threads, vecs, 1, threads, chunk, grid, False, k, k * stage, step)


# -- gated -------------------------------------------------------------------------------------

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


# -- QK norm + RoPE ----------------------------------------------------------------------------
# A head is kept in the registers of one group of up to 32 threads, from its load to its store
# (kernels/qk_norm_rope.cu); past 512 channels a thread would hold more than 16 of a 16-bit head
# and the backward's sums would spill.
QK_ROPE_MAX_HEAD_DIM = 512
QK_ROPE_TOKEN_THREADS = 512      # the most threads a forward block gives one token's heads
QK_ROPE_BLOCK = 256              # a forward block takes several tokens while it has fewer threads
QK_ROPE_EXCHANGE_BLOCK = 256     # blocks exchanging a head through shared memory (pairs 0): at most
QK_ROPE_BACKWARD_BLOCK = 256     # the backward's blocks (kernels/qk_norm_rope.cu: kQkBackwardBlock)


def rope_pairs(rotary_dim, is_neox):
    """The XOR distance from a rotated channel to the one it turns with (the kernels' PAIRS):
    1 for interleaved pairs (GPT-J: 2i with 2i + 1); rotary_dim / 2 for NeoX halves (i with
    i + rotary_dim / 2) when that is a power of two, so that the partner is in the same vector,
    another lane or another of the thread's vectors; 0 for NeoX halves of any other size, which
    the kernels exchange through shared memory."""
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even and >= 2, got {rotary_dim}")
    half = rotary_dim // 2
    if not is_neox or half == 1:
        return 1
    return half if half & (half - 1) == 0 else 0


def qk_rope_geometry(head_dim, vec, backward=False):
    """(threads per head, vectors per thread) for heads of ``head_dim`` elements in vectors of
    ``vec``: the fused op's warp groups (8 to 32 threads, two vectors each) for the forward,
    one vector a thread (8 to 32 threads) for the backward, which keeps four arrays of the head
    and two of dweight sums; more vectors a thread where a warp's 32 do not cover the head."""
    n = head_dim // vec
    per_thread = 1 if backward else 2
    threads = min(max(_pow2_ceil(_ceil_div(n, per_thread)), 8), WARP)
    return threads, _pow2_ceil(_ceil_div(n, threads))


def _check_qk_geometry(head_dim, vec, threads, vecs):
    if not (_is_power_of_two(threads) and threads <= WARP and _is_power_of_two(vecs)):
        raise ValueError(f"threads_per_head must be a power of two up to {WARP} and vecs_per_thread a power of "
                         f"two, got {threads} and {vecs}")
    if threads * vecs * vec < head_dim:
        raise ValueError(f"{threads} threads x {vecs} vectors of {vec} do not cover a head of {head_dim}")


@dataclass(frozen=True)
class QkRopePlan:
    """How one QK norm + RoPE forward call is launched (kernels/qk_norm_rope.cu).

    vec, threads_per_head, vecs_per_thread: a head is a group of threads_per_head threads
      holding vecs_per_thread vectors of vec elements each (the whole head, in registers).
    pairs: ``rope_pairs`` (where a channel's partner lies: the kernel's PAIRS).
    heads_per_block, head_chunks: a token's q and k heads are split into head_chunks chunks
      (grid.y) of heads_per_block; token_threads: the threads of one token's chunk, a whole
      number of warps (a warp never holds two tokens).
    tokens_per_block, token_blocks: tokens a block, and blocks along the tokens (grid.x).
    block, grid: threads a block and blocks in all.
    The kernel reads the split back from the launch (heads per block from grid.y, tokens a
    block from the block size), so the plan needs no field of the Params.
    """

    vec: int
    threads_per_head: int
    vecs_per_thread: int
    pairs: int
    heads_per_block: int
    head_chunks: int
    token_threads: int
    tokens_per_block: int
    token_blocks: int
    block: int
    grid: int

    def template_args(self):
        """The kernel's template arguments after <T, W, C>: VEC, LANES, VECS, PAIRS."""
        return self.vec, self.threads_per_head, self.vecs_per_thread, self.pairs

    def grid_dims(self):
        """(x, y): blocks along the tokens, chunks of a token's heads."""
        return self.token_blocks, self.head_chunks


def qk_rope_plan(tokens, heads, head_dim, rotary_dim, is_neox, vec, *, threads_per_head=None, vecs_per_thread=None):
    """The forward's plan for ``tokens`` tokens of ``heads`` heads (q's and k's) of
    ``head_dim`` elements in vectors of ``vec`` (every head of every array starts on that grid
    and holds whole vectors: the launcher's choice).

    ``qk_rope_geometry`` gives the group of a head (threads_per_head / vecs_per_thread force
    it, for sweeps); a token's groups take at most QK_ROPE_TOKEN_THREADS threads (with
    pairs 0, whose blocks hold the shared-memory exchange, QK_ROPE_EXCHANGE_BLOCK), else its
    heads are split evenly over grid.y; a block takes as many tokens as fit QK_ROPE_BLOCK
    threads (at least one). A function of its arguments only, not of the device.
    """
    if tokens < 0 or heads < 1 or head_dim < 1 or vec < 1 or head_dim % vec:
        raise ValueError("qk_rope_plan needs tokens >= 0, heads >= 1 and head_dim a multiple of vec")
    if head_dim > QK_ROPE_MAX_HEAD_DIM or rotary_dim > head_dim:
        raise ValueError(f"qk_rope_plan needs rotary_dim <= head_dim <= {QK_ROPE_MAX_HEAD_DIM}")
    pairs = rope_pairs(rotary_dim, is_neox)
    threads, vecs = qk_rope_geometry(head_dim, vec)
    threads, vecs = threads_per_head or threads, vecs_per_thread or vecs
    _check_qk_geometry(head_dim, vec, threads, vecs)
    most = QK_ROPE_EXCHANGE_BLOCK if pairs == 0 else QK_ROPE_TOKEN_THREADS
    chunks = _ceil_div(heads * threads, most)
    per_block = _ceil_div(heads, chunks)
    token_threads = _ceil_div(per_block * threads, WARP) * WARP
    per_token_block = max(1, min(QK_ROPE_BLOCK // token_threads, tokens))
    token_blocks = max(1, _ceil_div(tokens, per_token_block))
    if token_blocks > MAX_GRID_X:
        raise ValueError(f"too many tokens for one launch ({tokens})")
    return QkRopePlan(vec, threads, vecs, pairs, per_block, chunks, token_threads, per_token_block, token_blocks,
                      token_threads * per_token_block, token_blocks * chunks)


@dataclass(frozen=True)
class QkRopeBackwardPlan:
    """How one QK norm + RoPE backward call is launched (kernels/qk_norm_rope.cu).

    vec, threads_per_head, vecs_per_thread, pairs: as in ``QkRopePlan``. groups: heads in
    flight a block (QK_ROPE_BACKWARD_BLOCK / threads_per_head). The (token, head) items,
    numbered token by token (q's heads, then k's), are cut into ``grid`` runs of
    ``items_per_block`` (a multiple of groups), a block each; each block writes one partial
    row of dweight sums (q's then k's), which the reduction adds in a fixed order: the bits
    depend only on the plan.
    """

    vec: int
    threads_per_head: int
    vecs_per_thread: int
    pairs: int
    groups: int
    block: int
    items_per_block: int
    grid: int

    def template_args(self):
        return self.vec, self.threads_per_head, self.vecs_per_thread, self.pairs

    @property
    def partials(self):
        return self.grid


def qk_rope_backward_plan(tokens, heads, head_dim, rotary_dim, is_neox, vec, sm_count, *, max_blocks_per_sm=None,
                          threads_per_head=None, vecs_per_thread=None):
    """The backward's plan: ``qk_rope_geometry(backward=True)`` (or the forced geometry), blocks
    of QK_ROPE_BACKWARD_BLOCK threads, about BACKWARD_THREADS_PER_SM resident threads an SM (at
    most ``max_blocks_per_sm`` blocks: the kernel's occupancy, which the launcher asks the
    driver for), each block taking an equal run of items."""
    if tokens < 0 or heads < 1 or head_dim < 1 or vec < 1 or head_dim % vec or sm_count < 1:
        raise ValueError("qk_rope_backward_plan needs tokens >= 0, heads >= 1, head_dim a multiple of vec, "
                         "sm_count >= 1")
    if head_dim > QK_ROPE_MAX_HEAD_DIM or rotary_dim > head_dim:
        raise ValueError(f"qk_rope_backward_plan needs rotary_dim <= head_dim <= {QK_ROPE_MAX_HEAD_DIM}")
    pairs = rope_pairs(rotary_dim, is_neox)
    threads, vecs = qk_rope_geometry(head_dim, vec, backward=True)
    threads, vecs = threads_per_head or threads, vecs_per_thread or vecs
    _check_qk_geometry(head_dim, vec, threads, vecs)
    groups = QK_ROPE_BACKWARD_BLOCK // threads
    per_sm = max(1, BACKWARD_THREADS_PER_SM // QK_ROPE_BACKWARD_BLOCK)
    if max_blocks_per_sm is not None:
        per_sm = max(1, min(per_sm, max_blocks_per_sm))
    items_per_block, grid = _chunks(tokens * heads, sm_count * per_sm, groups)
    return QkRopeBackwardPlan(vec, threads, vecs, pairs, groups, QK_ROPE_BACKWARD_BLOCK, items_per_block, grid)
