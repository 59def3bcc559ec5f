"""What a call's items pass in the caller's process before anything is sent: the model's item
rules (shapes, grids, dtypes; `vitpool.items.prepare_item`), then the pool's bounds on one item,
its output tokens (`max_item_tokens`) and its pixel bytes (the queue's `max_queued_bytes`).

A bad item costs no hop and harms no one; its InvalidItemError names its index in the call.
"""

from __future__ import annotations

from typing import Any

from vitpool.errors import InvalidItemError
from vitpool.items import Prepared, check_token_bound, prepare_item
from vitpool.pool.item_queue import oversized_item_reason
from vitpool.specs import ItemRules


def checked_item(
    index: int, item: Any, rules: ItemRules, max_item_tokens: int | None, max_queued_bytes: int | None = None
) -> Prepared:
    """Item `index` of a call, checked and sized (an item of several inputs as its parts).

    Raises:
        InvalidItemError: the model's rules refuse it, or it is over a bound (the message names
            the bound and how to raise it).
    """
    prepared = prepare_item(index, item, rules)
    check_token_bound(index, prepared, max_item_tokens, "pool", "launch the pool")
    reason = None if max_queued_bytes is None else oversized_item_reason(prepared.nbytes, max_queued_bytes)
    if reason is not None:
        raise InvalidItemError(index, reason)
    return prepared


def checked_items(
    items: Any, rules: ItemRules, max_item_tokens: int | None, max_queued_bytes: int | None = None
) -> list[Prepared]:
    """Every item checked; raises the first item's InvalidItemError (nothing is sent then)."""
    return [
        checked_item(index, item, rules, max_item_tokens, max_queued_bytes)
        for index, item in enumerate(items)
    ]


def each_checked(
    items: Any, rules: ItemRules, max_item_tokens: int | None, max_queued_bytes: int | None = None
) -> list[Prepared | InvalidItemError]:
    """Per item, in order: the checked item, or its InvalidItemError (the others go on)."""
    outcomes: list[Prepared | InvalidItemError] = []
    for index, item in enumerate(items):
        try:
            outcomes.append(checked_item(index, item, rules, max_item_tokens, max_queued_bytes))
        except InvalidItemError as error:
            outcomes.append(error)
    return outcomes
