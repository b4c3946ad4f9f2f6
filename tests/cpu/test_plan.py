"""The launcher's pure functions, on the CPU: launch_plan, vector_width, row layout, overlap."""

import dataclasses
import itertools
import random

import numpy as np
import pytest

import cupy_rmsnorm as rn
from cupy_rmsnorm import _abi
from cupy_rmsnorm import _layout
from cupy_rmsnorm._plan import vector_width
from cupy_rmsnorm.ops.backward.plan import backward_refit_keywords
from cupy_rmsnorm.ops.backward import launch as backward_launch

H200_SMS = 132
A100_SMS = 108

# (rows, hidden, itemsize, vec, sm_count, fused, max_cluster) -> (variant, threads_per_row,
# vecs_per_thread, rows_per_block, block, grid, cluster), worked out by hand from
# launch_plan's docstring. With n = ceil(hidden / vec) vectors per row (a partial one counts):
# - n <= 64 (128 for rms_norm): G = next power of two of n / t within [8, 32], t = 4 for
#   rms_norm past 64 vectors, else 2; 256-thread blocks of 256 / G rows;
# - rows <= 256: cluster C = 1 for n <= 512, else the largest power of two <= max_cluster
#   with rows x C <= sm_count and n / C >= 128; G = next power of two of n / C within
#   [64, 512];
# - more rows: G = next power of two of n / t within [64, 1024], t = 4 for rms_norm past
#   256 vectors, else 2;
# - vectors per thread = next power of two of (n / C) / G; past 4 (2 fused) G becomes 1024,
#   and past 1024 x 4 (x 2 fused) vectors per block the row streams (no vectors kept);
# - grid = max(1, ceil(rows / rows_per_block)) x C blocks.
PLAN_TABLE = [
    # n <= 64: groups of 8..32 threads share 256-thread blocks
    ((3, 1, 4, 1, H200_SMS, False, 1), ("registers", 8, 1, 32, 256, 1, 1)),
    ((5, 7, 2, 1, H200_SMS, False, 1), ("registers", 8, 1, 32, 256, 1, 1)),
    ((100, 64, 4, 4, H200_SMS, False, 1), ("registers", 8, 2, 32, 256, 4, 1)),
    ((257, 256, 2, 8, H200_SMS, False, 1), ("registers", 16, 2, 16, 256, 17, 1)),       # n = 32
    ((257, 255, 2, 8, H200_SMS, True, 8), ("registers", 16, 2, 16, 256, 17, 1)),
    ((4096, 512, 2, 8, H200_SMS, False, 1), ("registers", 32, 2, 8, 256, 512, 1)),      # n = 64: 2 each
    ((4096, 512, 2, 8, H200_SMS, True, 1), ("registers", 32, 2, 8, 256, 512, 1)),       # fused: 2 each
    ((100_000, 128, 2, 8, H200_SMS, False, 1), ("registers", 8, 2, 32, 256, 3125, 1)),
    ((1_000_000, 128, 2, 8, A100_SMS, True, 1), ("registers", 8, 2, 32, 256, 31250, 1)),
    # few rows (<= 256): one vector per thread, clusters for rows past 512 vectors
    ((7, 100, 2, 1, H200_SMS, False, 1), ("registers", 32, 4, 8, 256, 1, 1)),         # rms: n <= 128
    ((7, 100, 2, 1, H200_SMS, True, 1), ("registers", 128, 1, 1, 128, 7, 1)),
    ((3, 1000, 4, 4, H200_SMS, False, 1), ("registers", 256, 1, 1, 256, 3, 1)),
    ((1, 4096, 2, 8, H200_SMS, False, 8), ("registers", 512, 1, 1, 512, 1, 1)),        # n = 512: no cluster
    ((0, 4096, 2, 8, H200_SMS, False, 1), ("registers", 512, 1, 1, 512, 1, 1)),        # zero rows: valid plan
    ((1, 8192, 2, 8, H200_SMS, False, 1), ("registers", 512, 2, 1, 512, 1, 1)),        # no clusters (sm_80)
    ((1, 8192, 2, 8, H200_SMS, False, 8), ("registers", 128, 1, 1, 128, 8, 8)),
    ((1, 4104, 2, 8, H200_SMS, False, 8), ("registers", 256, 1, 1, 256, 4, 4)),        # n = 513
    ((30, 16384, 2, 8, H200_SMS, False, 8), ("registers", 512, 1, 1, 512, 120, 4)),    # 30 x 8 > 132
    ((67, 8192, 2, 8, H200_SMS, False, 8), ("registers", 512, 2, 1, 512, 67, 1)),      # 67 x 2 > 132
    ((64, 16384, 2, 8, H200_SMS, True, 1), ("registers", 1024, 2, 1, 1024, 64, 1)),    # 512 x 4 > 2 each
    ((64, 16384, 2, 8, H200_SMS, True, 8), ("registers", 512, 2, 1, 512, 128, 2)),
    ((64, 32768, 2, 8, H200_SMS, False, 1), ("registers", 1024, 4, 1, 1024, 64, 1)),   # n = 4096
    ((3, 8192, 2, 2, H200_SMS, False, 1), ("registers", 1024, 4, 1, 1024, 3, 1)),      # n = 4096
    ((3, 8192, 2, 2, H200_SMS, False, 8), ("registers", 512, 1, 1, 512, 24, 8)),
    ((3, 8193, 2, 2, H200_SMS, False, 1), ("stream", 1024, 0, 1, 1024, 3, 1)),         # n = 4097: the tail's
    ((3, 8193, 2, 2, H200_SMS, False, 8), ("registers", 512, 2, 1, 512, 24, 8)),       # vector counts
    # many rows: n / 4 threads for rms_norm past 256 vectors, n / 2 otherwise
    ((300, 4096, 2, 8, H200_SMS, False, 8), ("registers", 128, 4, 1, 128, 300, 1)),
    ((1000, 4096, 2, 8, 1, False, 1), ("registers", 128, 4, 1, 128, 1000, 1)),
    ((4096, 4096, 2, 8, H200_SMS, False, 8), ("registers", 128, 4, 1, 128, 4096, 1)),
    ((4096, 4096, 2, 8, H200_SMS, True, 8), ("registers", 256, 2, 1, 256, 4096, 1)),
    ((5000, 4096, 2, 8, H200_SMS, False, 1), ("registers", 128, 4, 1, 128, 5000, 1)),
    ((4096, 4096, 2, 2, H200_SMS, False, 1), ("registers", 512, 4, 1, 512, 4096, 1)),   # vec 2
    ((4096, 4096, 2, 1, H200_SMS, False, 1), ("registers", 1024, 4, 1, 1024, 4096, 1)), # scalar
    ((4096, 1024, 2, 8, H200_SMS, False, 1), ("registers", 32, 4, 8, 256, 512, 1)),     # n = 128: group
    ((4096, 1032, 2, 8, H200_SMS, False, 1), ("registers", 128, 2, 1, 128, 4096, 1)),   # n = 129
    ((4096, 1024, 2, 8, H200_SMS, True, 1), ("registers", 64, 2, 1, 64, 4096, 1)),
    ((4096, 520, 2, 8, H200_SMS, False, 1), ("registers", 32, 4, 8, 256, 512, 1)),      # n = 65
    ((4096, 520, 2, 8, H200_SMS, True, 1), ("registers", 64, 2, 1, 64, 4096, 1)),
    ((8192, 2048, 2, 8, H200_SMS, False, 1), ("registers", 128, 2, 1, 128, 8192, 1)),   # n = 256
    ((8192, 2040, 2, 8, H200_SMS, False, 1), ("registers", 128, 2, 1, 128, 8192, 1)),   # n = 255
    ((8192, 2056, 2, 8, H200_SMS, False, 1), ("registers", 128, 4, 1, 128, 8192, 1)),   # n = 257
    # too long for registers: a 1024-thread block (per row, or per cluster share) streams it
    ((4096, 4096, 2, 1, H200_SMS, True, 1), ("stream", 1024, 0, 1, 1024, 4096, 1)),     # fused, n = 4096
    ((64, 32768, 2, 8, H200_SMS, True, 1), ("stream", 1024, 0, 1, 1024, 64, 1)),
    ((64, 32776, 2, 8, H200_SMS, False, 1), ("stream", 1024, 0, 1, 1024, 64, 1)),       # n = 4097
    ((9000, 262144, 4, 4, H200_SMS, True, 8), ("stream", 1024, 0, 1, 1024, 9000, 1)),
    ((3, 8196, 2, 2, H200_SMS, False, 1), ("stream", 1024, 0, 1, 1024, 3, 1)),          # n = 4098
    ((1, 262144, 2, 8, H200_SMS, True, 8), ("stream", 1024, 0, 1, 1024, 8, 8)),         # 4096 per block
]


