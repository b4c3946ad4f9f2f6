"""The QK norm + RoPE plans (cupy_rmsnorm/_plan.py: rope_pairs, qk_rope_plan,
qk_rope_backward_plan), pure functions checked on the CPU: the geometry covers a head and fits
the kernels' shared memory, the forward's split (which the kernel reads back from the launch)
reaches every (token, head) once, a channel's partner lies where the kernel looks for it, and
the backward's walk covers every item once, in a fixed order. And the launcher's Params: the
element each (token, head) starts at, as the kernels compute it, for the layouts of a call."""

import itertools
import re

import numpy as np
import pytest

from cupy_rmsnorm import _abi, _compile, _launcher, _layout, _validate
from cupy_rmsnorm import _plan as P
from cupy_rmsnorm._interop import NumpyKind
from cupy_rmsnorm.ops.qk_rope import checks as qk_rope_checks
from cupy_rmsnorm.ops.qk_rope import launch as qk_rope_launch
from cupy_rmsnorm.ops.qk_rope import plan as qk_rope_plan

HEAD_DIMS = tuple(range(2, qk_rope_plan.QK_ROPE_MAX_HEAD_DIM + 1, 2))
VECS = (1, 2, 4, 8)


def rotary_dims(head_dim):
    """Full, half (when even) and a few others: powers of two, and one that is not."""
    dims = {head_dim, head_dim // 2 if head_dim % 4 == 0 else head_dim, 2, 6}
    dims |= {d for d in (8, 16, 32, 64, 128, 256, 48, 96, 80) if d <= head_dim}
    return sorted(d for d in dims if d <= head_dim and d % 2 == 0)


def test_rope_pairs():
    assert qk_rope_plan.rope_pairs(128, False) == qk_rope_plan.rope_pairs(6, False) == 1          # interleaved pairs
    assert qk_rope_plan.rope_pairs(128, True) == 64 and qk_rope_plan.rope_pairs(64, True) == 32   # NeoX halves, powers of two
    assert qk_rope_plan.rope_pairs(2, True) == 1                                       # one pair: both layouts agree
    assert qk_rope_plan.rope_pairs(96, True) == 0 and qk_rope_plan.rope_pairs(80, True) == 0      # through shared memory
    for bad in (0, 3, -2):
        with pytest.raises(ValueError, match=r"^rotary_dim must be even and >= 2"):
            qk_rope_plan.rope_pairs(bad, True)


@pytest.mark.parametrize("backward", [False, True])
def test_geometry_covers_a_head_and_fits_the_shared_memory(backward):
    """Every head_dim up to the limit, at every vector width that divides it: a power of two of
    8 to 32 threads, a power of two of vectors, covering the head, at most 16 elements a thread
    (kernels/qk_norm_rope.cu sizes its shared memory for 256 threads of those)."""
    for head_dim, vec in itertools.product(HEAD_DIMS, VECS):
        if head_dim % vec:
            continue
        threads, vecs = qk_rope_plan.qk_rope_geometry(head_dim, vec, backward)
        assert threads in (8, 16, 32) and vecs & (vecs - 1) == 0
        assert threads * vecs * vec >= head_dim
        assert vecs * vec <= 16, (head_dim, vec)
        per_thread = 1 if backward else 2
        if head_dim // vec <= 32 * per_thread:                          # a warp's share: the plain geometry
            assert vecs <= per_thread


def _forward_items(plan, tokens, heads):
    """The (token, head) each group of the launch works on, as the kernel reads it back from the
    launch (forward_item in kernels/qk_norm_rope.cu): {(token, head): groups}."""
    seen = {}
    per_block = -(-heads // plan.head_chunks)
    token_threads = -(-per_block * plan.threads_per_head // 32) * 32
    for bx, by in itertools.product(range(plan.token_blocks), range(plan.head_chunks)):
        for t in range(0, plan.block, plan.threads_per_head):      # a group's first thread
            in_block = t // token_threads
            group = (t - in_block * token_threads) // plan.threads_per_head
            token = bx * (plan.block // token_threads) + in_block
            head = by * per_block + group
            if token < tokens and group < per_block and head < heads:
                seen[(token, head)] = seen.get((token, head), 0) + 1
    return seen


@pytest.mark.parametrize("tokens", [1, 3, 7, 40])
@pytest.mark.parametrize("heads", [1, 3, 5, 12, 40, 72, 132, 260])
@pytest.mark.parametrize("head_dim,rotary_dim,vec", [(128, 128, 8), (64, 64, 4), (96, 96, 8), (256, 128, 1)])
def test_forward_split_reaches_every_head_once(tokens, heads, head_dim, rotary_dim, vec):
    plan = qk_rope_plan.qk_rope_plan(tokens, heads, head_dim, rotary_dim, True, vec)
    most = qk_rope_plan.QK_ROPE_EXCHANGE_BLOCK if plan.pairs == 0 else qk_rope_plan.QK_ROPE_TOKEN_THREADS
    assert plan.block % 32 == 0 and plan.token_threads % 32 == 0        # a warp never holds two tokens
    assert plan.token_threads <= most and plan.block <= max(most, qk_rope_plan.QK_ROPE_BLOCK)
    assert plan.heads_per_block == -(-heads // plan.head_chunks)        # what the kernel computes
    assert plan.block // plan.token_threads == plan.tokens_per_block
    assert plan.grid == plan.token_blocks * plan.head_chunks and plan.grid_dims() == (plan.token_blocks,
                                                                                     plan.head_chunks)
    seen = _forward_items(plan, tokens, heads)
    assert seen == {(t, h): 1 for t in range(tokens) for h in range(heads)}


def test_forward_plan_is_a_function_of_its_arguments():
    a = qk_rope_plan.qk_rope_plan(4096, 40, 128, 128, True, 8)
    assert a == qk_rope_plan.qk_rope_plan(4096, 40, 128, 128, True, 8)
    # Qwen3-8B's heads (32 q + 8 k) of 128 in 16-byte vectors: 8 threads a head, two vectors each,
    # one token's 40 heads in a block of 320 threads; NeoX halves 64 channels apart: in a thread
    assert (a.threads_per_head, a.vecs_per_thread, a.pairs, a.block, a.head_chunks) == (8, 2, 64, 320, 1)
    assert a.pairs >= a.vec * a.threads_per_head
    # a token's 132 heads take two chunks; few heads: several tokens a block
    assert qk_rope_plan.qk_rope_plan(10, 132, 128, 128, True, 8).head_chunks == 3
    small = qk_rope_plan.qk_rope_plan(1000, 3, 64, 64, False, 8)
    assert small.tokens_per_block == 8 and small.block == 256


def _holder(j, vec, lanes):
    """(lane, vector, element) of a head's element j (j = e + vec * (lane + lanes * i))."""
    v, e = divmod(j, vec)
    i, lane = divmod(v, lanes)
    return lane, i, e


@pytest.mark.parametrize("backward", [False, True])
def test_partners_lie_where_the_kernel_looks(backward):
    """For PAIRS > 0, the partner j ^ PAIRS of every rotated element j is in the same vector
    (PAIRS < VEC), the same vector of lane ^ (PAIRS / VEC), or vector i ^ (PAIRS / (VEC x
    LANES)) of the same lane (kernels/qk_norm_rope.cu: partner_values); and it is the rope's
    partner: j +- rotary_dim / 2 (NeoX) or j ^ 1 (interleaved). Rotated elements sit in the
    first Rotating::value vectors of a thread."""
    for head_dim, vec in itertools.product((2, 6, 64, 80, 96, 128, 256, 512), VECS):
        if head_dim % vec:
            continue
        threads, vecs = qk_rope_plan.qk_rope_geometry(head_dim, vec, backward)
        for rd, neox in itertools.product(rotary_dims(head_dim), (True, False)):
            pairs = qk_rope_plan.rope_pairs(rd, neox)
            if pairs == 0:
                continue
            rotating = vecs if pairs == 1 else min(vecs, -(-2 * pairs // (vec * threads)))
            half = rd // 2
            for j in range(rd):
                partner = (j + half if j < half else j - half) if neox else j ^ 1
                assert j ^ pairs == partner, (rd, neox, j)
                lane, i, e = _holder(j, vec, threads)
                assert i < rotating
                if pairs < vec:
                    want = (lane, i, e ^ pairs)
                elif pairs < vec * threads:
                    want = (lane ^ (pairs // vec), i, e)
                else:
                    want = (lane, i ^ (pairs // (vec * threads)), e)
                assert _holder(partner, vec, threads) == want


@pytest.mark.parametrize("tokens,heads", [(0, 40), (1, 3), (7, 40), (1000, 12), (4096, 72)])
@pytest.mark.parametrize("head_dim,vec", [(128, 8), (64, 4), (96, 2), (512, 8)])
def test_backward_runs_cover_the_items(tokens, heads, head_dim, vec):
    plan = qk_rope_plan.qk_rope_backward_plan(tokens, heads, head_dim, head_dim, True, vec, 132)
    assert plan.block == qk_rope_plan.QK_ROPE_BACKWARD_BLOCK == plan.groups * plan.threads_per_head
    assert plan.items_per_block % plan.groups == 0
    items = tokens * heads
    assert plan.grid * plan.items_per_block >= items and (plan.grid - 1) * plan.items_per_block < max(items, 1)
    assert plan.partials == plan.grid
    assert plan == qk_rope_plan.qk_rope_backward_plan(tokens, heads, head_dim, head_dim, True, vec, 132)    # a fixed order
    # the kernel's walk (qk_norm_rope_backward_kernel): group g of block b starts at item
    # b * items_per_block + g and steps by groups, its (token, head) carried along
    seen = set()
    for b, g in itertools.product(range(plan.grid), range(plan.groups)):
        begin = b * plan.items_per_block
        end = min(begin + plan.items_per_block, items)
        item = begin + g
        token, head = divmod(item, heads)
        for _ in range(begin, end, plan.groups):
            if item < end:
                assert (token, head) == divmod(item, heads) and (token, head) not in seen
                seen.add((token, head))
            item, head = item + plan.groups, head + plan.groups
            while head >= heads:
                head, token = head - heads, token + 1
    assert len(seen) == items
    capped = qk_rope_plan.qk_rope_backward_plan(tokens, heads, head_dim, head_dim, True, vec, 132, max_blocks_per_sm=1)
    assert capped.grid <= 132 and capped.grid * capped.items_per_block >= items


def test_forced_geometry():
    plan = qk_rope_plan.qk_rope_plan(10, 8, 128, 128, True, 8, threads_per_head=16, vecs_per_thread=1)
    assert (plan.threads_per_head, plan.vecs_per_thread) == (16, 1)
    with pytest.raises(ValueError, match=r"do not cover a head of 128"):
        qk_rope_plan.qk_rope_plan(10, 8, 128, 128, True, 8, threads_per_head=8, vecs_per_thread=1)
    with pytest.raises(ValueError, match=r"^threads_per_head must be a power of two up to 32"):
        qk_rope_plan.qk_rope_backward_plan(10, 8, 128, 128, True, 8, 132, threads_per_head=64)
    with pytest.raises(ValueError, match=r"rotary_dim <= head_dim <= 512"):
        qk_rope_plan.qk_rope_plan(10, 8, 1024, 128, True, 8)


def test_the_kernel_constants_match_the_plan():
    src = _compile.kernel_file("qk_norm_rope.cu")
    assert int(re.search(r"constexpr int kQkExchangeBlock = (\d+);", src).group(1)) == qk_rope_plan.QK_ROPE_EXCHANGE_BLOCK
    backward = _compile.kernel_file("qk_norm_rope_backward.cu")
    assert int(re.search(r"constexpr int kQkBackwardBlock = (\d+);", backward).group(1)) == \
        qk_rope_plan.QK_ROPE_BACKWARD_BLOCK
    assert "__launch_bounds__(512)" in src and qk_rope_plan.QK_ROPE_TOKEN_THREADS == 512 and qk_rope_plan.QK_ROPE_BLOCK <= 512
    # the kernel's read-back of the split is the plan's formula
    assert "const int per_block = (heads + (int)gridDim.y - 1) / (int)gridDim.y;" in src
    assert "const int token_threads = (per_block * LANES + 31) / 32 * 32;" in src
    # the shared memory: 256 threads of at most 16 elements (test above) in float32
    assert "__shared__ float shared[kQkBackwardBlock * VECS * VEC];" in backward


# -- the launcher's Params: a token's and a head's first element, as the kernels compute it ---------

def _params_of(arrays, **keywords):
    """(arrays after the layout, the layout, the forward's QkRopeParams record) of a NumPy call."""
    arrays = qk_rope_launch.QkRopeArrays(**arrays)
    spec = qk_rope_checks.check_qk_rope(arrays, keywords.get("rotary_dim"), keywords.get("is_neox", True))
    metas = qk_rope_launch.QkRopeArrays(*(None if a is None else NumpyKind.meta(a) for a in arrays))
    spec = qk_rope_checks.check_qk_rope_arrays(metas, spec)
    arrays, layout = qk_rope_launch.qk_rope_layout(NumpyKind, arrays, metas, spec)
    params = np.zeros(1, qk_rope_launch.QK_ROPE_PARAMS_DTYPE)
    qk_rope_launch._qk_rope_params(params, layout, _validate.check_scalars(1e-6, 0.0, "fp32", False),
                              qk_rope_launch._HEAD_MAJOR)
    return arrays, layout, params[0]


def _element(a, index):
    """Element offset of a[index] from a's first element (a NumPy array, broadcast ones too)."""
    return sum(i * s for i, s in zip(index, a.strides)) // a.itemsize


def _packed(lead, hq, hk, d, dtype="float16"):
    """q and k: per-head views of a packed (lead..., (hq + 2 hk) d) projection."""
    qkv = np.zeros(lead + ((hq + 2 * hk) * d,), dtype)
    return qkv[..., :hq * d].reshape(lead + (hq, d)), qkv[..., hq * d:(hq + hk) * d].reshape(lead + (hk, d))


@pytest.mark.parametrize("layout", ["packed", "batched", "transposed", "one token", "three axes"])
def test_params_address_every_token_and_head(layout):
    """row_offset(outer, inner) + head * head stride, as the kernels compute it from the Params,
    is q[token, head, 0] (k, cos, sin, positions, a given out_q) and the fresh out_k's
    contiguous element, for every token and head."""
    hq, hk, d = 4, 2, 64
    if layout == "packed":
        lead = (5,)
        q, k = _packed(lead, hq, hk, d)
    elif layout == "batched":
        lead = (3, 5)
        q, k = _packed(lead, hq, hk, d)
    elif layout == "transposed":              # (T, B) views of a (B, T) projection
        lead = (5, 3)
        q, k = (a.swapaxes(0, 1) for a in _packed((3, 5), hq, hk, d))
    elif layout == "one token":
        lead = ()
        q, k = _packed((1,), hq, hk, d)
        q, k = q[0], k[0]
    else:                                       # three token axes that merge into no two levels
        lead = (2, 3, 4)
        q, k = (a[::2, ::2, ::2] for a in _packed((4, 6, 8), hq, hk, d))
    cos = np.ones(lead[-1:] + (d,), np.float32) if lead else np.ones(d, np.float32)
    out_q = np.empty_like(q)
    arrays, lay, p = _params_of(dict(q=q, k=k, cos=cos, sin=cos.copy(), out_q=out_q))
    assert lay.copied == (layout == "three axes")        # inputs past two levels: contiguous copies
    q, k = arrays.q, arrays.k
    n_inner = int(p["n_inner"])
    tokens = list(np.ndindex(*lead)) if lead else [()]
    assert int(p["tokens"]) == len(tokens)
    for t, index in enumerate(tokens):
        outer, inner = divmod(t, n_inner)

        def first(name):
            return outer * int(p[name][0]) + inner * int(p[name][1])

        for h in range(hq):
            assert first("q") + h * int(p["q_head"]) == _element(q, index + (h, 0))
            assert first("out_q") + h * int(p["out_q_head"]) == _element(arrays.out_q, index + (h, 0))
        for h in range(hk):
            assert first("k") + h * int(p["k_head"]) == _element(k, index + (h, 0))
            assert first("out_k") + h * int(p["out_k_head"]) == (t * hk + h) * d      # fresh: contiguous
        assert first("cos") == _element(arrays.cos, index + (0,))                 # broadcast over the batch
        assert first("sin") == _element(arrays.sin, index + (0,))
