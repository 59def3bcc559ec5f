"""EncoderPool: what users launch, connect to and call.

A launched pool is a named controller actor (membership, scaling) and one encoder actor per GPU.
Every handle, in the launching process or any other process in the cluster, runs its own
dispatcher: calls go from the caller's process straight to the encoder actors. Pixels and
embeddings go through shared memory to actors on the caller's node and through Ray's object store
to the others; only small control messages go anywhere else.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import ray

from vitpool.actors import ActorInfo
from vitpool.actors.local_channel import ChannelClient
from vitpool.codec import decode_request, encode_results
from vitpool.errors import ConfigError, InvalidItemError, PoolUnavailableError, VitpoolError
from vitpool.graphs.inputs import prepare_items
from vitpool.items import Embedding, Item, Video
from vitpool.packing import Budget, ItemCost
from vitpool.pool.calls import Call, QueuedItem
from vitpool.pool.cluster import (
    check_bundles,
    check_capacity,
    cluster_gpus,
    colocated_options,
    default_threads,
    free_resources,
    join_ray,
)
from vitpool.pool.controller import NAMESPACE, Membership, PoolController
from vitpool.pool.dispatcher import Dispatcher
from vitpool.pool.rank_delivery import RDT_TRANSPORTS, RankDelivery, choose_transport
from vitpool.pool.settings import PoolSettings
from vitpool.pool.stats import PoolStats, percentile, recent_rate
from vitpool.transport.wire import to_array, wire_dtype_name

logger = logging.getLogger(__name__)

MEMBERSHIP_REFRESH_S = 0.5  # how often a handle asks the controller whether the actors changed
PROGRESS_EVERY_S = 15.0


class EncoderPool:
    """A data-parallel pool of GPU encoder actors on Ray. Create it with `launch` or `connect`.

    Thread-safe: any number of threads (and asyncio tasks) may call one handle at once; their
    items are packed together.
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
        self._rules = _item_rules(membership)
        self._node_id = ray.get_runtime_context().get_node_id()
        budgets = _common_budgets(membership.infos.values())
        self._refresh_now = threading.Event()
        self._failed_actors: list[int] = []  # to report to the controller, from the refresher thread
        self._dispatcher = Dispatcher(
            budgets, self._settings, on_actor_failed=self._actor_failed, make_channel=self._channel_to
        )
        self._dispatcher.set_actors(membership.actors, budgets)
        self._closed = threading.Event()
        self._refresher = threading.Thread(target=self._refresh_loop, name="vitpool-membership", daemon=True)
        self._refresher.start()

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
            address: a Ray cluster to join (else RAY_ADDRESS; else a local cluster is started,
                owned by the pool and stopped by `shutdown`).
            actor_options: Ray options for each encoder actor, over the defaults
                {"num_gpus": 1, "num_cpus": 1}; e.g. {"num_gpus": 0.5} shares a GPU.
            placement_group: colocate with an existing placement group (say, a tensor-parallel
                LLM's): one encoder actor in each of its GPU bundles (`num_actors` defaults to
                their number), on the share of the bundle's GPU that `actor_options["num_gpus"]`
                sets (required; the bundle must have it free). `num_cpus` defaults to 0 here.
            **settings: any field of `vitpool.pool.settings.PoolSettings` (dtype, batch_window_s,
                max_batches_in_flight_per_actor, max_items_per_batch, ...).

        Raises:
            ConfigError: bad settings, or a pool with this name already runs.
            VitpoolError: an actor failed to start (the message carries its error); nothing
                the launch started is left behind.
        """
        pool_settings = PoolSettings(model=model, budgets=budgets, **settings)
        if num_actors is not None and (isinstance(num_actors, bool) or not isinstance(num_actors, int) or num_actors < 1):
            raise ConfigError(f"num_actors must be a positive integer or None; got {num_actors!r}")
        owns_ray = join_ray(address)
        controller = None
        try:
            placement = None
            if placement_group is not None:
                options, placement = colocated_options(placement_group, actor_options)
                num_actors = len(placement.bundles) if num_actors is None else num_actors
                check_bundles(placement, num_actors)
            else:
                gpus = cluster_gpus()
                options = {"num_gpus": 1 if gpus >= 1 else 0, "num_cpus": 1, **(actor_options or {})}
                if num_actors is None:
                    num_actors = max(1, int(gpus)) if options.get("num_gpus") else 1
                check_capacity(options, num_actors)
            threads = pool_settings.actor_threads or default_threads(options, num_actors)
            try:
                controller = (
                    ray.remote(PoolController)
                    .options(name=name, namespace=NAMESPACE, num_cpus=0, max_concurrency=32)
                    .remote(name, pool_settings, options, threads, placement)
                )
                ray.get(controller.version.remote())
            except ValueError as error:  # Ray: the name is taken
                controller = None
                raise ConfigError(
                    f"a pool named {name!r} is already running ({error}); connect to it with "
                    f"EncoderPool.connect({name!r}) or launch with another name"
                ) from None
            logger.info(
                "launching pool %r: %d encoder actors (%s), model %s",
                name, num_actors, options, pool_settings.model or "shipped tiny Qwen3-VL",
            )
            started, _ = ray.get(controller.scale.remote(num_actors))
            failures = _await_started(controller, started, pool_settings.startup_timeout_s)
            if failures:
                raise VitpoolError(f"{len(failures)} of {num_actors} encoder actors failed to start: {failures[0]}")
            membership = ray.get(controller.membership.remote())
            return cls(name, controller, owns_pool=True, owns_ray=owns_ray, membership=membership)
        except BaseException:
            if controller is not None:
                _stop_controller(controller)
            if owns_ray:
                ray.shutdown()
            raise

    @classmethod
    def connect(cls, name: str = "vitpool", address: str | None = None, timeout_s: float = 60.0) -> EncoderPool:
        """A handle to a running pool, from any process or Ray actor in its cluster.

        Raises:
            PoolUnavailableError: no pool of this name runs (or none of its actors is ready
                within `timeout_s`).
        """
        owns_ray = join_ray(address)
        try:
            try:
                controller = ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                raise PoolUnavailableError(
                    f"no pool named {name!r} runs in this Ray cluster; start one with EncoderPool.launch"
                ) from None
            deadline = time.monotonic() + timeout_s
            membership = ray.get(controller.membership.remote(), timeout=timeout_s)
            while not membership.actors:
                if time.monotonic() > deadline:
                    raise PoolUnavailableError(f"pool {name!r} has no ready encoder actor after {timeout_s:.0f} s")
                time.sleep(0.2)
                membership = ray.get(controller.membership.remote(), timeout=timeout_s)
            return cls(name, controller, owns_pool=False, owns_ray=owns_ray, membership=membership)
        except BaseException:
            if owns_ray:
                ray.shutdown()
            raise

    # encode

    def encode(self, items: Sequence[Item], timeout_s: float | None = None) -> list[Embedding]:
        """Encode `items` on the pool; one Embedding per item, in input order, on the CPU.

        Raises:
            InvalidItemError: an item is malformed (its index is named); nothing is sent.
            TimeoutError: no result within `timeout_s`.
            PoolUnavailableError: the pool has no actor left.
        """
        if not _checked_list(items):
            return []
        # Without a timeout this thread may carry its own batches; with one it must stay free to
        # give up, so connection threads carry them.
        call = self._submit(items, want_refs=False, timeout_s=timeout_s, inline=timeout_s is None)
        try:
            results = call.future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            raise self._timed_out(call, timeout_s) from None
        refs = _refs_among(results)
        if refs:  # none when every batch took the same-node channel; ray.get costs even then
            for index, value in zip(refs, ray.get(list(refs.values()))):
                results[index] = value
        return results

    async def encode_async(self, items: Sequence[Item], timeout_s: float | None = None) -> list[Embedding]:
        """`encode` for asyncio callers: awaits without blocking the event loop."""
        if not _checked_list(items):
            return []
        call, queued = self._prepare_call(items, want_refs=False)
        try:
            self._dispatcher.submit(call, queued, timeout_s=0)
        except TimeoutError:  # the queue is full: wait for room off the event loop
            await asyncio.to_thread(self._dispatcher.submit, call, queued, timeout_s)
        try:
            results = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(call.future)), timeout_s)
        except asyncio.TimeoutError:
            raise self._timed_out(call, timeout_s) from None
        refs = _refs_among(results)
        for index, value in zip(refs, await asyncio.gather(*refs.values())):
            results[index] = value
        return results

    def encode_bytes(self, request: bytes, timeout_s: float | None = None) -> bytes:
        """Encode a request in vitpool's msgpack format (`vitpool.codec`), for bytes that come from
        outside the Ray cluster; returns the results in the same format. Nothing is unpickled.

        Raises:
            ValueError: the bytes are not a well-formed request (InvalidItemError, a ValueError
                too, for an item the model cannot take).
        """
        return encode_results(self.encode(decode_request(request), timeout_s))

    def encode_refs(self, items: Sequence[Item], timeout_s: float | None = None) -> list[ray.ObjectRef]:
        """Encode `items`; returns one Ray object reference per item, in input order, each to an
        Embedding. Returns once the results are in the object store (so a reference never points
        at work that may still be retried), for callers that pass them on without fetching them.
        """
        if not _checked_list(items):
            return []
        call = self._submit(items, want_refs=True, timeout_s=timeout_s)
        try:
            return call.future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            raise self._timed_out(call, timeout_s) from None

    def deliver_to(self, ranks: Sequence[Any], transport: str = "auto", actor_index: int | None = None) -> RankDelivery:
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
        """
        if transport not in ("auto", "object_store", *RDT_TRANSPORTS):
            raise ConfigError(f"transport {transport!r}: use 'auto', 'object_store', 'nccl' or 'gloo'")
        self._refresh()
        actors = self._membership.actors
        index = min(actors) if actor_index is None else actor_index
        if index not in actors:
            raise ConfigError(f"no encoder actor {index} takes work; the pool has {sorted(actors)}")
        chosen = choose_transport(transport, self._settings.rank_transport, actors[index], ranks, self.name)
        dtype_name = self._membership.infos[index].dtype_name
        return RankDelivery(actors[index], index, chosen, self._rules, dtype_name)

    def _submit(self, items: Sequence[Item], want_refs: bool, timeout_s: float | None, inline: bool = False) -> Call:
        """Check and queue a call, waiting up to `timeout_s` for room in the queue. `inline`: this
        thread may carry batches over the same-node channel itself (it waits for them anyway)."""
        call, queued = self._prepare_call(items, want_refs)
        self._dispatcher.submit(call, queued, timeout_s, inline)
        return call

    def _prepare_call(self, items: Sequence[Item], want_refs: bool) -> tuple[Call, list[QueuedItem]]:
        # Checked here, in the caller's process, so a bad item costs no hop and harms no one.
        try:
            prepared = prepare_items(items, self._rules)
            limit = self._settings.max_item_tokens
            for index, item in enumerate(prepared):
                if limit is not None and item.size.num_tokens > limit:
                    raise InvalidItemError(
                        index, f"{item.size.num_tokens} output tokens is over this pool's max_item_tokens={limit}"
                    )
        except InvalidItemError:
            self._dispatcher.count_rejected(1)
            raise
        call = Call(len(prepared))
        # Arrays can take the same-node channel; references (put in the caller's thread, outside
        # the dispatcher's lock) go through Ray and give results that stay in the object store.
        keep_arrays = not want_refs and self._dispatcher.has_channel
        queued = [
            QueuedItem(
                call, index, ItemCost(p.size.num_tokens, p.size.num_sequences),
                isinstance(item, Video), p.grid, wire_dtype_name(p.pixels.dtype),
                to_array(p.pixels) if keep_arrays else ray.put(to_array(p.pixels)),
                p.pixels.nbytes,
            )
            for index, (item, p) in enumerate(zip(items, prepared))
        ]
        return call, queued

    def _timed_out(self, call: Call, timeout_s: float | None) -> TimeoutError:
        error = TimeoutError(f"pool {self.name!r}: no result within {timeout_s} s")
        self._dispatcher.cancel(call, error)
        return error

    # scale, stats, shutdown

    @property
    def num_actors(self) -> int:
        """Encoder actors taking work, as this handle last saw."""
        return len(self._membership.actors)

    def scale(self, num_actors: int) -> None:
        """Add or remove encoder actors while work is in flight; returns when the new ones are
        ready (removed ones finish their batches first; nothing in flight is lost)."""
        if isinstance(num_actors, bool) or not isinstance(num_actors, int) or num_actors < 1:
            raise ConfigError(f"num_actors must be a positive integer; got {num_actors!r}")
        placement = ray.get(self._controller.placement.remote())
        if placement is not None:
            check_bundles(placement, num_actors)
        else:
            check_capacity(ray.get(self._controller.actor_options.remote()), num_actors)
        started, retired = ray.get(self._controller.scale.remote(num_actors))
        if retired:
            logger.info("pool %r: retiring encoder actors %s", self.name, retired)
        failures = _await_started(self._controller, started, self._settings.startup_timeout_s)
        self._refresh()
        if failures:
            raise VitpoolError(f"{len(failures)} new encoder actors failed to start: {failures[0]}")

    def stats(self, timeout_s: float = 30.0) -> PoolStats:
        actors = ray.get(self._controller.all_actors.remote(), timeout=timeout_s)
        health = ray.get(self._controller.health.remote(), timeout=timeout_s)
        actor_stats = []
        for handle in actors.values():
            try:
                actor_stats.append(ray.get(handle.stats.remote(), timeout=timeout_s))
            except ray.exceptions.RayError:
                continue  # starting, retiring or dead: no stats
        counters = self._dispatcher.counters
        return PoolStats(
            name=self.name,
            num_actors=self.num_actors,
            actors=sorted(actor_stats, key=lambda s: s.actor_index),
            queue_depth=self._dispatcher.queue_depth,
            batches_in_flight=sum(self._dispatcher.in_flight().values()),
            calls=counters.calls,
            items=counters.items,
            batches=counters.batches,
            channel_batches=counters.channel_batches,
            failed_calls=counters.failed_calls,
            requeued_items=counters.requeued_items,
            failed_batches=counters.failed_batches,
            timed_out_batches=counters.timed_out_batches,
            rejected_items=counters.rejected_items,
            actor_restarts=health.restarts,
            actor_failures=health.failures,
            queued_bytes=self._dispatcher.queued_bytes,
            peak_queued_items=counters.peak_queued_items,
            peak_queued_bytes=counters.peak_queued_bytes,
            items_per_second=recent_rate(list(counters.completions)),
            latency_p50_s=percentile(list(counters.latencies_s), 0.50),
            latency_p99_s=percentile(list(counters.latencies_s), 0.99),
        )

    def close(self) -> None:
        """Detach this handle; the pool keeps running for its other callers."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._refresh_now.set()
        self._dispatcher.close()
        self._refresher.join(timeout=5)

    def shutdown(self) -> None:
        """Stop what this handle started: the pool's actors if it launched them, and the Ray
        cluster (or connection) if it started it. A handle from `connect` only detaches."""
        self.close()
        if self._owns_pool:
            _stop_controller(self._controller)
            logger.info("pool %r stopped", self.name)
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()

    def __enter__(self) -> EncoderPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # membership

    def _actor_failed(self, actor_index: int) -> None:
        # The dispatcher's callback (no Ray calls there): the refresher thread reports it.
        self._failed_actors.append(actor_index)
        self._refresh_now.set()

    def _refresh_loop(self) -> None:
        while not self._closed.is_set():
            self._refresh_now.wait(MEMBERSHIP_REFRESH_S)
            self._refresh_now.clear()
            if self._closed.is_set():
                return
            try:
                while self._failed_actors:
                    index = self._failed_actors.pop(0)
                    ray.get(self._controller.report_failure.remote(index), timeout=30)
                self._refresh()
            except ray.exceptions.RayError as error:
                logger.warning("pool %r: its controller is gone (%s); calls will fail", self.name, error)
                self._dispatcher.set_actors({}, self._dispatcher_budgets())
                return

    def _refresh(self) -> None:
        version = ray.get(self._controller.version.remote())
        if version == self._membership.version:
            return
        membership = ray.get(self._controller.membership.remote())
        self._membership = membership
        self._dispatcher.set_actors(membership.actors, self._dispatcher_budgets())
        logger.info("pool %r: %d encoder actors take work", self.name, len(membership.actors))

    def _channel_to(self, actor_index: int) -> ChannelClient | None:
        """A same-node channel to the actor, if the settings allow it and the actor is on this node."""
        info = self._membership.infos.get(actor_index)
        if not self._settings.same_node_channel or info is None or info.channel is None:
            return None
        if info.node_id != self._node_id:
            return None
        # a reply later than the batch timeout counts as a broken connection (the dispatcher has
        # given up on the batch by then)
        settings = self._settings
        return ChannelClient(info.channel, settings.batch_timeout_s + 5.0, settings.channel_spin_s)

    def _dispatcher_budgets(self) -> list[Budget]:
        return _common_budgets(self._membership.infos.values())


def _refs_among(results: list[Any]) -> dict[int, ray.ObjectRef]:
    """The results that came as Ray references (through a Ray call), by position; the others
    came over the same-node channel as Embeddings."""
    return {i: r for i, r in enumerate(results) if isinstance(r, ray.ObjectRef)}


def _checked_list(items: Any) -> bool:
    """Whether there is anything to encode; TypeError for something that is not a list of items."""
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise TypeError(f"items must be a list of vitpool.Image / vitpool.Video; got {type(items).__name__}")
    return len(items) > 0


def _await_started(controller: Any, started: list[tuple[int, Any, Any]], timeout_s: float) -> list[str]:
    """Wait for new actors to load and capture, logging progress; activate each that is ready.
    Returns the errors of those that failed (they are dropped from the pool)."""
    pending = {ref: index for index, _, ref in started}
    total, failures = len(started), []
    start = last_report = time.monotonic()
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
        for ref in ready:
            index = pending.pop(ref)
            try:
                info: ActorInfo = ray.get(ref)
            except ray.exceptions.RayError as error:
                failures.append(f"actor {index}: {error}")
                ray.get(controller.forget.remote(index))
                continue
            ray.get(controller.activate.remote(index, info))
            logger.info(
                "encoder actor %d ready on %s in %.1f s (%d budgets, %d disabled) [%d/%d]",
                index, info.device, info.startup_seconds, len(info.budgets), len(info.disabled_budgets),
                total - len(pending), total,
            )
        now = time.monotonic()
        if pending and now - last_report >= PROGRESS_EVERY_S:
            last_report = now
            logger.info(
                "waiting for %d of %d encoder actors to be placed, load and capture (%.0f s; free in the "
                "cluster now: %s)", len(pending), total, now - start, free_resources(),
            )
        if pending and now - start > timeout_s:
            for ref, index in pending.items():
                failures.append(f"actor {index}: not ready after {timeout_s:.0f} s")
                ray.get(controller.forget.remote(index))
            break
    return failures


def _stop_controller(controller: Any) -> None:
    try:
        ray.get(controller.shutdown.remote(), timeout=60)
    except ray.exceptions.RayError:
        pass
    ray.kill(controller, no_restart=True)


def _item_rules(membership: Membership):
    if not membership.infos:
        raise PoolUnavailableError("the pool has no ready encoder actor")
    return next(iter(membership.infos.values())).item_rules


def _common_budgets(infos: Any) -> list[Budget]:
    """The budgets every actor has (they differ only if actors chose defaults on unlike GPUs)."""
    infos = list(infos)
    if not infos:
        return [Budget(64, 64, 32)]  # placeholder until an actor joins; nothing is sent without one
    common = set(infos[0].budgets).intersection(*(set(i.budgets) for i in infos[1:]))
    return sorted(common) or sorted(infos[0].budgets)
