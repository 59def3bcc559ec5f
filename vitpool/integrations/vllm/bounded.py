"""The bookkeeping every embedding publisher shares: entries bounded in bytes, least recently used
evicted first, none used (published, or asked about) within `min_age_s`: vLLM may have been told it
exists and not have loaded it yet. Not thread-safe: its owner locks."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class PublisherStats:
    entries: int = 0
    bytes: int = 0
    published: int = 0
    evicted: int = 0
    refused: int = 0  # no room: every entry younger than min_age_s, or the item alone over the bound
    loaded: int = 0  # entries handed to vLLM's workers (the store only: files are read unseen)
    dropped: int = 0  # entries a reader could not load (the store only)


class BoundedEntries:
    def __init__(self, max_bytes: int, min_age_s: float) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self.min_age_s = float(min_age_s)
        self._entries: OrderedDict[str, tuple[int, float]] = OrderedDict()  # key -> (bytes, last used)
        self.stats = PublisherStats()

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def touch(self, key: str) -> bool:
        """Mark `key` used now (last to be evicted, and not for `min_age_s`: whoever asked may tell
        vLLM it exists); False if absent."""
        entry = self._entries.get(key)
        if entry is None:
            return False
        self._entries[key] = (entry[0], time.monotonic())
        self._entries.move_to_end(key)
        return True

    def touch_many(self, keys: list[str]) -> list[bool]:
        return [self.touch(key) for key in keys]

    def add(self, key: str, nbytes: int, added_at: float | None = None) -> list[str] | None:
        """Count a new entry (replacing `key`'s). Returns the keys to evict to make room, already
        uncounted; None, counting nothing, when it cannot fit now."""
        previous = self._entries.get(key)
        held = self.stats.bytes - (previous[0] if previous else 0)
        if nbytes > self.max_bytes:
            self.stats.refused += 1
            return None
        now = time.monotonic()
        victims, freed = [], 0
        for other, (size, used) in self._entries.items():  # least recently used first
            if held - freed + nbytes <= self.max_bytes:
                break
            if other != key and now - used >= self.min_age_s:
                victims.append(other)
                freed += size
        if held - freed + nbytes > self.max_bytes:
            self.stats.refused += 1
            return None
        for other in victims:
            self.stats.bytes -= self._entries.pop(other)[0]
            self.stats.evicted += 1
        self.remove(key)
        self._entries[key] = (nbytes, now if added_at is None else added_at)
        self.stats.bytes += nbytes
        self.stats.entries = len(self._entries)
        return victims

    def remove(self, key: str) -> bool:
        removed = self._entries.pop(key, None)
        if removed is None:
            return False
        self.stats.bytes -= removed[0]
        self.stats.entries = len(self._entries)
        return True

    def snapshot(self) -> PublisherStats:
        self.stats.entries = len(self._entries)
        return PublisherStats(**vars(self.stats))
