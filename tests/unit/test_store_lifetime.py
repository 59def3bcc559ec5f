"""The embedding store's lifetime and counters, and its reader's connection, without a cluster:
the store's class is plain Python, and the reader's join is replaced by a slow stand-in."""

from __future__ import annotations

import threading
import time

import pytest

from vitpool.integrations.vllm import store as store_module
from vitpool.integrations.vllm.store import EmbeddingStore, StoredRef, StoreReader


def entry(key: str, owner: str) -> StoredRef:
    return StoredRef(key, [None], "array", 16, "float32", owner)


def test_entries_of_a_publisher_whose_job_ended_are_dropped_before_any_answer(monkeypatch):
    monkeypatch.setattr(store_module, "OWNER_CHECK_S", 0.0)
    ended: set[str] = set()
    monkeypatch.setattr(store_module, "ended_jobs", lambda: ended)
    store = EmbeddingStore(max_bytes=1 << 20, min_age_s=0.0)
    assert store.put_many([entry("old-a", "01"), entry("old-b", "01"), entry("new", "02")]) == [True] * 3
    assert store.contains_many(["old-a", "new"]) == [True, True]
    ended.add("01")  # the first gateway exited: its bytes went with it
    assert store.contains_many(["old-a", "old-b", "new"]) == [False, False, True]
    stats = store.stats()
    assert stats.entries == 1 and stats.dropped == 2 and stats.bytes == 16


def test_loads_are_counted_and_a_lost_one_is_dropped_not_counted():
    store = EmbeddingStore(max_bytes=1 << 20, min_age_s=0.0)
    store.put_many([entry("a", "01"), entry("b", "01")])
    assert [e and e.key for e in store.get_many(["a", "b", "absent"])] == ["a", "b", None]
    store.drop(["b"])  # a reader could not fetch it
    stats = store.stats()
    assert (stats.published, stats.loaded, stats.dropped, stats.entries) == (2, 1, 1, 1)


def test_a_reader_never_waits_for_ray_on_the_callers_thread(monkeypatch):
    """Joining Ray runs on a thread of its own: until it is done "is it here" answers None at
    once (vLLM encodes itself), and a failed join is logged once."""
    release = threading.Event()
    joins = []

    def slow_join(address):
        joins.append(address)
        release.wait(10)
        raise ConnectionError("the Ray cluster at x uses token authentication: set RAY_AUTH_MODE=token")

    monkeypatch.setattr("vitpool.pool.cluster.join_ray", slow_join)
    monkeypatch.setattr(store_module.ray, "is_initialized", lambda: False)
    reader = StoreReader("p", address="10.0.0.1:6379")
    reader.connect_in_background()
    started = time.monotonic()
    assert [reader.contains("k") for _ in range(100)] == [None] * 100
    assert reader.get_many(["k"]) == [None]  # a worker's load: nothing, never an exception
    assert time.monotonic() - started < 1.0
    release.set()
    reader._attempt.join(5)
    assert joins == ["10.0.0.1:6379"]  # one try (the next after RETRY_S)


@pytest.mark.parametrize("error", [
    ConnectionError("no cluster"),  # a join that fails
    RuntimeError("anything"),  # whatever else: still not raised into vLLM
])
def test_a_failed_join_is_logged_once_with_its_cause(monkeypatch, caplog, error):
    def failing_join(address):
        raise error

    monkeypatch.setattr("vitpool.pool.cluster.join_ray", failing_join)
    monkeypatch.setattr(store_module.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(StoreReader, "RETRY_S", 0.0)
    reader = StoreReader("p")
    for _ in range(3):
        reader.connect_in_background()
        reader._attempt.join(5)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and str(error) in warnings[0]
