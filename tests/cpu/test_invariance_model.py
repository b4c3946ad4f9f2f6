"""Batch invariance on the CPU: the canonical summation tree (cupy_rmsnorm/_reference.py,
``canonical_sum_of_squares``) and a step-by-step NumPy model of the order in which the
kernel adds (kernels/rms_norm.cu: vector trees, SlotSums' reduce-scatter over lanes, warps
and cluster ranks, the slots' tree; streamed rows in batches, epochs and a binary counter).

The model follows the kernel's data movement literally (which lane holds which slot after
each exchange, which warp writes which shared-memory cell), so a wrong lane mapping there
shows up here as a wrong bit, without a GPU. Every plan the launcher can make, and forced
ones, must give the canonical tree's bits.
"""

import itertools

import ml_dtypes
import numpy as np
import pytest

import cupy_rmsnorm as rn
from cupy_rmsnorm._reference import canonical_sum_of_squares

F32 = np.float32
BATCH = {False: 4, True: 2}   # the streamed kernel's steps per lane exchange (rms_norm, fused)
EPOCH = 32                    # kEpoch


def _log2(n):
    return n.bit_length() - 1


def pairwise(a):
    """Binary tree over the last axis (a power of two), neighbours first."""
    while a.shape[-1] > 1:
        a = (a[..., 0::2] + a[..., 1::2]).astype(F32)
    return a[..., 0]


# -- SlotSums<SLOTS, LANES>, lane by lane -------------------------------------------------
def held(lane, r, slots, lanes):
    h = _log2(min(slots, lanes))
    return r + sum(((lane >> k) & 1) * (slots >> (k + 1)) for k in range(h))


def over_lanes(p, lanes):
    """p: (32, SLOTS) float32, lane l's slots; xor exchanges within groups of `lanes` lanes.
    Returns (32, KEPT): what each lane keeps."""
    slots = p.shape[1]
    lane = np.arange(p.shape[0])
    for k in range(_log2(min(slots, lanes))):
        half = p.shape[1] // 2
        upper = ((lane >> k) & 1).astype(bool)[:, None]
        give = np.where(upper, p[:, :half], p[:, half:])
        keep = np.where(upper, p[:, half:], p[:, :half])
        p = (keep + give[lane ^ (1 << k)]).astype(F32)
    o = 1 << _log2(min(slots, lanes))
    while o < lanes:
        p = (p + p[lane ^ o]).astype(F32)
        o *= 2
    return p


def slot_tree(p, slots, lanes):
    lane = np.arange(p.shape[0])
    t = pairwise(p)
    for k in reversed(range(_log2(min(slots, lanes)))):
        t = (t + t[lane ^ (1 << k)]).astype(F32)
    return t


def _one_value(t):
    assert np.all(t.view(np.uint32) == t.view(np.uint32)[0]), "lanes disagree"
    return t[0]