def _fields(plan):
    return (plan.variant, plan.threads_per_row, plan.vecs_per_thread, plan.rows_per_block,
            plan.block, plan.grid, plan.cluster)


@pytest.mark.parametrize("args, expected", PLAN_TABLE, ids=[str(a) for a, _ in PLAN_TABLE])
def test_launch_plan_table(args, expected):
    plan = rn.launch_plan(*args[:6], max_cluster=args[6])
    assert _fields(plan) == expected
    assert plan.vec == args[3] and plan.edges
    assert plan.template_args() == (args[3], expected[1], expected[2], "true") + \
        ((expected[6],) if expected[6] > 1 else ())
    if args[1] % args[3] == 0:      # rows of whole vectors: the kernel without head and tail
        assert rn.launch_plan(*args[:6], max_cluster=args[6], edges=False).template_args()[3] == "false"


def test_launch_plan_forced_choices():
    """threads_per_row / vecs_per_thread (for sweeps) override the heuristic."""
    p = rn.launch_plan(4096, 4096, 2, 8, H200_SMS, threads_per_row=64, vecs_per_thread=8)
    assert (p.variant, p.threads_per_row, p.vecs_per_thread, p.block) == ("registers", 64, 8, 64)
    p = rn.launch_plan(4096, 4096, 2, 8, H200_SMS, threads_per_row=32, vecs_per_thread=16)
    assert (p.threads_per_row, p.rows_per_block, p.block, p.grid) == (32, 8, 256, 512)
    p = rn.launch_plan(4096, 4096, 2, 8, H200_SMS, vecs_per_thread=0)
    assert p.variant == "stream" and p.vecs_per_thread == 0
    p = rn.launch_plan(1, 32768, 2, 8, H200_SMS, cluster=2)
    assert (p.cluster, p.threads_per_row, p.vecs_per_thread, p.grid) == (2, 512, 4, 2)


