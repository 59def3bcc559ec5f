"""What `EncoderPool.stats()` returns."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from vitpool.actors.reports import ActorStats
from vitpool.errors import counted

RATE_WINDOW_S = 10.0


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

    @property
    def hit_rate(self) -> float:
        looked_up = self.hits + self.misses
        return self.hits / looked_up if looked_up else 0.0

    def summary(self) -> str:
        return (
            f"embedding cache: {self.entries} entries, {self.bytes / 2**20:.1f} of "
            f"{self.capacity_bytes / 2**20:.1f} MiB, hits {self.hits}, misses {self.misses} "
            f"({self.hit_rate:.0%} hit rate), waited {self.waits}, evictions {self.evictions}"
        )


@dataclass
class PoolStats:
    """A snapshot of a pool.

    Per actor: `actors` (device, batches, items, graph hit rate, padding waste, busy time).
    For the calls made through this handle's process: queue depth, batches in flight (and how
    many batches went through the same-node channel), items per second over the last 10 s, and
    call latency (submit to results ready) p50/p99 over the last 4096 calls. The pool's embedding
    cache, shared by every caller, where it is on (`cache`).
    """

    name: str
    num_actors: int
    actors: list[ActorStats] = field(default_factory=list)
    queue_depth: int = 0
    batches_in_flight: int = 0
    calls: int = 0
    items: int = 0
    batches: int = 0
    channel_batches: int = 0
    failed_calls: int = 0
    requeued_items: int = 0  # sent again after their actor died, went silent or left
    failed_batches: int = 0  # actor died, timed out or failed the batch
    timed_out_batches: int = 0
    rejected_items: int = 0  # bad input, found in this process or by an actor
    actor_restarts: int = 0  # replacements the pool started for dead or silent actors
    actor_failures: int = 0  # actors reported dead or silent (by any caller process)
    queued_bytes: int = 0
    peak_queued_items: int = 0
    peak_queued_bytes: int = 0
    items_per_second: float = 0.0
    latency_p50_s: float = 0.0
    latency_p99_s: float = 0.0
    cache: CacheStats | None = None  # the pool's embedding cache, shared by every caller; None: off

    def summary(self) -> str:
        lines = [
            (f"pool {self.name!r}: {counted(self.num_actors, 'actor')}, {counted(self.items, 'item')} in "
            f"{counted(self.batches, 'batch')} ({self.channel_batches} through shared memory), "
            f"{self.items_per_second:.1f} items/s, latency p50 {self.latency_p50_s * 1e3:.2f} ms "
            f"p99 {self.latency_p99_s * 1e3:.2f} ms, queue {self.queue_depth}, in flight {self.batches_in_flight}, "
            f"failed calls {self.failed_calls}, requeued items {self.requeued_items}, rejected items "
            f"{self.rejected_items}, failed batches {self.failed_batches} ({self.timed_out_batches} timed out), "
            f"actor failures {self.actor_failures}, restarts {self.actor_restarts}, peak queue "
            f"{counted(self.peak_queued_items, 'item')} / {self.peak_queued_bytes / 2**20:.1f} MiB")
        ]
        if self.cache is not None:
            lines.append(f"  {self.cache.summary()}")
        for actor in self.actors:
            lines.append(
                f"  actor {actor.actor_index} on {actor.device}: {counted(actor.batches, 'batch')}, "
                f"{counted(actor.items, 'item')}, {counted(actor.runs, 'run')} "
                f"({counted(actor.combined_batches, 'batch')} combined), "
                f"graph hit rate {actor.graph_hit_rate:.0%}, padding waste {actor.padding_waste:.0%}, "
                f"busy {actor.busy_seconds:.2f} s ({actor.utilization:.0%}), out-of-memory splits {actor.oom_splits}"
            )
        return "\n".join(lines)


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
