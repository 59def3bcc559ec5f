"""Autoscaling on a local Ray cluster (CPU actors): a burst of calls grows the pool to its
maximum, quiet shrinks it to its minimum, and every item of every call comes back right and is
counted in the pool's totals, through both changes."""

from __future__ import annotations

import threading
import time

import pytest
from conftest import BUDGETS, assert_same, mixed_items

from vitpool import EncoderPool

pytestmark = pytest.mark.ray


def wait_for_actors(pool: EncoderPool, count: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pool.num_actors == count:
            return True
        time.sleep(0.1)
    return False


def test_a_burst_grows_the_pool_to_its_maximum_and_quiet_shrinks_it_to_its_minimum(
    ray_cluster, reference_encoder
):
    pool = EncoderPool.launch(
        budgets=BUDGETS,
        name="autoscaled",
        device="cpu",
        actor_options={"num_gpus": 0},
        autoscale=(1, 2),
        autoscale_interval_s=0.2,
        startup_timeout_s=120,
    )
    calls = [mixed_items(seed) for seed in range(6)]
    wanted = [reference_encoder.encode(items) for items in calls]
    sent, wrong, errors = [0], [], []
    lock, burst_over = threading.Lock(), threading.Event()

    def caller(offset: int) -> None:
        number = offset
        while not burst_over.is_set():
            items = calls[number % len(calls)]
            try:
                got = pool.encode(items, timeout_s=60)
                assert_same(got, wanted[number % len(calls)])
            except AssertionError as error:
                wrong.append(error)
            except Exception as error:  # noqa: BLE001 - every failure is a finding here
                errors.append(error)
            with lock:
                sent[0] += len(items)
            number += 1

    try:
        assert pool.num_actors == 1
        threads = [threading.Thread(target=caller, args=(n,)) for n in range(3)]
        for thread in threads:
            thread.start()
        grew = wait_for_actors(pool, 2, timeout_s=90)
        time.sleep(1.0)  # both actors serve the burst for a moment
        burst_over.set()
        for thread in threads:
            thread.join(timeout=60)
        assert grew, pool.stats().summary()
        assert wait_for_actors(pool, 1, timeout_s=90), pool.stats().summary()
        assert errors == [] and wrong == []
        # the controller counts the retired actor once its retirement is over, a moment after
        # this handle stopped seeing it
        deadline = time.monotonic() + 30
        while (stats := pool.stats()).departed_actors < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert stats.autoscale_ups >= 1 and stats.autoscale_downs >= 1, stats.summary()
        assert stats.failed_calls == 0 and stats.departed_actors >= 1
        assert stats.pool_items == sent[0] == stats.items, stats.summary()  # nothing lost, nothing run twice
        assert "autoscaling 1-2 actors" in stats.summary()
    finally:
        burst_over.set()
        pool.shutdown()
