"""The bookkeeping every embedding publisher shares: entries bounded in bytes, least recently used
evicted first, none used (published, or asked about) within `min_age_s`: vLLM may have been told it
exists and not have loaded it yet. The bound is the pool's own (`vitpool.pool.lru`); the publishers
keep the entries' contents themselves (files, object references) and count them here. Not
thread-safe: its owner locks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from vitpool.pool.lru import ByteBoundedLRU

Value = TypeVar("Value")


@dataclass
class PublisherStats:
    entries: int = 0
    bytes: int = 0
    published: int = 0
    evicted: int = 0
    refused: int = 0  # no room: every entry younger than min_age_s, or the item alone over the bound
    loaded: int = 0  # entries handed to vLLM's workers (the store only: files are read unseen)
    dropped: int = 0  # entries a reader could not load (the store only)
    consumer_dtype: str | None = None  # the dtype vLLM's workers run, as their reads say (the store only)


class BoundedEntries(ByteBoundedLRU[str, Value]):
    """Keys and their sizes (and, for a publisher that keeps them here, their values), bounded as
    `ByteBoundedLRU` bounds them.

    `stats` is the publisher's counters: it counts `published`, `loaded` and `dropped` there
    itself; `entries`, `bytes`, `evicted` and `refused` are the bound's, current whenever read.
    """

    def __init__(self, max_bytes: int, min_age_s: float) -> None:
        super().__init__(max_bytes, min_age_s)
        self._stats = PublisherStats()

    @property
    def stats(self) -> PublisherStats:
        stats = self._stats
        stats.entries, stats.bytes, stats.evicted, stats.refused = (
            len(self),
            self.bytes,
            self.evictions,
            self.refusals,
        )
        return stats

    def touch_many(self, keys: list[str]) -> list[bool]:
        return [self.touch(key) for key in keys]

    def add(self, key: str, nbytes: int, added_at: float | None = None) -> list[str] | None:
        """Count a new entry (replacing `key`'s). Returns the keys to evict to make room, already
        uncounted; None, counting nothing, when it cannot fit now."""
        evicted = self.put(key, None, nbytes, used_at=added_at)
        return None if evicted is None else [other for other, _ in evicted]

    def remove(self, key: str) -> bool:
        if key not in self:
            return False
        self.pop(key)
        return True

    def snapshot(self) -> PublisherStats:
        return PublisherStats(**vars(self.stats))
