"""EncoderPool: what users launch, connect to and call.

A launched pool is a named controller actor (membership, scaling) and one encoder actor per GPU.
Every handle, in the launching process or any other process in the cluster, runs its own
dispatcher: calls go from the caller's process straight to the encoder actors. Pixels and
embeddings go through shared memory to actors on the caller's node and through Ray's object store
to the others; only small control messages go anywhere else.

This module is the facade: it checks a call's items against the model's rules (in this process,
once), queues them with the dispatcher, and waits. Starting actors is `launcher`'s, keeping the
membership current `membership`'s, choosing batches and actors `policy`'s, moving batches the
transport's. A caller's process loads no model code: the rules arrive pickled from an actor.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Sequence
from typing import Any

import ray

from vitpool.codec import decode_request, encode_results
from vitpool.errors import ConfigError, InvalidItemError, PoolUnavailableError, VitpoolError
from vitpool.items import Embedding, Item, prepare_items
from vitpool.packing import Budget
from vitpool.pool.calls import Call, QueuedItem
from vitpool.pool.controller import Membership
from vitpool.pool.dispatcher import Dispatcher
from vitpool.pool.launcher import find_pool, launch_pool, scale_pool, stop_controller
from vitpool.pool.membership import MembershipWatcher
from vitpool.pool.rank_delivery import RDT_TRANSPORTS, RankDelivery, choose_transport
from vitpool.pool.settings import PoolSettings
from vitpool.pool.stats import PoolStats, percentile, recent_rate
from vitpool.transport.link import ActorLink
from vitpool.transport.links import make_link
from vitpool.transport.wire import to_array

logger = logging.getLogger(__name__)


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
        self._closed = threading.Event()
        self._dispatcher = Dispatcher(
            _common_budgets(membership.infos.values()), self._settings,
            on_actor_failed=self._actor_failed, make_link=self._link_to,
        )
        self._dispatcher.set_actors(membership.actors, _common_budgets(membership.infos.values()))
        self._watcher = MembershipWatcher(controller, membership, self._membership_changed, self._controller_lost)

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
        controller, owns_ray, membership = launch_pool(
            pool_settings, num_actors, name, address, actor_options, placement_group
        )
        return cls(name, controller, owns_pool=True, owns_ray=owns_ray, membership=membership)

    @classmethod
    def connect(cls, name: str = "vitpool", address: str | None = None, timeout_s: float = 60.0) -> EncoderPool:
        """A handle to a running pool, from any process or Ray actor in its cluster.

        Raises:
            PoolUnavailableError: no pool of this name runs (or none of its actors is ready
                within `timeout_s`).
        """
        controller, owns_ray, membership = find_pool(name, address, timeout_s)
        return cls(name, controller, owns_pool=False, owns_ray=owns_ray, membership=membership)

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
        self._watcher.refresh()
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
        # Checked and sized here, once, in the caller's process: a bad item costs no hop and harms
        # no one, and the specs travel with the pixels.
        try:
            prepared = prepare_items(items, self._rules)
            limit = self._settings.max_item_tokens
            for index, item in enumerate(prepared):
                if limit is not None and item.spec.num_tokens > limit:
                    raise InvalidItemError(
                        index, f"{item.spec.num_tokens} output tokens is over this pool's max_item_tokens={limit}"
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
                call, index, p.spec,
                to_array(p.pixels) if keep_arrays else ray.put(to_array(p.pixels)),
                p.pixels.nbytes,
            )
            for index, p in enumerate(prepared)
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
        retired, failures = scale_pool(self._controller, num_actors, self._settings.startup_timeout_s)
        if retired:
            logger.info("pool %r: retiring encoder actors %s", self.name, retired)
        self._watcher.refresh()
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
            peak_queued_items=self._dispatcher.peak_queued[0],
            peak_queued_bytes=self._dispatcher.peak_queued[1],
            items_per_second=recent_rate(list(counters.completions)),
            latency_p50_s=percentile(list(counters.latencies_s), 0.50),
            latency_p99_s=percentile(list(counters.latencies_s), 0.99),
        )

    def close(self) -> None:
        """Detach this handle; the pool keeps running for its other callers."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._watcher.close()
        self._dispatcher.close()

    def shutdown(self) -> None:
        """Stop what this handle started: the pool's actors if it launched them, and the Ray
        cluster (or connection) if it started it. A handle from `connect` only detaches."""
        self.close()
        if self._owns_pool:
            stop_controller(self._controller)
            logger.info("pool %r stopped", self.name)
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()

    def __enter__(self) -> EncoderPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # membership

    def _actor_failed(self, actor_index: int) -> None:
        # The dispatcher's callback (no Ray calls there): the watcher's thread reports it.
        self._watcher.report_failure(actor_index)

    def _membership_changed(self, membership: Membership) -> None:
        self._membership = membership
        self._dispatcher.set_actors(membership.actors, _common_budgets(membership.infos.values()))
        logger.info("pool %r: %d encoder actors take work", self.name, len(membership.actors))

    def _controller_lost(self, error: BaseException) -> None:
        self._dispatcher.set_actors({}, _common_budgets(self._membership.infos.values()))

    def _link_to(self, actor_index: int) -> ActorLink:
        """How to reach an actor: the same-node channel where the settings allow it and the actor
        serves one on this node, else Ray calls."""
        info = self._membership.infos.get(actor_index)
        channel = None
        if self._settings.same_node_channel and info is not None and info.node_id == self._node_id:
            channel = info.channel
        # a reply later than the batch timeout counts as a broken connection (the dispatcher has
        # given up on the batch by then)
        settings = self._settings
        return make_link(
            self._membership.actors[actor_index], channel, settings.batch_timeout_s + 5.0, settings.channel_spin_s,
            f"encoder actor {actor_index}",
        )


def _refs_among(results: list[Any]) -> dict[int, ray.ObjectRef]:
    """The results that came as Ray references (through a Ray call), by position; the others
    came over the same-node channel as Embeddings."""
    return {i: r for i, r in enumerate(results) if isinstance(r, ray.ObjectRef)}


def _checked_list(items: Any) -> bool:
    """Whether there is anything to encode; TypeError for something that is not a list of items."""
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise TypeError(f"items must be a list of vitpool.Image / vitpool.Video; got {type(items).__name__}")
    return len(items) > 0


def _item_rules(membership: Membership):
    if not membership.infos:
        raise PoolUnavailableError("the pool has no ready encoder actor")
    return next(iter(membership.infos.values())).item_rules


def _common_budgets(infos: Any) -> list[Budget]:
    """The budgets every actor has (they differ only if actors chose defaults on unlike GPUs)."""
    infos = list(infos)
    if not infos:
        return [Budget(64, (), 32)]  # placeholder until an actor joins; nothing is sent without one
    common = set(infos[0].budgets).intersection(*(set(i.budgets) for i in infos[1:]))
    return sorted(common) or sorted(infos[0].budgets)
