"""The pool's counters, defined once, and what `EncoderPool.stats()` returns.

Two dataclasses hold every counter of a pool, each field with what it counts: `CallerCounters`,
what a handle counts of its calls (its dispatcher's counters are one), and `PoolCounters`, what
the controller counts of its actors. `PoolStats` is both plus the snapshot's other figures, the
metrics export one Ray counter per field (`vitpool.pool.metrics`), and `EncoderPool.stats` copies
them over by name: a new counter is one field here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

from vitpool.actors.reports import ActorStats
from vitpool.errors import counted

logger = logging.getLogger(__name__)

RATE_WINDOW_S = 10.0


def counter(what: str) -> Any:
    """A counter field: 0 at first, counting up; `what` it counts is also its metric's description."""
    return field(default=0, metadata={"counts": what})


# keyword-only, so that `PoolStats`, which adds them to its own fields, keeps its positional ones
@dataclass(kw_only=True)
class CallerCounters:
    """What a handle counted of the calls made through it since it was opened (its dispatcher counts)."""

    calls: int = counter("calls made")
    items: int = counter("items encoded")
    tokens: int = counter("output tokens encoded")
    batches: int = counter("batches sent to the actors")
    channel_batches: int = counter("batches answered through the same-node channel rather than a Ray call")
    failed_calls: int = counter("calls that failed")
    rejected_items: int = counter("bad items, found in the caller or by an actor")
    requeued_items: int = counter("items sent again after their actor died, left or went silent")
    failed_batches: int = counter("batches whose actor died, timed out or failed them")
    timed_out_batches: int = counter("batches unanswered within batch_timeout_s")


@dataclass(kw_only=True)
class PoolCounters:
    """What the pool's controller counted of its actors since launch."""

    actor_failures: int = counter("actors reported dead or silent (by any caller, or the controller's check)")
    actor_restarts: int = counter("replacements started for dead or silent actors")
    standby_takeovers: int = counter("actors that a node's warm standby became (replacements or autoscaled)")
    departed_actors: int = counter("actors that retired or failed since launch")
    autoscale_ups: int = counter("actors the autoscaler added")
    autoscale_downs: int = counter("actors the autoscaler retired")


def counter_meanings(counters: type) -> dict[str, str]:
    """Each counter of a counters class (`CallerCounters`, `PoolCounters`), by name: what it counts."""
    return {item.name: item.metadata["counts"] for item in fields(counters)}


def counts(counters: type, source: Any) -> dict[str, int]:
    """`source`'s value of each counter of `counters` (an instance of it, or of a class that has its
    fields: a dispatcher's counters, `PoolStats`)."""
    return {name: getattr(source, name) for name in counter_meanings(counters)}


@dataclass
class CacheStats:
    """The cache's counters since it started (it starts empty again if its actor restarts).

    `hits` and `misses` count keys looked up; `waits` the keys whose lookup found them being
    encoded for another caller; `lapsed_claims` the claims whose caller never published or gave
    them up in time; `lost_hits` hits whose object was gone when fetched (encoded again).
    """

    capacity_bytes: int = 0
    entries: int = 0
    bytes: int = 0
    hits: int = 0
    misses: int = 0
    waits: int = 0
    inserts: int = 0
    evictions: int = 0
    too_large: int = 0  # embeddings larger than the whole cache, not kept
    lapsed_claims: int = 0
    lost_hits: int = 0
    local_hits: int = 0  # keys served by the asking handle's own tier, never looked up here

    @property
    def hit_rate(self) -> float:
        looked_up = self.hits + self.misses
        return self.hits / looked_up if looked_up else 0.0

    def summary(self) -> str:
        return (
            f"embedding cache: {self.entries} entries, {self.bytes / 2**20:.1f} of "
            f"{self.capacity_bytes / 2**20:.1f} MiB, hits {self.hits}, misses {self.misses} "
            f"({self.hit_rate:.0%} hit rate), waited {self.waits}, evictions {self.evictions}; "
            f"this handle's own tier: {self.local_hits} hits"
        )


