"""Packing properties (hypothesis): every item once, bounds respected, smallest fitting budget."""

from __future__ import annotations

import itertools
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from vitpool.packing import Budget, ItemCost, budget_ladder, make_budgets, pack, plain_budgets
from vitpool.packing.packer import fits


def frames(tokens: int, sequences: int) -> ItemCost:
    return ItemCost(tokens, (("sequences", sequences),))


items_strategy = st.lists(st.builds(frames, st.integers(1, 600), st.integers(1, 12)), max_size=60)
budgets_strategy = st.lists(st.integers(1, 512), min_size=1, max_size=8, unique=True)


@settings(max_examples=300, deadline=None)
@given(
    items=items_strategy,
    token_budgets=budgets_strategy,
    max_items=st.integers(1, 8),
    extra_frames=st.integers(0, 16),
)
def test_pack_properties(items, token_budgets, max_items, extra_frames):
    max_items = min(max_items, min(token_budgets))
    budgets = make_budgets(token_budgets, max_items, max_items + extra_frames)
    batches = pack(items, budgets)
    placed = sorted(i for batch in batches for i in batch.item_indices)
    assert placed == list(range(len(items)))  # every item exactly once
    largest = max(budgets)
    for batch in batches:
        members = [items[i] for i in batch.item_indices]
        assert batch.num_tokens == sum(m.num_tokens for m in members)
        assert batch.need("sequences") == sum(dict(m.needs)["sequences"] for m in members)
        if batch.budget is None:
            # oversized: alone, and really too large for the largest budget
            assert len(members) == 1
            assert not fits(largest, 1, batch.num_tokens, batch.needs)
            continue
        assert fits(batch.budget, len(members), batch.num_tokens, batch.needs)
        smaller = [b for b in budgets if b < batch.budget]
        assert not any(fits(b, len(members), batch.num_tokens, batch.needs) for b in smaller)


@settings(max_examples=200, deadline=None)
@given(items=items_strategy, token_budgets=budgets_strategy, max_tokens=st.integers(1, 600))
def test_a_token_cap_bounds_shared_batches(items, token_budgets, max_tokens):
    budgets = make_budgets(token_budgets, min(8, min(token_budgets)), None)
    capped = pack(items, budgets, max_tokens)
    assert sorted(i for batch in capped for i in batch.item_indices) == list(range(len(items)))
    for batch in capped:
        assert len(batch.item_indices) == 1 or batch.num_tokens <= max_tokens
    if max_tokens >= max(budgets).num_tokens:  # no cap below the largest budget: packed as without
        assert capped == pack(items, budgets)


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(1, 64), min_size=1, max_size=40))
def test_small_items_share_batches(sizes):
    """Items that all fit one budget together take a single replay."""
    items = [frames(size, 1) for size in sizes]
    budgets = make_budgets([64, 4096], None, None)
    batches = pack(items, budgets)
    if len(items) <= budgets[-1].max_items:
        assert len(batches) == 1


@given(low=st.integers(1, 300), span=st.integers(0, 5000))
def test_ladder_bounds(low, span):
    ladder = budget_ladder(low, low + span, 1.125, 32)
    assert ladder[0] == low and ladder[-1] == low + span
    assert all(a < b <= 2 * a for a, b in itertools.pairwise(ladder))


def test_packing_imports_neither_torch_nor_ray():
    import subprocess

    code = "import sys, vitpool.packing; assert 'torch' not in sys.modules and 'ray' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_few_sequence_variant_serves_small_batches():
    budgets = make_budgets([64, 832], None, None)
    assert [(b.num_tokens, b.max_sequences) for b in budgets] == [(64, 64), (832, 4), (832, 64)]
    [one_image] = pack([frames(784, 1)], budgets)
    assert one_image.budget.max_sequences == 4
    [many_frames] = pack([frames(400, 8), frames(300, 1)], budgets)
    assert many_frames.budget.max_sequences == 64


@settings(max_examples=200, deadline=None)
@given(
    items=st.lists(st.tuples(st.integers(1, 300), st.integers(0, 6), st.integers(0, 3)), max_size=40),
    window_limit=st.integers(1, 12),
    tile_limit=st.integers(1, 8),
)
def test_any_named_capacity_is_bounded(items, window_limit, tile_limit):
    """Packing knows capacities only by name: a family may declare any (windows, tiles, ...)."""
    costs = [ItemCost(tokens, (("tiles", tiles), ("windows", windows))) for tokens, windows, tiles in items]
    budgets = [Budget(256, (("tiles", tile_limit), ("windows", window_limit)), 8), Budget(512, (), 8)]
    batches = pack(costs, budgets)
    assert sorted(i for batch in batches for i in batch.item_indices) == list(range(len(costs)))
    for batch in batches:
        members = [costs[i] for i in batch.item_indices]
        if batch.budget is None:
            assert len(members) == 1 and members[0].num_tokens > 512
            continue
        for name, limit in batch.budget.limits:
            assert sum(dict(m.needs)[name] for m in members) <= limit
        assert batch.num_tokens <= batch.budget.num_tokens and len(members) <= batch.budget.max_items
        if batch.budget.num_tokens == 512 and len(members) == 1:  # the small budget did not hold it
            assert not fits(budgets[0], 1, members[0].num_tokens, members[0].needs)


def test_plain_budgets_bound_tokens_and_items_only():
    budgets = plain_budgets([256, 1024], 4)
    assert [(b.num_tokens, b.limits, b.max_items) for b in budgets] == [(256, (), 4), (1024, (), 4)]
    assert budgets[0].max_sequences == 4  # no sequence bound: the items bound it


def test_public_names_resolve():
    import vitpool

    for name in vitpool.__all__:
        assert getattr(vitpool, name).__name__ == name
