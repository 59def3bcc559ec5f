"""The pool's embedding cache on a local Ray cluster (CPU actors): a hit returns the same tensors
without an encode, from this handle's own tier or, for any other handle, from the shared cache; a
changed pixel misses; the byte bound holds; concurrent and repeated items are encoded once;
losing an encoder actor (the owner of what it published), the cache itself or the process that
published an `encode_refs` result costs no result."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import ray
import torch
from conftest import BUDGETS, assert_same, image, mixed_items

from vitpool import EncoderPool

pytestmark = pytest.mark.ray

CAPACITY = 2 << 20  # holds the largest of `mixed_items` (0.55 MB) and a few dozen small ones


@pytest.fixture(scope="module")
def pool(ray_cluster):
    pool = EncoderPool.launch(
        budgets=BUDGETS,
        name="vitpool-cache",
        device="cpu",
        num_actors=1,
        startup_timeout_s=120,
        embedding_cache_bytes=CAPACITY,
        max_actor_restarts=2,
    )
    yield pool
    pool.shutdown()


def encoded_items(pool: EncoderPool) -> int:
    return sum(actor.items for actor in pool.stats().actors)


def distinct(seed: int, count: int, side: int = 8) -> list:
    generator = torch.Generator().manual_seed(seed)
    return [image(side, side, generator) for _ in range(count)]


def answering_cache(pool: EncoderPool):
    """The cache's stats once it answers (the test before this one killed it: Ray restarts it)."""
    deadline = time.monotonic() + 60
    while (stats := pool.stats().cache) is None:
        assert time.monotonic() < deadline, "the cache's actor did not come back"
        time.sleep(0.2)
    return stats


def inserted(pool: EncoderPool, count: int, why: str = "the entries never arrived") -> None:
    """Wait until the cache holds `count` inserts in all (publishing is asynchronous)."""
    deadline = time.monotonic() + 30
    while answering_cache(pool).inserts < count:
        assert time.monotonic() < deadline, why
        time.sleep(0.05)


def test_a_repeat_is_served_equal_without_an_encode(pool, reference_encoder):
    items = mixed_items(101)
    first = pool.encode(items)
    assert_same(first, reference_encoder.encode(items))
    inserted(pool, len(items))  # by the encoder actor, after its reply
    cache = pool.stats().cache
    before = encoded_items(pool)
    again = pool.encode(items)
    assert_same(again, first)
    assert encoded_items(pool) == before
    after = pool.stats().cache
    assert (after.local_hits, after.hits, after.misses) == (
        cache.local_hits + len(items),
        cache.hits,
        cache.misses,
    )
    again[0].tokens.add_(1.0)  # a caller's results are its own: the entry does not change
    assert_same(pool.encode(items[:1]), first[:1])


def test_another_handle_and_every_call_style_hit(pool, reference_encoder):
    items = distinct(102, 3)
    expected = pool.encode(items)
    published_by_caller = distinct(108, 2)  # encode_refs results: this caller publishes the references
    inserts = pool.stats().cache.inserts
    refs = pool.encode_refs(published_by_caller)
    inserted(
        pool, inserts + len(published_by_caller), "the references were never published"
    )  # on this caller's thread
    before, hits = encoded_items(pool), pool.stats().cache.hits
    other = EncoderPool.connect("vitpool-cache")
    try:
        assert_same(other.encode(items), expected)
        assert other.stats().cache.hits == hits + len(items)  # the shared cache's, not a tier's
        assert_same(ray.get(other.encode_refs(items)), expected)
        assert_same(asyncio.run(other.encode_async(items)), expected)
        assert_same(other.encode(published_by_caller), reference_encoder.encode(published_by_caller))
        assert_same(other.encode(published_by_caller), ray.get(refs))
    finally:
        other.close()
    assert encoded_items(pool) == before


