"""EncoderPool on a local Ray cluster with two fake GPUs: two encoder actors running on the CPU."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time

import pytest
import ray
import torch
from conftest import BUDGETS, assert_same, image, mixed_items, ray_env

from vitpool import ConfigError, EncoderPool, InvalidItemError, PoolUnavailableError
from vitpool.codec import decode_results, encode_request

POOL_NAME = "vitpool-test"


def wait_until(condition, timeout_s: float, interval_s: float = 0.05) -> bool:
    """Whether `condition()` became true within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
    return True


pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def pool(ray_cluster):
    pool = EncoderPool.launch(budgets=BUDGETS, name=POOL_NAME, device="cpu")
    yield pool
    pool.shutdown()


def test_launch_starts_one_actor_per_gpu(pool):
    assert pool.num_actors == 2
    stats = pool.stats()
    assert [a.actor_index for a in stats.actors] == [0, 1]


def test_results_equal_the_in_process_encoder_in_order(pool, reference_encoder):
    items = mixed_items(0)
    before = pool.stats()
    results = pool.encode(items)
    after = pool.stats()
    assert_same(results, reference_encoder.encode(items))
    # the actors share this node: every batch took the shared-memory channel
    assert after.channel_batches - before.channel_batches == after.batches - before.batches > 0
    assert all(torch.isfinite(r.tokens).all() for r in results)
    # results are the caller's own memory, safe to write
    results[0].tokens.add_(1.0)


