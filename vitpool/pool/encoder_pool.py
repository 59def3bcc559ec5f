"""EncoderPool: what users launch, connect to and call.

A launched pool is a named controller actor (membership, scaling) and one encoder actor per GPU.
Every handle, in the launching process or any other process in the cluster, runs its own
dispatcher: calls go from the caller's process straight to the encoder actors. Pixels and
embeddings go through shared memory to actors on the caller's node and through Ray's object store
to the others; only small control messages go anywhere else.

This module is the facade. A call's way through (check its items against the model's rules, in
this process, once; ask the cache; queue; wait; fetch) is `encode_call`'s, starting actors
`launcher`'s, keeping the membership current `membership`'s, what the handle reads of it
`pool_view`'s, choosing batches and actors `policy`'s, moving batches the transport's. A caller's
process loads no model code: the rules arrive pickled from an actor.

A handle that was closed, or whose pool's controller is gone, or whose process left Ray, raises
PoolUnavailableError saying which from every method, before any Ray call (`handle_state`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import ray

from vitpool.codec import decode_request, encode_results
from vitpool.errors import ConfigError, PoolUnavailableError, counted
from vitpool.items import Embedding, Item, check_item_list
from vitpool.pool.controller import Membership
from vitpool.pool.dispatcher import Dispatcher
from vitpool.pool.embedding_cache import CacheClient
from vitpool.pool.encode_call import EncodePipeline
from vitpool.pool.handle_state import HandleState
from vitpool.pool.launcher import find_pool, launch_pool, progress_on_stderr, scale_pool, stop_controller
from vitpool.pool.membership import MembershipWatcher
from vitpool.pool.metrics import CallerMetrics
from vitpool.pool.pool_view import (
    common_budgets,
    dtype_name,
    item_rules,
    link_to,
    pool_stats,
    read_actor_stats,
)
from vitpool.pool.rank_delivery import RDT_TRANSPORTS, RankDelivery, choose_transport
from vitpool.pool.settings import PoolSettings
from vitpool.pool.start_errors import start_failure
from vitpool.pool.stats import PoolStats
from vitpool.specs import ItemRules
from vitpool.transport.link import ActorLink

logger = logging.getLogger(__name__)

CONTROLLER_PROBE_S = 5.0  # how long a failed call waits to learn whether the controller is gone


class EncoderPool:
    """A data-parallel pool of GPU encoder actors on Ray. Create it with `launch` or `connect`.

    Thread-safe: any number of threads (and asyncio tasks) may call one handle at once; their
    items are packed together.

    Once the handle is closed (`close`, `shutdown`), its pool's controller is gone (the process
    that launched the pool ended or shut it down), or this process left Ray, every method but
    `close` and `shutdown` raises PoolUnavailableError saying which.
    """

    def __init__(
        self, name: str, controller: Any, owns_pool: bool, owns_ray: bool, membership: Membership
    ) -> None:
        # Built by EncoderPool.launch and EncoderPool.connect, which find the controller and membership.
        self.name = name
        self._controller = controller
        self._owns_pool = owns_pool
        self._owns_ray = owns_ray
        self._settings = membership.settings
        self._membership = membership
        self._rules = item_rules(membership)
        self._node_id = ray.get_runtime_context().get_node_id()
        self._state = HandleState(name)  # closed, or its pool lost: unusable
        self._stopped = False  # shutdown has stopped what this handle started
        self._dispatcher = Dispatcher(
            common_budgets(membership.infos.values()),
            self._settings,
            on_actor_failed=self._actor_failed,
            make_link=self._link_to,
        )
        self._dispatcher.set_actors(membership.actors, common_budgets(membership.infos.values()))
        self._watcher = MembershipWatcher(
            controller, membership, self._membership_changed, self._controller_lost
        )
        self._cache = (
            CacheClient(
                membership.cache,
                self._settings.model,
                dtype_name(membership),
                self._settings.local_cache_bytes,
            )
            if membership.cache is not None
            else None
        )
        self._pipeline = EncodePipeline(
            name, self._dispatcher, self._rules, self._settings, self._cache, explained=self._explained
        )
        interval = self._settings.metrics_interval_s
        self._metrics = CallerMetrics(name, self._dispatcher, interval) if interval is not None else None

    # launch and connect

    @classmethod
    def launch(
        cls,
        model: str | None = None,
        num_actors: int | None = None,
        budgets: Sequence[int] | None = None,
        name: str = "vitpool",
        address: str | None = None,
        actor_options: dict[str, Any] | None = None,
        placement_group: Any = None,
        progress: bool = True,
        **settings: Any,
    ) -> EncoderPool:
        """Start a pool: a named controller and `num_actors` encoder actors, each ready only once
        its graphs are captured and checked (progress is logged while they start).

        Args:
            model: local Hugging Face checkpoint directory; None for the shipped tiny model.
            num_actors: encoder actors; default one per GPU in the cluster, or one CPU actor on
                a cluster without GPUs.
            budgets: token budgets each actor captures; None for its device's defaults.
            name: the pool's name, for `EncoderPool.connect(name)` from any process.
            address: a Ray cluster to join (else RAY_ADDRESS; else the cluster `ray start` last
                started on this machine, while it runs; else a local cluster is started, owned by
                the pool and stopped by `shutdown`). The cluster joined, and why that one, is
                logged. A cluster on this machine that uses token authentication is joined with
                this machine's token; one elsewhere needs RAY_AUTH_MODE=token and its token.
            actor_options: Ray options for each encoder actor, over the defaults
                {"num_gpus": 1, "num_cpus": 1}; e.g. {"num_gpus": 0.5} shares a GPU.
            placement_group: colocate with an existing placement group (say, a tensor-parallel
                LLM's): one encoder actor in each of its GPU bundles (`num_actors` defaults to
                their number), on the share of the bundle's GPU that `actor_options["num_gpus"]`
                sets (required; the bundle must have it free). `num_cpus` defaults to 0 here.
            progress: show the start-up's progress (the cluster joined, each actor ready) on
                stderr where this process has not set up logging; False: quiet. Logging the
                caller configured is used as it is either way.
            **settings: any field of `vitpool.pool.settings.PoolSettings` (dtype, batch_window_s,
                max_batches_in_flight_per_actor, max_items_per_batch, ...); `detached=True` for a
                pool that outlives this process (a service: stopped by any handle's `shutdown()`).

        Raises:
            ConfigError: bad settings, or a pool with this name already runs; device="cuda" for
                actors that get no GPU; or an actor's own ConfigError as it started.
            CheckpointError: `model` is not a local checkpoint directory (a Hub id, a wrong
                path), has no readable config.json, or is of a family vitpool does not serve
                (checked here, before any actor starts); or an actor's own CheckpointError as it
                loaded the weights.
            VitpoolError: an actor failed to start for another reason, or the pool's controller
                died as it started (its one line and the Ray cluster it was in; the full error is
                the cause). Whatever the error, nothing the launch started is left behind.
            ConnectionError: the Ray cluster could not be joined, e.g. it uses token
                authentication and this process sends no token (the message says what to set).
        """
        pool_settings = PoolSettings(model=model, budgets=budgets, **settings)
        with progress_on_stderr(progress):
            controller, owns_ray, membership = launch_pool(
                pool_settings, num_actors, name, address, actor_options, placement_group
            )
        return cls(name, controller, owns_pool=True, owns_ray=owns_ray, membership=membership)

    @classmethod
    def connect(
        cls, name: str = "vitpool", address: str | None = None, timeout_s: float = 60.0
    ) -> EncoderPool:
        """A handle to a running pool, from any process or Ray actor in its cluster. Pools live in
        the Ray namespace "vitpool", whatever the caller's own, so the name is all it takes; the
        cluster is the one `launch` would join (`address`, RAY_ADDRESS, a running `ray start`).

        Raises:
            PoolUnavailableError: no pool of this name runs (or none of its actors is ready
                within `timeout_s`); the message names the Ray cluster looked in and why that one.
            ConnectionError: the Ray cluster could not be joined (as for `launch`).
        """
        controller, owns_ray, membership = find_pool(name, address, timeout_s)
        return cls(name, controller, owns_pool=False, owns_ray=owns_ray, membership=membership)

    # encode

    def encode(
        self, items: Sequence[Item], timeout_s: float | None = None, return_exceptions: bool = False
    ) -> list[Embedding] | list[Embedding | Exception]:
        """Encode `items` on the pool; one Embedding per item, in input order, on the CPU.

        Args:
            items: Image and Video items.
            timeout_s: how long to wait for the call's results (and for room in the queue);
                None: no bound.
            return_exceptions: False (default): an item that fails raises its error and the
                call's other results are not returned. True: every item is encoded that can be,
                and a failed item's slot holds its exception instead of an Embedding (as
                `asyncio.gather(..., return_exceptions=True)`): InvalidItemError (naming its index)
                for an item refused here or found with NaN or infinite pixels on the actor,
                EncodeError for one whose batch failed on the actor, PoolUnavailableError for one
                that found no actor. A timeout, a closed handle or a call too large for the queue
                still raise: those are the call's, not an item's.

        Raises:
            InvalidItemError: an item is malformed or over `max_item_tokens` (nothing is sent), or
                its pixels are not finite; its index is named. Not with `return_exceptions`.
            TimeoutError: no result within `timeout_s`.
            PoolUnavailableError: the pool has no actor left, or this handle is closed or its
                pool's controller gone.
            ValueError: the call can never fit this process's queue (split it).
        """
        self._state.check_usable()
        if not _checked_list(items):
            return []
        return self._pipeline.encode(items, timeout_s, return_exceptions)

    async def encode_async(
        self, items: Sequence[Item], timeout_s: float | None = None, return_exceptions: bool = False
    ) -> list[Embedding] | list[Embedding | Exception]:
        """`encode` for asyncio callers: awaits without blocking the event loop. Takes and raises
        what `encode` does."""
        self._state.check_usable()
        if not _checked_list(items):
            return []
        return await self._pipeline.encode_async(items, timeout_s, return_exceptions)

    def encode_bytes(self, request: bytes, timeout_s: float | None = None) -> bytes:
        """Encode a request in vitpool's msgpack format (`vitpool.codec`), for bytes that come from
        outside the Ray cluster; returns the results in the same format. Nothing is unpickled.

        Raises:
            ValueError: the bytes are not a well-formed request (InvalidItemError, a ValueError
                too, for an item the model cannot take).
            PoolUnavailableError, TimeoutError: as for `encode`.
        """
        self._state.check_usable()
        return encode_results(self.encode(decode_request(request), timeout_s))

    def encode_refs(self, items: Sequence[Item], timeout_s: float | None = None) -> list[ray.ObjectRef]:
        """Encode `items`; returns one Ray object reference per item, in input order, each to an
        Embedding. Returns once the results are in the object store (so a reference never points
        at work that may still be retried), for callers that pass them on without fetching them.

        Raises:
            InvalidItemError, TimeoutError, PoolUnavailableError, ValueError: as for `encode`.
        """
        self._state.check_usable()
        if not _checked_list(items):
            return []
        return self._pipeline.encode(items, timeout_s, want_refs=True)

    def deliver_to(
        self, ranks: Sequence[Any], transport: str = "auto", actor_index: int | None = None
    ) -> RankDelivery:
        """A delivery of encodes to every tensor-parallel rank in `ranks` (Ray actor handles):
        `delivery.encode(items)` returns a reference and a layout that the caller passes to a
        method of each rank, where `vitpool.received_embeddings(outputs, layout)` reads them.

        Args:
            ranks: the ranks' actor handles (for RDT, created as `vitpool.pool.rank_delivery` says).
            transport: "auto" (the pool's `rank_transport` if it works here, else the object
                store, with a warning saying why), "object_store", "nccl" or "gloo".
            actor_index: the encoder actor that serves the delivery; default the lowest-numbered.

        Raises:
            ConfigError: an unknown transport, or an RDT transport asked for by name that cannot
                work here (the message says why).
            PoolUnavailableError: this handle is closed or its pool's controller gone.
        """
        self._state.check_usable()
        if transport not in ("auto", "object_store", *RDT_TRANSPORTS):
            raise ConfigError(f"transport {transport!r}: use 'auto', 'object_store', 'nccl' or 'gloo'")
        self._refresh()
        actors = self._membership.actors
        index = min(actors) if actor_index is None else actor_index
        if index not in actors:
            raise ConfigError(f"no encoder actor {index} takes work; the pool has {sorted(actors)}")
        chosen = choose_transport(transport, self._settings.rank_transport, actors[index], ranks, self.name)
        dtype_name = self._membership.infos[index].dtype_name
        return RankDelivery(
            actors[index], index, chosen, self._rules, dtype_name, self._settings.max_item_tokens
        )

    # scale, stats, shutdown

    @property
    def settings(self) -> PoolSettings:
        """The settings the pool was launched with (its checkpoint, budgets, limits)."""
        return self._settings

    @property
    def item_rules(self) -> ItemRules:
        """What the pool's model takes (`vitpool.specs.ItemRules`): its pixel row shape, output
        shapes, and the check each item passes in the caller's process."""
        return self._rules

    @property
    def num_actors(self) -> int:
        """Encoder actors taking work, as this handle last saw.

        Raises:
            PoolUnavailableError: this handle is closed or its pool's controller gone.
        """
        self._state.check_usable()
        return len(self._membership.actors)

    def scale(self, num_actors: int) -> None:
        """Add or remove encoder actors while work is in flight; returns when the new ones are
        ready (removed ones finish their batches first; nothing in flight is lost).

        Raises:
            ConfigError: the cluster (or placement group) cannot hold `num_actors`; or a new
                actor's own ConfigError as it started.
            CheckpointError, VitpoolError: a new actor failed to start (as for `launch`).
            PoolUnavailableError: this handle is closed or its pool's controller gone.
        """
        self._state.check_usable()
        try:
            retired, num_started, failures = scale_pool(
                self._controller, num_actors, self._settings.startup_timeout_s
            )
        except ray.exceptions.RayActorError as error:
            raise self._orphaned(error) from None
        if retired:
            logger.info("pool %r: retiring encoder actors %s", self.name, retired)
        self._refresh()
        if failures:
            raise start_failure(failures, num_started)

    def stats(self, timeout_s: float = 30.0) -> PoolStats:
        """A snapshot of the pool's actors and of this process's calls.

        Raises:
            PoolUnavailableError: this handle is closed or its pool's controller gone.
        """
        self._state.check_usable()
        try:
            actors, health = ray.get(self._controller.snapshot.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError as error:
            raise self._orphaned(error) from None
        actor_stats = read_actor_stats(actors, timeout_s)
        num_actors = len(self._membership.actors)
        return pool_stats(
            self.name,
            num_actors,
            actor_stats,
            health,
            self._dispatcher,
            self._cache,
            self._settings,
            timeout_s,
        )

    def close(self) -> None:
        """Detach this handle; the pool keeps running for its other callers. Calls waiting in
        this process fail with PoolUnavailableError, as does every later use of the handle.
        Closing again does nothing."""
        self._close("close()")

    def shutdown(self) -> None:
        """Stop the pool if this handle launched it or the pool is detached (from any handle:
        that is how a service is stopped), and the Ray cluster (or connection) if this handle
        started it. A handle from `connect` to a pool that another process launched, not
        detached, only detaches (that pool stops with its launcher). Shutting down again does
        nothing."""
        self._shutdown(stop_pool=self._owns_pool or self._settings.detached)

    def __enter__(self) -> EncoderPool:  # noqa: PYI034 - typing.Self needs Python 3.11; vitpool supports 3.10
        self._state.check_usable()
        return self

    def __exit__(self, *exc_info: object) -> None:
        # Leaving a `with` block never stops a detached pool, whoever launched it.
        self._shutdown(stop_pool=self._owns_pool and not self._settings.detached)

    def _shutdown(self, stop_pool: bool) -> None:
        self._close("shutdown()")
        if self._stopped:
            return
        self._stopped = True
        if not ray.is_initialized():
            return  # whatever Ray held went with it; a Ray call here would start a new instance
        if stop_pool:
            stop_controller(self._controller)
            logger.info("pool %r stopped", self.name)
        if self._owns_ray:
            ray.shutdown()

    # usability

    def _close(self, closed_by: str) -> None:
        if not self._state.close(closed_by):
            return
        self._watcher.close()
        self._dispatcher.close(self._state.unusable_reason())
        if self._cache is not None:
            self._cache.close()
        if self._metrics is not None:
            self._metrics.close()

    def _explained(self, error: PoolUnavailableError) -> PoolUnavailableError:
        """A call found no actor left: where the pool's controller is gone too (its launcher
        ended, which the watcher may not have heard yet: the actors die first), say that."""
        if self._state.lost is None and not self._state.closed.is_set() and ray.is_initialized():
            try:
                ray.get(self._controller.version.remote(), timeout=CONTROLLER_PROBE_S)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as gone:
                return self._orphaned(gone)
        return error

    def _orphaned(self, error: BaseException) -> PoolUnavailableError:
        """A call to the controller found it gone: the handle is unusable from now on."""
        self._controller_lost(error)
        return PoolUnavailableError(self._state.unusable_reason() or str(error))

    def _refresh(self) -> None:
        try:
            self._watcher.refresh()
        except ray.exceptions.RayActorError as error:
            raise self._orphaned(error) from None

    # membership

    def _actor_failed(self, actor_index: int) -> None:
        # The dispatcher's callback (no Ray calls there): the watcher's thread reports it.
        self._watcher.report_failure(actor_index)

    def _membership_changed(self, membership: Membership) -> None:
        self._membership = membership
        self._dispatcher.set_actors(membership.actors, common_budgets(membership.infos.values()))
        logger.info("pool %r: %s taking work", self.name, counted(len(membership.actors), "encoder actor"))

    def _controller_lost(self, error: BaseException) -> None:
        """The pool's controller is gone (its actors went with it), or this process left Ray: what
        waits fails, and so does every later use of the handle."""
        lost = self._state.lose()
        if lost is not None:
            self._dispatcher.close(lost)

    def _link_to(self, actor_index: int) -> ActorLink:
        return link_to(self._membership, self._settings, actor_index, self._node_id)


def _checked_list(items: Any) -> bool:
    """Whether there is anything to encode; TypeError for something that is not a list of items."""
    check_item_list(items)
    return len(items) > 0
