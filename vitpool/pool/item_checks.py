"""What a call's items pass in the caller's process before anything is sent: the model's item
rules (shapes, grids, dtypes; `vitpool.items.prepare_item`), then the pool's bounds on one item,
its output tokens (`max_item_tokens`) and its pixel bytes (the queue's `max_queued_bytes`).

A bad item costs no hop and harms no one; its InvalidItemError names its index in the call.
"""

from __future__ import annotations

from typing import Any

from vitpool.errors import InvalidItemError
from vitpool.items import Prepared, prepare_item
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
    if max_item_tokens is not None and prepared.num_tokens > max_item_tokens:
        num_rows = sum(part.spec.num_rows for part in prepared.parts)
        raise InvalidItemError(
            index,
            f"{prepared.num_tokens} output tokens ({num_rows} pixel rows) is over this pool's bound, "
            f"max_item_tokens={max_item_tokens}: resize it as the model's processor does (its max_pixels), "
            "or launch the pool with a larger max_item_tokens (None: no bound)",
        )
    reason = (
        None if max_queued_bytes is None else oversized_item_reason(prepared.nbytes, max_queued_bytes)
    )
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
