"""Reliability of the pool on a local Ray cluster (two fake GPUs, CPU actors): killed actor
processes lose nothing and are replaced, a pool with no actor left fails promptly, bad input is
rejected by name without harming a concurrent caller, and an overloaded pool stays bounded."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
import ray
import torch
from conftest import BUDGETS, ROW_WIDTH, CheckedStream, assert_same, image, mixed_items, wait_for

from vitpool import EncoderPool, Image, InvalidItemError, PoolUnavailableError, Video

pytestmark = pytest.mark.ray


def launch(name: str, **settings) -> EncoderPool:
    # A short startup timeout: if an earlier test left the fake GPUs taken, fail, do not wait.
    return EncoderPool.launch(budgets=BUDGETS, name=name, device="cpu", startup_timeout_s=120, **settings)


def actor_pids(pool: EncoderPool) -> dict[int, int]:
    membership = ray.get(pool._controller.membership.remote())
    return {index: info.pid for index, info in membership.infos.items()}


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a killed child stays a zombie until its parent reaps it: that is not alive
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def checked_stream(pool: EncoderPool, reference_encoder, threads: int = 4) -> CheckedStream:
    """Threads calling the pool back to back with calls of 2 to 4 mixed items."""
    return CheckedStream(pool, reference_encoder, [mixed_items(900 + n)[: 2 + n % 3] for n in range(threads)])


def test_a_killed_actor_loses_nothing_and_is_replaced(ray_cluster, reference_encoder):
    pool = launch("vitpool-kill", max_actor_restarts=2)
    try:
        victim, pid = min(actor_pids(pool).items())
        with checked_stream(pool, reference_encoder) as stream:
            wait_for(lambda: stream.completed >= 10, 120, "the stream to run", pool)
            in_flight = pool._dispatcher.in_flight().get(victim, 0)
            os.kill(pid, signal.SIGKILL)
            killed_at, completed_at_kill = time.monotonic(), stream.completed
            wait_for(
                lambda: stream.completed >= completed_at_kill + 20 or stream.failures,
                120,
                "calls after the kill",
                pool,
            )
            wait_for(
                lambda: pool.num_actors == 2 and victim not in actor_pids(pool), 180, "the replacement", pool
            )
            recovered_s = time.monotonic() - killed_at
            wait_for(
                lambda: stream.completed >= completed_at_kill + 40 or stream.failures,
                120,
                "calls on the new actor",
                pool,
            )
        stats = pool.stats()
        assert stream.failures == [], stats.summary()
        assert stats.failed_calls == 0, stats.summary()
        assert stats.actor_failures == 1 and stats.actor_restarts == 1, stats.summary()
        assert victim not in actor_pids(pool) and len(actor_pids(pool)) == 2
        print(
            f"\nkilled actor {victim} with {in_flight} batches in flight from this process; "
            f"{stats.requeued_items} items sent again, 0 lost; "
            f"replaced and taking work {recovered_s:.1f} s later"
        )
    finally:
        pool.shutdown()


def test_with_every_actor_dead_calls_fail_promptly(ray_cluster):
    pool = launch("vitpool-all-dead", max_actor_restarts=0)
    try:
        pids = list(actor_pids(pool).values())
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not any(process_alive(pid) for pid in pids), 30, "the actors' processes to end")
        start = time.monotonic()
        with pytest.raises(PoolUnavailableError):
            pool.encode([image(8, 8)], timeout_s=60)
        assert time.monotonic() - start < 15
        start = time.monotonic()
        with pytest.raises(PoolUnavailableError, match="no encoder actor left"):
            pool.encode([image(8, 8)], timeout_s=60)
        assert time.monotonic() - start < 1
        assert pool.stats().actor_restarts == 0
    finally:
        pool.shutdown()


BAD_INPUTS = {
    "wrong row width": lambda: Image(torch.randn(64, ROW_WIDTH - 1), (1, 8, 8)),
    "rows do not match the grid": lambda: Image(torch.randn(60, ROW_WIDTH), (1, 8, 8)),
    "image with t > 1": lambda: Image(torch.randn(128, ROW_WIDTH), (2, 8, 8)),
    "grid not a multiple of the merge": lambda: Image(torch.randn(63, ROW_WIDTH), (1, 7, 9)),
    "negative grid": lambda: Image(torch.randn(64, ROW_WIDTH), (1, -8, -8)),
    "grid of two numbers": lambda: Image(torch.randn(64, ROW_WIDTH), (8, 8)),
    "one-dimensional pixels": lambda: Image(torch.randn(64 * ROW_WIDTH), (1, 8, 8)),
    "integer pixels": lambda: Image(torch.ones(64, ROW_WIDTH, dtype=torch.int32), (1, 8, 8)),
    "not an item": lambda: {"pixel_values": torch.randn(64, ROW_WIDTH), "grid_thw": (1, 8, 8)},
    "over max_item_tokens": lambda: Image(torch.randn(1600, ROW_WIDTH), (1, 40, 40)),
    "NaN pixels": lambda: Image(torch.full((64, ROW_WIDTH), float("nan")), (1, 8, 8)),
    "infinite video": lambda: Video(torch.full((32, ROW_WIDTH), float("inf")), (2, 4, 4)),
    "numpy object array": lambda: Image(np.array([[object()]]), (1, 1, 1)),
}


def test_bad_inputs_name_their_item_and_spare_a_concurrent_caller(ray_cluster, reference_encoder):
    pool = launch("vitpool-bad", max_item_tokens=300)
    try:
        with checked_stream(pool, reference_encoder, threads=2) as stream:
            for kind, build in BAD_INPUTS.items():
                good = image(4, 4)
                with pytest.raises(InvalidItemError) as raised:
                    pool.encode([good, build()], timeout_s=60)
                assert raised.value.index == 1 and raised.value.reason, kind
                assert "item 1" in str(raised.value), kind
            completed = stream.completed
            wait_for(
                lambda: stream.completed > completed + 5 or stream.failures, 120, "the good caller", pool
            )
        assert stream.failures == []
        stats = pool.stats()
        assert stats.rejected_items == len(BAD_INPUTS)
        assert stats.failed_calls == 2  # the two bad calls that reached an actor (NaN, infinity)
    finally:
        pool.shutdown()


def test_an_overloaded_pool_stays_within_its_bounds(ray_cluster, reference_encoder):
    items = [image(16, 16, torch.Generator().manual_seed(s)) for s in range(2)]
    bound_bytes = 6 * items[0].pixel_values.nbytes
    pool = launch(
        "vitpool-overload",
        max_queued_items=6,
        max_queued_bytes=bound_bytes,
        max_batches_in_flight_per_actor=1,
        batch_window_s=0.01,
    )
    try:
        expected = reference_encoder.encode(items)
        answered, failures = [0], []
        lock = threading.Lock()
        deadline = time.monotonic() + 4.0

        def caller() -> None:
            while time.monotonic() < deadline:
                try:
                    assert_same(pool.encode(items, timeout_s=120), expected)
                except Exception as error:  # noqa: BLE001 - collected and reported
                    failures.append(repr(error))
                    return
                with lock:
                    answered[0] += 1

        rss_before, rss_peak = resident_bytes(), [0]

        def watch_memory() -> None:
            while time.monotonic() < deadline:
                rss_peak[0] = max(rss_peak[0], resident_bytes())
                time.sleep(0.05)

        threads = [threading.Thread(target=caller) for _ in range(16)] + [
            threading.Thread(target=watch_memory)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        stats = pool.stats()
        growth = rss_peak[0] - rss_before
        assert growth < 256 << 20, f"the caller's memory grew by {growth >> 20} MiB under overload"
        assert failures == []
        assert stats.calls == answered[0] and stats.items == 2 * answered[0]  # every accepted item answered
        assert 6 >= stats.peak_queued_items >= 4  # it filled up, and no further
        assert stats.peak_queued_bytes <= bound_bytes
        assert stats.queue_depth == 0 and stats.queued_bytes == 0
        print(
            f"\noverload: {answered[0]} calls answered; peak queue {stats.peak_queued_items} items, "
            f"{stats.peak_queued_bytes} bytes (bounds 6, {bound_bytes}); caller's resident memory "
            f"peaked {growth / 2**20:.1f} MiB above its start"
        )
        with pytest.raises(ValueError, match="can never fit"):
            pool.encode([image(16, 16) for _ in range(7)])
    finally:
        pool.shutdown()
