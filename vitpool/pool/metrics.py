"""The pool's metrics, through Ray's own (`ray.util.metrics`): each node's Ray metrics agent
exports them on its Prometheus endpoint (`ray start --metrics-export-port`, with `ray[default]`
installed), named `ray_vitpool_...`, with Ray's own labels and these:

| metric | kind | labels | what |
|---|---|---|---|
| `vitpool_calls` | counter | pool | calls made (this process's handle, one series per process) |
| `vitpool_items` | counter | pool | items encoded |
| `vitpool_tokens` | counter | pool | output tokens encoded |
| `vitpool_failed_calls` | counter | pool | calls that failed |
| `vitpool_rejected_items` | counter | pool | bad items (found in the caller or by an actor) |
| `vitpool_requeued_items` | counter | pool | items sent again after their actor died, left or went silent |
| `vitpool_failed_batches` | counter | pool | batches whose actor died, timed out or failed them |
| `vitpool_call_latency_seconds` | histogram | pool | a call's submit to results ready |
| `vitpool_queue_items`, `vitpool_queue_bytes` | gauge | pool | waiting in this process's queue |
| `vitpool_batches_in_flight` | gauge | pool | sent and not yet answered |
| `vitpool_actors` | gauge | pool | encoder actors taking work |
| `vitpool_actor_failures`, `vitpool_actor_restarts` | counter | pool | dead or silent actors; replacements |
| `vitpool_actor_busy_fraction` | gauge | pool, actor | share of the last interval with a batch running |
| `vitpool_actor_graph_hit_rate` | gauge | pool, actor | share of items run in a captured graph (GPU actors) |
| `vitpool_actor_padding_waste` | gauge | pool, actor | share of budgeted rows that were padding |
| `vitpool_actor_items` | counter | pool, actor | items the actor encoded |

Nothing is recorded on a call's path: a thread of each handle (`CallerMetrics`) reads its
dispatcher's counters every `metrics_interval_s`, and one of the controller (`PoolMetrics`) reads
the actors' stats as often. A counter goes up by what its source counted since the last reading.
A handle reads its counters once more when it is closed, or when its process exits without closing
it (Ray exports what was recorded as the process leaves), so a short-lived caller's calls count too.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Callable
from typing import Any

from vitpool.actors.reports import ActorStats

logger = logging.getLogger(__name__)

LATENCY_BOUNDARIES_S = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0]
CALLER_COUNTERS = {
    "calls": "calls made",
    "items": "items encoded",
    "tokens": "output tokens encoded",
    "failed_calls": "calls that failed",
    "rejected_items": "bad items, found in the caller or by an actor",
    "requeued_items": "items sent again after their actor died, left or went silent",
    "failed_batches": "batches whose actor died, timed out or failed them",
}
# How long a process's exit waits for a handle's last reading: it reads local counters into Ray's
# local recorder, which takes milliseconds; the bound only keeps a stuck reading from holding the exit.
EXIT_RECORD_TIMEOUT_S = 2.0


class Periodic:
    """A daemon thread that calls `record` every `interval_s` until closed (and once more then)."""

    def __init__(self, name: str, interval_s: float, record: Callable[[], None], final_record: bool = True) -> None:
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
            name: Counter(f"vitpool_{name}", description=text, tag_keys=("pool",)) for name, text in CALLER_COUNTERS.items()
        }
        self._latency = Histogram(
            "vitpool_call_latency_seconds", description="a call's submit to results ready",
            boundaries=LATENCY_BOUNDARIES_S, tag_keys=("pool",),
        )
        self._queue_items = Gauge("vitpool_queue_items", description="items waiting in the caller's queue", tag_keys=("pool",))
        self._queue_bytes = Gauge("vitpool_queue_bytes", description="pixel bytes waiting in the caller's queue", tag_keys=("pool",))
        self._in_flight = Gauge("vitpool_batches_in_flight", description="batches sent, not yet answered", tag_keys=("pool",))
        self._seen = dict.fromkeys(CALLER_COUNTERS, 0)
        self._seen_completed = 0
        self._every = Periodic("vitpool-metrics", interval_s, self._record)
        # The reading thread is a daemon (it must not keep the process alive), so it dies unheard at
        # exit: a caller that ends within one interval without closing its handle would report none
        # of its calls. Registered after `import ray`, this runs before Ray's own exit handler.
        atexit.register(self._record_at_exit)

    def _record(self) -> None:
        counters = self._dispatcher.counters
        for name, counter in self._counters.items():
            value = getattr(counters, name)
            if value > self._seen[name]:
                counter.inc(value - self._seen[name], tags=self._tags)
            self._seen[name] = value
        completed, latencies = counters.completed_calls, list(counters.latencies_s)
        for latency in latencies[max(0, len(latencies) - (completed - self._seen_completed)):]:
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
    """The pool's actors as Ray metrics, recorded by a thread of its controller.

    Args:
        pool: the pool's name.
        actors: the active actors' handles by index.
        health: (actor failures, restarts) so far.
        interval_s: how often they are read.
        saw: told each actor's stats as they are read (the controller keeps the last).
    """

    def __init__(
        self, pool: str, actors: Callable[[], dict[int, Any]], health: Callable[[], tuple[int, int]], interval_s: float,
        saw: Callable[[int, Any], None] | None = None,
    ) -> None:
        from ray.util.metrics import Counter, Gauge

        self._pool, self._actors, self._health, self._interval_s = pool, actors, health, interval_s
        self._saw = saw
        self._num_actors = Gauge("vitpool_actors", description="encoder actors taking work", tag_keys=("pool",))
        self._failures = Counter("vitpool_actor_failures", description="actors found dead or silent", tag_keys=("pool",))
        self._restarts = Counter("vitpool_actor_restarts", description="replacements started", tag_keys=("pool",))
        keys = ("pool", "actor")
        self._busy = Gauge("vitpool_actor_busy_fraction", description="share of the last interval with a batch running", tag_keys=keys)
        self._hit_rate = Gauge("vitpool_actor_graph_hit_rate", description="share of items run in a captured graph", tag_keys=keys)
        self._padding = Gauge("vitpool_actor_padding_waste", description="share of budgeted rows that were padding", tag_keys=keys)
        self._items = Counter("vitpool_actor_items", description="items the actor encoded", tag_keys=keys)
        self._seen_health = (0, 0)
        self._seen_actor: dict[int, tuple[float, float, int]] = {}  # index -> (uptime, busy seconds, items)
        # no last reading on close: the actors are being stopped
        self._every = Periodic("vitpool-pool-metrics", interval_s, self._record, final_record=False)

    def _record(self) -> None:
        import ray

        tags = {"pool": self._pool}
        actors = self._actors()
        self._num_actors.set(len(actors), tags=tags)
        failures, restarts = self._health()
        if failures > self._seen_health[0]:
            self._failures.inc(failures - self._seen_health[0], tags=tags)
        if restarts > self._seen_health[1]:
            self._restarts.inc(restarts - self._seen_health[1], tags=tags)
        self._seen_health = (failures, restarts)
        refs = {index: handle.stats.remote() for index, handle in actors.items()}
        for index, ref in refs.items():
            try:
                stats = ray.get(ref, timeout=self._interval_s)
            except ray.exceptions.RayError:
                continue  # retiring or dead: the dispatcher and the controller see to it
            if self._saw is not None:
                self._saw(index, stats)
            actor_tags = {"pool": self._pool, "actor": str(index)}
            uptime, busy, items = self._seen_actor.get(index, (0.0, 0.0, 0))
            if stats.uptime_seconds > uptime:
                self._busy.set(min(1.0, (stats.busy_seconds - busy) / (stats.uptime_seconds - uptime)), tags=actor_tags)
            if runs_graphs(stats):
                self._hit_rate.set(stats.graph_hit_rate, tags=actor_tags)
            self._padding.set(stats.padding_waste, tags=actor_tags)
            if stats.items > items:
                self._items.inc(stats.items - items, tags=actor_tags)
            self._seen_actor[index] = (stats.uptime_seconds, stats.busy_seconds, stats.items)

    def close(self) -> None:
        self._every.close()


def runs_graphs(stats: ActorStats) -> bool:
    """Whether an actor's graph hit rate means something: a CPU actor runs its static forward
    without capture (`PoolStats.summary` shows "-" for it), and an actor that has encoded nothing
    has no rate yet. Either exports no value rather than a misleading 0.0."""
    return stats.captures_graphs and stats.graph_items + stats.eager_items > 0