def test_launch_plan_is_frozen():
    plan = rn.launch_plan(4, 4096, 2, 8, H200_SMS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.grid = 7
    assert plan == rn.launch_plan(4, 4096, 2, 8, H200_SMS)


@pytest.mark.parametrize("args", [(-1, 8, 2, 8, 1), (1, 0, 2, 8, 1), (1, 8, 2, 0, 1), (1, 8, 2, 8, 0)])
def test_launch_plan_rejects_bad_arguments(args):
    with pytest.raises(ValueError):
        rn.launch_plan(*args)


def test_launch_plan_rejects_impossible_choices():
    with pytest.raises(ValueError, match="multiple of vec"):
        rn.launch_plan(4, 4095, 2, 8, H200_SMS, edges=False)
    with pytest.raises(ValueError, match="more than 32 threads"):
        rn.launch_plan(4, 256, 2, 8, H200_SMS, cluster=2)     # a warp group per row
    with pytest.raises(ValueError, match="streamed row needs more than 32 threads"):
        rn.launch_plan(4, 256, 2, 8, H200_SMS, threads_per_row=32, vecs_per_thread=0)


@pytest.mark.parametrize("overrides, message", [
    (dict(threads_per_row=48), "threads_per_row must be a power of two"),
    (dict(threads_per_row=2048), "threads_per_row must be a power of two up to 1024"),
    (dict(threads_per_row=0), "threads_per_row"),
    (dict(vecs_per_thread=3), "vecs_per_thread must be a power of two"),
    (dict(vecs_per_thread=-1), "vecs_per_thread"),
    (dict(cluster=3), "cluster must be a power of two"),
    (dict(cluster=16), "cluster must be a power of two up to 8"),
    (dict(threads_per_row=64, vecs_per_thread=4), "do not cover a row of 512 vectors"),
    (dict(threads_per_row=128, vecs_per_thread=2, cluster=1), "do not cover"),
])
def test_launch_plan_rejects_forced_choices_off_the_tree(overrides, message):
    """Forced choices split the row in powers of two and cover it (the canonical tree's
    shape), or launch_plan says which one does not."""
    with pytest.raises(ValueError, match=message):
        rn.launch_plan(4096, 4096, 2, 8, H200_SMS, **overrides)


def test_the_tail_vector_is_covered():
    """A hidden size past a whole number of vectors counts the partial vector: the thread
    that owns its index exists in every register plan."""
    for hidden in range(1, 5000, 37):
        for vec in (2, 4, 8):
            for rows in (1, 300, 10 ** 5):
                p = rn.launch_plan(rows, hidden, 2, vec, H200_SMS, max_cluster=8)
                if p.vecs_per_thread:
                    assert p.threads_per_row * p.vecs_per_thread * p.cluster >= -(-hidden // vec), (hidden, vec, p)


def _sampled_hidden_sizes():
    """1..4200 exhaustively (every boundary for every vec), then a sample up to 300000
    with the powers of two and their neighbours, where the boundaries sit."""
    rng = random.Random(1234)
    sizes = set(range(1, 4201))
    sizes |= set(rng.sample(range(4201, 300_001), 3000))
    for p in range(1, 19):
        sizes |= {2 ** p - 1, 2 ** p, 2 ** p + 1, 2 ** p + 8, 2 ** p - 8}
    sizes |= {5120, 6144, 7168, 11008, 13824, 14336, 28672, 262144, 300_000}
    return sorted(s for s in sizes if 1 <= s <= 300_000)


def test_launch_plan_properties():
    sm_counts = (1, A100_SMS, H200_SMS)
    rows_options = (0, 1, 3, 256, 257, 4096, 10 ** 6)
    grids = list(itertools.product(rows_options, sm_counts, (False, True), (1, 8)))
    variants_seen = set()
    count = 0
    for hidden in _sampled_hidden_sizes():
        for itemsize, vec in ((2, 1), (2, 2), (2, 4), (2, 8), (4, 1), (4, 2), (4, 4)):
            n = -(-hidden // vec)          # vectors, a partial last one included
            count += 1   # rows, SM count and fused cycle with the hidden sizes
            for rows, sms, fused, max_cluster in (grids[count % len(grids)], grids[(count * 7 + 3) % len(grids)]):
                p = rn.launch_plan(rows, hidden, itemsize, vec, sms, fused, max_cluster=max_cluster)
                ctx = (rows, hidden, itemsize, vec, sms, fused, max_cluster, p)
                max_nv = 2 if fused else 4       # registers left for a second array when fused
                variants_seen.add(p.variant)
                assert p.vec == vec, ctx
                assert p.threads_per_row & (p.threads_per_row - 1) == 0, ctx   # a power of two
                assert 8 <= p.threads_per_row <= 1024, ctx
                assert p.block <= 1024, ctx
                assert p.block == p.threads_per_row * p.rows_per_block, ctx
                # the kernel's __launch_bounds__ allow max(G, 256) threads
                assert p.block <= max(p.threads_per_row, 256), ctx
                if p.threads_per_row <= 32:    # shuffle-only reduction: several rows per block
                    assert p.block == 256, ctx
                else:                          # shared-memory reduction: one row per block
                    assert p.rows_per_block == 1, ctx
                c = p.cluster
                assert c in (1, 2, 4, 8) and c <= max_cluster, ctx
                if c > 1:                      # few long rows, all in one wave
                    assert p.threads_per_row > 32 and rows * c <= sms, ctx
                # a block (a cluster) per row group, every row owned
                assert p.grid == max(1, -(-rows // p.rows_per_block)) * c, ctx
                assert p.grid_dims() == (p.grid, 1), ctx
                m = -(-max(n, 1) // c)         # vectors per block
                if p.variant == "stream":
                    assert p.vecs_per_thread == 0 and p.threads_per_row == 1024, ctx
                else:
                    assert p.variant == "registers", ctx
                    assert 1 <= p.vecs_per_thread <= max_nv, ctx
                    assert p.threads_per_row * p.vecs_per_thread >= m, ctx
                # streaming exactly when a block's share cannot fit 1024 threads' registers
                assert (p.variant == "stream") == (m > 1024 * max_nv), ctx
    assert variants_seen == {"registers", "stream"}


def test_early_trigger():
    """Early unless the grid is more than one block per SM and less than a full wave."""
    from cupy_rmsnorm._plan import early_trigger
    assert early_trigger(1, 132, 8) and early_trigger(132, 132, 8)         # <= one block per SM
    assert not early_trigger(133, 132, 8) and not early_trigger(1055, 132, 8)
    assert early_trigger(1056, 132, 8) and early_trigger(16384, 132, 9)    # a wave or more


def test_grid_dims_split_huge_grids():
    """Past 2**31 - 1 blocks the grid gets rows of 2**16 blocks (a multiple of every cluster
    size); past what that holds, launch_plan refuses."""
    small = rn.launch_plan(10, 4096, 2, 8, H200_SMS)
    assert small.grid_dims() == (10, 1)
    huge = rn.launch_plan(2 ** 31 + 5, 4096, 2, 8, H200_SMS)
    assert huge.grid == 2 ** 31 + 5
    assert huge.grid_dims() == (2 ** 16, 2 ** 15 + 1)
    with pytest.raises(ValueError, match="too many rows"):
        rn.launch_plan(2 ** 16 * 65535 + 1, 4096, 2, 8, H200_SMS)


def test_launch_plan_is_monotone_in_hidden():
    """A longer row never gets fewer threads x vectors (no row silently loses its tail)."""
    for vec in (1, 2, 4, 8):
        for rows in (16, 10 ** 5):
            prev = 0
            for hidden in range(1, 40_000, 7):
                p = rn.launch_plan(rows, hidden, 2, vec, H200_SMS)
                cap = 10 ** 9 if p.variant == "stream" else p.threads_per_row * p.vecs_per_thread
                assert cap >= prev, (hidden, vec, p)
                prev = cap


# -- vector_width --------------------------------------------------------------------------

@pytest.mark.parametrize("itemsize, pointers, stride_diffs, expected", [
    (2, [], [], 8),                          # x alone: 16 bytes
    (4, [], [], 4),
    (2, [0, 0, 0], [0, 0, 0, 0, 0, 0], 8),   # same alignment pattern as x
    (2, [4096, 2 ** 40], [0, 0], 8),         # far apart, multiples of 16 bytes
    (2, [-16, 32], [0], 8),                  # negative differences
    (4, [1024], [0, 0], 4),
    (2, [8], [0, 0], 4),                     # 8-byte difference: 4 halves
    (4, [8], [0, 0], 2),                     # 8-byte difference: 2 floats
    (2, [4], [], 2),
    (4, [4], [], 1),
    (2, [2], [], 1),
    (2, [-6], [], 1),
    (2, [1], [], 1),                         # not even element-aligned: scalar, never 0
    (4, [2], [], 1),
    (2, [0], [8], 4),                        # row strides differ by 4 halves
    (2, [0], [0, 2], 1),                     # inner strides differ by one half
    (4, [16], [4], 1),
    (2, [48], [16 * 7], 8),
])
def test_vector_width(itemsize, pointers, stride_diffs, expected):
    assert vector_width(itemsize, pointers, stride_diffs) == expected


def test_vector_width_allows_every_access():
    """Whatever it returns, every difference is a multiple of vec elements (brute force)."""
    rng = random.Random(7)
    for _ in range(2000):
        itemsize = rng.choice((2, 4))
        pointers = [rng.randrange(-4096, 4096) * rng.choice((1, itemsize)) for _ in range(rng.randrange(0, 4))]
        strides = [rng.randrange(-64, 64) * itemsize for _ in range(rng.randrange(0, 6))]
        vec = vector_width(itemsize, pointers, strides)
        vb = vec * itemsize
        assert vb <= 16 and vec & (vec - 1) == 0
        if vec > 1:
            assert all(d % vb == 0 for d in pointers + strides)
        # and it is the widest: twice as wide would break some difference (or pass 16 bytes)
        if 2 * vb <= 16:
            assert any(d % (2 * vb) for d in pointers + strides)


# -- row_layout ----------------------------------------------------------------------------

def _elem_strides(a):
    return tuple(s // a.itemsize for s in a.strides)


def _assert_addresses(shape, strides, layout_strides, n_inner):
    """The two-level layout addresses every row exactly where the original strides do."""
    lead_shape, lead_strides = shape[:-1], strides[:-1]
    so, si = layout_strides
    rows = int(np.prod(lead_shape)) if lead_shape else 1
    for r in range(rows):
        idx = np.unravel_index(r, lead_shape) if lead_shape else ()
        want = sum(i * s for i, s in zip(idx, lead_strides))
        outer, inner = divmod(r, n_inner)
        # a level of one may carry any stride: only used levels count
        got = (outer * so if rows // n_inner > 1 else 0) + (inner * si if n_inner > 1 else 0)
        assert got == want, (shape, strides, layout_strides, n_inner, r)


def _layout_of(*arrays):
    shape = arrays[0].shape
    return _layout.row_layout(shape, [_elem_strides(a)[:-1] for a in arrays])


def test_row_layout_contiguous():
    x = np.empty((4, 8, 16), np.float16)
    lay = _layout_of(x)
    assert (lay.rows, lay.n_inner) == (32, 1)
    assert lay.strides == ((16, 0),)
    _assert_addresses(x.shape, _elem_strides(x), lay.strides[0], lay.n_inner)


def test_row_layout_one_dimensional_and_zero_rows():
    x = np.empty((16,), np.float32)
    lay = _layout_of(x)
    assert (lay.rows, lay.n_inner, lay.strides) == (1, 1, ((0, 0),))
    z = np.empty((0, 16), np.float32)
    lay = _layout_of(z)
    assert lay.rows == 0 and lay.strides[0] is not None
    z3 = np.empty((3, 0, 16), np.float32)
    assert _layout_of(z3).rows == 0


def test_row_layout_wider_buffer_slice():
    buf = np.empty((10, 96), np.float16)
    x = buf[:, :64]
    out = np.empty((10, 64), np.float16)
    lay = _layout_of(out, x)
    assert (lay.rows, lay.n_inner) == (10, 1)
    assert lay.strides == ((64, 0), (96, 0))


def test_row_layout_fused_qkv_heads():
    tokens, heads, head_dim = 5, 4, 8
    qkv = np.empty((tokens, 3 * heads * head_dim), np.float16)
    q = qkv[:, :heads * head_dim].reshape(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:2 * heads * head_dim].reshape(tokens, heads, head_dim)
    out = np.empty((tokens, heads, head_dim), np.float16)
    lay = _layout_of(out, q, k)
    assert (lay.rows, lay.n_inner) == (tokens * heads, heads)
    assert lay.strides == ((heads * head_dim, head_dim), (3 * heads * head_dim, head_dim),
                           (3 * heads * head_dim, head_dim))
    for a, st in zip((out, q, k), lay.strides):
        _assert_addresses(a.shape, _elem_strides(a), st, lay.n_inner)


def test_row_layout_transposed_leading_axes():
    base = np.empty((3, 5, 16), np.float32)      # (B, A, hidden)
    x = base.transpose(1, 0, 2)                  # (A, B, hidden), strides (16, 80)
    lay = _layout_of(x)
    assert (lay.rows, lay.n_inner) == (15, 3)
    assert lay.strides == ((16, 80),)
    _assert_addresses(x.shape, _elem_strides(x), lay.strides[0], lay.n_inner)
    # next to a contiguous output, the split is shared and both fit
    out = np.empty(x.shape, np.float32)
    lay = _layout_of(out, x)
    assert lay.strides[0] is not None and lay.strides[1] is not None
    for a, st in zip((out, x), lay.strides):
        _assert_addresses(a.shape, _elem_strides(a), st, lay.n_inner)


def test_row_layout_size_one_axes():
    base = np.empty((5, 7, 16), np.float16)
    x = base[:, None, 2:3, None, :]             # (5, 1, 1, 1, 16)
    x = np.lib.stride_tricks.as_strided(x, x.shape, (x.strides[0], 12345, 6789, 2, 2))
    lay = _layout_of(x)
    assert (lay.rows, lay.n_inner) == (5, 1)
    assert lay.strides == ((7 * 16, 0),)
    y = base[None, :, :1, :]                    # (1, 5, 1, 16)
    lay = _layout_of(y)
    assert (lay.rows, lay.strides) == (5, ((7 * 16, 0),))


def test_row_layout_merges_what_merges():
    base = np.empty((6, 4, 10, 16), np.float16)
    x = base[:, :, :3]                           # (6, 4, 3, 16): axes 0 and 1 merge, 2 does not
    lay = _layout_of(x)
    assert (lay.rows, lay.n_inner) == (72, 3)
    assert lay.strides == ((160, 16),)
    _assert_addresses(x.shape, _elem_strides(x), lay.strides[0], lay.n_inner)


def test_row_layout_no_common_split():
    base = np.empty((4, 6, 10, 16), np.float32)
    three_levels = base[:, :3, :5]               # breaks after axis 0 and after axis 1
    out = np.empty(three_levels.shape, np.float32)
    lay = _layout_of(out, three_levels)
    assert lay.strides[0] is not None and lay.strides[1] is None
    _assert_addresses(out.shape, _elem_strides(out), lay.strides[0], lay.n_inner)

    a = np.empty((4, 6, 10, 16), np.float32)[:, :3]    # (4, 3, 10, 16): break after axis 0
    b = np.empty((4, 3, 20, 16), np.float32)[:, :, :10]  # break after axis 1
    lay = _layout_of(a, b)                       # the first array with a single break wins
    assert lay.strides[0] is not None and lay.strides[1] is None
    assert lay.n_inner == 30
    _assert_addresses(a.shape, _elem_strides(a), lay.strides[0], lay.n_inner)
    lay = _layout_of(b, a)
    assert lay.strides[0] is not None and lay.strides[1] is None
    assert lay.n_inner == 10
    _assert_addresses(b.shape, _elem_strides(b), lay.strides[0], lay.n_inner)

    # an array with two breaks does not set the split; the first with a single one does
    c = np.empty((4, 6, 5, 16), np.float32)[:, :3]     # (4, 3, 5, 16): break after axis 0
    lay = _layout_of(three_levels, c)
    assert lay.strides[0] is None and lay.strides[1] is not None
    assert lay.n_inner == 15
    _assert_addresses(c.shape, _elem_strides(c), lay.strides[1], lay.n_inner)


def test_row_layout_none_input_stays_none():
    lay = _layout.row_layout((4, 16), [(16,), None])
    assert lay.strides[1] is None and lay.strides[0] == (16, 0)


def test_row_layout_random_views_address_the_right_rows():
    """Random slicings/transposes of 2..4 leading axes: any layout returned is exact."""
    rng = np.random.default_rng(3)
    fitted = 0
    for _ in range(300):
        nd = int(rng.integers(1, 4))
        full = tuple(int(n) for n in rng.integers(1, 5, size=nd)) + (8,)
        base = np.empty(full, np.float16)
        sl = tuple(slice(0, int(rng.integers(1, n + 1)), int(rng.integers(1, 3))) for n in full[:-1])
        v = base[sl + (slice(None),)]
        perm = list(rng.permutation(nd)) + [nd]
        v = v.transpose(perm)
        out = np.empty(v.shape, np.float16)
        lay = _layout_of(out, v)
        assert lay.rows == int(np.prod(v.shape[:-1]))
        assert lay.strides[0] is not None        # a contiguous output always fits
        for a, st in zip((out, v), lay.strides):
            if st is not None:
                fitted += a is v
                _assert_addresses(a.shape, _elem_strides(a), st, lay.n_inner)
    assert fitted > 100


# -- rows_overlap_themselves ---------------------------------------------------------------

def _rows_collide(so, si, rows, n_inner, hidden):
    """Brute force: do any two rows' [offset, offset + hidden) intervals intersect?"""
    n_outer = rows // n_inner
    offs = sorted(o * so + i * si for o in range(n_outer) for i in range(n_inner))
    return any(b - a < hidden for a, b in zip(offs, offs[1:]))


@pytest.mark.parametrize("strides, rows, n_inner, hidden, expected", [
    ((16, 0), 4, 1, 16, False),       # contiguous
    ((0, 0), 4, 1, 16, True),         # broadcast rows (stride 0)
    ((15, 0), 4, 1, 16, True),        # one element short
    ((-16, 0), 4, 1, 16, False),      # reversed rows
    ((0, 0), 1, 1, 16, False),        # a single row never collides
    ((64, 16), 12, 4, 16, False),     # contiguous, two levels
    ((64, 0), 12, 4, 16, True),       # inner level broadcast
    ((16, 64), 8, 4, 16, False),      # transposed levels, disjoint
    ((32, 48), 4, 2, 16, False),      # interleaved, disjoint
    ((16, 24), 8, 4, 16, True),       # inner rows land on outer rows
    ((100, 7), 8, 2, 8, True),        # inner stride too small
])
def test_rows_overlap_themselves(strides, rows, n_inner, hidden, expected):
    assert _layout.rows_overlap_themselves(strides, rows, n_inner, hidden) is expected
    assert _rows_collide(*strides, rows, n_inner, hidden) is expected


def test_rows_overlap_themselves_never_misses_a_collision():
    """It may be conservative, but a real collision is always reported (random brute force)."""
    rng = random.Random(11)
    for _ in range(3000):
        hidden = rng.randrange(1, 9)
        n_inner = rng.randrange(1, 5)
        rows = n_inner * rng.randrange(1, 5)
        so, si = rng.randrange(-40, 41), rng.randrange(-40, 41)
        if _rows_collide(so, si, rows, n_inner, hidden):
            assert _layout.rows_overlap_themselves((so, si), rows, n_inner, hidden), (so, si, rows, n_inner, hidden)


def test_rows_overlap_as_strided_output():
    buf = np.zeros(64, np.float16)
    bad = np.lib.stride_tricks.as_strided(buf, shape=(4, 16), strides=(0, 2))
    st = _elem_strides(bad)[:-1]
    lay = _layout.row_layout(bad.shape, [st])
    assert _layout.rows_overlap_themselves(lay.strides[0], lay.rows, lay.n_inner, 16)


# -- overlap --------------------------------------------------------------------------------

def _span(a, rows, n_inner):
    """The (ptr, strides, extent) triple the API builds, from a real NumPy view."""
    lay = _layout.row_layout(a.shape, [_elem_strides(a)[:-1]])
    assert lay.strides[0] is not None and lay.n_inner == n_inner
    ptr = a.__array_interface__["data"][0]
    ext = _layout.extent(ptr, lay.strides[0], rows, n_inner, a.shape[-1], a.itemsize)
    return ptr, lay.strides[0], ext


def _overlap(a, b):
    lay = _layout.row_layout(a.shape, [_elem_strides(a)[:-1], _elem_strides(b)[:-1]])
    return _layout.overlap(_span(a, lay.rows, lay.n_inner), _span(b, lay.rows, lay.n_inner),
                             lay.rows, lay.n_inner, a.shape[-1], a.itemsize)


def test_overlap_cases():
    buf = np.zeros((8, 64), np.float16)
    x = buf[:4, :32]
    assert _overlap(x, buf[:4, :32]) == "same"
    assert _overlap(x, buf[4:8, :32]) is None             # disjoint extents
    assert _overlap(x, buf[:4, 32:64]) is None            # interleaved, no shared element
    assert _overlap(x, buf[:4, 16:48]) == "partial"       # interleaved, sharing
    assert _overlap(x, buf[1:5, :32]) == "partial"        # shifted by a row
    assert _overlap(x, buf[:4, 1:33]) == "partial"        # shifted by one element
    assert _overlap(x, buf[::2, :32]) == "partial"        # same start, another stride
    flat = np.zeros(4 * 32 + 1, np.float16)
    assert _overlap(flat[:128].reshape(4, 32), flat[1:].reshape(4, 32)) == "partial"


def test_overlap_same_with_irrelevant_strides():
    """A level of one row may carry any stride: the arrays are still the very same rows."""
    p = 4096
    ext = (p, p + 16 * 4)
    assert _layout.overlap((p, (5, 0), ext), (p, (7, 9), ext), 1, 1, 16, 4) == "same"
    ext = _layout.extent(p, (64, 16), 4, 4, 16, 4)
    assert _layout.overlap((p, (3, 16), ext), (p, (64, 16), ext), 4, 4, 16, 4) == "same"
    assert _layout.overlap((p, (64, 3), ext), (p, (64, 16), ext), 4, 4, 16, 4) == "partial"


def test_overlap_agrees_with_numpy_shares_memory():
    rng = np.random.default_rng(5)
    buf = np.zeros(4096, np.float32)
    for _ in range(400):
        hidden = int(rng.integers(1, 9))
        rows = int(rng.integers(2, 6))
        views = []
        for _ in range(2):
            start = int(rng.integers(0, 64))
            stride = int(rng.integers(hidden, 3 * hidden + 1)) * int(rng.choice((1, -1)))
            if stride < 0:
                start += -stride * (rows - 1)
            views.append(np.lib.stride_tricks.as_strided(buf[start:], (rows, hidden), (4 * stride, 4)))
        a, b = views
        expected = np.shares_memory(a, b)
        got = _overlap(a, b)
        if not expected:
            assert got is None, (a.strides, b.strides)
        else:
            assert got in ("same", "partial")
            same = (a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
                    and a.strides == b.strides)
            assert (got == "same") == same


# -- backward_plan -----------------------------------------------------------------------------

# (rows, hidden, itemsize, vec, sm_count, max_blocks_per_sm) -> (variant, threads_per_row,
# vecs_per_thread, groups_per_block, block, rows_per_block, grid), worked out by hand from
# backward_plan's docstring. With n = hidden // vec vectors per row:
# - n <= 64: G = next power of two of n / 2 within [8, 32], vectors per thread the next power
#   of two of n / G, 256 / G groups in a 256-thread block;
# - n <= 1024: a block of G = next power of two of n (at least 128 here) threads, one vector each;
# - past that: streamed, 512 threads;
# - a block-wide group with vectors kept ("registers") and no more rows than SMs: "row";
# - blocks per SM: 1024 // block (at least 1, at most max_blocks_per_sm); rows_per_block:
#   ceil(rows / (sm_count x blocks per SM)) rounded up to a multiple of the groups;
#   grid: ceil(rows / rows_per_block), at least 1.
BACKWARD_TABLE = [
    ((1, 4096, 2, 8, H200_SMS, None), ("row", 512, 1, 1, 512, 1, 1)),
    ((132, 4096, 2, 8, H200_SMS, 1), ("row", 512, 1, 1, 512, 1, 132)),                # one row an SM
    ((133, 4096, 2, 8, H200_SMS, None), ("registers", 512, 1, 1, 512, 1, 133)),
    ((1024, 4096, 2, 8, H200_SMS, None), ("registers", 512, 1, 1, 512, 4, 256)),
    ((4096, 4096, 2, 8, H200_SMS, None), ("registers", 512, 1, 1, 512, 16, 256)),
    ((16384, 4096, 2, 8, H200_SMS, None), ("registers", 512, 1, 1, 512, 63, 261)),
    ((16384, 8192, 2, 8, H200_SMS, None), ("registers", 1024, 1, 1, 1024, 125, 132)),
    ((4096, 512, 2, 8, H200_SMS, None), ("registers", 32, 2, 8, 256, 8, 512)),
    ((4096, 4095, 2, 8, H200_SMS, None), ("registers", 512, 1, 1, 512, 16, 256)),      # n = 511
    ((4096, 4095, 2, 1, H200_SMS, None), ("stream", 512, 0, 1, 512, 16, 256)),         # scalar: n = 4095
    ((7, 1, 4, 1, H200_SMS, None), ("registers", 8, 1, 32, 256, 32, 1)),
    ((257, 7, 2, 1, H200_SMS, None), ("registers", 8, 1, 32, 256, 32, 9)),
    ((100_000, 128, 2, 8, H200_SMS, None), ("registers", 8, 2, 32, 256, 192, 521)),     # n = 16
    ((4096, 1024, 4, 4, H200_SMS, None), ("registers", 256, 1, 1, 256, 8, 512)),
    ((4096, 8192, 4, 4, H200_SMS, None), ("stream", 512, 0, 1, 512, 16, 256)),         # n = 2048
    ((0, 4096, 2, 8, H200_SMS, None), ("registers", 512, 1, 1, 512, 1, 1)),            # no rows: valid
    ((4096, 4096, 2, 8, H200_SMS, 1), ("registers", 512, 1, 1, 512, 32, 128)),         # occupancy 1
    ((4096, 520, 2, 8, H200_SMS, None), ("registers", 128, 1, 1, 128, 4, 1024)),       # n = 65
    ((3, 33, 2, 1, H200_SMS, None), ("registers", 32, 2, 8, 256, 8, 1)),
    ((10 ** 6, 2048, 2, 8, A100_SMS, None), ("registers", 256, 1, 1, 256, 2315, 432)),
]


def _backward_fields(p):
    return (p.variant, p.threads_per_row, p.vecs_per_thread, p.groups_per_block, p.block,
            p.rows_per_block, p.grid)


@pytest.mark.parametrize("args, expected", BACKWARD_TABLE, ids=[str(a) for a, _ in BACKWARD_TABLE])
def test_backward_plan_table(args, expected):
    plan = rn.backward_plan(*args[:5], max_blocks_per_sm=args[5])
    assert _backward_fields(plan) == expected
    assert plan.vec == args[3] and plan.edges and plan.partials == plan.grid
    assert plan.template_args() == (args[3], expected[1], expected[2], "true")
    if args[1] % args[3] == 0:
        assert rn.backward_plan(*args[:5], edges=False).template_args()[3] == "false"


def test_backward_plan_forced_and_refused():
    p = rn.backward_plan(4096, 4096, 2, 8, H200_SMS, vecs_per_thread=0)
    assert (p.variant, p.threads_per_row) == ("stream", 512)
    p = rn.backward_plan(4096, 4096, 2, 8, H200_SMS, threads_per_row=1024, vecs_per_thread=1)
    assert (p.block, p.rows_per_block, p.grid) == (1024, 32, 128)
    with pytest.raises(ValueError, match="more than 32 threads"):
        rn.backward_plan(4, 64, 2, 8, H200_SMS, vecs_per_thread=0)     # a warp group cannot stream
    with pytest.raises(ValueError, match="multiple of vec"):
        rn.backward_plan(4, 4095, 2, 8, H200_SMS, edges=False)
    p = rn.backward_plan(3, 4096, 2, 8, H200_SMS, vecs_per_thread=0)        # few rows, streamed
    assert (p.variant, p.grid) == ("stream", 3)
    for args in [(-1, 8, 2, 8, 1), (1, 0, 2, 8, 1), (1, 8, 2, 0, 1), (1, 8, 2, 8, 0), (1, 8, 0, 8, 1)]:
        with pytest.raises(ValueError):
            rn.backward_plan(*args)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.grid = 3


# the backward kernel's static shared memory: GROUPS x SPAN floats of dweight sums
STATIC_SHARED_BYTES = 48 * 1024


def test_backward_plan_properties():
    count = 0
    for hidden in _sampled_hidden_sizes():
        for itemsize, vec in ((2, 1), (2, 2), (2, 8), (4, 1), (4, 4)):
            count += 1
            n = max(hidden // vec, 1)
            for rows, sms, occupancy in (((0, 1, 3, 257, 4096, 10 ** 6)[count % 6], (1, A100_SMS, H200_SMS)[count % 3],
                                          (None, 1, 2, 3)[count % 4]),):
                p = rn.backward_plan(rows, hidden, itemsize, vec, sms, max_blocks_per_sm=occupancy)
                ctx = (rows, hidden, itemsize, vec, sms, occupancy, p)
                g = p.threads_per_row
                assert g & (g - 1) == 0 and 8 <= g <= 1024 and p.block <= 1024, ctx
                assert p.block == g * p.groups_per_block, ctx
                assert p.groups_per_block == (256 // g if g <= 32 else 1), ctx
                if p.variant in ("registers", "row"):
                    assert 1 <= p.vecs_per_thread <= 2 and g * p.vecs_per_thread >= n, ctx
                    span = (g * p.vecs_per_thread + 2) * (vec + (vec > 1))    # the kernel's SPAN (padded)
                    assert span >= hidden and p.groups_per_block * span * 4 <= STATIC_SHARED_BYTES, ctx
                else:
                    assert p.vecs_per_thread == 0 and p.groups_per_block == 1, ctx
                assert (p.variant == "stream") == (n > 1024), ctx
                # the row kernel: one row a block, whatever the occupancy (no more rows than SMs);
                # it takes its row from its block index alone, so its grid is the rows
                row = p.vecs_per_thread > 0 and g > 32 and 1 <= rows <= sms
                assert (p.variant == "row") == row and (not row or (p.rows_per_block == 1 and p.grid == rows)), ctx
                # every row in exactly one block, every block with rows, few partial rows
                assert p.rows_per_block % p.groups_per_block == 0, ctx
                assert p.grid * p.rows_per_block >= rows and (p.grid - 1) * p.rows_per_block < max(rows, 1), ctx
                per_sm = max(1, min(1024 // p.block, occupancy or 1024))
                assert p.grid <= sms * per_sm, ctx


# -- staged backward rows (sm_90: bulk copies into shared memory) ---------------------------------

H200_SHARED = {"shared_per_sm": 233472, "shared_per_block": 232448}   # the H200's, as the driver reports
STAGED_RESERVE = 1024 + 256      # per block: CUDA's reserved kilobyte, the kernel's static shared memory

# (rows, hidden, itemsize, vec, arrays) -> (threads per row, steps, rows a step, rows_per_block,
# grid, stages), by hand: threads = next power of two of n within [64, 512], steps =
# ceil(n / threads), except 512 x 1 from 24 rows an SM, which becomes 256 threads x 2 steps,
# rows two at a time, and 128 x 1, which takes rows two at a time with up to six stages
# (four for blocks of up to 10 rows);
# stage = arrays x hidden x itemsize + 8; blocks per SM 1024 // (threads x rows a step), fewer
# until the wanted stages fit each one's share of the SM (or one block is left); stages: as
# many as fit, at most 4 (6 for 128 x 1 pairs) and at most rows_per_block; staged from 12 rows
# per SM.
STAGED_TABLE = [
    ((16384, 4096, 2, 8, 2), (256, 2, 2, 63, 261, 4)),  # 2 blocks; 115456 // 16392 = 7 fit
    ((16384, 4096, 2, 8, 3), (256, 2, 2, 63, 261, 4)),  # 115456 // 24584 = 4
    ((3168, 4096, 2, 8, 2), (256, 2, 2, 12, 264, 4)),   # 24 rows an SM: pairs
    ((3167, 4096, 2, 8, 2), (512, 1, 1, 12, 264, 4)),   # one row short of 24 an SM: a row at a time
    ((4096, 2048, 4, 4, 2), (256, 2, 2, 16, 256, 4)),   # float32 rows of 512 vectors: pairs
    ((4096, 8192, 2, 8, 3), (512, 2, 1, 32, 128, 4)),   # two blocks: 115456 // 49160 = 2; one: 4
    ((4096, 2048, 2, 8, 2), (256, 1, 1, 8, 512, 4)),    # 4 blocks; 57088 // 8200 = 6
    ((4096, 8192, 4, 4, 2), (512, 4, 1, 32, 128, 3)),   # n = 2048; one block: 232192 // 65544 = 3
    ((8192, 1000, 2, 8, 2), (128, 1, 2, 16, 512, 6)),   # n = 125: pairs, 4 blocks an SM, 16 rows each
    ((3167, 1000, 2, 8, 2), (128, 1, 2, 6, 528, 4)),    # 128 x 1: pairs below 24 rows an SM too
    ((5280, 1000, 2, 8, 3), (128, 1, 2, 10, 528, 4)),   # 10 rows a block: four stages
    ((5281, 1000, 2, 8, 3), (128, 1, 2, 11, 481, 6)),   # 11: six
    ((1584, 1000, 2, 8, 2), (128, 1, 2, 3, 528, 3)),    # ... down to 12 an SM (staged): three rows a block
    ((4096, 512, 4, 4, 3), (128, 1, 2, 8, 512, 4)),     # float32 rows of 128 vectors: pairs
]


@pytest.mark.parametrize("args, expected", STAGED_TABLE, ids=[str(a) for a, _ in STAGED_TABLE])
def test_staged_backward_plan_table(args, expected):
    rows, hidden, itemsize, vec, arrays = args
    p = rn.backward_plan(rows, hidden, itemsize, vec, H200_SMS, edges=False, arrays=arrays, **H200_SHARED)
    assert (p.variant, p.threads_per_row, p.vecs_per_thread, p.rows_per_step, p.rows_per_block, p.grid,
            p.stages) == ("staged", *expected)
    stage = arrays * hidden * itemsize + 8
    assert p.shared_bytes == p.stages * stage and p.block == p.threads_per_row and p.groups_per_block == 1
    assert p.template_args() == expected[:3] and not p.edges
    name = backward_launch.backward_instantiation_name("bfloat16", None, p)
    assert name == ("rmsnorm::rms_norm_backward_staged_kernel<__nv_bfloat16, __nv_bfloat16, "
                    f"{expected[0]}, {expected[1]}, {expected[2]}>")


def test_staged_pairs_forced_and_refused():
    # forced without a geometry: the staged geometry (512 x 1 here), two rows a step; eight
    # stages fit one block of 512 an SM, and four are wanted
    p = rn.backward_plan(4096, 4096, 2, 8, H200_SMS, edges=False, rows_per_step=2, **H200_SHARED)
    assert (p.threads_per_row, p.vecs_per_thread, p.rows_per_step, p.grid, p.stages) == (512, 1, 2, 128, 4)
    # a row a step, forced: no pairs where the heuristic would pair
    p = rn.backward_plan(4096, 4096, 2, 8, H200_SMS, edges=False, rows_per_step=1, **H200_SHARED)
    assert (p.threads_per_row, p.vecs_per_thread, p.rows_per_step, p.grid) == (512, 1, 1, 256)
    # fewer than four stages (two steps of two rows) refused; a block of three rows takes three
    with pytest.raises(ValueError, match="2 at a time needs 4 stages"):
        rn.backward_plan(4096, 4096, 2, 8, H200_SMS, edges=False, rows_per_step=2, stages=3, **H200_SHARED)
    p = rn.backward_plan(3 * H200_SMS, 4096, 2, 8, H200_SMS, edges=False, rows_per_step=2, max_blocks_per_sm=1,
                         **H200_SHARED)
    assert (p.rows_per_block, p.stages) == (3, 3)
    # four stages of 48 KiB for one block: fits; rows_per_step must be 1 or 2
    p = rn.backward_plan(4096, 8192, 2, 8, H200_SMS, edges=False, arrays=3, rows_per_step=2, **H200_SHARED)
    assert (p.threads_per_row, p.vecs_per_thread, p.rows_per_step, p.grid, p.stages) == (512, 2, 2, 128, 4)
    with pytest.raises(ValueError, match="rows_per_step must be 1 or 2"):
        rn.backward_plan(4096, 4096, 2, 8, H200_SMS, edges=False, rows_per_step=3, **H200_SHARED)
    # rows_per_step alone asks for the staged kernel: refused where it cannot run
    with pytest.raises(ValueError, match="16-byte grid"):
        rn.backward_plan(4096, 4096, 2, 8, H200_SMS, edges=True, rows_per_step=2, **H200_SHARED)


@pytest.mark.parametrize("args, why", [
    ((4096, 4096, 2, 8), {"edges": True}),                          # rows off the 16-byte grid
    ((4096, 4096, 2, 4), {}),                                       # 8-byte vectors
    ((4096, 4096, 2, 8), {"shared_per_sm": 0, "shared_per_block": 0}),   # no bulk copies (before sm_90)
    ((4096, 512, 2, 8), {}),                                        # 64 vectors: warp groups
    ((1024, 4096, 2, 8), {}),                                       # 7.8 rows an SM
    ((1583, 1000, 2, 8), {}),                                       # one row short of 12 an SM
    ((4096, 32768, 2, 8), {}),                                      # 8 steps a row
    ((64, 65536, 2, 8), {}),                                        # two stages do not fit
    ((4096, 4096, 2, 8), {"threads_per_row": 512, "vecs_per_thread": 1}),   # a forced register geometry
    ((4096, 4096, 2, 8), {"stages": 0}),
])
def test_backward_plans_that_are_not_staged(args, why):
    kw = {"edges": False, **H200_SHARED, **why}
    assert rn.backward_plan(*args, H200_SMS, **kw).variant != "staged"


def test_staged_backward_plan_forced_and_refused():
    p = rn.backward_plan(1024, 4096, 2, 8, H200_SMS, edges=False, threads_per_row=128, stages=2, **H200_SHARED)
    assert (p.variant, p.threads_per_row, p.vecs_per_thread, p.stages) == ("staged", 128, 4, 2)
    p = rn.backward_plan(1, 4096, 2, 8, H200_SMS, edges=False, stages=3, **H200_SHARED)
    assert (p.variant, p.rows_per_block, p.stages) == ("staged", 1, 1)      # one row: one stage
    with pytest.raises(ValueError, match="16-byte grid"):
        rn.backward_plan(4096, 4096, 2, 8, H200_SMS, edges=True, stages=2, **H200_SHARED)
    # three stages of 48 KiB: one block an SM instead of two; five do not fit a block
    p = rn.backward_plan(4096, 8192, 2, 8, H200_SMS, edges=False, arrays=3, stages=3, **H200_SHARED)
    assert (p.stages, p.grid, p.rows_per_block) == (3, 128, 32)
    with pytest.raises(ValueError, match="5 stages of 49160 bytes"):
        rn.backward_plan(4096, 8192, 2, 8, H200_SMS, edges=False, arrays=3, stages=5, **H200_SHARED)
    with pytest.raises(ValueError, match="two stages or more"):
        rn.backward_plan(4096, 4096, 2, 8, H200_SMS, edges=False, stages=1, rows_per_step=1, **H200_SHARED)
    assert rn.backward_plan(1584, 1000, 2, 8, H200_SMS, edges=False, **H200_SHARED).variant == "staged"
    # staged=True: staged wherever it can run (here four rows a block, which the heuristic leaves
    # to the register kernel), or an error; staged=False: never
    assert rn.backward_plan(1024, 4096, 2, 8, H200_SMS, edges=False, **H200_SHARED).variant == "registers"
    p = rn.backward_plan(1024, 4096, 2, 8, H200_SMS, edges=False, staged=True, **H200_SHARED)
    assert (p.variant, p.rows_per_block, p.stages) == ("staged", 4, 4)
    assert rn.backward_plan(16384, 4096, 2, 8, H200_SMS, edges=False, staged=False, **H200_SHARED).variant == "registers"
    with pytest.raises(ValueError, match="16-byte grid"):
        rn.backward_plan(4096, 4096, 2, 4, H200_SMS, edges=False, staged=True, **H200_SHARED)
    with pytest.raises(ValueError, match="at most 4 vectors"):
        rn.backward_plan(4096, 32768, 2, 8, H200_SMS, edges=False, staged=True, **H200_SHARED)
    with pytest.raises(ValueError, match="covering it"):
        rn.backward_plan(4096, 4096, 2, 8, H200_SMS, edges=False, threads_per_row=128, vecs_per_thread=2,
                         stages=2, **H200_SHARED)


def test_the_launchers_replan_keeps_the_kernel():
    """The launcher plans, compiles that plan's kernel, asks the driver how many of its blocks
    fit an SM and plans again with that and the first plan's kernel (its kind and, staged, its
    template arguments: backward_refit_keywords): the second plan must launch the same kernel.
    An earlier heuristic turned a register plan staged at lower occupancy, and the rows-a-step
    heuristic, replanned with rows_per_step alone, came back 512 x 1 for a kernel of 256 x 2;
    the H200 refused both launches (CUDA_ERROR_INVALID_VALUE)."""
    for rows, hidden, itemsize, arrays in itertools.product((1000, 1584, 4096, 16384), (1000, 2048, 4096, 8192),
                                                            (2, 4), (2, 3)):
        vec = 16 // itemsize
        if hidden % vec:
            continue
        first = rn.backward_plan(rows, hidden, itemsize, vec, H200_SMS, edges=False, arrays=arrays, **H200_SHARED)
        for occupancy in (1, 2, 3):
            again = rn.backward_plan(rows, hidden, itemsize, vec, H200_SMS, edges=False, arrays=arrays,
                                     max_blocks_per_sm=occupancy, **backward_refit_keywords(first), **H200_SHARED)
            ctx = (rows, hidden, itemsize, arrays, occupancy, first, again)
            assert again.variant == first.variant and again.template_args() == first.template_args(), ctx
            assert again.grid <= H200_SMS * occupancy, ctx


def test_staged_backward_plan_properties():
    count = 0
    for hidden in _sampled_hidden_sizes():
        for itemsize in (2, 4):
            vec = 16 // itemsize
            if hidden % vec:
                continue
            count += 1
            n = hidden // vec
            rows = (1, 257, 4096, 16384, 10 ** 6)[count % 5]
            occupancy = (None, 1, 2, 3)[count % 4]
            arrays = 2 + count % 2
            p = rn.backward_plan(rows, hidden, itemsize, vec, H200_SMS, edges=False, arrays=arrays,
                                 max_blocks_per_sm=occupancy, **H200_SHARED)
            ctx = (rows, hidden, itemsize, arrays, occupancy, p)
            if p.variant != "staged":
                continue
            g = p.threads_per_row
            assert g & (g - 1) == 0 and 64 <= g <= 512 and g * p.vecs_per_thread >= n, ctx
            assert 1 <= p.vecs_per_thread <= 4 and n > 64, ctx
            paired = (256 < n <= 512 and rows >= 24 * H200_SMS) or 64 < n <= 128
            most = 6 if paired and n <= 128 and p.rows_per_block > 10 else 4
            assert 1 <= p.stages <= min(most, p.rows_per_block) and rows >= 12 * H200_SMS, ctx
            assert p.stages >= min(2 * p.rows_per_step, p.rows_per_block), ctx
            assert p.rows_per_step == (2 if paired else 1), ctx
            stage = arrays * hidden * itemsize + 8
            assert p.shared_bytes == p.stages * stage, ctx
            per_sm = -(-p.grid // H200_SMS)
            assert p.shared_bytes + STAGED_RESERVE <= H200_SHARED["shared_per_block"], ctx
            assert per_sm * (p.shared_bytes + STAGED_RESERVE) <= H200_SHARED["shared_per_sm"], ctx
            assert per_sm <= min(1024 // (g * p.rows_per_step), occupancy or 1024), ctx
            assert p.grid * p.rows_per_block >= rows and (p.grid - 1) * p.rows_per_block < rows, ctx
    assert count > 20


def test_backward_plan_refuses_a_geometry_that_misses_part_of_the_row():
    # 1024 threads x 1 vector of 1 element cover 1024 of 4096 elements (a forced geometry
    # meeting the scalar path): refused, not launched
    with pytest.raises(ValueError, match="do not cover a row of 4096"):
        rn.backward_plan(10, 4096, 4, 1, 132, threads_per_row=1024, vecs_per_thread=1)
    assert rn.backward_plan(10, 4096, 4, 4, 132, threads_per_row=1024, vecs_per_thread=1).grid >= 1
