"""The backward's plans: the register, row and staged kernels' geometry, fitted to a kernel's
occupancy; pure functions, tested on a CPU."""

from dataclasses import dataclass

from ..._plan import MAX_BLOCK, WARP, WARP_VARIANT_BLOCK, _ceil_div, _chunks, _pow2_ceil


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
