"""The pool's metrics, through Ray's own (`ray.util.metrics`): each node's Ray metrics agent
exports them on its Prometheus endpoint (`ray start --metrics-export-port`, with `ray[default]`
installed), named `ray_vitpool_...`, with Ray's own labels and these:

| metric | kind | labels | what |
|---|---|---|---|
| `vitpool_<counter>` | counter | pool | one per field of `vitpool.pool.stats.CallerCounters`, named after it (one series per caller process): `vitpool_calls`, `vitpool_items`, `vitpool_tokens`, `vitpool_failed_calls`, `vitpool_rejected_items`, `vitpool_failed_batches`, ... |
| `vitpool_call_latency_seconds` | histogram | pool | a call's submit to results ready |
| `vitpool_queue_items`, `vitpool_queue_bytes` | gauge | pool | waiting in this process's queue |
| `vitpool_batches_in_flight` | gauge | pool | sent and not yet answered |
| `vitpool_<counter>` | counter | pool | one per field of `vitpool.pool.stats.PoolCounters`, named after it (the controller's): `vitpool_actor_failures`, `vitpool_actor_restarts`, `vitpool_autoscale_ups`, ... |
| `vitpool_actors` | gauge | pool | encoder actors taking work |
| `vitpool_actor_busy_fraction` | gauge | pool, actor | share of the last interval with a batch running |
| `vitpool_actor_graph_hit_rate` | gauge | pool, actor | share of items run in a captured graph (GPU actors) |
| `vitpool_actor_padding_waste` | gauge | pool, actor | share of budgeted rows that were padding |
| `vitpool_actor_items` | counter | pool, actor | items the actor encoded |

Each counter's description is what its field says it counts. Nothing is recorded on a call's path:
a thread of each handle (`CallerMetrics`) reads its dispatcher's counters every
`metrics_interval_s`, and the controller's reader of its actors (`vitpool.pool.actor_reader.ActorReader`)
hands `PoolMetrics` a reading of them as often. A counter goes up by what its source counted since
the last reading. A handle reads its counters once more when it is closed, or when its process
exits without closing it (Ray exports what was recorded as the process leaves), so a short-lived
caller's calls count too.
"""  # noqa: E501 - two rows of the Markdown table above; a table row cannot be wrapped

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Callable
from typing import Any

from vitpool.actors.reports import ActorStats
from vitpool.pool.actor_reader import ActorReading
from vitpool.pool.stats import CallerCounters, PoolCounters, counter_meanings, counts

logger = logging.getLogger(__name__)

LATENCY_BOUNDARIES_S = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0]
# How long a process's exit waits for a handle's last reading: it reads local counters into Ray's
# local recorder, which takes milliseconds; the bound only keeps a stuck reading from holding the exit.
EXIT_RECORD_TIMEOUT_S = 2.0