def test_one_changed_pixel_misses(pool, reference_encoder):
    item = distinct(103, 1)[0]
    pool.encode([item])
    changed = image(8, 8)
    changed.pixel_values.copy_(torch.as_tensor(item.pixel_values))
    changed.pixel_values[5, 9] += 0.5
    before, misses = encoded_items(pool), pool.stats().cache.misses
    assert_same(pool.encode([changed]), reference_encoder.encode([changed]))
    assert encoded_items(pool) == before + 1
    assert pool.stats().cache.misses == misses + 1


def test_the_byte_bound_holds_under_distinct_items(pool):
    for seed in range(6):
        pool.encode(distinct(200 + seed, 8, side=16))
        stats = pool.stats().cache
        assert stats.bytes <= CAPACITY, stats.summary()
    assert stats.evictions > 0, stats.summary()


def test_concurrent_and_repeated_duplicates_are_encoded_once(pool, reference_encoder):
    item = distinct(104, 1, side=16)[0]
    before = encoded_items(pool)
    barrier, results, errors = threading.Barrier(6), [None] * 6, []

    def call(slot: int) -> None:
        try:
            barrier.wait()
            results[slot] = pool.encode([item, item])  # a repeat within the call too
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=call, args=(slot,)) for slot in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert errors == []
    expected = reference_encoder.encode([item])[0]
    for pair in results:
        assert_same(pair, [expected, expected])
        assert pair[0].tokens.data_ptr() != pair[1].tokens.data_ptr()
    assert encoded_items(pool) == before + 1


def test_losing_an_encoder_actor_or_the_cache_costs_no_result(pool, reference_encoder):
    items = distinct(105, 2)
    expected = pool.encode(items)
    ((victim_pid, victim),) = [
        (info.pid, pool._membership.actors[i]) for i, info in pool._membership.infos.items()
    ]
    ray.kill(victim, no_restart=True)
    local_hits = pool.stats().cache.local_hits
    assert_same(pool.encode(items), expected)  # this handle's tier holds them, though their owner is gone
    assert pool.stats().cache.local_hits == local_hits + len(items)
    deadline = time.monotonic() + 120
    # this handle's own view of the pool, which the next call uses, must hold the replacement
    while not [info for info in pool._membership.infos.values() if info.pid != victim_pid]:
        assert time.monotonic() < deadline, "no replacement encoder actor"
        time.sleep(0.2)
    ray.kill(pool._cache._handle, no_restart=False)  # it comes back empty
    assert answering_cache(pool).entries == 0
    fresh = distinct(106, 1)
    assert_same(pool.encode(fresh), reference_encoder.encode(fresh))  # encoded, by the new actor
    inserted(pool, 1, "the restarted cache got no entry")  # it fills again
    assert_same(pool.encode(items), expected)


@ray.remote(num_cpus=0)
class _OtherCaller:
    """A caller in a process of its own (so that this process's tier of the cache lacks its items)."""

    def encode(self, items) -> int:
        pool = EncoderPool.connect("vitpool-cache")
        pool.encode(items)
        return len(items)


def test_an_entry_whose_encoder_actor_exited_misses_cleanly(pool, reference_encoder):
    items = distinct(107, 2)
    inserts = answering_cache(pool).inserts
    other = _OtherCaller.remote()
    assert ray.get(other.encode.remote(items)) == 2
    inserted(pool, inserts + 2, "the encoder actor's entries never arrived")
    ((victim_pid, victim),) = [
        (info.pid, pool._membership.actors[i]) for i, info in pool._membership.infos.items()
    ]
    ray.kill(
        victim, no_restart=True
    )  # the entries' objects die with their owner, the actor that published them
    deadline = time.monotonic() + 120
    while not [info for info in pool._membership.infos.values() if info.pid != victim_pid]:
        assert time.monotonic() < deadline, "no replacement encoder actor"
        time.sleep(0.2)
    time.sleep(2)  # and Ray has told the object store
    lost, before = answering_cache(pool).lost_hits, encoded_items(pool)
    assert_same(pool.encode(items), reference_encoder.encode(items))
    assert encoded_items(pool) == before + 2
    assert answering_cache(pool).lost_hits == lost + 2
