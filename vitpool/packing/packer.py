"""Bin-packing items into budget-sized batches. Pure Python: sizes in, batches of indices out.

An item is anything with `num_tokens` and `needs` (an `ItemSpec`, or an `ItemCost` in tests):
packing knows capacities only by name and bounds each by the budget's limit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from vitpool.packing.budgets import Budget, Needs


class Packable(Protocol):
    num_tokens: int
    needs: Needs
    path: str


@dataclass(frozen=True)
class ItemCost:
    """An item as packing sees it."""

    num_tokens: int
    needs: Needs = ()
    path: str = ""


@dataclass(frozen=True)
class Batch:
    """Items that run together. `budget` is None for an oversized item, which runs alone, eager."""

    item_indices: tuple[int, ...]
    budget: Budget | None
    num_tokens: int
    needs: Needs = ()

    @property
    def padding_tokens(self) -> int:
        return 0 if self.budget is None else self.budget.num_tokens - self.num_tokens

    def need(self, name: str) -> int:
        return dict(self.needs).get(name, 0)


def add_needs(total: dict[str, int], needs: Needs) -> None:
    for name, amount in needs:
        total[name] = total.get(name, 0) + amount


def fits(budget: Budget, num_items: int, num_tokens: int, needs: Needs | dict[str, int]) -> bool:
    if num_items > budget.max_items or num_tokens > budget.num_tokens:
        return False
    used = needs if isinstance(needs, dict) else dict(needs)
    return all(used.get(name, 0) <= limit for name, limit in budget.limits)


def smallest_fitting(
    budgets: Sequence[Budget],
    num_items: int,
    num_tokens: int,
    needs: Needs | dict[str, int],
    is_sorted: bool = False,
    path: str = "",
) -> Budget | None:
    """The cheapest budget of `path` that holds such a batch, or None. `is_sorted`: `budgets` is
    already in order (the dispatcher packs on every dispatch, so it sorts once)."""
    used = needs if isinstance(needs, dict) else dict(needs)
    for budget in budgets if is_sorted else sorted(budgets):
        if budget.path == path and fits(budget, num_items, num_tokens, used):
            return budget
    return None


def pack(
    items: Sequence[Packable],
    budgets: Sequence[Budget],
    max_tokens: int | None = None,
    budgets_sorted: bool = False,
) -> list[Batch]:
    """Pack `items` into batches: every item exactly once, each batch in its smallest fitting budget.

    First-fit decreasing into bins the size of the largest budget keeps replays few; each bin then
    takes the smallest budget that holds it, which keeps padding small. An item that fits no
    budget alone gets a batch of its own with `budget=None`. `max_tokens` caps the tokens of a
    batch of several items below the largest budget (an item over it still gets a batch).
    `budgets_sorted`: `budgets` are in order already (a caller that packs often sorts them once).
    Items of different paths (`Budget.path`) never share a batch: each path packs into its own
    budgets, paths in the order their first item comes.
    """
    ordered_budgets = budgets if budgets_sorted else sorted(budgets)
    paths = list(dict.fromkeys(item.path for item in items))
    if paths == [""] and all(budget.path == "" for budget in ordered_budgets):
        return _pack_path(items, range(len(items)), ordered_budgets, max_tokens)
    batches = []
    for path in paths:
        indices = [i for i, item in enumerate(items) if item.path == path]
        own = [budget for budget in ordered_budgets if budget.path == path]
        batches.extend(_pack_path(items, indices, own, max_tokens))
    return batches


def _pack_path(
    items: Sequence[Packable],
    indices: Sequence[int],
    ordered_budgets: Sequence[Budget],
    max_tokens: int | None,
) -> list[Batch]:
    """`pack` of `items[i] for i in indices`, all of one path, into that path's sorted budgets."""
    if not ordered_budgets:
        return [Batch((i,), None, items[i].num_tokens, _sorted(items[i].needs)) for i in indices]
    largest = ordered_budgets[-1]
    oversized: list[Batch] = []
    bins: list[list[int]] = []
    bin_tokens: list[int] = []
    bin_needs: list[dict[str, int]] = []
    by_size = sorted(indices, key=lambda i: (-items[i].num_tokens, i))
    for index in by_size:
        item = items[index]
        if not fits(largest, 1, item.num_tokens, item.needs):
            oversized.append(Batch((index,), None, item.num_tokens, _sorted(item.needs)))
            continue
        for b, members in enumerate(bins):
            tokens = bin_tokens[b] + item.num_tokens
            if max_tokens is not None and tokens > max_tokens:
                continue
            needs = dict(bin_needs[b])
            add_needs(needs, item.needs)
            if fits(largest, len(members) + 1, tokens, needs):
                members.append(index)
                bin_tokens[b] = tokens
                bin_needs[b] = needs
                break
        else:
            bins.append([index])
            bin_tokens.append(item.num_tokens)
            bin_needs.append(dict(item.needs))
    batches = []
    for members, tokens, needs in zip(bins, bin_tokens, bin_needs):
        budget = smallest_fitting(
            ordered_budgets, len(members), tokens, needs, is_sorted=True, path=ordered_budgets[0].path
        )
        assert budget is not None, "a bin always fits the largest budget"
        batches.append(Batch(tuple(members), budget, tokens, _sorted(needs)))
    return batches + oversized


def _sorted(needs: Needs | dict[str, int]) -> Needs:
    return tuple(sorted(dict(needs).items()))
