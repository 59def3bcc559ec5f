"""The dispatcher, run in each caller's process.

Every process that calls the pool has one. It queues the items of all its concurrent calls and
sends batches straight to the encoder actors; which items go together, in which budget, and to
which actor is the policy's choice (`vitpool.pool.policy`), and how a batch travels is the
actor's link's (`vitpool.transport.link`: shared memory to an actor on this node, a Ray call
otherwise). The batch plan sent is the one the actor runs. The hot path is one hop: caller ->
encoder actor -> caller; the controller is never on it. Here: the queue, its bounds, the calls,
and what each outcome means for the actors. The batches in flight and their timeouts are
`vitpool.pool.flights`'; what an outcome means for the items is `vitpool.pool.item_outcomes`'.

The queue is bounded (items and pixel bytes): a call that would pass the bounds waits for room.
A batch unanswered after `batch_timeout_s` counts as failed, like one whose actor died: its items
go to other actors and the actor is reported, for the controller to replace. When no actor is
left, waiting and new calls fail at once with PoolUnavailableError.

Items go out at once while some actor is idle; while every actor is busy they wait up to
`batch_window_s` for others to share a batch, or until an actor frees a slot. A batch whose
actor left the pool (retired or died) goes back to the queue and to another actor. The items of
small calls (`small_first_tokens`) go in batches of their own, which also have a lane of slots of
their own at each actor, so they never wait here behind large batches (`vitpool.pool.policy`).

Threads: callers submit and may dispatch in their own thread. Outcome callbacks (from Ray's
threads, the channel's connection threads, or a caller carrying its own batch) only update
state, making no Ray calls; the dispatcher's thread sends whatever they freed room for.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from vitpool.errors import PoolUnavailableError, counted
from vitpool.packing import Budget
from vitpool.pool.calls import Call, QueuedItem
from vitpool.pool.flights import Flight, Flights
from vitpool.pool.item_outcomes import DispatchCounters, ItemOutcomes
from vitpool.pool.item_queue import ItemQueue
from vitpool.pool.policy import ActorLoad, DispatchPolicy
from vitpool.pool.settings import PoolSettings
from vitpool.specs import BatchPlan
from vitpool.transport.link import (
    OK,
    ActorGone,
    ActorLink,
    Done,
    InlineExchange,
    Outcome,
    Refused,
)

logger = logging.getLogger(__name__)

NO_ACTOR_LEFT = "the pool has no encoder actor left; see the log for why"


@dataclass
class _ActorSlot:
    link: ActorLink
    load: ActorLoad = field(default_factory=ActorLoad)


class Dispatcher:
    """Queues a process's calls and keeps the actors busy with their batches.

    Args:
        budgets: the budgets every actor captured.
        settings: the pool's settings (queue bounds, batch window, timeouts, batch limits).
        on_actor_failed: told the index of a dead or silent actor; it must make no Ray calls.
        make_link: the link to an actor, by index, when it joins.
        ties_in_own_order: actors that tie on load are tried in an order of this dispatcher's
            own (`DispatchPolicy.tie_seed`); False: lowest index first.
    """

    def __init__(
        self,
        budgets: list[Budget],
        settings: PoolSettings,
        on_actor_failed: Callable[[int], None],
        make_link: Callable[[int], ActorLink],
        ties_in_own_order: bool = True,
    ) -> None:
        self._tie_seed = random.getrandbits(32) if ties_in_own_order else None
        self._policy = _policy(budgets, settings, self._tie_seed)
        self._settings = settings
        self._window_s = settings.batch_window_s
        self._on_actor_failed = on_actor_failed
        self._make_link = make_link
        self._actors: dict[int, _ActorSlot] = {}
        self._failed_actors: set[int] = set()  # never taken back, whatever a stale membership says
        self._flights = Flights(settings.batch_timeout_s)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._room = threading.Condition(self._lock)  # the queue has room again
        self._queue = ItemQueue(settings.max_queued_items, settings.max_queued_bytes, self._room)
        self._closed = False
        self._closed_reason = "this pool handle is closed"
        self._slot_freed = False  # a batch finished since the last dispatch: send without a window
        self._thread_waits_untimed = False  # no flight's deadline armed in the dispatcher's thread
        self._registering = threading.local()  # set while _send adds a completion callback
        self._early_outcomes: list[tuple[Flight, Any]] = []  # for the dispatcher's thread to finish
        self._call_tokens: weakref.WeakKeyDictionary[Call, int] = weakref.WeakKeyDictionary()  # small first
        self.counters = DispatchCounters()
        self._items = ItemOutcomes(self._queue, self.counters, settings.max_attempts_per_item)
        self._thread = threading.Thread(target=self._run, name="vitpool-dispatcher", daemon=True)
        self._thread.start()

    # membership

    def set_actors(self, actors: Iterable[int], budgets: list[Budget]) -> None:
        """The actors (by index) that take work now. Others stop getting batches; theirs in
        flight finish."""
        actors = set(actors)
        with self._lock:
            self._policy = _policy(budgets, self._settings, self._tie_seed)
            for index, slot in self._actors.items():
                slot.load.accepting = index in actors
            for index in sorted(actors):
                if index not in self._actors and index not in self._failed_actors:
                    self._actors[index] = _ActorSlot(self._make_link(index))
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
        if not self._queue.can_ever_hold(len(items), nbytes):
            raise self._never_fits(items, nbytes)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            while True:
                self._check_open()
                if self._queue.has_room(len(items), nbytes):
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"the pool's queue stayed full for {timeout_s} s")
                self._room.wait(remaining)
            self.counters.calls += 1
            self._call_tokens[call] = sum(item.spec.num_tokens for item in items)
            self._queue.push(items)
            exchanges: list[InlineExchange] | None = [] if inline else None
            if self._policy.has_idle_actor(self._loads()):
                self._dispatch(exchanges)
            else:
                self._wake.notify_all()
        for exchange in exchanges or ():
            exchange.send()  # all first, so that batches to several actors run at once
        for exchange in exchanges or ():
            exchange.finish()

    def _never_fits(self, items: list[QueuedItem], nbytes: int) -> ValueError:
        """Why a call can never be queued. Each item was bounded once, where the caller's items
        are checked (`item_checks`: an item over the queue's bytes is refused naming it), so what
        is left is the call as a whole."""
        return ValueError(
            f"a call of {counted(len(items), 'item')} and {nbytes} pixel bytes can never fit this "
            f"process's queue (max_queued_items={self._queue.max_items}, "
            f"max_queued_bytes={self._queue.max_bytes}), though each item fits on its own: split the "
            "call into smaller calls"
        )

    def _check_open(self) -> None:
        if self._closed:
            raise PoolUnavailableError(self._closed_reason)
        if not any(slot.load.accepting for slot in self._actors.values()):
            raise PoolUnavailableError(NO_ACTOR_LEFT)

    def count_requeued(self, count: int) -> None:
        """Count items sent again by the caller (their results were lost after the answer)."""
        with self._lock:
            self.counters.requeued_items += count

    def count_rejected(self, count: int) -> None:
        """Count items the caller's checks refused (they never reach the queue)."""
        with self._lock:
            self.counters.rejected_items += count

    def cancel(self, call: Call, error: BaseException) -> None:
        """Give up on a call (its caller timed out); its queued items leave the queue at once."""
        with self._lock:
            self._items.fail_call(call, error)
            self._queue.drop_finished_calls()

    @property
    def has_channel(self) -> bool:
        """Whether some actor takes batches through the same-node channel (callers then keep
        pixels as arrays instead of putting them in the object store)."""
        with self._lock:  # outcome callbacks change the actors
            return any(slot.link.is_local for slot in self._actors.values())

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def queued_bytes(self) -> int:
        return self._queue.nbytes

    @property
    def peak_queued(self) -> tuple[int, int]:
        """The most items and pixel bytes that waited at once."""
        return self._queue.peak_items, self._queue.peak_bytes

    def in_flight(self) -> dict[int, int]:
        """Batches sent and not yet answered, per actor."""
        with self._lock:
            return {index: slot.load.in_flight for index, slot in self._actors.items()}

    def close(self, reason: str | None = None) -> None:
        """Fail what waits, close the links; batches in flight fail when their outcome comes.
        `reason`: the PoolUnavailableError's message for the calls that waited, and for later
        ones (default: the handle is closed). Closing again does nothing: the first reason stands."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if reason is not None:
                self._closed_reason = reason
            while self._early_outcomes:
                self._finish_locked(*self._early_outcomes.pop(0))
            self._items.fail_queue(self._closed_reason)
            for slot in self._actors.values():
                slot.link.close()
            self._wake.notify_all()
            self._room.notify_all()
        self._thread.join(timeout=5)

    # dispatching (lock held)

    def _loads(self) -> dict[int, ActorLoad]:
        return {index: slot.load for index, slot in self._actors.items()}

    def _is_small_call(self, call: Call) -> bool:
        tokens = self._call_tokens.get(call)
        return (
            tokens is not None
            and self._policy.small_tokens is not None
            and tokens <= self._policy.small_tokens
        )

    def _has_room(self, loads: dict[int, ActorLoad]) -> bool:
        return self._policy.free_slots(loads) > 0 or self._policy.free_small_slots(loads) > 0

    def _dispatch(self, exchanges: list | None = None) -> int:
        """Send as much of the queue as the actors have room for; returns how many batches went.
        Batches this thread can carry itself go to `exchanges`, if it gives a list; else the links
        carry them."""
        sent = 0
        while self._queue:
            loads = self._loads()
            free_slots, free_small_slots = (
                self._policy.free_slots(loads),
                self._policy.free_small_slots(loads),
            )
            if free_slots <= 0 and free_small_slots <= 0:
                break
            taken = self._queue.take(
                *self._policy.room(free_slots, free_small_slots)
            )  # drops items of calls that are over
            left: list[int] = []
            small = [self._is_small_call(item.call) for item in taken]
            for batch in self._policy.plan([item.spec for item in taken], small):
                is_small = self._policy.is_small(batch, small)
                actor_index = self._policy.choose_actor(self._loads(), is_small)
                if actor_index is None:  # no room for it: it waits (a later, small batch may go)
                    left.extend(batch.item_indices)
                    continue
                members = [taken[i] for i in batch.item_indices]
                small_lane = self._policy.takes_in_small_lane(self._actors[actor_index].load, is_small)
                keys = tuple(m.cache_key for m in members)
                plan = BatchPlan(batch.budget, tuple(m.spec for m in members), keys if any(keys) else ())
                self._send(actor_index, plan, members, self._policy.cost(batch), exchanges, small_lane)
                sent += 1
            if left:  # back at the front, in queue order
                self._queue.push([taken[i] for i in sorted(left)], front=True)
                break
        return sent

    def _send(
        self,
        actor_index: int,
        plan: BatchPlan,
        members: list[QueuedItem],
        cost: float,
        exchanges: list | None,
        small_lane: bool = False,
    ) -> None:
        slot = self._actors[actor_index]
        slot.load.last_sent = self.counters.batches + 1
        self.counters.batches += 1
        if self._thread_waits_untimed:  # the dispatcher's thread must watch this batch's deadline
            self._thread_waits_untimed = False
            self._wake.notify_all()
        flight = self._flights.take_off(slot.load, actor_index, members, cost, small_lane)
        pixels = [m.pixels for m in members]

        def on_outcome(outcome: Outcome) -> None:
            self._on_outcome(flight, outcome)

        if exchanges is not None:
            exchange = slot.link.exchange(plan, pixels, on_outcome)
            if exchange is not None:
                exchanges.append(exchange)
                return
        self._registering.active = True
        try:
            slot.link.send(plan, pixels, on_outcome)
        finally:
            self._registering.active = False

    # outcomes (any thread; no Ray calls here)

    def _on_outcome(self, flight: Flight, outcome: Outcome) -> None:
        if getattr(self._registering, "active", False):
            # The outcome was known before `send` returned (its actor is gone), so this runs in
            # _send with the lock held: the dispatcher's thread finishes it.
            self._early_outcomes.append((flight, outcome))
            self._wake.notify_all()
            return
        with self._lock:
            self._finish_locked(flight, outcome)

    def _finish_locked(self, flight: Flight, outcome: Outcome) -> None:
        index = flight.actor_index
        slot = self._actors.get(index)
        if not self._flights.land(flight, slot.load if slot is not None else None):
            return  # it timed out before: its items went elsewhere already
        failed_before = self.counters.failed_calls
        if isinstance(outcome, Done) and outcome.receipt.status == OK:
            self._items.complete(flight, outcome)
        elif isinstance(outcome, Refused):
            self._actor_left(flight, f"encoder actor {index} left the pool ({outcome.reason})")
        elif isinstance(outcome, ActorGone):
            self.counters.failed_batches += 1
            self._actor_failed(index, f"encoder actor {index} died: {outcome.reason}")
            self._requeue(flight, f"encoder actor {index} died")
        else:  # the actor failed on the batch itself
            self.counters.failed_batches += 1
            self._items.batch_failed(flight, outcome)
        if self.counters.failed_calls != failed_before:
            self._queue.drop_finished_calls()
        self._forget_idle_leavers()
        self._slot_freed = True
        if self._queue:  # else the dispatcher's thread has nothing to do: waking it costs the caller
            self._wake.notify_all()

    def _actor_left(self, flight: Flight, why: str) -> None:
        """A retiring actor refused a batch (the controller knows; the membership drops it soon)."""
        slot = self._actors.get(flight.actor_index)
        if slot is not None and slot.load.accepting:
            slot.load.accepting = False
            logger.info("%s; its batches go to other actors", why)
        self._requeue(flight, why)

    def _actor_failed(self, index: int, why: str) -> None:
        """An actor died or went silent: no more batches for it, and the pool is told."""
        if index in self._failed_actors:
            return
        self._failed_actors.add(index)
        slot = self._actors.get(index)
        if slot is not None:
            slot.load.accepting = False
            slot.link.close()
        logger.warning("%s; its batches go to other actors", why)
        self._on_actor_failed(index)

    def _check_timeouts(self) -> float | None:
        """Give up on batches past their timeout; returns seconds until the next one would be."""
        late, next_in = self._flights.overdue()
        for flight in late:
            slot = self._actors.get(flight.actor_index)
            self._flights.land(flight, slot.load if slot is not None else None)
            self.counters.failed_batches += 1
            self.counters.timed_out_batches += 1
            why = (
                f"encoder actor {flight.actor_index} did not answer a batch within "
                f"{self._flights.timeout_s} s"
            )
            self._actor_failed(flight.actor_index, why)
            self._requeue(flight, why)
            self._forget_idle_leavers()
        return next_in

    def _fail_queue_if_no_actor(self) -> None:
        if not any(slot.load.accepting for slot in self._actors.values()):
            self._items.fail_queue(NO_ACTOR_LEFT)

    def _requeue(self, flight: Flight, why: str) -> None:
        self._items.requeue(flight, why, self._closed_reason if self._closed else None)
        self._fail_queue_if_no_actor()

    def _forget_idle_leavers(self) -> None:
        for index in [i for i, s in self._actors.items() if not s.load.accepting and s.load.in_flight == 0]:
            self._actors.pop(index).link.close()

    # the dispatcher's thread: window expiry and whatever completions freed room for

    def _run(self) -> None:
        with self._lock:
            while not self._closed:
                while self._early_outcomes:
                    self._finish_locked(*self._early_outcomes.pop(0))
                timeout = self._check_timeouts()
                loads = self._loads()
                if self._queue and self._has_room(loads):
                    waited = time.monotonic() - self._queue.oldest().enqueued_at
                    if self._policy.has_idle_actor(loads) or waited >= self._window_s or self._slot_freed:
                        self._slot_freed = False
                        try:
                            sent = self._dispatch()
                        except Exception:
                            logger.exception("dispatch failed")
                            self._items.fail_queue("dispatch failed; see the log")
                            continue
                        if sent:
                            continue
                        # Room only in a lane that nothing queued fits: wait for an answer or a call.
                    else:
                        window_left = self._window_s - waited
                        timeout = window_left if timeout is None else min(timeout, window_left)
                self._thread_waits_untimed = timeout is None
                self._wake.wait(timeout)


def _policy(budgets: list[Budget], settings: PoolSettings, tie_seed: int | None) -> DispatchPolicy:
    return DispatchPolicy(
        tuple(budgets),
        settings.max_batches_in_flight_per_actor,
        settings.max_tokens_per_run,
        settings.small_first_tokens,
        tie_seed,
    )