class Periodic:
    """A daemon thread that calls `record` every `interval_s` until closed (and once more then)."""

    def __init__(
        self, name: str, interval_s: float, record: Callable[[], None], final_record: bool = True
    ) -> None:
        self._interval_s, self._record, self._final_record = interval_s, record, final_record
        self._closed = threading.Event()
        self._failed_before = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed.wait(self._interval_s):
            self._record_logged()
        if self._final_record:
            self._record_logged()

    def _record_logged(self) -> None:
        try:
            self._record()
        except Exception:  # a reading that fails must never take the pool down
            # said once as a warning (a thread that always fails would otherwise go unseen)
            level = logging.DEBUG if self._failed_before else logging.WARNING
            logger.log(level, "%s: a periodic reading failed", self._thread.name, exc_info=True)
            self._failed_before = True

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop, after the last reading where there is one (waiting at most `timeout_s` for it)."""
        self._closed.set()
        self._thread.join(timeout=timeout_s)


class CallerMetrics:
    """A handle's counters as Ray metrics, recorded by a thread of its own.

    Args:
        pool: the pool's name (the `pool` label).
        dispatcher: the handle's dispatcher (`counters`, `queue_depth`, `queued_bytes`, `in_flight()`).
        interval_s: how often they are read.
    """

    def __init__(self, pool: str, dispatcher: Any, interval_s: float) -> None:
        from ray.util.metrics import Counter, Gauge, Histogram

        self._tags = {"pool": pool}
        self._dispatcher = dispatcher
        self._counters = {
            name: Counter(f"vitpool_{name}", description=meaning, tag_keys=("pool",))
            for name, meaning in counter_meanings(CallerCounters).items()
        }
        self._latency = Histogram(
            "vitpool_call_latency_seconds",
            description="a call's submit to results ready",
            boundaries=LATENCY_BOUNDARIES_S,
            tag_keys=("pool",),
        )
        self._queue_items = Gauge(
            "vitpool_queue_items", description="items waiting in the caller's queue", tag_keys=("pool",)
        )
        self._queue_bytes = Gauge(
            "vitpool_queue_bytes", description="pixel bytes waiting in the caller's queue", tag_keys=("pool",)
        )
        self._in_flight = Gauge(
            "vitpool_batches_in_flight", description="batches sent, not yet answered", tag_keys=("pool",)
        )
        self._seen = dict.fromkeys(self._counters, 0)
        self._seen_completed = 0
        self._every = Periodic("vitpool-metrics", interval_s, self._record)
        # The reading thread is a daemon (it must not keep the process alive), so it dies unheard at
        # exit: a caller that ends within one interval without closing its handle would report none
        # of its calls. Registered after `import ray`, this runs before Ray's own exit handler.
        atexit.register(self._record_at_exit)

    def _record(self) -> None:
        counters = self._dispatcher.counters
        _increase(self._counters, self._seen, counts(CallerCounters, counters), self._tags)
        completed, latencies = counters.completed_calls, list(counters.latencies_s)
        for latency in latencies[max(0, len(latencies) - (completed - self._seen_completed)) :]:
            self._latency.observe(latency, tags=self._tags)
        self._seen_completed = completed
        self._queue_items.set(self._dispatcher.queue_depth, tags=self._tags)
        self._queue_bytes.set(self._dispatcher.queued_bytes, tags=self._tags)
        self._in_flight.set(sum(self._dispatcher.in_flight().values()), tags=self._tags)

    def close(self) -> None:
        """Record what was counted since the last reading, and stop."""
        atexit.unregister(self._record_at_exit)
        self._every.close()

    def _record_at_exit(self) -> None:
        import ray

        if not ray.is_initialized():
            return  # this process left Ray: a reading would go nowhere
        self._every.close(timeout_s=EXIT_RECORD_TIMEOUT_S)


class PoolMetrics:
    """The pool's actors as Ray metrics, from the readings of its controller's `ActorReader`.

    Args:
        pool: the pool's name.
        counters: the controller's counters now.
    """

    def __init__(self, pool: str, counters: Callable[[], PoolCounters]) -> None:
        from ray.util.metrics import Counter, Gauge

        self._tags = {"pool": pool}
        self._counters_now = counters
        self._num_actors = Gauge(
            "vitpool_actors", description="encoder actors taking work", tag_keys=("pool",)
        )
        self._counters = {
            name: Counter(f"vitpool_{name}", description=meaning, tag_keys=("pool",))
            for name, meaning in counter_meanings(PoolCounters).items()
        }
        keys = ("pool", "actor")
        self._busy = Gauge(
            "vitpool_actor_busy_fraction",
            description="share of the last interval with a batch running",
            tag_keys=keys,
        )
        self._hit_rate = Gauge(
            "vitpool_actor_graph_hit_rate",
            description="share of items run in a captured graph",
            tag_keys=keys,
        )
        self._padding = Gauge(
            "vitpool_actor_padding_waste",
            description="share of budgeted rows that were padding",
            tag_keys=keys,
        )
        self._items = Counter("vitpool_actor_items", description="items the actor encoded", tag_keys=keys)
        self._seen_counters = dict.fromkeys(self._counters, 0)
        self._seen_actors: dict[int, ActorStats] = {}  # index -> its stats at the last reading

    def take(self, reading: ActorReading) -> None:
        """Record one reading of the actors (every `metrics_interval_s`), and the controller's counters."""
        self._num_actors.set(len(reading.actors), tags=self._tags)
        _increase(self._counters, self._seen_counters, counts(PoolCounters, self._counters_now()), self._tags)
        for index, stats in reading.stats.items():
            actor_tags = {**self._tags, "actor": str(index)}
            earlier = self._seen_actors.get(index)
            busy = stats.busy_fraction_since(earlier)  # the first reading: since the actor started
            if busy is not None:
                self._busy.set(busy, tags=actor_tags)
            if runs_graphs(stats):
                self._hit_rate.set(stats.graph_hit_rate, tags=actor_tags)
            self._padding.set(stats.padding_waste, tags=actor_tags)
            items_before = earlier.items if earlier is not None else 0
            if stats.items > items_before:
                self._items.inc(stats.items - items_before, tags=actor_tags)
            self._seen_actors[index] = stats
        self._seen_actors = {
            index: seen for index, seen in self._seen_actors.items() if index in reading.actors
        }


def _increase(
    metrics: dict[str, Any], seen: dict[str, int], values: dict[str, int], tags: dict[str, str]
) -> None:
    """Raise each Ray counter by what its source counted since the last reading (`seen`, updated)."""
    for name, value in values.items():
        if value > seen[name]:
            metrics[name].inc(value - seen[name], tags=tags)
        seen[name] = value


def runs_graphs(stats: ActorStats) -> bool:
    """Whether an actor's graph hit rate means something: a CPU actor runs its static forward
    without capture (`PoolStats.summary` shows "-" for it), and an actor that has encoded nothing
    has no rate yet. Either exports no value rather than a misleading 0.0."""
    return stats.captures_graphs and stats.graph_items + stats.eager_items > 0
