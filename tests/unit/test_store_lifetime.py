"""The embedding store's copies and counters, and its reader's connection, without a cluster: the
store's class is plain Python over a stand-in object store, and the reader's join is replaced by a
slow stand-in."""

from __future__ import annotations

import threading
import time

import pytest

from vitpool.integrations.vllm import store as store_module
from vitpool.integrations.vllm.store import EmbeddingStore, StoredRef, StoreReader


def entry(key: str, ref: object = None) -> StoredRef:
    return StoredRef(key, [ref], "array", 16, "float32")


@pytest.fixture
def fake_ray_objects(monkeypatch):
    """Ray's object store as a dict: a reference is a key, "lost-..." ones cannot be read."""
    objects: dict[str, object] = {}

    def get(ref, timeout=None):
        if str(ref).startswith("lost"):
            raise store_module.ray.exceptions.ObjectLostError(str(ref))
        return ref

    def put(value):
        objects[f"own-{len(objects)}"] = value
        return f"own-{len(objects) - 1}"

    monkeypatch.setattr(store_module.ray, "get", get)
    monkeypatch.setattr(store_module.ray, "put", put)
    return objects


def test_the_store_holds_its_own_copy_and_refuses_what_it_cannot_read(fake_ray_objects):
    store = EmbeddingStore(max_bytes=1 << 20, min_age_s=0.0)
    assert store.put_many([entry("a", "bytes-a"), entry("gone", "lost-1"), entry("b", "bytes-b")]) == [
        True,
        False,
        True,
    ]
    held = store.get_many(["a", "b", "gone"])
    assert [e.object[0] for e in held[:2]] == ["own-0", "own-1"] and held[2] is None  # the store's objects
    assert fake_ray_objects == {"own-0": "bytes-a", "own-1": "bytes-b"}
    assert store.stats().entries == 2


def test_the_store_keeps_the_dtype_vllms_workers_read_in(fake_ray_objects):
    """The gateway's stats show it beside the dtype the gateway was given (`vllm_dtype`)."""
    from vitpool.integrations.vllm.gateway import Gateway

    store = EmbeddingStore(max_bytes=1 << 20, min_age_s=0.0)
    store.put_many([entry("a", "x")])
    store.get_many(["a"])  # a reader that does not say
    assert store.stats().consumer_dtype is None
    store.get_many(["a"], consumer_dtype="float16")
    stats = store.stats()
    assert stats.consumer_dtype == "float16"

    class Viewing:  # the one attribute of a gateway that vllm_view reads besides the publisher's
        dtype, processor, publisher = "torch.bfloat16", None, store

        def _sees_reads(self) -> bool:
            return True

    view = Gateway.vllm_view(Viewing(), stats)
    assert (view["dtype"], view["vllm_dtype"], view["loaded"]) == ("bfloat16", "float16", 2)
    assert "restart it with --dtype float16" in view["warning"]


def test_loads_are_counted_and_a_lost_one_is_dropped_not_counted(fake_ray_objects):
    store = EmbeddingStore(max_bytes=1 << 20, min_age_s=0.0)
    store.put_many([entry("a", "x"), entry("b", "y")])
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


@pytest.mark.parametrize(
    "error",
    [
        ConnectionError("no cluster"),  # a join that fails
        RuntimeError("anything"),  # whatever else: still not raised into vLLM
    ],
)
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
