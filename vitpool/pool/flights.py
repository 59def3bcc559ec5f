"""The batches a caller's dispatcher has in flight (`vitpool.pool.dispatcher`, whose lock is held
for all of it). Each holds a slot, and its cost, at its actor from its send until it is answered or
given up; it is given up once `batch_timeout_s` old, as one whose actor died is.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from vitpool.pool.calls import QueuedItem
from vitpool.pool.policy import ActorLoad


@dataclass(eq=False)  # identity: a flight is tracked in a set
class Flight:
    """A batch sent to an actor and not yet answered (or given up)."""

    actor_index: int
    members: list[QueuedItem]
    cost: float
    small_lane: bool = False  # in its actor's small lane (`vitpool.pool.policy`)
    sent_at: float = field(default_factory=time.monotonic)


class Flights:
    """One dispatcher's batches in flight."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._flying: set[Flight] = set()

    def __iter__(self) -> Iterator[Flight]:
        return iter(self._flying)

    def take_off(
        self, load: ActorLoad, actor_index: int, members: list[QueuedItem], cost: float, small_lane: bool
    ) -> Flight:
        """A batch sent: it holds a slot of its actor (`load`; in the small lane, `small_lane`)."""
        load.in_flight += 1
        load.small_in_flight += small_lane
        load.outstanding_cost += cost
        flight = Flight(actor_index, members, cost, small_lane)
        self._flying.add(flight)
        return flight

    def land(self, flight: Flight, load: ActorLoad | None) -> bool:
        """A flight answered or given up: its slot and cost are free again at its actor (`load`;
        None for an actor no longer in the dispatcher's list). False for one given up before."""
        if flight not in self._flying:
            return False
        self._flying.discard(flight)
        if load is not None:
            load.in_flight -= 1
            load.small_in_flight -= flight.small_lane
            load.outstanding_cost -= flight.cost
        return True

    def overdue(self) -> tuple[list[Flight], float | None]:
        """The flights past their timeout, and the seconds until the next of the others would be
        (None: no other)."""
        now = time.monotonic()
        late, next_deadline = [], None
        for flight in self._flying:
            deadline = flight.sent_at + self.timeout_s
            if deadline <= now:
                late.append(flight)
            elif next_deadline is None or deadline < next_deadline:
                next_deadline = deadline
        return late, None if next_deadline is None else next_deadline - now
