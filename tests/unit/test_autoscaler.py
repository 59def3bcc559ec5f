"""The autoscaling decision, on plain readings: up after sustained load, down after sustained
idleness, within the bounds, never while an actor is starting."""

from __future__ import annotations

import pytest

from vitpool.actors.reports import ActorStats
from vitpool.errors import ConfigError
from vitpool.pool.actor_reader import ActorReading
from vitpool.pool.autoscaler import DOWN_READINGS, UP_READINGS, AutoscalePolicy, Autoscaler, checked_bounds
from vitpool.pool.settings import PoolSettings


def readings(
    policy: AutoscalePolicy, busy: float, count: int, num_actors: int, starting: int = 0
) -> list[int]:
    return [policy.decide([busy] * num_actors, num_actors, starting) for _ in range(count)]


def test_sustained_load_adds_one_actor_after_the_readings_and_counts_again():
    policy = AutoscalePolicy(1, 4)
    assert readings(policy, 0.9, UP_READINGS, 1) == [0] * (UP_READINGS - 1) + [1]
    assert readings(policy, 0.9, UP_READINGS, 2) == [0] * (UP_READINGS - 1) + [1]  # the count starts again


def test_a_dip_resets_the_count():
    policy = AutoscalePolicy(1, 4)
    steps = (
        readings(policy, 0.9, UP_READINGS - 1, 1)
        + readings(policy, 0.5, 1, 1)
        + readings(policy, 0.9, UP_READINGS - 1, 1)
    )
    assert steps == [0] * (2 * UP_READINGS - 1)


def test_sustained_idleness_retires_one_actor_but_never_below_the_minimum():
    policy = AutoscalePolicy(2, 4)
    assert readings(policy, 0.1, DOWN_READINGS, 3) == [0] * (DOWN_READINGS - 1) + [-1]
    assert readings(policy, 0.0, 3 * DOWN_READINGS, 2) == [0] * (3 * DOWN_READINGS)


def test_never_above_the_maximum_and_nothing_while_an_actor_starts():
    policy = AutoscalePolicy(1, 2)
    assert readings(policy, 1.0, 3 * UP_READINGS, 2) == [0] * (3 * UP_READINGS)
    policy = AutoscalePolicy(1, 4)
    assert readings(policy, 1.0, 3 * UP_READINGS, 1, starting=1) == [0] * (3 * UP_READINGS)


def test_a_pool_below_its_minimum_grows_at_once():
    assert AutoscalePolicy(2, 4).decide([0.0], 1, 0) == 1


def test_bounds_are_checked():
    assert checked_bounds([1, 3]) == (1, 3)
    assert PoolSettings(autoscale=[1, 2]).autoscale == (1, 2)
    for bad in ((0, 2), (3, 2), (1,), "1,2", (1.0, 2), (True, 2)):
        with pytest.raises(ConfigError, match="autoscale"):
            PoolSettings(autoscale=bad)
    with pytest.raises(ConfigError, match="autoscale_interval_s"):
        PoolSettings(autoscale=(1, 2), autoscale_interval_s=0)


def test_the_autoscaler_decides_on_each_actors_busy_fraction_since_its_last_reading(monkeypatch):
    scaled_to = []
    autoscaler = Autoscaler(
        AutoscalePolicy(1, 2), starting=lambda: 0, scale=scaled_to.append, actor_resources={"CPU": 1}
    )
    monkeypatch.setattr(autoscaler, "_request", lambda num_actors: None)  # no Ray autoscaler here
    monkeypatch.setattr("ray.available_resources", lambda: {"CPU": 4.0})

    def reading(second: int, busy_seconds: float) -> ActorReading:
        return ActorReading(
            (0,), {0: ActorStats(0, "cpu", busy_seconds=busy_seconds, uptime_seconds=float(second))}
        )

    # the first reading spans the actor's start (idle for 10 s): not counted; then 90% busy
    autoscaler.take(reading(10, 0.0))
    for second in range(1, UP_READINGS + 1):
        assert scaled_to == []
        autoscaler.take(reading(10 + second, 0.9 * second))
    assert scaled_to == [2] and autoscaler.scale_ups == 1
