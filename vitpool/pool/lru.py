"""Entries bounded in bytes, least recently used evicted first: the one such bound that the pool's
embedding cache, a handle's own tier of it and the vLLM publishers (`vitpool.integrations.vllm.bounded`)
all keep.

`min_age_s` protects an entry used (added, or marked used) within that many seconds from eviction:
a vLLM publisher may have told vLLM an entry exists, and vLLM may not have loaded it yet. An entry
that cannot fit without evicting a protected one is refused, and nothing is evicted for it.

Not thread-safe: its owner locks.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

Key = TypeVar("Key", bound=Hashable)
Value = TypeVar("Value")


@dataclass(slots=True)
class _Slot:
    value: Any
    nbytes: int
    used_at: float  # time.monotonic() when last added or marked used


class ByteBoundedLRU(Generic[Key, Value]):
    """At most `max_bytes` of entries, each added with its size in bytes.

    Counters since it was made: `evictions` (entries dropped to make room; not those replaced or
    removed) and `refusals` (entries not added: over the whole bound alone, or no room without
    evicting one younger than `min_age_s`).
    """

    def __init__(self, max_bytes: int, min_age_s: float = 0.0) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self.min_age_s = float(min_age_s)
        self.bytes = 0
        self.evictions = 0
        self.refusals = 0
        self._slots: OrderedDict[Key, _Slot] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: object) -> bool:
        return key in self._slots

    def get(self, key: Key) -> Value | None:
        """`key`'s value, marked used now; None if absent."""
        slot = self._slots.get(key)
        if slot is None:
            return None
        self._mark_used(key, slot)
        return slot.value

    def peek(self, key: Key) -> Value | None:
        """`key`'s value without marking it used; None if absent."""
        slot = self._slots.get(key)
        return None if slot is None else slot.value

    def touch(self, key: Key) -> bool:
        """Mark `key` used now (last to be evicted, and not within `min_age_s`); False if absent."""
        slot = self._slots.get(key)
        if slot is None:
            return False
        self._mark_used(key, slot)
        return True

    def put(
        self, key: Key, value: Value, nbytes: int, used_at: float | None = None
    ) -> list[tuple[Key, Value]] | None:
        """Add `key` (replacing its entry, which counts as neither evicted nor refused), as used at
        `used_at` (default now; an older time makes it evictable sooner). Returns the entries
        evicted to make room, least recently used first; None, changing nothing, when it is
        refused."""
        previous = self._slots.get(key)
        held = self.bytes - (previous.nbytes if previous is not None else 0)
        if nbytes > self.max_bytes:
            self.refusals += 1
            return None
        now = time.monotonic()
        victims, freed = [], 0
        for other, slot in self._slots.items():
            if held - freed + nbytes <= self.max_bytes:
                break
            if other != key and now - slot.used_at >= self.min_age_s:
                victims.append(other)
                freed += slot.nbytes
        if held - freed + nbytes > self.max_bytes:
            self.refusals += 1
            return None
        evicted = [(other, self._pop_slot(other).value) for other in victims]
        self.evictions += len(evicted)
        self._pop_slot(key)
        self._slots[key] = _Slot(value, nbytes, now if used_at is None else used_at)
        self.bytes += nbytes
        return evicted

    def pop(self, key: Key) -> Value | None:
        """Remove `key` (not counted as an eviction); its value, or None if absent."""
        slot = self._pop_slot(key)
        return None if slot is None else slot.value

    def _pop_slot(self, key: Key) -> _Slot | None:
        slot = self._slots.pop(key, None)
        if slot is not None:
            self.bytes -= slot.nbytes
        return slot

    def _mark_used(self, key: Key, slot: _Slot) -> None:
        slot.used_at = time.monotonic()
        self._slots.move_to_end(key)