def test_sixteen_threads_get_exactly_their_own_results(pool, reference_encoder):
    outcomes: dict[int, object] = {}
    before = pool.stats()

    def caller(seed: int) -> None:
        items = mixed_items(100 + seed)[: 1 + seed % 4]
        try:
            outcomes[seed] = (items, [pool.encode(items) for _ in range(2)])
        except Exception as error:  # noqa: BLE001 - reported below
            outcomes[seed] = error

    threads = [threading.Thread(target=caller, args=(seed,)) for seed in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert sorted(outcomes) == list(range(16))
    for seed, outcome in outcomes.items():
        assert not isinstance(outcome, Exception), f"caller {seed}: {outcome!r}"
        items, repeats = outcome
        expected = reference_encoder.encode(items)
        for results in repeats:
            assert_same(results, expected)
    # concurrent calls shared batches: fewer batches than calls (each call alone needs at least one)
    after = pool.stats()
    assert after.calls - before.calls == 32
    assert after.batches - before.batches < after.calls - before.calls


def test_encode_async_from_asyncio(pool, reference_encoder):
    calls = [mixed_items(200 + i)[i : i + 2] for i in range(3)]

    async def main():
        return await asyncio.gather(*(pool.encode_async(items) for items in calls))

    for items, results in zip(calls, asyncio.run(main())):
        assert_same(results, reference_encoder.encode(items))


def test_encode_refs_resolve_to_embeddings(pool, reference_encoder):
    items = mixed_items(300)
    before = pool.stats()
    refs = pool.encode_refs(items)
    assert pool.stats().channel_batches == before.channel_batches  # references need the object store
    assert all(isinstance(ref, ray.ObjectRef) for ref in refs)
    assert_same(ray.get(refs), reference_encoder.encode(items))


def test_a_broken_channel_falls_back_to_ray_without_losing_a_call(ray_cluster, reference_encoder):
    pool = EncoderPool.connect(POOL_NAME)
    try:
        items = mixed_items(350)
        assert_same(pool.encode(items), reference_encoder.encode(items))  # opens connections
        for slot in pool._dispatcher._actors.values():
            for connection in slot.link._channel._all:
                connection._socket.shutdown(socket.SHUT_RDWR)
        results = [pool.encode(items) for _ in range(3)]
        for result in results:
            assert_same(result, reference_encoder.encode(items))
        stats = pool.stats()
        # the batches that found their channel broken went again, through Ray, to the same actor
        assert stats.failed_calls == 0 and stats.failed_batches == 0
        assert stats.batches > stats.channel_batches  # the later batches went through Ray
        assert not any(slot.link.is_local for slot in pool._dispatcher._actors.values())
    finally:
        pool.close()


ENGINE_FREE_CALLER = """
import sys, ray, torch
ray.init(address=sys.argv[1])
from vitpool import EncoderPool, Image
pool = EncoderPool.connect(sys.argv[2])
[result] = pool.encode([Image(torch.randn(64, 1536), (1, 8, 8))])
assert result.tokens.shape == (16, 128) and bool(torch.isfinite(result.tokens).all())
pool.close()
# (Ray loads the actor's class, vitpool.actors.encoder_actor, with each handle: the engine is not in it)
engine = [m for m in sys.modules if m.startswith(("transformers", "vitpool.graphs",
                                                  "vitpool.families.qwen3_vl.adapter",
                                                  "vitpool.models.loading", "vitpool.models.registry"))]
print("engine modules:", engine)
"""


def test_a_caller_process_loads_no_engine(pool):
    """connect + encode in a fresh process: the item rules arrive pickled, and nothing of the
    engine (transformers, modeling code, graphs) is imported."""
    address = ray.get_runtime_context().gcs_address
    done = subprocess.run(
        [sys.executable, "-c", ENGINE_FREE_CALLER, address, POOL_NAME],
        env=ray_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "engine modules: []" in done.stdout, done.stdout


def test_encode_bytes_answers_in_the_codec(pool, reference_encoder):
    items = mixed_items(320)
    results = decode_results(pool.encode_bytes(encode_request(items)))
    assert_same(results, reference_encoder.encode(items))
    with pytest.raises(ValueError, match="not a vitpool message"):
        pool.encode_bytes(b"\x80\x04not msgpack")
    with pytest.raises(InvalidItemError, match="item 0"):
        pool.encode_bytes(encode_request([image(3, 4)]))


def test_empty_call_returns_empty(pool):
    assert pool.encode([]) == []
    assert pool.encode_refs([]) == []
    with pytest.raises(TypeError, match="list of vitpool.Image"):
        pool.encode(image(4, 4))


@ray.remote(num_cpus=0)
class OtherCaller:
    """Another process of the cluster, as an LLM deployment's worker would be."""

    def encode(self, pool_name: str, pixels: list, grids: list) -> list:
        from vitpool import EncoderPool, Image

        pool = EncoderPool.connect(pool_name)
        try:
            results = pool.encode([Image(torch.from_numpy(p), g) for p, g in zip(pixels, grids)])
            return [r.tokens.numpy() for r in results]
        finally:
            pool.close()


def test_connect_by_name_from_another_actor(pool, reference_encoder):
    items = [image(8, 8, torch.Generator().manual_seed(s)) for s in range(3)]
    caller = OtherCaller.remote()
    tokens = ray.get(
        caller.encode.remote(POOL_NAME, [i.pixel_values.numpy() for i in items], [i.grid_thw for i in items])
    )
    ray.kill(caller)
    for got, want in zip(tokens, reference_encoder.encode(items)):
        torch.testing.assert_close(torch.from_numpy(got.copy()), want.tokens, rtol=1e-5, atol=1e-5)


def test_scaling_down_and_up_during_a_stream_loses_nothing(pool, reference_encoder):
    stop = threading.Event()
    failures: list[str] = []
    completed = [0]

    def stream(seed: int) -> None:
        items = mixed_items(400 + seed)[:3]
        expected = reference_encoder.encode(items)
        while not stop.is_set():
            try:
                assert_same(pool.encode(items, timeout_s=60), expected)
                completed[0] += 1
            except Exception as error:  # noqa: BLE001 - collected and reported
                failures.append(repr(error))
                return

    def calls_complete(count: int) -> None:
        """Wait until `count` more calls of the stream are done (or a stream failed)."""
        target = completed[0] + count
        assert wait_until(lambda: completed[0] >= target or failures, timeout_s=60), "the stream stalled"

    threads = [threading.Thread(target=stream, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    calls_complete(4)
    pool.scale(1)
    assert pool.num_actors == 1
    calls_complete(4)
    pool.scale(2)
    assert pool.num_actors == 2
    calls_complete(4)
    stop.set()
    for thread in threads:
        thread.join(timeout=120)
    assert failures == []
    assert completed[0] >= 12
    stats = pool.stats()
    assert stats.failed_calls == 0
    assert len(stats.actors) == 2  # the retired actor is gone, a new one took its place


def test_bad_items_name_their_index_and_spare_other_callers(pool, reference_encoder):
    good = mixed_items(500)[:2]
    bad_shape = [image(4, 4), image(4, 4)]
    bad_shape[1].pixel_values = torch.randn(16, 100)
    with pytest.raises(InvalidItemError, match="item 1: pixel_values have 100 features"):
        pool.encode(bad_shape)
    nan_item = image(4, 4)
    nan_item.pixel_values[3, 7] = float("nan")
    results: dict[str, object] = {}

    def good_caller() -> None:
        results["good"] = pool.encode(good)

    thread = threading.Thread(target=good_caller)
    thread.start()
    # the NaN is found on the actor, in a batch possibly shared with the good caller's items
    with pytest.raises(InvalidItemError, match="item 2: pixel_values contain NaN"):
        pool.encode([image(4, 4), image(4, 4), nan_item])
    thread.join(timeout=60)
    assert_same(results["good"], reference_encoder.encode(good))


def test_stats_count_what_was_done(pool):
    before = pool.stats()
    items = mixed_items(600)
    pool.encode(items)
    after = pool.stats()
    assert after.items - before.items == len(items)
    assert after.calls - before.calls == 1
    assert sum(a.items for a in after.actors) - sum(a.items for a in before.actors) == len(items)
    assert 0 < after.latency_p50_s <= after.latency_p99_s
    assert after.queue_depth == 0 and after.batches_in_flight == 0
    # CPU actors capture no graphs: every item ran eager, and the hit rate is exactly 0
    assert sum(a.eager_items for a in after.actors) - sum(a.eager_items for a in before.actors) == len(items)
    assert all(a.graph_items == 0 and a.graph_hit_rate == 0.0 for a in after.actors)
    assert all(a.busy_seconds > 0 for a in after.actors if a.items)


def test_a_second_pool_of_the_same_name_is_refused(pool):
    with pytest.raises(ConfigError, match="already running"):
        EncoderPool.launch(budgets=BUDGETS, name=POOL_NAME)


def test_connect_to_a_missing_pool_fails_clearly(ray_cluster):
    with pytest.raises(PoolUnavailableError, match="no pool named 'nobody'"):
        EncoderPool.connect("nobody")


def test_bad_settings_fail_before_anything_starts(ray_cluster):
    with pytest.raises(ConfigError, match="max_batches_in_flight_per_actor"):
        EncoderPool.launch(max_batches_in_flight_per_actor=0)
    with pytest.raises(ConfigError, match="num_actors"):
        EncoderPool.launch(num_actors=0)
    with pytest.raises(ConfigError, match="duplicates"):
        EncoderPool.launch(budgets=[16, 16])
    with pytest.raises(ConfigError, match="max_tokens_per_run"):
        EncoderPool.launch(max_tokens_per_run=0)
    with pytest.raises(ConfigError, match="channel_spin_s"):
        EncoderPool.launch(channel_spin_s=-1)
    with pytest.raises(ConfigError, match="need 3 GPUs; the cluster has 2"):
        EncoderPool.launch(num_actors=3, name="too-big")
    assert "too-big" not in {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}


def test_shutdown_of_a_pool_on_a_running_cluster_leaves_the_cluster(ray_cluster):
    # both fake GPUs belong to the module's pool: this one runs a CPU actor
    pool = EncoderPool.launch(
        budgets=BUDGETS, name="short-lived", num_actors=1, actor_options={"num_gpus": 0}, device="cpu"
    )
    assert pool.encode([image(4, 4)])[0].tokens.shape == (4, 128)
    pool.shutdown()
    assert ray.is_initialized()

    def gone() -> bool:
        return not any(
            a["name"].startswith("short-lived") for a in ray.util.list_named_actors(all_namespaces=True)
        )

    assert wait_until(gone, timeout_s=30)


SELF_STARTED = """
import ray, torch
from vitpool import EncoderPool, Image
pool = EncoderPool.launch(budgets=[16, 64], device="cpu", actor_options={"num_gpus": 0})
assert pool.num_actors == 1, pool.num_actors
assert pool.encode([Image(torch.randn(16, 1536), (1, 4, 4))])[0].tokens.shape == (4, 128)
pool.shutdown()
assert not ray.is_initialized()
print("stopped")
"""


def test_a_pool_that_started_ray_stops_it():
    done = subprocess.run(
        [sys.executable, "-c", SELF_STARTED],
        env=ray_env(),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "stopped" in done.stdout
