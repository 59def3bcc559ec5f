"""Bin-packing items into budget-sized batches. Pure Python: indices and sizes in, batches out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vitpool.packing.budgets import Budget


@dataclass(frozen=True)
class ItemCost:
    """An item as packing sees it."""

    num_tokens: int
    num_sequences: int


@dataclass(frozen=True)
class Batch:
    """Items that run together. `budget` is None for an oversized item, which runs alone, eager."""

    item_indices: tuple[int, ...]
    budget: Budget | None
    num_tokens: int
    num_sequences: int

    @property
    def padding_tokens(self) -> int:
        return 0 if self.budget is None else self.budget.num_tokens - self.num_tokens


def fits(budget: Budget, num_items: int, num_tokens: int, num_sequences: int) -> bool:
    return (
        num_items <= budget.max_items
        and num_tokens <= budget.num_tokens
        and num_sequences <= budget.max_sequences
    )


def pack(items: Sequence[ItemCost], budgets: Sequence[Budget], max_tokens: int | None = None) -> list[Batch]:
    """Pack `items` into batches: every item exactly once, each batch in its smallest fitting budget.

    First-fit decreasing into bins the size of the largest budget keeps replays few; each bin then
    takes the smallest budget that holds it, which keeps padding small. An item that fits no
    budget alone gets a batch of its own with `budget=None`. `max_tokens` caps the tokens of a
    batch of several items below the largest budget (an item over it still gets a batch).
    """
    if not budgets:
        return [Batch((i,), None, item.num_tokens, item.num_sequences) for i, item in enumerate(items)]
    ordered_budgets = sorted(budgets)
    largest = ordered_budgets[-1]
    oversized: list[Batch] = []
    bins: list[list[int]] = []
    bin_tokens: list[int] = []
    bin_sequences: list[int] = []
    by_size = sorted(range(len(items)), key=lambda i: (-items[i].num_tokens, i))
    for index in by_size:
        item = items[index]
        if not fits(largest, 1, item.num_tokens, item.num_sequences):
            oversized.append(Batch((index,), None, item.num_tokens, item.num_sequences))
            continue
        for b, members in enumerate(bins):
            if fits(
                largest,
                len(members) + 1,
                bin_tokens[b] + item.num_tokens,
                bin_sequences[b] + item.num_sequences,
            ) and (max_tokens is None or bin_tokens[b] + item.num_tokens <= max_tokens):
                members.append(index)
                bin_tokens[b] += item.num_tokens
                bin_sequences[b] += item.num_sequences
                break
        else:
            bins.append([index])
            bin_tokens.append(item.num_tokens)
            bin_sequences.append(item.num_sequences)
    batches = [
        Batch(
            tuple(members),
            _smallest_fitting(ordered_budgets, len(members), tokens, sequences),
            tokens,
            sequences,
        )
        for members, tokens, sequences in zip(bins, bin_tokens, bin_sequences)
    ]
    return batches + oversized


def _smallest_fitting(
    ordered_budgets: Sequence[Budget], num_items: int, num_tokens: int, num_sequences: int
) -> Budget:
    for budget in ordered_budgets:
        if fits(budget, num_items, num_tokens, num_sequences):
            return budget
    raise AssertionError("a bin always fits the largest budget")
