"""launch_plan for the quantized forms: the plain geometry, but for the per-token form's register
rule in large blocks, the per-group form's preconditions and where rows take 32-bit offsets."""

import pytest

from cupy_rmsnorm import launch_plan
from cupy_rmsnorm._plan import MAX_VECS_PER_THREAD_PER_TOKEN_LARGE_BLOCK, QUANT_GROUP, fits_32_bit_offsets

SMS = 132


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("rows", [1, 100, 4096])
def test_static_and_per_group_plans_are_the_plain_ones(rows, fused):
    for hidden in (128, 1024, 4096, 7168, 8192, 16384, 32768, 65536):
        plain = launch_plan(rows, hidden, 2, 8, SMS, fused, edges=False, max_cluster=8)
        for form in ("static", "per_group"):
            assert launch_plan(rows, hidden, 2, 8, SMS, fused, edges=False, max_cluster=8, quant=form) == plain


def test_per_token_keeps_two_vectors_a_thread_in_large_blocks():
    changed = 0
    for rows in (1, 100, 4096):
        for hidden in range(1024, 65537, 1024):
            plain = launch_plan(rows, hidden, 2, 8, SMS, edges=True, max_cluster=8)
            p = launch_plan(rows, hidden, 2, 8, SMS, edges=True, max_cluster=8, quant="per_token")
            if p.block >= 512:
                assert p.vecs_per_thread <= MAX_VECS_PER_THREAD_PER_TOKEN_LARGE_BLOCK, p
            if p != plain:
                changed += 1
                assert plain.block >= 512 or plain.vecs_per_thread > 2
            else:
                assert p.block < 512 or p.vecs_per_thread <= 2
    assert changed       # (bf16 rows of 16K-32K among many rows: streamed, not 4 vectors a thread)
    p = launch_plan(4096, 32768, 2, 8, SMS, quant="per_token")
    assert (p.variant, p.block) == ("stream", 1024)


def test_per_group_preconditions():
    with pytest.raises(ValueError, match="per_group"):
        launch_plan(4, 4096, 2, 8, SMS, edges=True, quant="per_group")
    with pytest.raises(ValueError, match="per_group"):
        launch_plan(4, QUANT_GROUP * 3 + 8, 2, 8, SMS, edges=False, quant="per_group")
    with pytest.raises(ValueError, match="quant must be one of"):
        launch_plan(4, 4096, 2, 8, SMS, quant="per_block")


def test_32_bit_offsets_where_blocks_outnumber_the_sms_without_clusters():
    """flat (the call fits 32-bit offsets) is taken by quantized plans whose grid has more blocks
    than SMs and no cluster, but for the fused per-token form; never by the plain op's."""
    for fused in (False, True):
        for form in ("static", "per_token", "per_group"):
            taken = not (fused and form == "per_token")
            for rows, hidden, want in ((1, 4096, False), (132, 4096, False), (133, 4096, True), (256, 4096, True),
                                       (32, 7168, False), (4096, 4096, True), (4096, 512, True), (64, 65536, False)):
                p = launch_plan(rows, hidden, 2, 8, SMS, fused, edges=False, max_cluster=8, quant=form, flat=True)
                assert p.flat == (want and taken) and (p.cluster == 1 or not p.flat), (fused, form, rows, hidden, p)
                assert not launch_plan(rows, hidden, 2, 8, SMS, fused, edges=False, max_cluster=8, quant=form).flat
            p = launch_plan(4096, 512, 2, 8, SMS, fused, edges=False, max_cluster=8, quant=form, flat=True)
            assert p.rows_per_block > 1 and p.flat == taken
        assert not launch_plan(4096, 4096, 2, 8, SMS, fused, edges=False, max_cluster=8, flat=True).flat


def test_fits_32_bit_offsets():
    limit = 2 ** 31
    assert fits_32_bit_offsets(4096, 4096, 1, [4096, 4096, 0, 0])
    assert not fits_32_bit_offsets(4096, 4096, 2, [4096, 4096, 0, 0])          # per-head rows
    rows, hidden = 1 << 17, 1 << 14                                              # 2**31 elements
    assert not fits_32_bit_offsets(rows, hidden, 1, [hidden])
    assert fits_32_bit_offsets(rows, hidden - 1, 1, [hidden - 1])
    stride = (limit - 4096) // (rows - 1)                                        # the last row just fits, or not
    assert fits_32_bit_offsets(rows, limit - 1 - (rows - 1) * stride, 1, [stride])
    assert not fits_32_bit_offsets(rows, limit - (rows - 1) * stride, 1, [stride])
    assert fits_32_bit_offsets(rows, 16, 1, [-stride]) and not fits_32_bit_offsets(rows, 16, 1, [-stride - 1])
    assert fits_32_bit_offsets(1, 16, 1, [1 << 40])                             # one row: no stride taken
    assert fits_32_bit_offsets(rows, 16, 1, [16], scales_strides=(1, rows), groups=1 << 14)   # 2**31 - 1
    assert not fits_32_bit_offsets(rows, 16, 1, [16], scales_strides=(1, rows), groups=(1 << 14) + 1)
    assert fits_32_bit_offsets(4096, 4096, 1, [4096], scales_strides=(1, 4096), groups=32)
