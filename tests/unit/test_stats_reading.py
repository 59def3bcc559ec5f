"""The pool's counters defined once (every place that lists them derives from `CallerCounters` and
`PoolCounters`), the busy fraction, and the controller's one reader of its actors: one stats call
per actor per reading, each consumer served at its own interval. Fake actors and a fake clock: no
Ray cluster."""

from __future__ import annotations

import time
from dataclasses import fields
from types import SimpleNamespace

import pytest
import ray
import ray.util.metrics

from vitpool.actors.reports import ActorStats
from vitpool.pool.actor_reader import ActorReader, ActorReading
from vitpool.pool.dispatcher import DispatchCounters
from vitpool.pool.metrics import CallerMetrics, PoolMetrics
from vitpool.pool.stats import (
    CallerCounters,
    PoolCounters,
    PoolStats,
    counter_meanings,
    counts,
)


class FakeMetric:
    """Ray's Counter, Gauge or Histogram: what was added, by its tags' actor label."""

    def __init__(self, name: str, **options: object) -> None:
        self.name, self.total, self.last = name, 0.0, {}

    def inc(self, value: float, tags: dict) -> None:
        self.total += value

    def set(self, value: float, tags: dict) -> None:
        self.last[tags.get("actor", "")] = value

    def observe(self, value: float, tags: dict) -> None:
        pass


@pytest.fixture
def made(monkeypatch) -> dict[str, FakeMetric]:
    metrics: dict[str, FakeMetric] = {}
    for kind in ("Counter", "Gauge", "Histogram"):
        monkeypatch.setattr(
            ray.util.metrics, kind, lambda name, **options: metrics.setdefault(name, FakeMetric(name))
        )
    return metrics


def test_every_counter_is_in_the_stats_and_the_metrics(made):
    caller_names, pool_names = list(counter_meanings(CallerCounters)), list(counter_meanings(PoolCounters))
    stats_names = {item.name for item in fields(PoolStats)}
    assert set(caller_names) | set(pool_names) <= stats_names
    assert set(caller_names) <= {item.name for item in fields(DispatchCounters)}
    # each counter's own value, so that a counter copied from another would show
    dispatched = DispatchCounters(**{name: n + 1 for n, name in enumerate(caller_names)})
    controller = PoolCounters(**{name: n + 1 for n, name in enumerate(pool_names)})
    stats = PoolStats("p", 1, **counts(CallerCounters, dispatched), **counts(PoolCounters, controller))
    assert counts(CallerCounters, stats) == counts(CallerCounters, dispatched)
    assert counts(PoolCounters, stats) == counts(PoolCounters, controller)
    assert PoolStats("p", 1, [ActorStats(items=3)]).pool_items == 3  # positional fields as before

    dispatcher = SimpleNamespace(counters=dispatched, queue_depth=0, queued_bytes=0, in_flight=dict)
    caller = CallerMetrics("p", dispatcher, interval_s=3600.0)
    caller.close()  # one last reading
    pool = PoolMetrics("p", lambda: controller)
    pool.take(ActorReading((), {}))
    for name, value in {**counts(CallerCounters, dispatched), **counts(PoolCounters, controller)}.items():
        assert made[f"vitpool_{name}"].total == value, name


@pytest.mark.parametrize(
    "earlier, later, fraction",
    [
        (None, ActorStats(busy_seconds=2.0, uptime_seconds=8.0), 0.25),  # no reading before: since the start
        (
            ActorStats(busy_seconds=2.0, uptime_seconds=8.0),
            ActorStats(busy_seconds=5.0, uptime_seconds=12.0),
            0.75,
        ),
        # a busy time counted up to the reading can pass the interval by a hair: at most 1
        (
            ActorStats(busy_seconds=1.0, uptime_seconds=2.0),
            ActorStats(busy_seconds=3.1, uptime_seconds=4.0),
            1.0,
        ),
        (ActorStats(uptime_seconds=4.0), ActorStats(uptime_seconds=4.0), None),  # no time passed: no fraction
        (None, ActorStats(), None),  # an actor that reports no uptime yet
    ],
)
def test_busy_fraction(earlier, later, fraction):
    assert later.busy_fraction_since(earlier) == fraction


class FakeActors:
    """Actors whose stats calls are refs answered (or not) as the test says."""

    def __init__(self, indices: list[int]) -> None:
        self.handles = {
            index: SimpleNamespace(stats=SimpleNamespace(remote=self._asker(index))) for index in indices
        }
        self.asked: list[int] = []
        self.silent: set[int] = set()  # their calls stay unanswered
        self.dead: set[int] = set()
        self.waited_for: list[list[int]] = []  # the actors of each wait with a timeout

    def _asker(self, index: int):
        def remote() -> tuple[int, int]:
            self.asked.append(index)
            return index, len(self.asked)  # a ref: unique per call

        return remote

    def wait(self, refs, num_returns, timeout):
        if timeout:
            self.waited_for.append(sorted(ref[0] for ref in refs))
        ready = [ref for ref in refs if ref[0] not in self.silent]
        return ready, [ref for ref in refs if ref not in ready]

    def get(self, ref, timeout=None):
        if ref[0] in self.dead:
            raise ray.exceptions.RayActorError()
        return ActorStats(ref[0], "cpu", items=ref[1])


