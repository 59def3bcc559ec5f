"""One caller's request as the pool tracks it: its items, where their results are, its future."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vitpool.specs import ItemSpec


@dataclass
class QueuedItem:
    """One item waiting for (or riding in) a batch. `pixels` is its array (for the same-node
    channel) or a reference to it in the object store, put there by the caller's own thread."""

    call: Call
    index: int  # position in the caller's list
    spec: ItemSpec  # computed once, in the caller's process; travels with the pixels
    pixels: Any  # np.ndarray or ray.ObjectRef
    nbytes: int  # the pixels' size, for the queue's bound
    attempts: int = 0
    enqueued_at: float = field(default_factory=time.monotonic)
    part: int = 0  # which part of its item it is (an item of several inputs; see `Call`)
    cache_key: bytes | None = None  # the actor publishes its result under this key (see `BatchPlan`)


@dataclass
class PartResults:
    """The results of an item of several inputs, all in, in join order: each an Embedding or a
    reference to one. The caller joins them (`Embedding.joined`) once it has fetched them."""

    parts: list[Any]


class Call:
    """The future of one call: resolves to its results in input order, each an Embedding (from
    the same-node channel) or a reference to one (from a Ray call).

    `return_exceptions`: an item's failure is its own outcome (its slot holds the exception and
    the call goes on, as `asyncio.gather(..., return_exceptions=True)`); else it fails the call.
    `num_parts`: per item, its parts (an item of several inputs travels as one queued item per
    part); its slot holds a `PartResults` once every part is in, or the first part's error.
    """

    def __init__(
        self, num_items: int, return_exceptions: bool = False, num_parts: Sequence[int] = ()
    ) -> None:
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.results: list[Any] = [None] * num_items
        self.remaining = num_items
        self.return_exceptions = return_exceptions
        self.submitted_at = time.monotonic()
        self._parts: dict[int, list[Any]] = {
            index: [None] * count for index, count in enumerate(num_parts) if count > 1
        }

    @property
    def done(self) -> bool:
        return self.future.done()

    def complete_item(self, index: int, result: Any, part: int = 0) -> bool:
        """Record one item's result (or one part's); True when this completed the call."""
        if self.done or self.results[index] is not None:
            return False
        parts = self._parts.get(index)
        if parts is not None and not isinstance(result, BaseException):
            parts[part] = result
            if any(value is None for value in parts):
                return False
            result = PartResults(parts)
        self.results[index] = result
        self.remaining -= 1
        if self.remaining == 0:
            self.future.set_result(list(self.results))
            return True
        return False

    def fail(self, error: BaseException) -> None:
        """Fail the whole call (its caller gave up, or it never got in)."""
        if not self.done:
            self.future.set_exception(error)
