"""The one byte-bounded LRU (`vitpool.pool.lru`) that the pool's embedding cache, a handle's own tier
and the vLLM publishers (`BoundedEntries`) keep: eviction by bytes in least-recently-used order,
the `min_age_s` protection, and the counters. Time is a fake clock, so ages are exact."""

from __future__ import annotations

import types

import pytest

from vitpool.integrations.vllm.bounded import BoundedEntries, PublisherStats
from vitpool.pool import lru
from vitpool.pool.lru import ByteBoundedLRU


@pytest.fixture
def clock(monkeypatch):
    """The LRU's clock, set by hand: `clock.now = ...`."""
    clock = types.SimpleNamespace(now=1000.0)
    monkeypatch.setattr(lru, "time", types.SimpleNamespace(monotonic=lambda: clock.now))
    return clock


def test_eviction_is_by_bytes_least_recently_used_first(clock):
    cache = ByteBoundedLRU(100)
    assert cache.put("a", "A", 40) == [] and cache.put("b", "B", 30) == [] and cache.put("c", "C", 30) == []
    assert cache.bytes == 100 and len(cache) == 3
    assert cache.get("a") == "A"  # a is now the most recent: b goes first
    assert cache.put("d", "D", 50) == [("b", "B"), ("c", "C")]  # two small entries make room for one large
    assert "b" not in cache and "c" not in cache and cache.peek("a") == "A" and cache.peek("d") == "D"
    assert (cache.bytes, len(cache), cache.evictions, cache.refusals) == (90, 2, 2, 0)
    assert cache.put("e", "E", 10) == []  # fits exactly: nothing evicted
    assert cache.bytes == 100


def test_peek_does_not_refresh_an_entry_and_touch_does(clock):
    cache = ByteBoundedLRU(20)
    cache.put("a", 1, 10)
    cache.put("b", 2, 10)
    assert cache.peek("a") == 1 and cache.peek("absent") is None
    assert cache.put("c", 3, 10) == [("a", 1)]  # peeking left a the least recently used
    assert cache.touch("b") and not cache.touch("absent")
    assert cache.put("d", 4, 10) == [("c", 3)]


def test_a_replacement_or_a_removal_is_not_an_eviction(clock):
    cache = ByteBoundedLRU(100)
    cache.put("a", "old", 60)
    assert cache.put("a", "new", 90) == []  # its own old bytes make room for it
    assert cache.get("a") == "new" and cache.bytes == 90 and cache.evictions == 0
    assert cache.pop("a") == "new" and cache.pop("a") is None
    assert cache.bytes == 0 and len(cache) == 0 and cache.evictions == 0


def test_an_entry_over_the_whole_bound_is_refused_and_changes_nothing(clock):
    cache = ByteBoundedLRU(100)
    cache.put("a", "A", 60)
    assert cache.put("huge", "H", 101) is None
    assert cache.put("a", "too big now", 101) is None  # a refused replacement keeps the old entry
    assert cache.peek("a") == "A" and cache.bytes == 60 and cache.refusals == 2 and cache.evictions == 0


def test_an_entry_younger_than_min_age_is_never_evicted(clock):
    cache = ByteBoundedLRU(100, min_age_s=30.0)
    cache.put("young", "Y", 40)
    cache.put("adopted", "A", 40, used_at=clock.now - 60)  # after "young" in use order, but old
    assert cache.put("new", "N", 50) == [("adopted", "A")]  # "young" is skipped, though least recently used
    assert cache.bytes == 90
    assert cache.put("newer", "X", 40) is None  # no room without evicting a protected entry: refused
    assert "young" in cache and "new" in cache and cache.bytes == 90 and cache.refusals == 1
    clock.now += 30  # both are 30 s old now: evictable, least recently used first
    assert cache.put("newer", "X", 40) == [("young", "Y")]


def test_a_refused_entry_evicts_nothing_even_where_some_room_could_be_made(clock):
    cache = ByteBoundedLRU(100, min_age_s=30.0)
    cache.put("old", "O", 20, used_at=clock.now - 60)  # evictable, but frees too little
    cache.put("young", "Y", 60)
    assert cache.put("x", "X", 50) is None
    assert "old" in cache and cache.bytes == 80 and cache.evictions == 0 and cache.refusals == 1


def test_being_used_resets_an_entrys_age(clock):
    cache = ByteBoundedLRU(100, min_age_s=30.0)
    cache.put("a", "A", 60)
    clock.now += 60
    assert cache.get("a") == "A"  # asked about: protected again for min_age_s
    assert cache.put("b", "B", 60) is None
    clock.now += 30
    assert cache.put("b", "B", 60) == [("a", "A")]


def test_an_entry_added_as_used_long_ago_is_evictable_at_once(clock):
    cache = ByteBoundedLRU(100, min_age_s=30.0)
    cache.put("adopted", "A", 60, used_at=clock.now - 60)
    assert cache.put("new", "N", 60) == [("adopted", "A")]


def test_the_bound_must_be_positive():
    for bad in (0, -1):
        with pytest.raises(ValueError, match="max_bytes must be positive"):
            ByteBoundedLRU(bad)


def test_a_publishers_stats_follow_the_bound_and_keep_its_own_counts(clock):
    entries = BoundedEntries(max_bytes=100, min_age_s=30.0)
    assert entries.add("a", 60) == [] and entries.add("b", 30) == []
    entries.stats.published += 2  # as the publishers count, through the live stats
    clock.now += 31
    assert entries.add("c", 50) == ["a"]  # keys only: the publisher holds the contents
    assert entries.add("d", 90) is None  # "c" is too young to make room
    entries.stats.loaded += 1
    snapshot = entries.snapshot()
    assert snapshot == PublisherStats(entries=2, bytes=80, published=2, evicted=1, refused=1, loaded=1)
    entries.remove("b")
    assert (
        snapshot.bytes == 80 and entries.stats.bytes == 50 and entries.stats.entries == 1
    )  # a copy, then live
    assert not entries.remove("b") and entries.snapshot().evicted == 1
