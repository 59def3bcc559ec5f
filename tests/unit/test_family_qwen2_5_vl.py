"""Qwen2.5-VL's own checks: attention windows as a per-batch capacity (the checks every grid
family shares are in test_adapter_conformance.py and test_grid_families.py)."""

from __future__ import annotations

import torch
from conftest import relative_error
from family_cases.common import tower_reference
from family_cases.qwen2_5_vl import BUDGETS, ROW_WIDTH, tiny_encoder

from vitpool import Image
from vitpool.families.qwen2_5_vl.rules import WINDOWS, frame_windows, max_windows

TOLERANCE = 1e-5


def image(generator: torch.Generator, h: int, w: int) -> Image:
    return Image(torch.randn(h * w, ROW_WIDTH, generator=generator), (1, h, w))


def test_every_default_budget_bounds_windows():
    encoder = tiny_encoder(list(BUDGETS))
    assert all(budget.limit(WINDOWS) is not None for budget in encoder.budgets)


def test_windows_limit_is_settable_and_bounds_batches():
    limited = tiny_encoder(list(BUDGETS), capacity_limits={WINDOWS: 4})
    assert [budget.limit(WINDOWS) for budget in limited.budgets] == [4, 4, 4]
    assert all(budget.max_items <= 4 for budget in limited.budgets)
    generator = torch.Generator().manual_seed(8)
    # 4 windows each (two batches at most), and one of 9 windows: larger than every budget
    batch = [image(generator, 8, 8), image(generator, 8, 6), image(generator, 12, 12)]
    rules = limited.adapter.item_rules
    specs = [rules.item_spec("image", tuple(i.pixel_values.shape), "float32", i.grid_thw) for i in batch]
    assert [spec.need(WINDOWS) for spec in specs] == [4, 4, 9]
    before = limited.stats()
    embeddings = limited.encode(batch)
    after = limited.stats()
    assert after.eager_batches == before.eager_batches + 1  # the 9-window item, at its own size
    assert sum(after.replays_per_budget.values()) == sum(before.replays_per_budget.values()) + 2
    reference = tower_reference(limited)
    for item, embedding in zip(batch, embeddings, strict=True):
        assert relative_error(embedding.tokens, reference(item)[0]) <= TOLERANCE


def test_default_windows_bound_holds_every_frame():
    """`max_windows` never refuses a batch its tokens and sequences allow."""
    for v in range(1, 7):
        for h in range(1, 25):
            for w in range(1, 25):
                windows = frame_windows(2 * h, 2 * w, 2, v)
                assert windows <= max_windows(h * w, 1, v), (v, h, w)