@pytest.fixture
def actors(monkeypatch) -> FakeActors:
    fake = FakeActors([0, 1, 2])
    monkeypatch.setattr(ray, "wait", fake.wait)
    monkeypatch.setattr(ray, "get", fake.get)
    return fake


def test_a_reading_asks_each_actor_once_and_an_unanswered_one_not_again(actors):
    reader = ActorReader(lambda: actors.handles)
    reader.close()
    actors.silent = {1}
    actors.dead = {2}
    first = reader.read(timeout_s=0.1)
    assert sorted(actors.asked) == [0, 1, 2] and first.actors == (0, 1, 2)
    assert list(first.stats) == [0] and first.dead == (2,)
    reader.read(timeout_s=0.1)
    assert sorted(actors.asked) == [0, 0, 1, 2, 2]  # actor 1 is not asked again...
    assert actors.waited_for == [[0, 1, 2], [0, 2]]  # ... nor waited for: it held up one reading only
    actors.silent = set()
    third = reader.read(timeout_s=0.1)
    assert sorted(third.stats) == [0, 1] and third.stats[1].items == 2  # its first answer, late


def serve_until(reader: ActorReader, now: list[float], end_s: float) -> None:
    """What the reader's thread does, on a fake clock: wake when the soonest consumer is due, and
    serve those due."""
    while (soonest := reader.soonest_due_s()) <= end_s:
        now[0] = soonest
        reader._serve_due()


def test_each_consumer_gets_readings_at_its_own_interval_from_one_reading_per_period(actors):
    now = [0.0]
    reader = ActorReader(lambda: actors.handles, clock=lambda: now[0])
    reader.close()  # the test turns the clock and serves the due consumers itself
    taken: dict[str, list[float]] = {"liveness": [], "metrics": [], "autoscaler": []}
    reader.add("liveness", 2.0, lambda reading: taken["liveness"].append(now[0]), every_reading=True)
    reader.add("metrics", 5.0, lambda reading: taken["metrics"].append(now[0]))
    reader.add("autoscaler", 1.0, lambda reading: taken["autoscaler"].append(now[0]))
    serve_until(reader, now, 20.0)
    assert taken["autoscaler"] == [float(t) for t in range(1, 21)]  # the shortest interval: every reading
    assert taken["liveness"] == taken["autoscaler"]  # every reading (its 2 s are the most apart)
    assert taken["metrics"] == [5.0, 10.0, 15.0, 20.0]  # from readings taken anyway
    # one stats call per actor per reading: 20 readings of 3 actors (three threads of their own
    # asked 3 * (20 + 10 + 4) times)
    assert len(actors.asked) == 20 * 3


def test_a_longer_interval_takes_the_nearest_reading_and_keeps_its_rate(actors):
    now = [0.0]
    reader = ActorReader(lambda: actors.handles, clock=lambda: now[0])
    reader.close()
    taken = []
    reader.add("liveness", 2.0, lambda reading: None)
    reader.add("metrics", 5.0, lambda reading: taken.append(now[0]))
    serve_until(reader, now, 20.0)
    assert taken == [4.0, 10.0, 14.0, 20.0]  # each within a second of 5, 10, 15, 20
    assert len(actors.asked) == 10 * 3  # a reading every 2 s only


def test_a_reading_that_outlasts_an_interval_leaves_a_whole_one_after_it(actors):
    now = [0.0]
    reader = ActorReader(lambda: actors.handles, clock=lambda: now[0])
    reader.close()
    taken = []

    def slow(reading: ActorReading) -> None:
        taken.append(now[0])
        now[0] += 3.0  # this reading's consumers took 3 s

    reader.add("autoscaler", 1.0, slow)
    serve_until(reader, now, 9.0)
    assert taken == [1.0, 5.0, 9.0]


def test_a_failing_consumer_spares_the_others(actors):
    now = [0.0]
    reader = ActorReader(lambda: actors.handles, clock=lambda: now[0])
    reader.close()
    taken = []
    reader.add("metrics", 1.0, lambda reading: 1 / 0)
    reader.add("autoscaler", 1.0, taken.append)
    serve_until(reader, now, 2.0)
    assert len(taken) == 2 and sorted(taken[0].stats) == [0, 1, 2]


def test_the_reader_thread_reads_until_closed(actors):
    readings = []
    reader = ActorReader(lambda: actors.handles)
    reader.add("metrics", 0.01, readings.append)
    try:
        deadline = time.monotonic() + 30
        while len(readings) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        reader.close()
    assert len(readings) >= 3 and not reader._thread.is_alive()
