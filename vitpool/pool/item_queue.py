"""The items a caller process has accepted and not yet sent, bounded in items and pixel bytes.

Not thread-safe on its own: the dispatcher holds its lock around every call, and passes its
condition so that callers waiting for room wake when items leave.
"""

from __future__ import annotations

import collections
import threading

from vitpool.pool.calls import QueuedItem


def oversized_item_reason(nbytes: int, max_bytes: int) -> str | None:
    """Why one item of `nbytes` pixel bytes can never be queued (the item is the problem, not
    its call), or None when it fits an empty queue."""
    if nbytes <= max_bytes:
        return None
    return (
        f"its pixels take {nbytes} bytes, more than this process's queue ever holds "
        f"(max_queued_bytes={max_bytes}); send a smaller item or launch the pool with a larger "
        "max_queued_bytes"
    )


class ItemQueue:
    """Oldest first. Items sent again go back to the front, past the bounds: they were accepted."""

    def __init__(self, max_items: int, max_bytes: int, room: threading.Condition) -> None:
        self.max_items = max_items
        self.max_bytes = max_bytes
        self._room = room  # notified whenever items leave
        self._items: collections.deque[QueuedItem] = collections.deque()
        self.nbytes = 0
        self.peak_items = 0
        self.peak_bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def oldest(self) -> QueuedItem:
        return self._items[0]

    def can_ever_hold(self, num_items: int, nbytes: int) -> bool:
        return num_items <= self.max_items and nbytes <= self.max_bytes

    def has_room(self, num_items: int, nbytes: int) -> bool:
        return len(self._items) + num_items <= self.max_items and self.nbytes + nbytes <= self.max_bytes

    def push(self, items: list[QueuedItem], front: bool = False) -> None:
        if front:
            self._items.extendleft(reversed(items))
        else:
            self._items.extend(items)
        self.nbytes += sum(item.nbytes for item in items)
        self.peak_items = max(self.peak_items, len(self._items))
        self.peak_bytes = max(self.peak_bytes, self.nbytes)

    def take(self, token_room: int, item_room: int) -> list[QueuedItem]:
        """The oldest items, up to `item_room` items and (past the first) `token_room` output
        tokens; items of calls that are already over leave the queue on the way."""
        taken: list[QueuedItem] = []
        left: list[QueuedItem] = []
        tokens = 0
        while self._items and len(taken) < item_room:
            item = self._items[0]
            if item.call.done:
                left.append(self._items.popleft())
                continue
            if taken and tokens + item.spec.num_tokens > token_room:
                break
            taken.append(self._items.popleft())
            tokens += item.spec.num_tokens
        self._left(taken + left)
        return taken

    def drop_finished_calls(self) -> None:
        """Free the room of calls that failed or were given up while their items waited."""
        dropped = [item for item in self._items if item.call.done]
        if dropped:
            self._items = collections.deque(item for item in self._items if not item.call.done)
            self._left(dropped)

    def clear(self) -> list[QueuedItem]:
        """Empty the queue; returns what was in it."""
        items = list(self._items)
        self._items.clear()
        self._left(items)
        return items

    def _left(self, items: list[QueuedItem]) -> None:
        if items:
            self.nbytes -= sum(item.nbytes for item in items)
            self._room.notify_all()
