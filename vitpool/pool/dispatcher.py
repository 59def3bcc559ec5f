"""The dispatcher: the coordinator's logic, run in each caller's process.

Every process that calls the pool has one. It queues the items of all its concurrent calls,
packs them into token budgets, and sends each batch straight to the encoder actor with the
least outstanding estimated cost, keeping at most `max_in_flight` batches on each actor. The
hot path is one hop: caller -> encoder actor -> caller; the controller is never on it. To an
actor on the caller's node a batch goes through the same-node channel (shared memory, see
`vitpool.actors.local_channel`); to others, and for callers that want object references, it is
a Ray actor call with the pixels in the object store.

The queue is bounded (items and pixel bytes): a call that would pass the bounds waits for room.
A batch unanswered after `batch_timeout_s` counts as failed, like one whose actor died: its items
go to other actors and the actor is reported, for the controller to replace. When no actor is
left, waiting and new calls fail at once with PoolUnavailableError.

Items go out at once while some actor is idle; while every actor is busy they wait up to
`batch_window_s` for others to share a batch, or until an actor frees a slot. A batch whose
actor left the pool (retired or died) goes back to the queue and to another actor.

Threads: callers submit and may dispatch in their own thread. Completion callbacks (Ray's, and
the channel's connection threads) only update state, making no Ray calls; the dispatcher's thread
sends whatever they freed room for.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray

from vitpool.actors import OK, RETIRED, BatchReceipt
from vitpool.actors.local_channel import ChannelClient, ChannelClosed, ChannelReply, Exchange
from vitpool.errors import EncodeError, InvalidItemError, PoolUnavailableError
from vitpool.packing import Budget, batch_cost, pack
from vitpool.pool.calls import Call, QueuedItem
from vitpool.pool.settings import PoolSettings

logger = logging.getLogger(__name__)

# Errors that mean the actor is gone (or going), not that the batch was bad: send it elsewhere.
_ACTOR_GONE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)
_LATENCY_SAMPLES = 4096


@dataclass
class _ActorSlot:
    handle: Any
    channel: ChannelClient | None = None  # the same-node fast path, if the actor is on this node
    accepting: bool = True
    in_flight: int = 0
    outstanding_cost: float = 0.0


@dataclass(eq=False)  # identity: a flight is tracked in a set
class _Flight:
    actor_index: int
    members: list[QueuedItem]
    cost: float
    results: list[Any]  # per member: a Ray reference to its Embedding, or (by channel) the Embedding
    sent_at: float = field(default_factory=time.monotonic)


@dataclass
class DispatchCounters:
    """What this process's dispatcher has seen."""

    calls: int = 0
    items: int = 0
    batches: int = 0
    channel_batches: int = 0  # sent through the same-node channel rather than a Ray call
    requeued_items: int = 0
    failed_calls: int = 0
    failed_batches: int = 0  # the actor died, went silent past the timeout, or failed the batch
    timed_out_batches: int = 0
    rejected_items: int = 0  # bad items, found here or by the actor
    peak_queued_items: int = 0
    peak_queued_bytes: int = 0
    latencies_s: collections.deque = field(default_factory=lambda: collections.deque(maxlen=_LATENCY_SAMPLES))
    completions: collections.deque = field(default_factory=lambda: collections.deque(maxlen=_LATENCY_SAMPLES))


