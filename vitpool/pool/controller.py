"""The pool's named Ray actor: it owns the encoder actors and knows who is in the pool.

It is off the hot path: callers send batches straight to the encoder actors. Each handle keeps
one long poll open here (`wait_for_change`), answered as soon as the membership changes, so a
new or departed actor is known to every caller at once, with no polling in between. Encoder
actors are created here, so they share the controller's lifetime, not a caller's.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from vitpool.actors.reports import ActorInfo, ActorStats
from vitpool.encoder_spec import ActorSpec
from vitpool.pool.actor_reader import ActorReader, ActorReading
from vitpool.pool.autoscaler import READING_TIMEOUT_INTERVALS, AutoscalePolicy, Autoscaler
from vitpool.pool.cache_actor import start_cache_actor
from vitpool.pool.cluster import Placement
from vitpool.pool.member import ACTIVE, RETIRING, STARTING, Member, stop_member
from vitpool.pool.metrics import PoolMetrics
from vitpool.pool.replacement import ActorReplacement
from vitpool.pool.settings import PoolSettings
from vitpool.pool.start_errors import one_line, start_error
from vitpool.pool.stats import PoolCounters, add_actor_counts
from vitpool.pool.warm_standbys import Standbys

logger = logging.getLogger(__name__)

NAMESPACE = "vitpool"  # fixed, so that every job in the cluster finds a pool by its name
# Long polls run in a concurrency group of their own, so that they never hold up scaling,
# failure reports or stats; each handle keeps one open.
WATCH_GROUP = "watch"
MAX_WATCHING_HANDLES = 128
# An autoscaled actor waits this long for its node to free a GPU for a warm standby, then starts
# fresh anywhere: unlike a dead actor's node, the standby's node may have no GPU free at all.
SCALE_UP_HOLD_TIMEOUT_S = 5.0
# How often, at least, the controller reads its actors (and so finds those that died). Callers report
# a dead actor when a batch to it fails, but a caller never sends to an actor its dispatcher does not
# choose (a light load goes to the actors it prefers), so without this a dead actor could stay
# unreplaced.
LIVENESS_INTERVAL_S = 2.0


@dataclass(frozen=True)
class PoolHealth:
    counters: PoolCounters
    restarts_left: int
    departed: ActorStats = field(
        default_factory=ActorStats
    )  # the departed actors' last known counters, summed


@dataclass(frozen=True)
class Membership:
    """The actors that take work now, and what callers need to check and pack items."""

    version: int
    actors: dict[int, Any]  # actor index -> handle, active actors only
    infos: dict[int, ActorInfo]
    settings: PoolSettings
    cache: Any = None  # the pool's embedding cache actor (`cache_actor`), or None when it is off


class PoolController(ActorReplacement):
    """Plain class; `EncoderPool.launch` runs it as a named, threaded Ray actor. Replacing actors
    (a failed one, a warm standby's take-over) is `ActorReplacement`'s."""

    def __init__(
        self,
        name: str,
        settings: PoolSettings,
        actor_options: dict,
        actor_threads: int,
        placement: Placement | None = None,
    ) -> None:
        self._name = name
        self._placement = placement
        self._settings = settings
        self._actor_options = actor_options
        self._actor_threads = actor_threads
        self._members: dict[int, Member] = {}
        self._next_index = 0
        self._version = 0
        self._counters = PoolCounters()  # the autoscaler counts its own steps; `health` adds them
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        # the pool's totals outlive its actors: the last counters seen of each, and of those gone
        self._last_stats: dict[int, ActorStats] = {}
        self._departed = ActorStats()
        # created here, so it shares the controller's lifetime (and the pool's), not a caller's
        self._cache = (
            start_cache_actor(settings.embedding_cache_bytes) if settings.embedding_cache_bytes else None
        )
        self._autoscaler: Autoscaler | None = None
        self._standbys = (
            Standbys(
                name,
                NAMESPACE,
                settings.model,
                actor_options,
                settings.rank_transport is not None,
                self._max_concurrency(),
            )
            if placement is None and settings.uses_warm_standby(actor_options)
            else None
        )
        # One thread reads the active actors for the controller's own use (every reading), the
        # metrics and the autoscaler (each at its interval); a stats call that fails says who died.
        self._reader = ActorReader(lambda: self.membership().actors)
        self._reader.add("liveness check", LIVENESS_INTERVAL_S, self._took_reading, every_reading=True)
        if settings.metrics_interval_s is not None:
            metrics = PoolMetrics(name, lambda: self.health().counters)
            self._reader.add("metrics", settings.metrics_interval_s, metrics.take)

    def settings(self) -> PoolSettings:
        return self._settings

    def _actor_spec(self) -> ActorSpec:
        """What each encoder actor is built from: the settings' spec, with the pool's cache."""
        return dataclasses.replace(
            self._settings.actor_spec(self._actor_threads), embedding_cache=self._cache
        )

    def actor_options(self) -> dict:
        return dict(self._actor_options)

    def placement(self) -> Placement | None:
        return self._placement

    def bundles(self) -> dict[int, int]:
        """Actor index -> its bundle of the placement group (colocated pools only)."""
        with self._lock:
            return {i: m.bundle for i, m in self._members.items() if m.bundle is not None}

    def version(self) -> int:
        return self._version

    def membership(self) -> Membership:
        """The actors that take work now."""
        with self._lock:
            return self._membership_locked()

    @ray.method(concurrency_group=WATCH_GROUP)
    def wait_for_change(self, known_version: int, timeout_s: float) -> Membership | None:
        """The membership once its version differs from `known_version`, or None after
        `timeout_s` without a change (the caller asks again)."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self._version == known_version:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._changed.wait(remaining)
            return self._membership_locked()

    def _membership_locked(self) -> Membership:
        active = {i: m for i, m in self._members.items() if m.state == ACTIVE}
        return Membership(
            self._version,
            {i: m.handle for i, m in active.items()},
            {i: m.info for i, m in active.items() if m.info is not None},
            self._settings,
            self._cache,
        )

    def standbys(self) -> dict[str, Any]:
        """Node id -> handle of its warm standby (`vitpool.pool.warm_standbys`); empty without them."""
        return {} if self._standbys is None else self._standbys.handles()

    def all_actors(self) -> dict[int, Any]:
        """Every actor the pool holds, starting and retiring ones too (for stats)."""
        with self._lock:
            return {i: m.handle for i, m in self._members.items()}

    def snapshot(self) -> tuple[dict[int, Any], PoolHealth]:
        """`all_actors` and `health` at one moment, so that an actor leaving between the two is
        counted once."""
        with self._lock:
            return {i: m.handle for i, m in self._members.items()}, self._health_locked()

    def start_autoscaling(self) -> None:
        """Start the autoscaler (`settings.autoscale`), once the first actors are ready."""
        if self._autoscaler is not None or self._settings.autoscale is None:
            return
        options = self._actor_options
        resources = {
            "GPU": float(options.get("num_gpus") or 0),
            "CPU": float(options.get("num_cpus") or 0),
            **{name: float(amount) for name, amount in (options.get("resources") or {}).items()},
        }
        self._autoscaler = Autoscaler(
            AutoscalePolicy(*self._settings.autoscale), self._starting, self.scale_to, resources
        )
        interval_s = self._settings.autoscale_interval_s
        self._reader.add(
            "autoscaler", interval_s, self._autoscaler.take, interval_s * READING_TIMEOUT_INTERVALS
        )

    def scale_to(self, num_actors: int) -> None:
        """`scale` for the autoscaler: new actors take work once ready, with no caller waiting; a
        warm standby, where one is ready, becomes a new actor on a free GPU of its node."""
        started, _ = self.scale(num_actors, use_standbys=True)
        for index, handle, info_ref in started:
            if info_ref is not None:  # a fresh actor (a standby's take-over runs on its own)
                threading.Thread(
                    target=self._activate_when_ready, args=(index, handle, info_ref), daemon=True
                ).start()

    def _starting(self) -> int:
        with self._lock:
            return sum(member.state == STARTING for member in self._members.values())

    def _took_reading(self, reading: ActorReading) -> None:
        """Every reading of the actors: keep each one's latest counters (to add to the pool's totals
        when it leaves), and report those that Ray says have died (slow ones are the batch timeout's)."""
        with self._lock:
            for index, stats in reading.stats.items():
                if index in self._members:
                    self._last_stats[index] = stats
        for index in reading.dead:
            logger.warning("encoder actor %d is dead (found by the controller's check)", index)
            self.report_failure(index)

    def _depart(self, index: int, final: ActorStats | None = None) -> None:
        """An actor that served leaves (lock held): its counters join the departed totals."""
        last = self._last_stats.pop(index, None)
        stats = final or last
        self._counters.departed_actors += 1
        if stats is not None:
            add_actor_counts(self._departed, stats)

    def scale(
        self, num_actors: int, use_standbys: bool = False
    ) -> tuple[list[tuple[int, Any, Any]], list[int]]:
        """Start or retire actors so that `num_actors` are active or starting.

        Returns (index, handle, reference to its ActorInfo) of each started actor, for the caller
        to wait on and then `activate`, and the indices of the actors being retired. With
        `use_standbys`, ready warm standbys become some of the new actors; their reference is
        None, and they are activated here once they have taken over.
        """
        takeovers = []
        with self._lock:
            current = sorted(
                i for i, m in self._members.items() if m.state in (STARTING, ACTIVE) and not m.stand_in
            )
            started = []
            for _ in range(num_actors - len(current)):
                found = self._standbys.take_any() if use_standbys and self._standbys is not None else None
                if found is None:
                    started.append(self._start_actor())
                else:
                    node, standby = found
                    started.append(self._new_member(standby.handle))
                    takeovers.append((started[-1][0], standby, node, SCALE_UP_HOLD_TIMEOUT_S))
            # Newest first: the oldest actors have the warmest caches and the most history.
            retired = current[num_actors:] if num_actors < len(current) else []
            for index in retired:
                self._members[index].state = RETIRING
            if retired:
                self._bump()
        for index in retired:
            threading.Thread(target=self._retire, args=(index,), daemon=True).start()
        for takeover in takeovers:
            threading.Thread(target=self._take_over, args=takeover, daemon=True).start()
        return started, retired

    def activate(self, index: int, info: ActorInfo) -> None:
        """A started actor is ready (its graphs captured and checked): it takes work from now."""
        with self._lock:
            member = self._members.get(index)
            if member is None or member.state != STARTING:
                return
            member.state, member.info = ACTIVE, info
            self._bump()
            self._end_stand_in(member)
        # By default only actors that run on a GPU get one: a CPU actor starts in about as long.
        if self._standbys is not None and (self._settings.warm_standby or info.device.startswith("cuda")):
            ahead = (self._actor_spec(), info.gpu_ids) if self._settings.standby_graphs else None
            self._standbys.ensure(info.node_id, ahead)

    def forget(self, index: int) -> None:
        """Drop an actor that failed to start or died."""
        with self._lock:
            member = self._members.pop(index, None)
            if member is not None and member.state == ACTIVE:
                self._bump()
            if member is not None:
                self._keep_stand_in(member)
        if member is not None:
            stop_member(member)

    def health(self) -> PoolHealth:
        with self._lock:
            return self._health_locked()

    def _health_locked(self) -> PoolHealth:
        scaler = self._autoscaler
        counters = dataclasses.replace(
            self._counters,
            autoscale_ups=scaler.scale_ups if scaler else 0,
            autoscale_downs=scaler.scale_downs if scaler else 0,
        )
        return PoolHealth(
            counters,
            self._settings.max_actor_restarts - self._counters.actor_restarts,
            ActorStats(**vars(self._departed)),
        )

    def _activate_when_ready(self, index: int, handle: Any, info_ref: Any) -> None:
        try:
            info = ray.get(info_ref, timeout=self._settings.startup_timeout_s)
        except (ray.exceptions.RayError, TimeoutError) as error:
            logger.error(
                "encoder actor %d (a replacement or autoscaled) failed to start: %s",
                index,
                one_line(start_error(error)),
            )
            self.forget(index)
            return
        self.activate(index, info)
        logger.info("encoder actor %d (a replacement or autoscaled) ready on %s", index, info.device)

    def shutdown(self) -> int:
        """Kill every encoder actor; returns how many there were."""
        self._reader.close()
        if self._standbys is not None:
            self._standbys.close()
        with self._lock:
            members, self._members = self._members, {}
            self._bump()
        for member in members.values():
            stop_member(member)
        return len(members)

    def _bump(self) -> None:
        """The membership changed (lock held): answer every waiting long poll."""
        self._version += 1
        self._changed.notify_all()

    def _max_concurrency(self) -> int:
        return self._settings.max_batches_in_flight_per_actor + 2  # + stats and retire

    def _new_member(self, handle: Any, bundle: int | None = None) -> tuple[int, Any, None]:
        """A starting member for `handle` under the next index (lock held)."""
        index = self._next_index
        self._next_index += 1
        self._members[index] = Member(handle, STARTING, bundle=bundle)
        return index, handle, None

    def _start_actor(self) -> tuple[int, Any, Any]:
        index = self._next_index
        settings = self._settings
        options = {
            "max_concurrency": self._max_concurrency(),
            "name": f"{self._name}-encoder-{index}",
            "namespace": NAMESPACE,
            **self._actor_options,
        }
        bundle = self._free_bundle()
        if bundle is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=self._placement.placement_group, placement_group_bundle_index=bundle
            )
        # Imported here: the controller's process loads the engine's module (not the engine), and
        # the callers, which import this module, do not.
        if settings.rank_transport is not None:  # its methods for Ray Direct Transport need Ray
            from vitpool.actors.delivering_actor import DeliveringEncoderActor as actor_class
        else:
            from vitpool.actors.encoder_actor import EncoderActor as actor_class
        handle = ray.remote(actor_class).options(**options).remote(index, self._actor_spec())
        self._new_member(handle, bundle)
        return index, handle, handle.info.remote()

    def _free_bundle(self) -> int | None:
        """The first bundle no actor holds (lock held), or None for a pool that is not colocated."""
        if self._placement is None:
            return None
        taken = {m.bundle for m in self._members.values()}
        for bundle in self._placement.bundles:
            if bundle not in taken:
                return bundle
        raise ValueError(f"every bundle of the placement group already holds an encoder actor: {taken}")

    def _retire(self, index: int) -> None:
        member = self._members.get(index)
        if member is None:
            return
        try:
            finished = ray.get(member.handle.retire.remote(self._settings.retire_timeout_s))
            if not finished:
                logger.warning(
                    "encoder actor %d still had batches after %.0f s; stopping it",
                    index,
                    self._settings.retire_timeout_s,
                )
        except ray.exceptions.RayError:
            pass  # it died on its own; callers send its batches elsewhere
        try:
            final = ray.get(member.handle.stats.remote(), timeout=10)
        except (ray.exceptions.RayError, TimeoutError):
            final = None
        with self._lock:
            if self._members.pop(index, None) is not None:
                self._depart(index, final)
                self._keep_stand_in(member)
            nodes = {m.info.node_id for m in self._members.values() if m.info is not None}
        stop_member(member)
        if self._standbys is not None:  # a node the pool left keeps no standby
            self._standbys.keep_only(nodes)
