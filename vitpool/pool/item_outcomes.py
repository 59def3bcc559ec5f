"""What a batch's outcome means for its items and their calls, in a caller's dispatcher
(`vitpool.pool.dispatcher`, whose lock is held for all of it).

An item's result goes to its call's slot. An item's failure (bad pixels found by the actor, a
failed batch, too many sends, no actor left) fails its call, or, for a call made with
`return_exceptions`, fills the item's slot. The items of a batch lost with its actor (it died,
left the pool or went silent) go back to the front of the queue, until an item has been sent
`max_attempts_per_item` times.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

from vitpool.errors import EncodeError, InvalidItemError, PoolUnavailableError, counted
from vitpool.pool.calls import Call, QueuedItem
from vitpool.pool.flights import Flight
from vitpool.pool.item_queue import ItemQueue
from vitpool.pool.stats import CallerCounters
from vitpool.transport.link import BatchFailed, Done, Outcome

_LATENCY_SAMPLES = 4096


@dataclass
class DispatchCounters(CallerCounters):
    """What this process's dispatcher has seen: the handle's counters (`CallerCounters`, defined
    with `PoolStats`), and the completed calls its latency and rate figures come from."""

    completed_calls: int = 0
    latencies_s: collections.deque = field(default_factory=lambda: collections.deque(maxlen=_LATENCY_SAMPLES))
    completions: collections.deque = field(default_factory=lambda: collections.deque(maxlen=_LATENCY_SAMPLES))


class ItemOutcomes:
    """Records what happens to queued and sent items, in the dispatcher's `counters`; items sent
    again go to the front of its `queue`."""

    def __init__(self, queue: ItemQueue, counters: DispatchCounters, max_attempts: int) -> None:
        self._queue = queue
        self._counters = counters
        self._max_attempts = max_attempts

    def complete(self, flight: Flight, outcome: Done) -> None:
        """The actor encoded the batch: each item's result, or the error it found in the item."""
        self._counters.channel_batches += outcome.through_channel
        for position, member in enumerate(flight.members):
            reason = outcome.receipt.item_errors.get(position)
            if reason is not None:
                self._counters.rejected_items += 1
                self.fail_item(member, InvalidItemError(member.index, reason))
            else:
                self.item_done(member.call, member.index, outcome.values[position], member.part)
        self._counters.items += len(flight.members)
        self._counters.tokens += sum(member.spec.num_tokens for member in flight.members)

    def batch_failed(self, flight: Flight, outcome: Outcome) -> None:
        """The actor failed on the batch itself: each of its items fails with that error."""
        cause = (
            outcome.error
            if isinstance(outcome, BatchFailed)
            else RuntimeError(f"unexpected outcome {outcome!r}")
        )
        for member in flight.members:
            failure = EncodeError(
                f"item {member.index}: encoder actor {flight.actor_index} failed on its batch: {cause}"
            )
            failure.__cause__ = cause
            self.fail_item(member, failure)

    def item_done(self, call: Call, index: int, value: object, part: int = 0) -> None:
        """Record one item's outcome (a result, or an error for a call that returns them)."""
        if call.complete_item(index, value, part):
            now = time.monotonic()
            self._counters.completed_calls += 1
            self._counters.latencies_s.append(now - call.submitted_at)
            self._counters.completions.append((now, len(call.results)))

    def fail_item(self, item: QueuedItem, error: BaseException) -> None:
        """One item failed: its slot holds the error where its call returns exceptions; else its
        call fails."""
        if item.call.return_exceptions:
            self.item_done(item.call, item.index, error)
        else:
            self.fail_call(item.call, error)

    def fail_call(self, call: Call, error: BaseException) -> None:
        """Fail a call once: its first error wins and is the one counted."""
        if not call.done:
            self._counters.failed_calls += 1
            call.fail(error)

    def requeue(self, flight: Flight, why: str, closed_reason: str | None) -> None:
        """A batch was lost with its actor (`why`): its items go back to the front of the queue,
        or fail, those sent too often and all of them once the dispatcher is closed
        (`closed_reason`; None while it is open)."""
        requeued = []
        for member in flight.members:
            if member.call.done:
                continue
            if closed_reason is not None:  # nothing dispatches any more
                error = PoolUnavailableError(f"item {member.index}: {closed_reason} ({why})")
                self.fail_item(member, error)
                continue
            member.attempts += 1
            if member.attempts >= self._max_attempts:
                error = PoolUnavailableError(
                    f"item {member.index} was sent {counted(member.attempts, 'time')}: {why}"
                )
                self.fail_item(member, error)
            else:
                requeued.append(member)
        self._counters.requeued_items += len(requeued)
        self._queue.push(requeued, front=True)  # already accepted: the bound does not apply

    def fail_queue(self, reason: str) -> None:
        """Fail every queued item with a PoolUnavailableError: `reason`, naming the item where its
        call returns exceptions (the call's other items may still succeed)."""
        failed = self._queue.clear()
        for item in failed:
            message = f"item {item.index}: {reason}" if item.call.return_exceptions else reason
            self.fail_item(item, PoolUnavailableError(message))
