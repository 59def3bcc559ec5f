"""Every family through a CPU pool: the same results as its in-process GraphEncoder."""

from __future__ import annotations

import pytest
import torch
from family_tiny import FAMILY_CASES, mixed_items, save_tiny_tower

from vitpool import EncoderPool, GraphEncoder, InvalidItemError, Video

pytestmark = pytest.mark.ray

BUDGETS = [16, 64, 256]


@pytest.mark.parametrize("family", sorted(FAMILY_CASES))
def test_a_pool_of_the_family_equals_its_encoder(ray_cluster, tmp_path, family):
    directory = save_tiny_tower(family, tmp_path)
    reference = GraphEncoder.from_pretrained(directory, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    items = mixed_items(family)
    pool = EncoderPool.launch(model=str(directory), budgets=BUDGETS, name=f"family-{family}", num_actors=1,
                              device="cpu")
    try:
        for got, want in zip(pool.encode(items), reference.encode(items), strict=True):
            assert got.tokens.shape == want.tokens.shape and len(got.deepstack) == len(want.deepstack)
            torch.testing.assert_close(got.tokens, want.tokens, rtol=1e-5, atol=1e-5)
        with pytest.raises(InvalidItemError, match="item 1"):  # checked in this process, by the rules
            pool.encode([items[0], Video(items[1].pixel_values, (2, 8, 6))])
    finally:
        pool.shutdown()
