"""launch_plan for the quantized forms: the plain geometry, but for the per-token form's register
rule in large blocks, and the per-group form's preconditions."""

import pytest

from cupy_rmsnorm import launch_plan
from cupy_rmsnorm._plan import MAX_VECS_PER_THREAD_PER_TOKEN_LARGE_BLOCK, QUANT_GROUP

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
