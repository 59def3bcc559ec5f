"""What a pool handle reads of its pool: from the membership, what the ready actors share (their
budgets, the dtype of their embeddings, the item rules) and how to reach each; a snapshot of the
pool's stats."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ray

from vitpool.errors import PoolUnavailableError
from vitpool.packing import Budget
from vitpool.pool.stats import CallerCounters, PoolCounters, PoolStats, counts, percentile, recent_rate
from vitpool.transport.link import ActorLink
from vitpool.transport.links import make_link

if TYPE_CHECKING:
    from vitpool.actors.reports import ActorStats
    from vitpool.pool.controller import Membership, PoolHealth
    from vitpool.pool.dispatcher import Dispatcher
    from vitpool.pool.embedding_cache import CacheClient
    from vitpool.pool.settings import PoolSettings
    from vitpool.specs import ItemRules


def common_budgets(infos: Any) -> list[Budget]:
    """The budgets every actor has (they differ only if actors chose defaults on unlike GPUs)."""
    infos = list(infos)
    if not infos:
        return [Budget(64, (), 32)]  # placeholder until an actor joins; nothing is sent without one
    common = set(infos[0].budgets).intersection(*(set(i.budgets) for i in infos[1:]))
    return sorted(common) or sorted(infos[0].budgets)


def dtype_name(membership: Membership) -> str:
    """The dtype the actors' embeddings come out in (they share the pool's settings)."""
    return next(iter(membership.infos.values())).dtype_name if membership.infos else ""


def item_rules(membership: Membership) -> ItemRules:
    if not membership.infos:
        raise PoolUnavailableError("the pool has no ready encoder actor")
    return next(iter(membership.infos.values())).item_rules


def link_to(membership: Membership, settings: PoolSettings, actor_index: int, node_id: str) -> ActorLink:
    """How to reach an actor from a process on node `node_id`: the same-node channel where the
    `settings` allow it and the actor serves one on this node, else Ray calls."""
    info = membership.infos.get(actor_index)
    channel = None
    if settings.same_node_channel and info is not None and info.node_id == node_id:
        channel = info.channel
    # a reply later than the batch timeout counts as a broken connection (the dispatcher has
    # given up on the batch by then)
    return make_link(
        membership.actors[actor_index],
        channel,
        settings.batch_timeout_s + 5.0,
        settings.channel_spin_s,
        f"encoder actor {actor_index}",
    )


def read_actor_stats(actors: dict[int, Any], timeout_s: float) -> list[ActorStats]:
    """The stats of each actor (by handle) that answers."""
    actor_stats = []
    for handle in actors.values():
        try:
            actor_stats.append(ray.get(handle.stats.remote(), timeout=timeout_s))
        except ray.exceptions.RayError:
            continue  # starting, retiring or dead: no stats
    return actor_stats


def pool_stats(
    name: str,
    num_actors: int,
    actor_stats: list[ActorStats],
    health: PoolHealth,
    dispatcher: Dispatcher,
    cache: CacheClient | None,
    settings: PoolSettings,
    timeout_s: float,
) -> PoolStats:
    """The pool's stats: its actors', its controller's `health`, and this process's calls (its
    `dispatcher` and its `cache` client)."""
    counters = dispatcher.counters
    return PoolStats(
        name=name,
        num_actors=num_actors,
        actors=sorted(actor_stats, key=lambda s: s.actor_index),
        queue_depth=dispatcher.queue_depth,
        batches_in_flight=sum(dispatcher.in_flight().values()),
        queued_bytes=dispatcher.queued_bytes,
        peak_queued_items=dispatcher.peak_queued[0],
        peak_queued_bytes=dispatcher.peak_queued[1],
        items_per_second=recent_rate(list(counters.completions)),
        latency_p50_s=percentile(list(counters.latencies_s), 0.50),
        latency_p99_s=percentile(list(counters.latencies_s), 0.99),
        cache=cache.stats(timeout_s) if cache is not None else None,
        departed=health.departed,
        autoscale=settings.autoscale,
        **counts(CallerCounters, counters),
        **counts(PoolCounters, health.counters),
    )