# -- the kernel's sum for one row ------------------------------------------------------------
def vector_trees(squares, vec):
    n_vec = -(-squares.size // vec)
    padded = np.zeros(n_vec * vec, F32)
    padded[:squares.size] = squares
    return pairwise(padded.reshape(n_vec, vec))


def block_total(warp_sums, warps):
    """warp_sums: (SLOTS, WARPS) of one block; what each lane keeps after the warps' level."""
    lane = np.arange(32)
    return over_lanes(warp_sums[:, lane % warps].T.copy(), warps)


def kernel_sum(squares, vec, threads, vecs, cluster, fused=False):
    """The row's sum as kernels/rms_norm.cu adds it under a plan (vecs=0: streamed)."""
    vt = vector_trees(squares, vec)
    n_vec, step = vt.size, threads * cluster
    lanes, warps = min(threads, 32), max(1, threads // 32)

    def at(v):
        return np.where(v < n_vec, vt[np.minimum(v, n_vec - 1)], F32(0))

    if vecs:                                     # the row in registers: slots i < vecs
        assert threads * vecs * cluster >= n_vec
        blocks = []
        for rank in range(cluster):
            first = rank * threads + np.arange(threads)
            part = np.stack([at(first + i * step) for i in range(vecs)], axis=1)   # (threads, slots)
            if threads <= 32:
                return _one_value(slot_tree(over_lanes(part, lanes), vecs, lanes))
            warp_sums = np.zeros((vecs, warps), F32)
            for w in range(warps):
                kept = over_lanes(part[32 * w:32 * (w + 1)], 32)
                for lane in range(min(vecs, 32)):
                    for r in range(kept.shape[1]):
                        warp_sums[held(lane, r, vecs, 32), w] = kept[lane, r]
            blocks.append(block_total(warp_sums, warps))
        if cluster == 1:
            return _one_value(slot_tree(blocks[0], vecs, warps))
        block_sums = np.zeros((cluster, vecs), F32)
        h = min(vecs, warps)
        for rank, kept in enumerate(blocks):
            for lane in range(h):
                for r in range(kept.shape[1]):
                    block_sums[rank, held(lane, r, vecs, warps)] = kept[lane, r]
        q = block_sums[np.arange(32) % cluster]
        return _one_value(slot_tree(over_lanes(q, cluster), vecs, cluster))

    # streamed: batches over the lanes, epochs over the warps and ranks, a counter over epochs
    batch = BATCH[fused]
    steps = -(-n_vec // step)
    lane = np.arange(32)
    levels, epochs = {}, 0
    for e0 in range(0, steps, EPOCH):
        count = min(EPOCH, steps - e0)
        step_sums = np.zeros((cluster, EPOCH), F32)
        for rank in range(cluster):
            warp_sums = np.full((EPOCH, warps), np.nan, F32)
            for b0 in range(0, count, batch):
                for w in range(warps):
                    first = rank * threads + 32 * w + lane
                    part = np.stack([at(first + (e0 + b0 + k) * step) for k in range(batch)], axis=1)
                    kept = over_lanes(part, 32)
                    for l in range(batch):
                        warp_sums[b0 + held(l, 0, batch, 32), w] = kept[l, 0]
            for s in range(EPOCH):
                t = warp_sums[s, lane % warps] if s < count else np.zeros(32, F32)
                o = 1
                while o < warps:
                    t = (t + t[lane ^ o]).astype(F32)
                    o *= 2
                step_sums[rank, s] = _one_value(t)
        sums = step_sums[0]
        if cluster > 1:
            sums = np.zeros(EPOCH, F32)
            for s in range(EPOCH):
                t = step_sums[lane % cluster, s]
                o = 1
                while o < cluster:
                    t = (t + t[lane ^ o]).astype(F32)
                    o *= 2
                sums[s] = _one_value(t)
        t = sums[lane].copy()
        for o in (1, 2, 4, 8, 16):
            t = (t + t[lane ^ o]).astype(F32)
        total = _one_value(t)
        k = 0                                    # push_epoch
        while (epochs >> k) & 1:
            total = F32(levels[k] + total)
            k += 1
        levels[k] = total
        epochs += 1
    if steps <= EPOCH:
        return levels[0]
    t = F32(0)                                   # fold_epochs
    for k in range(epochs.bit_length()):
        if (epochs >> k) & 1:
            t = F32(levels[k] + t)
    return t


def _bits(v):
    return np.asarray(v, F32).view(np.uint32)


def _squares(values):
    f = np.asarray(values, F32)
    return (f * f).astype(F32)


def _rows(rng, hidden, dtype=np.float32, n=1):
    """Random rows whose magnitudes span 2**-8 .. 2**8: any change of order shows in the bits."""
    return (rng.standard_normal((n, hidden)) * np.exp2(rng.uniform(-8, 8, (n, hidden)))).astype(dtype)


# -- the canonical tree itself -------------------------------------------------------------
def test_canonical_tree_is_the_pairwise_tree_padded_with_zeros():
    x = np.array([[1.0, 2.0, 3.0]], F32)
    assert canonical_sum_of_squares(x)[0] == F32((1 + 4) + (9 + 0))
    x = np.array([1e8, 1.0, -1e8, 1.0], F32)           # the order shows in float32
    assert canonical_sum_of_squares(x) == F32(F32(1e16 + 1) + F32(1e16 + 1))
    assert canonical_sum_of_squares(np.zeros((2, 0, 5), F32)).shape == (2, 0)
    assert canonical_sum_of_squares(np.ones(1, F32)) == 1


@pytest.mark.parametrize("hidden", [1, 2, 7, 255, 256, 1000, 4095, 4096, 5120, 65537])
def test_any_power_of_two_split_gives_the_same_bits(hidden):
    """Summing vectors of 2**a elements as trees, then 2**b of those at a time, and so on
    (any split, any padding to a longer power of two), gives the canonical bits."""
    rng = np.random.default_rng(hidden)
    x = _rows(rng, hidden, n=3)
    want = _bits(canonical_sum_of_squares(x))
    q = _squares(x)
    width = 1 << max(0, (hidden - 1).bit_length())
    for extra in (1, 2, 8):                             # padded further
        padded = np.zeros((3, width * extra), F32)
        padded[:, :hidden] = q
        for split in ((1,), (8,), (2, 16), (4, 32, 8), (8, 32, 4, 8)):
            a = padded
            for s in split:                             # the low levels, a group at a time
                if a.shape[-1] % s:
                    break
                a = pairwise(a.reshape(3, -1, s))
            assert np.array_equal(_bits(pairwise(a)), want), (hidden, extra, split)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_reference_uses_the_canonical_sum(dtype):
    """rms_norm_reference normalizes by the canonical sum (float32 math otherwise as before)."""
    rng = np.random.default_rng(3)
    x = _rows(rng, 1000, dtype, n=4)
    xf = x.astype(F32)
    inv = F32(1) / np.sqrt(canonical_sum_of_squares(x)[:, None] / F32(1000) + F32(1e-6))
    assert np.array_equal(rn.rms_norm_reference(x, eps=1e-6), (xf * inv).astype(dtype))


def test_flush_subnormals():
    x = np.array([1e-20, 1.0], F32)                     # 1e-40 is a float32 subnormal
    assert canonical_sum_of_squares(x, flush_subnormals=True) == F32(1.0)
    assert canonical_sum_of_squares(x[:1]) > 0 and canonical_sum_of_squares(x[:1], flush_subnormals=True) == 0


# -- the kernel's order, plan by plan ---------------------------------------------------------
SMS = 132


def _launcher_plans(hidden, vec, fused):
    """Every distinct (threads, vecs, cluster) launch_plan makes for this row at any row count."""
    plans = set()
    for rows in (1, 2, 5, 16, 17, 33, 67, 256, 257, 4096, 10 ** 6):
        p = rn.launch_plan(rows, hidden, 2, vec, SMS, fused, max_cluster=8)
        plans.add((p.threads_per_row, p.vecs_per_thread, p.cluster))
    return plans


def _forced_plans(hidden, vec):
    """Forced plans that cover the row, a sample of every shape the kernel has."""
    n = -(-hidden // vec)
    plans = set()
    for g, nv, c in itertools.product((8, 16, 32, 64, 128, 1024), (0, 1, 2, 4, 8), (1, 2, 4)):
        if (nv == 0 and g <= 32) or (c > 1 and g <= 32):
            continue
        if nv and (g * nv * c < n or g * nv * c > 16 * n + 1024):
            continue
        if nv == 0 and n > 20_000 and g < 64:
            continue
        plans.add((g, nv, c))
    return plans


@pytest.mark.parametrize("hidden", [1, 7, 100, 255, 256, 1000, 4095, 4096, 8192, 33001])
def test_every_plan_adds_in_the_canonical_order(hidden):
    """The model of the kernel gives the canonical bits under every plan the launcher makes
    (all vector widths) and a sample of forced ones, streamed rows included."""
    rng = np.random.default_rng(hidden + 1)
    for x in _rows(rng, hidden, ml_dtypes.bfloat16, n=2):
        want = _bits(canonical_sum_of_squares(x))
        q = _squares(x)
        for vec in (1, 2, 4, 8):
            for fused in (False, True):
                plans = _launcher_plans(hidden, vec, fused) | (_forced_plans(hidden, vec) if vec == 8 else set())
                for g, nv, c in sorted(plans):
                    got = _bits(kernel_sum(q, vec, g, nv, c, fused))
                    assert got == want, (hidden, vec, fused, g, nv, c)


def test_streamed_rows_of_many_epochs():
    """Rows of more than one epoch (32 steps): the epochs' counter and its fold."""
    rng = np.random.default_rng(7)
    for hidden, g, c in ((64 * 32 * 5 + 3, 64, 1), (128 * 32 * 3 + 1, 64, 2), (64 * 32 * 2, 64, 1),
                         (64 * 32 * 7 * 4, 256, 1)):
        q = _squares(_rows(rng, hidden)[0])
        want = _bits(pairwise(np.concatenate([q, np.zeros((1 << (hidden - 1).bit_length()) - hidden, F32)])))
        for vec in (1, 4):
            for fused in (False, True):
                assert _bits(kernel_sum(q, vec, g, 0, c, fused)) == want, (hidden, g, c, vec, fused)


def test_the_model_catches_a_wrong_order():
    """Sanity: a sequential sum (the old kernel's per-thread loop) differs somewhere."""
    rng = np.random.default_rng(11)
    q = _squares(_rows(rng, 4096)[0])
    sequential = F32(0)
    for v in q:
        sequential = F32(sequential + v)
    assert _bits(sequential) != _bits(kernel_sum(q, 8, 128, 4, 1))
