"""Which items go together and to which actor: the dispatcher's policy, apart from its mechanism.

Pure Python on plain values (no Ray, no threads), so that it is tested with fake actors in
milliseconds, like Ray Serve's request routers. The dispatcher asks it two things:

- `plan`: how a run of queued items (oldest first) is packed into batches, each in the smallest
  budget that holds it, oldest batch first;
- `choose_actor`: which actor takes the next batch: of those accepting work with a free slot,
  the one with the least outstanding estimated cost (patches plus attention's quadratic term).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from vitpool.packing import SEQUENCES, Batch, Budget, batch_cost, pack
from vitpool.specs import ItemSpec


@dataclass
class ActorLoad:
    """What the policy knows of one actor."""

    accepting: bool = True
    in_flight: int = 0  # batches sent and not yet answered
    outstanding_cost: float = 0.0  # their estimated cost, in token units


@dataclass(frozen=True)
class DispatchPolicy:
    """Args:
        budgets: the budgets every actor captured.
        max_in_flight: batches an actor may hold unanswered.
        max_tokens_per_run: the most output tokens several items share in one batch (None: the
            largest budget).
    """

    budgets: tuple[Budget, ...]
    max_in_flight: int
    max_tokens_per_run: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "budgets", tuple(sorted(self.budgets)))  # once: plan runs on every dispatch

    @property
    def largest(self) -> Budget:
        return self.budgets[-1]

    def plan(self, specs: Sequence[ItemSpec]) -> list[Batch]:
        """Batches of `specs` (indices into it), the one holding the oldest item first."""
        batches = pack(specs, self.budgets, self.max_tokens_per_run, budgets_sorted=True)
        return sorted(batches, key=lambda batch: min(batch.item_indices))

    def room(self, free_slots: int) -> tuple[int, int]:
        """(tokens, items) that `free_slots` full batches hold: how much of the queue to plan at
        once (packing a whole long queue on every dispatch would cost more than it gains)."""
        largest = self.largest
        return free_slots * largest.num_tokens, free_slots * largest.max_items

    def cost(self, batch: Batch) -> float:
        """A batch's estimated cost: a graph computes its whole budget, padding included."""
        tokens = batch.budget.num_tokens if batch.budget is not None else batch.num_tokens
        return batch_cost(tokens, batch.need(SEQUENCES) or len(batch.item_indices))

    def free_slots(self, loads: Mapping[int, ActorLoad]) -> int:
        """Batches the accepting actors can take now."""
        return sum(self.max_in_flight - load.in_flight for load in loads.values() if load.accepting)

    def has_idle_actor(self, loads: Mapping[int, ActorLoad]) -> bool:
        """Whether an accepting actor has nothing in flight (items then go at once, unbatched)."""
        return any(load.accepting and load.in_flight == 0 for load in loads.values())

    def choose_actor(self, loads: Mapping[int, ActorLoad]) -> int | None:
        """The accepting actor with a free slot and the least outstanding cost (lowest index on a
        tie), or None when none has room."""
        candidates = [
            (load.outstanding_cost, index)
            for index, load in loads.items()
            if load.accepting and load.in_flight < self.max_in_flight
        ]
        return min(candidates)[1] if candidates else None
