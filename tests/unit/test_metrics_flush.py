"""The metrics' edges without Ray's metrics agent: a caller's counts recorded when its process
exits without closing its handle (and nothing kept alive or failing then), and no graph hit rate
exported for actors that run no graphs."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
import ray.util.metrics

from vitpool.actors.reports import ActorStats
from vitpool.pool.actor_reader import ActorReading
from vitpool.pool.metrics import PoolMetrics
from vitpool.pool.stats import PoolCounters

# A caller process with fakes for Ray's metric classes (each recording prints a line) and a
# dispatcher that counted 30 calls; it exits long before the 60 s reading interval, as a script
# that makes its calls and ends does.
SHORT_LIVED_CALLER = textwrap.dedent("""
    import sys
    import ray, ray.util.metrics
    from types import SimpleNamespace

    class Fake:
        def __init__(self, name, description="", tag_keys=(), boundaries=None):
            self.name = name
        def inc(self, value, tags=None):
            print("inc", self.name, value, flush=True)
        def observe(self, value, tags=None):
            print("observe", self.name, flush=True)
        def set(self, value, tags=None):
            pass

    ray.util.metrics.Counter = ray.util.metrics.Gauge = ray.util.metrics.Histogram = Fake
    ray.is_initialized = lambda: sys.argv[1] != "left-ray"
    from vitpool.pool.metrics import CallerMetrics

    from vitpool.pool.dispatcher import DispatchCounters

    counters = DispatchCounters(calls=30, items=60, tokens=600, completed_calls=30)
    counters.latencies_s.extend([0.01] * 30)
    dispatcher = SimpleNamespace(counters=counters, queue_depth=0, queued_bytes=0, in_flight=dict)
    metrics = CallerMetrics("short", dispatcher, interval_s=60.0)
    if sys.argv[1] == "closed":
        metrics.close()
    print("exiting", flush=True)
""")


def run_caller(mode: str) -> tuple[list[str], float]:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", SHORT_LIVED_CALLER, mode],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    elapsed = time.monotonic() - start
    assert done.returncode == 0 and done.stderr.strip() == "", done.stderr[-3000:]
    return done.stdout.splitlines(), elapsed


@pytest.mark.parametrize(
    "mode",
    [
        "exits",  # never closed: counted as the process exits (was never counted)
        "closed",  # closed, then exits: counted once, by close, not again at exit
    ],
)
def test_a_short_lived_caller_reports_its_calls_once(mode):
    lines, elapsed = run_caller(mode)
    assert lines.count("inc vitpool_calls 30") == 1, lines
    # recorded by close() before the script's end, or by the exit hook after it
    assert (lines.index("inc vitpool_calls 30") < lines.index("exiting")) == (mode == "closed")
    assert "inc vitpool_items 60" in lines and "inc vitpool_tokens 600" in lines
    assert lines.count("observe vitpool_call_latency_seconds") == 30
    assert elapsed < 30  # the 60 s reading thread did not keep the process alive


def test_a_caller_that_left_ray_records_nothing_at_exit_and_exits_cleanly():
    lines, _ = run_caller("left-ray")
    assert lines == ["exiting"]


class FakeGauge:
    """Ray's Gauge (and Counter): the last value set, by actor."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}

    def set(self, value: float, tags: dict) -> None:
        self.values[tags.get("actor", "")] = value

    def inc(self, value: float, tags: dict) -> None:
        pass


def test_graph_hit_rate_is_exported_only_for_actors_that_run_graphs(monkeypatch):
    made: dict[str, FakeGauge] = {}  # by metric name
    for kind in ("Gauge", "Counter"):
        monkeypatch.setattr(
            ray.util.metrics, kind, lambda name, **options: made.setdefault(name, FakeGauge())
        )
    stats = {
        # a CPU actor runs its static forward without capture: `status` shows "- (CPU)"
        0: ActorStats(0, "cpu", batches=3, items=9, eager_items=9, padding_waste=0.25, uptime_seconds=10.0),
        # a GPU actor with 3 of 4 items in graphs
        1: ActorStats(
            1, "cuda:0 (NVIDIA H100)", batches=2, items=4, graph_items=3, eager_items=1, uptime_seconds=10.0
        ),
        # a GPU actor that has encoded nothing yet: no rate to speak of
        2: ActorStats(2, "cuda:1 (NVIDIA H100)", uptime_seconds=10.0),
    }
    metrics = PoolMetrics("p", PoolCounters)
    metrics.take(ActorReading(tuple(stats), stats))  # one reading, as the controller's reader hands it over
    assert made["vitpool_actor_graph_hit_rate"].values == {"1": 0.75}  # was 0.0 for actors 0 and 2
    assert made["vitpool_actor_padding_waste"].values == {"0": 0.25, "1": 0.0, "2": 0.0}  # as before
