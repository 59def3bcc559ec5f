"""Packing properties (hypothesis): every item once, bounds respected, smallest fitting budget."""

from __future__ import annotations

import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from vitpool.packing import ItemCost, budget_ladder, make_budgets, pack
from vitpool.packing.packer import fits

items_strategy = st.lists(
    st.builds(ItemCost, num_tokens=st.integers(1, 600), num_sequences=st.integers(1, 12)), max_size=60
)
budgets_strategy = st.lists(st.integers(1, 512), min_size=1, max_size=8, unique=True)


@settings(max_examples=300, deadline=None)
@given(items=items_strategy, token_budgets=budgets_strategy, max_items=st.integers(1, 8), extra_frames=st.integers(0, 16))
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
        assert batch.num_sequences == sum(m.num_sequences for m in members)
        if batch.budget is None:
            # oversized: alone, and really too large for the largest budget
            assert len(members) == 1
            assert not fits(largest, 1, batch.num_tokens, batch.num_sequences)
            continue
        assert fits(batch.budget, len(members), batch.num_tokens, batch.num_sequences)
        smaller = [b for b in budgets if b < batch.budget]
        assert not any(fits(b, len(members), batch.num_tokens, batch.num_sequences) for b in smaller)


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
    items = [ItemCost(size, 1) for size in sizes]
    budgets = make_budgets([64, 4096], None, None)
    batches = pack(items, budgets)
    if len(items) <= budgets[-1].max_items:
        assert len(batches) == 1


@given(low=st.integers(1, 300), span=st.integers(0, 5000))
def test_ladder_bounds(low, span):
    ladder = budget_ladder(low, low + span, 1.125, 32)
    assert ladder[0] == low and ladder[-1] == low + span
    assert all(a < b <= 2 * a for a, b in zip(ladder, ladder[1:]))


def test_packing_imports_neither_torch_nor_ray():
    import subprocess

    code = "import sys, vitpool.packing; assert 'torch' not in sys.modules and 'ray' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_few_sequence_variant_serves_small_batches():
    budgets = make_budgets([64, 832], None, None)
    assert [(b.num_tokens, b.max_sequences) for b in budgets] == [(64, 64), (832, 4), (832, 64)]
    [one_image] = pack([ItemCost(784, 1)], budgets)
    assert one_image.budget.max_sequences == 4
    [many_frames] = pack([ItemCost(400, 8), ItemCost(300, 1)], budgets)
    assert many_frames.budget.max_sequences == 64


def test_public_names_resolve():
    import vitpool

    for name in vitpool.__all__:
        assert getattr(vitpool, name).__name__ == name
