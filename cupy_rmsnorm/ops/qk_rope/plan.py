"""QK norm + RoPE's plans, forward and backward: threads per head, tokens per block; pure
functions, tested on a CPU."""

from dataclasses import dataclass

from ..._plan import MAX_GRID_X, WARP, _ceil_div, _chunks, _is_power_of_two, _pow2_ceil
from ..backward.plan import BACKWARD_THREADS_PER_SM


# -- QK norm + RoPE ----------------------------------------------------------------------------
# A head is kept in the registers of one group of up to 32 threads, from its load to its store
# (kernels/qk_norm_rope.cu); past 512 channels a thread would hold more than 16 of a 16-bit head
# and the backward's sums would spill.
QK_ROPE_MAX_HEAD_DIM = 512
QK_ROPE_TOKEN_THREADS = 512      # the most threads a forward block gives one token's heads
QK_ROPE_BLOCK = 256              # a forward block takes several tokens while it has fewer threads
QK_ROPE_EXCHANGE_BLOCK = 256     # blocks exchanging a head through shared memory (pairs 0): at most
QK_ROPE_BACKWARD_BLOCK = 256     # the backward's blocks (kernels/qk_norm_rope_backward.cu: kQkBackwardBlock)


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
    """How one QK norm + RoPE backward call is launched (kernels/qk_norm_rope_backward.cu).

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