class Dispatcher:
    def __init__(
        self,
        budgets: list[Budget],
        settings: PoolSettings,
        on_actor_failed: Callable[[int], None],
        make_channel: Callable[[int], ChannelClient | None] = lambda actor_index: None,
    ) -> None:
        self._budgets = budgets
        self._max_in_flight = settings.max_batches_in_flight_per_actor
        self._max_tokens_per_run = settings.max_tokens_per_run
        self._window_s = settings.batch_window_s
        self._max_attempts = settings.max_attempts_per_item
        self._batch_timeout_s = settings.batch_timeout_s
        self._max_queued_items = settings.max_queued_items
        self._max_queued_bytes = settings.max_queued_bytes
        self._on_actor_failed = on_actor_failed  # told the index of a dead or silent actor; no Ray calls here
        self._make_channel = make_channel
        self._actors: dict[int, _ActorSlot] = {}
        self._failed_actors: set[int] = set()  # never taken back, whatever a stale membership says
        self._flights: set[_Flight] = set()
        self._queue: collections.deque[QueuedItem] = collections.deque()
        self._queued_bytes = 0
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._room = threading.Condition(self._lock)  # the queue has room again
        self._closed = False
        self._slot_freed = False  # a batch finished since the last dispatch: send without a window
        self._thread_waits_untimed = False  # no flight's deadline armed in the dispatcher's thread
        self._registering = threading.local()  # set while _send adds a completion callback
        self._early_outcomes: list[tuple[_Flight, Any]] = []  # for the dispatcher's thread to finish
        self.counters = DispatchCounters()
        self._thread = threading.Thread(target=self._run, name="vitpool-dispatcher", daemon=True)
        self._thread.start()

    # membership

    def set_actors(self, actors: dict[int, Any], budgets: list[Budget]) -> None:
        """The actors that take work now. Others stop getting batches; theirs in flight finish."""
        with self._lock:
            self._budgets = budgets
            for index, slot in self._actors.items():
                slot.accepting = index in actors
            for index, handle in actors.items():
                if index not in self._actors and index not in self._failed_actors:
                    self._actors[index] = _ActorSlot(handle, self._make_channel(index))
            self._forget_idle_leavers()
            self._fail_queue_if_no_actor()
            self._wake.notify_all()

    # calls

    def submit(
        self, call: Call, items: list[QueuedItem], timeout_s: float | None = None, inline: bool = False
    ) -> None:
        """Queue a call's items, waiting up to `timeout_s` for room (TimeoutError after).

        `inline`: batches this call sends at once over the same-node channel are carried by this
        thread (send, then wait for the reply) instead of a connection's thread, for a caller
        that would only wait for its results anyway: one thread hand-off and wake-up fewer.
        """
        nbytes = sum(item.nbytes for item in items)
        if len(items) > self._max_queued_items or nbytes > self._max_queued_bytes:
            raise ValueError(
                f"a call of {len(items)} items and {nbytes} pixel bytes can never fit the queue "
                f"(max_queued_items={self._max_queued_items}, max_queued_bytes={self._max_queued_bytes}); "
                "split it into smaller calls"
            )
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            while True:
                self._check_open()
                if (
                    len(self._queue) + len(items) <= self._max_queued_items
                    and self._queued_bytes + nbytes <= self._max_queued_bytes
                ):
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"the pool's queue stayed full for {timeout_s} s")
                self._room.wait(remaining)
            self.counters.calls += 1
            self._enqueue(items)
            exchanges: list[tuple[Exchange, _Flight]] | None = [] if inline else None
            if self._has_idle_actor():
                self._dispatch(exchanges)
            else:
                self._wake.notify_all()
        for exchange, _ in exchanges or ():
            exchange.send()  # all first, so that batches to several actors run at once
        for exchange, flight in exchanges or ():
            self._on_channel_reply(flight, exchange.receive())

    def _check_open(self) -> None:
        if self._closed:
            raise PoolUnavailableError("this pool handle is closed")
        if not any(slot.accepting for slot in self._actors.values()):
            raise PoolUnavailableError("the pool has no encoder actor left; see the log for why")

    def _enqueue(self, items: list[QueuedItem], front: bool = False) -> None:
        if front:
            self._queue.extendleft(reversed(items))
        else:
            self._queue.extend(items)
        self._queued_bytes += sum(item.nbytes for item in items)
        counters = self.counters
        counters.peak_queued_items = max(counters.peak_queued_items, len(self._queue))
        counters.peak_queued_bytes = max(counters.peak_queued_bytes, self._queued_bytes)

    def _dequeued(self, items: list[QueuedItem]) -> None:
        if items:
            self._queued_bytes -= sum(item.nbytes for item in items)
            self._room.notify_all()

    def count_rejected(self, count: int) -> None:
        with self._lock:
            self.counters.rejected_items += count

    def cancel(self, call: Call, error: BaseException) -> None:
        """Give up on a call (its caller timed out); its queued items leave the queue at once."""
        with self._lock:
            self._fail_call(call, error)
            self._drop_finished_calls()

    @property
    def has_channel(self) -> bool:
        """Whether some actor takes batches through the same-node channel (callers then keep
        pixels as arrays instead of putting them in the object store)."""
        return any(slot.channel is not None for slot in self._actors.values())

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    def in_flight(self) -> dict[int, int]:
        with self._lock:
            return {index: slot.in_flight for index, slot in self._actors.items()}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            while self._early_outcomes:
                self._finish_locked(*self._early_outcomes.pop(0))
            self._fail_queue(PoolUnavailableError("the pool handle was closed"))
            for slot in self._actors.values():
                _close_channel(slot)
            self._wake.notify_all()
            self._room.notify_all()
        self._thread.join(timeout=5)

    # dispatching (lock held)

    def _has_idle_actor(self) -> bool:
        return any(slot.accepting and slot.in_flight == 0 for slot in self._actors.values())

    def _free_slots(self) -> int:
        return sum(
            self._max_in_flight - slot.in_flight for slot in self._actors.values() if slot.accepting
        )

    def _dispatch(self, exchanges: list | None = None) -> None:
        """Send as much of the queue as the actors have room for. Same-node batches go to
        `exchanges` for the caller to carry, if it gives a list; else to connection threads."""
        while self._queue:
            free_slots = self._free_slots()
            if free_slots <= 0:
                return
            taken = self._take(free_slots)  # drops the items of failed or timed-out calls
            batches = pack([item.cost for item in taken], self._budgets, self._max_tokens_per_run)
            batches.sort(key=lambda b: min(b.item_indices))  # oldest items first
            for number, batch in enumerate(batches):
                actor_index = self._least_loaded()
                if actor_index is None:
                    # No room after all: put the rest back at the front, in queue order.
                    rest = sorted(i for b in batches[number:] for i in b.item_indices)
                    self._enqueue([taken[i] for i in rest], front=True)
                    return
                budget_tokens = batch.budget.num_tokens if batch.budget else batch.num_tokens
                cost = batch_cost(budget_tokens, batch.num_sequences)
                self._send(actor_index, [taken[i] for i in batch.item_indices], cost, exchanges)

    def _take(self, free_slots: int) -> list[QueuedItem]:
        """Queued items, oldest first, as many as `free_slots` full batches would hold: packing
        the whole of a long queue on every dispatch would cost more than it gains."""
        largest = self._budgets[-1]
        token_room = free_slots * largest.num_tokens
        item_room = free_slots * largest.max_items
        taken: list[QueuedItem] = []
        dropped: list[QueuedItem] = []
        tokens = 0
        while self._queue and len(taken) < item_room:
            item = self._queue[0]
            if item.call.done:
                dropped.append(self._queue.popleft())
                continue
            if taken and tokens + item.cost.num_tokens > token_room:
                break
            taken.append(self._queue.popleft())
            tokens += item.cost.num_tokens
        self._dequeued(taken + dropped)
        return taken

    def _least_loaded(self) -> int | None:
        candidates = [
            (slot.outstanding_cost, index)
            for index, slot in self._actors.items()
            if slot.accepting and slot.in_flight < self._max_in_flight
        ]
        return min(candidates)[1] if candidates else None

    def _send(self, actor_index: int, members: list[QueuedItem], cost: float, exchanges: list | None) -> None:
        slot = self._actors[actor_index]
        metadata = [(m.is_video, m.grid, m.dtype_name) for m in members]
        slot.in_flight += 1
        slot.outstanding_cost += cost
        self.counters.batches += 1
        if self._thread_waits_untimed:  # the dispatcher's thread must watch this batch's deadline
            self._thread_waits_untimed = False
            self._wake.notify_all()
        if slot.channel is not None and all(isinstance(m.pixels, np.ndarray) for m in members):
            flight = _Flight(actor_index, members, cost, [])
            self._flights.add(flight)
            self.counters.channel_batches += 1
            items = [(meta, m.pixels, m.cost.num_tokens) for meta, m in zip(metadata, members)]
            if exchanges is not None:
                exchanges.append((slot.channel.exchange(items), flight))
            else:
                slot.channel.submit(items, lambda outcome: self._on_channel_reply(flight, outcome))
            return
        refs = slot.handle.encode_batch.options(num_returns=len(members) + 1).remote(
            metadata, *[m.pixels for m in members]
        )
        flight = _Flight(actor_index, members, cost, refs[:-1])
        self._flights.add(flight)
        self._registering.active = True
        try:
            refs[-1].future().add_done_callback(lambda future: self._on_receipt(flight, future))
        finally:
            self._registering.active = False

    # completion (Ray's callback thread or a channel connection's: no Ray calls here)

    def _on_receipt(self, flight: _Flight, future: Any) -> None:
        try:
            outcome = future.result()
        except Exception as error:  # noqa: BLE001 - handed on as the batch's outcome
            outcome = error
        if getattr(self._registering, "active", False):
            # The call was over before its callback was added (its actor is gone), so the callback
            # runs here, in _send, with the lock held: the dispatcher's thread finishes it.
            self._early_outcomes.append((flight, outcome))
            self._wake.notify_all()
            return
        self._finish(flight, outcome)

    def _on_channel_reply(self, flight: _Flight, outcome: ChannelReply | BaseException) -> None:
        if isinstance(outcome, ChannelReply):
            flight.results = outcome.values
            outcome = outcome.receipt
        self._finish(flight, outcome)

    def _finish(self, flight: _Flight, outcome: BatchReceipt | BaseException) -> None:
        with self._lock:
            self._finish_locked(flight, outcome)

    def _finish_locked(self, flight: _Flight, outcome: BatchReceipt | BaseException) -> None:
        index = flight.actor_index
        if flight not in self._flights:
            return  # it timed out before: its items went elsewhere already
        self._flights.discard(flight)
        failed_before = self.counters.failed_calls
        slot = self._actors.get(index)
        if slot is not None:
            slot.in_flight -= 1
            slot.outstanding_cost -= flight.cost
        if isinstance(outcome, BaseException) and not isinstance(outcome, ChannelClosed):
            self.counters.failed_batches += 1
        if isinstance(outcome, ChannelClosed):
            # The actor may be alive: go on through Ray, which tells a dead actor apart.
            if slot is not None and slot.channel is not None:
                logger.warning("%s (actor %d); its batches go through Ray from now on", outcome, index)
                _close_channel(slot)
            self._requeue(flight, str(outcome), count_attempt=False)  # at most once per actor
        elif isinstance(outcome, _ACTOR_GONE):
            self._actor_failed(index, f"encoder actor {index} died: {outcome}")
            self._requeue(flight, f"encoder actor {index} died")
        elif isinstance(outcome, BaseException):  # the actor failed on the batch itself
            failure = EncodeError(f"encoder actor {index} failed on a batch: {outcome}")
            failure.__cause__ = outcome
            for member in flight.members:
                self._fail_call(member.call, failure)
        elif outcome.status == RETIRED:
            self._actor_left(flight, f"encoder actor {index} left the pool")
        else:
            assert outcome.status == OK, outcome.status
            self._complete(flight, outcome)
        if self.counters.failed_calls != failed_before:
            self._drop_finished_calls()
        self._forget_idle_leavers()
        self._slot_freed = True
        if self._queue:  # else the dispatcher's thread has nothing to do: waking it costs the caller
            self._wake.notify_all()

    def _complete(self, flight: _Flight, receipt: BatchReceipt) -> None:
        now = time.monotonic()
        for position, member in enumerate(flight.members):
            call = member.call
            reason = receipt.item_errors.get(position)
            if reason is not None:
                self.counters.rejected_items += 1
                self._fail_call(call, InvalidItemError(member.index, reason))
            elif call.complete_item(member.index, flight.results[position]):
                self.counters.latencies_s.append(now - call.submitted_at)
                self.counters.completions.append((now, len(call.results)))
        self.counters.items += len(flight.members)

    def _actor_left(self, flight: _Flight, why: str) -> None:
        """A retiring actor refused a batch (the controller knows; the next refresh drops it)."""
        slot = self._actors.get(flight.actor_index)
        if slot is not None and slot.accepting:
            slot.accepting = False
            logger.info("%s; its batches go to other actors", why)
        self._requeue(flight, why)

    def _actor_failed(self, index: int, why: str) -> None:
        """An actor died or went silent: no more batches for it, and the pool is told."""
        if index in self._failed_actors:
            return
        self._failed_actors.add(index)
        slot = self._actors.get(index)
        if slot is not None:
            slot.accepting = False
            _close_channel(slot)
        logger.warning("%s; its batches go to other actors", why)
        self._on_actor_failed(index)

    def _check_timeouts(self) -> float | None:
        """Give up on batches past their timeout; returns seconds until the next one would be."""
        now = time.monotonic()
        next_deadline = None
        for flight in list(self._flights):
            deadline = flight.sent_at + self._batch_timeout_s
            if deadline <= now:
                self._flights.discard(flight)
                self.counters.failed_batches += 1
                self.counters.timed_out_batches += 1
                slot = self._actors.get(flight.actor_index)
                if slot is not None:
                    slot.in_flight -= 1
                    slot.outstanding_cost -= flight.cost
                why = f"encoder actor {flight.actor_index} did not answer a batch within {self._batch_timeout_s} s"
                self._actor_failed(flight.actor_index, why)
                self._requeue(flight, why)
                self._forget_idle_leavers()
            elif next_deadline is None or deadline < next_deadline:
                next_deadline = deadline
        return None if next_deadline is None else next_deadline - now

    def _drop_finished_calls(self) -> None:
        """Free the queue room of calls that failed or were given up while their items waited."""
        dropped = [item for item in self._queue if item.call.done]
        if dropped:
            self._queue = collections.deque(item for item in self._queue if not item.call.done)
            self._dequeued(dropped)

    def _fail_queue_if_no_actor(self) -> None:
        if not any(slot.accepting for slot in self._actors.values()):
            self._fail_queue(PoolUnavailableError("the pool has no encoder actor left; see the log for why"))

    def _requeue(self, flight: _Flight, why: str, count_attempt: bool = True) -> None:
        requeued = []
        for member in flight.members:
            if member.call.done:
                continue
            member.attempts += count_attempt
            if member.attempts >= self._max_attempts:
                error = PoolUnavailableError(f"item {member.index} was sent {member.attempts} times: {why}")
                self._fail_call(member.call, error)
            else:
                requeued.append(member)
        self.counters.requeued_items += len(requeued)
        self._enqueue(requeued, front=True)  # already accepted: the bound does not apply
        self._fail_queue_if_no_actor()

    def _forget_idle_leavers(self) -> None:
        for index in [i for i, s in self._actors.items() if not s.accepting and s.in_flight == 0]:
            _close_channel(self._actors.pop(index))

    def _fail_queue(self, error: BaseException) -> None:
        failed = list(self._queue)
        self._queue.clear()
        self._dequeued(failed)
        for item in failed:
            self._fail_call(item.call, error)

    def _fail_call(self, call: Call, error: BaseException) -> None:
        """Fail a call once: its first error wins and is the one counted."""
        if not call.done:
            self.counters.failed_calls += 1
            call.fail(error)

    # the dispatcher's thread: window expiry and whatever completions freed room for

    def _run(self) -> None:
        with self._lock:
            while not self._closed:
                while self._early_outcomes:
                    self._finish_locked(*self._early_outcomes.pop(0))
                timeout = self._check_timeouts()
                if self._queue and self._free_slots() > 0:
                    waited = time.monotonic() - self._queue[0].enqueued_at
                    if self._has_idle_actor() or waited >= self._window_s or self._slot_freed:
                        self._slot_freed = False
                        try:
                            self._dispatch()
                        except Exception:
                            logger.exception("dispatch failed")
                            self._fail_queue(PoolUnavailableError("dispatch failed; see the log"))
                        continue
                    window_left = self._window_s - waited
                    timeout = window_left if timeout is None else min(timeout, window_left)
                self._thread_waits_untimed = timeout is None
                self._wake.wait(timeout)


def _close_channel(slot: _ActorSlot) -> None:
    if slot.channel is not None:
        slot.channel.close()
        slot.channel = None
