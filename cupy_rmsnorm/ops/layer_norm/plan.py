"""LayerNorm's plans, forward and backward; pure functions, tested on a CPU.

A row lives in registers: n = hidden / vec vectors, the vectors per thread doubled (up to 16
elements a thread) while the row would need more than 512 threads, then the power of two of
threads that covers the rest. Up to 32 threads a row share a block of 256 (several rows a
block, warp shuffles only); more take a block each.
"""

from dataclasses import dataclass

MAX_ELEMENTS = 16                            # per thread
MAX_THREADS = {False: 1024, True: 512}       # forward, backward (hidden <= 16384, <= 8192)
GROUP_BLOCK = 256                            # a block of rows of up to 32 threads each


def geometry(hidden, vec, backward=False):
    """(threads per row, vectors per thread) of a row, or None past the kernels' reach."""
    n = hidden // vec
    vecs = 1
    while -(-n // vecs) > 512 and vecs * vec < MAX_ELEMENTS:
        vecs *= 2
    threads = 1 << max(0, (-(-n // vecs) - 1).bit_length())
    return (threads, vecs) if threads <= MAX_THREADS[backward] else None


def max_hidden(vec, backward=False):
    """The longest row a launch of vector width ``vec`` takes."""
    return MAX_THREADS[backward] * (MAX_ELEMENTS // vec) * vec


@dataclass(frozen=True)
class LayerNormPlan:
    vec: int
    threads_per_row: int
    vecs_per_thread: int
    block: int
    grid: int
    # the backward's: rows share a shift / scale row in groups of group_rows consecutive rows,
    # each group cut into blocks_per_group chunks of rows_per_block rows
    group_rows: int = 0
    blocks_per_group: int = 1
    rows_per_block: int = 1

    @property
    def rows_in_parallel(self):
        """Rows a block works on at once."""
        return 1 if self.threads_per_row > 32 else GROUP_BLOCK // self.threads_per_row

    def template_args(self):
        return self.vec, self.threads_per_row, self.vecs_per_thread


def layer_norm_plan(rows, hidden, vec):
    """The forward's plan, or ValueError for a row past the kernel's reach."""
    g = geometry(hidden, vec)
    if g is None:
        raise ValueError(f"x has hidden size {hidden}; the LayerNorm kernels take rows of at most "
                         f"{max_hidden(vec)} elements at this alignment")
    threads, vecs = g
    block = threads if threads > 32 else GROUP_BLOCK
    per_block = 1 if threads > 32 else GROUP_BLOCK // threads
    return LayerNormPlan(vec, threads, vecs, block, max(1, -(-rows // per_block)))


def layer_norm_backward_plan(rows, hidden, vec, group_rows, sm_count, blocks_per_sm=2):
    """The backward's plan: rows in groups of ``group_rows`` consecutive rows (the rows that
    share a shift / scale row; all rows without modulation), each group's rows cut into chunks,
    about ``sm_count * blocks_per_sm`` blocks in all (each writes one partial row of the
    parameters' gradients, which a second kernel adds in a fixed order)."""
    g = geometry(hidden, vec, backward=True)
    if g is None:
        raise ValueError(f"x has hidden size {hidden}; the LayerNorm backward takes rows of at most "
                         f"{max_hidden(vec, True)} elements at this alignment")
    threads, vecs = g
    block = threads if threads > 32 else GROUP_BLOCK
    parallel = 1 if threads > 32 else GROUP_BLOCK // threads
    group_rows = max(1, group_rows)
    groups = max(1, rows // group_rows)
    target = max(1, -(-sm_count * blocks_per_sm // groups))
    per_group = min(target, max(1, -(-group_rows // parallel)))
    rows_per_block = -(-group_rows // per_group)
    per_group = -(-group_rows // rows_per_block)
    return LayerNormPlan(vec, threads, vecs, block, groups * per_group, group_rows, per_group, rows_per_block)