@dataclass
class PoolStats(PoolCounters, CallerCounters):
    """A snapshot of a pool.

    The pool's: `actors` (per actor taking work: device, batches, items, graph hit rate, padding
    waste, busy time), `departed` (the counters of the actors that retired or failed since launch,
    summed, so that the pool's totals survive scaling), the controller's counters (`PoolCounters`:
    actor failures, restarts, ...), and the embedding cache shared by every caller (`cache`). This
    process's calls through its handles: their counters (`CallerCounters`: calls, items, ...),
    queue depth, batches in flight, items per second over the last 10 s, and call latency (submit
    to results ready) p50/p99 over the last 4096 calls.
    """

    name: str
    num_actors: int
    actors: list[ActorStats] = field(default_factory=list)
    queue_depth: int = 0
    batches_in_flight: int = 0
    queued_bytes: int = 0
    peak_queued_items: int = 0
    peak_queued_bytes: int = 0
    items_per_second: float = 0.0
    latency_p50_s: float = 0.0
    latency_p99_s: float = 0.0
    cache: CacheStats | None = None  # the pool's embedding cache, shared by every caller; None: off
    departed: ActorStats = field(default_factory=ActorStats)  # the departed actors' counters, summed
    autoscale: tuple[int, int] | None = None  # (min_actors, max_actors) where the pool autoscales

    @property
    def pool_items(self) -> int:
        """Items every actor encoded since launch, those that left included."""
        return sum(actor.items for actor in self.actors) + self.departed.items

    @property
    def pool_batches(self) -> int:
        return sum(actor.batches for actor in self.actors) + self.departed.batches

    def summary(self, this_process: bool = True) -> str:
        """A few lines and a table: the pool's totals, this process's calls (unless
        `this_process` is False: a process that made none), the cache, then one row per actor."""
        lines = [
            f"pool {self.name!r}: {counted(self.num_actors, 'encoder actor')} taking work; since launch "
            f"{counted(self.pool_items, 'item')} in {counted(self.pool_batches, 'batch')}"
            + (
                f" ({self.departed.items} by {counted(self.departed_actors, 'actor')} since retired or "
                "failed)"
                if self.departed_actors
                else ""
            )
            + f", actor failures {self.actor_failures}, restarts {self.actor_restarts}"
            + (f", warm standby take-overs {self.standby_takeovers}" if self.standby_takeovers else "")
            + (
                f"; autoscaling {self.autoscale[0]}-{self.autoscale[1]} actors: {self.autoscale_ups} up, "
                f"{self.autoscale_downs} down"
                if self.autoscale
                else ""
            )
        ]
        if this_process:
            lines.append(
                f"this process: {counted(self.calls, 'call')}, {counted(self.items, 'item')} in "
                f"{counted(self.batches, 'batch')} ({self.channel_batches} through shared memory), "
                f"{self.items_per_second:.1f} items/s over the last 10 s, latency p50 "
                f"{self.latency_p50_s * 1e3:.2f} ms p99 {self.latency_p99_s * 1e3:.2f} ms; queue "
                f"{counted(self.queue_depth, 'item')} (peak {self.peak_queued_items}, "
                f"{self.peak_queued_bytes / 2**20:.1f} MiB), in flight {self.batches_in_flight}; failed "
                f"calls {self.failed_calls}, rejected items {self.rejected_items}, requeued items "
                f"{self.requeued_items}, failed batches {self.failed_batches} ({self.timed_out_batches} "
                "timed out)"
            )
        if self.cache is not None:
            lines.append(self.cache.summary())
        lines += [
            (
                "| actor | device | batches | items | runs (combined batches) | graph hit rate | padding "
                "| busy | up |"
            ),
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for actor in self.actors:
            # a CPU actor runs its static forward without capture: no graphs to hit
            hit_rate = "- (CPU)" if not actor.captures_graphs else f"{actor.graph_hit_rate:.0%}"
            lines.append(
                f"| {actor.actor_index} | {actor.device} | {actor.batches} | {actor.items} | {actor.runs} "
                f"({actor.combined_batches}) | {hit_rate} | {actor.padding_waste:.0%} | "
                f"{actor.utilization:.0%} | {actor.uptime_seconds:.0f} s |"
                + (f" {counted(actor.oom_splits, 'out-of-memory split')}" if actor.oom_splits else "")
            )
        return "\n".join(lines)


def add_actor_counts(total: ActorStats, stats: ActorStats) -> None:
    """Add one actor's counters to `total` (its ratios are not summed)."""
    for name in (
        "batches",
        "items",
        "runs",
        "combined_batches",
        "graph_items",
        "eager_items",
        "rejected_items",
        "oom_splits",
        "busy_seconds",
        "uptime_seconds",
    ):
        setattr(total, name, getattr(total, name) + getattr(stats, name))


def percentile(values: Iterable[float], fraction: float) -> float:
    """Nearest-rank percentile; 0.0 for no values."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    rank = min(len(ordered) - 1, max(0, round(fraction * len(ordered)) - 1))
    return ordered[rank]


def recent_rate(completions: Iterable[tuple[float, int]], now: float | None = None) -> float:
    """Items per second over the last RATE_WINDOW_S, from (time, items) completion records."""
    now = time.monotonic() if now is None else now
    recent = [(t, n) for t, n in completions if now - t <= RATE_WINDOW_S]
    if not recent:
        return 0.0
    span = max(now - recent[0][0], 1e-3) if len(recent) > 1 else RATE_WINDOW_S
    return sum(n for _, n in recent) / span
