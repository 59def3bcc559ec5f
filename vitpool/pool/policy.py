"""Which items go together and to which actor: the dispatcher's policy, apart from its mechanism.

Pure Python on plain values (no Ray, no threads), so that it is tested with fake actors in
milliseconds, like Ray Serve's request routers. The dispatcher asks it two things:

- `plan`: how a run of queued items (oldest first) is packed into batches, each in the smallest
  budget that holds it, oldest batch first;
- `choose_actor`: which actor takes the next batch: of those accepting work with a free slot,
  the one with the least outstanding estimated cost (patches plus attention's quadratic term).

Small first (`small_tokens`): a call of at most that many output tokens in all is small. Its
items are packed apart from other calls' items, in batches of at most `small_tokens` tokens, and
each actor has a lane of `max_in_flight` slots for small batches beside its `max_in_flight` slots
for any batch (a small batch takes a slot of its lane where one is free, else one of the other
lane, oldest first, like any batch). So a small call never waits in its caller's queue behind
large batches (with one lane, a caller whose slots held two large batches kept its small items
queued until one of them came back), nor rides in a large batch (first-fit packing put small
items in large batches' gaps), and large batches keep their lane as it was. The actor then runs
waiting small batches before larger ones (`vitpool.actors.combining`).
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
    in_flight: int = 0  # batches sent and not yet answered, in either lane
    small_in_flight: int = 0  # of those, the ones in the small lane
    outstanding_cost: float = 0.0  # their estimated cost, in token units
    last_sent: int = 0  # when this dispatcher last sent it a batch (its count of batches sent then; 0: never)


@dataclass(frozen=True)
class DispatchPolicy:
    """Args:
    budgets: the budgets every actor captured.
    max_in_flight: batches an actor may hold unanswered (besides its small lane's, with
        `small_tokens`).
    max_tokens_per_run: the most output tokens several items share in one batch (None: the
        largest budget).
    small_tokens: calls of at most this many output tokens go small first (see the module);
        None: one lane, oldest batch first.
    tie_seed: orders actors that tie on cost: each caller process's dispatcher draws its
        own, so that callers, which each see only their own batches, do not all pile onto
        the lowest-numbered actors of a large pool. None: the lowest index wins a tie.
    """

    budgets: tuple[Budget, ...]
    max_in_flight: int
    max_tokens_per_run: int | None = None
    small_tokens: int | None = None
    tie_seed: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "budgets", tuple(sorted(self.budgets)))  # once: plan runs on every dispatch

    @property
    def largest(self) -> Budget:
        return self.budgets[-1]

    def plan(self, specs: Sequence[ItemSpec], small: Sequence[bool] | None = None) -> list[Batch]:
        """Batches of `specs` (indices into it), the one holding the oldest item first; with
        `small_tokens`, the items whose `small` flag is set (those of small calls) in batches of
        their own."""
        if self.small_tokens is None or small is None or not any(small):
            batches = pack(specs, self.budgets, self.max_tokens_per_run, budgets_sorted=True)
        else:
            apart = [i for i in range(len(specs)) if small[i]]
            others = [i for i in range(len(specs)) if not small[i]]
            small_cap = min(self.small_tokens, self.max_tokens_per_run or self.small_tokens)
            batches = self._pack_part(specs, apart, small_cap) + self._pack_part(
                specs, others, self.max_tokens_per_run
            )
        return sorted(batches, key=lambda batch: min(batch.item_indices))

    def _pack_part(
        self, specs: Sequence[ItemSpec], indices: list[int], max_tokens: int | None
    ) -> list[Batch]:
        """`pack` of `specs[i] for i in indices`, numbered as in `specs`."""
        if not indices:
            return []
        batches = pack([specs[i] for i in indices], self.budgets, max_tokens, budgets_sorted=True)
        return [
            Batch(tuple(indices[i] for i in batch.item_indices), batch.budget, batch.num_tokens, batch.needs)
            for batch in batches
        ]

    def is_small(self, batch: Batch, small: Sequence[bool]) -> bool:
        """Whether `batch` (of a plan made with these `small` flags) may take a slot of the small
        lane: it holds items of small calls only."""
        return (
            self.small_tokens is not None
            and batch.budget is not None
            and all(small[i] for i in batch.item_indices)
        )

    @property
    def small_lane_slots(self) -> int:
        """Slots of each actor's small lane (0 without small first)."""
        return 0 if self.small_tokens is None else self.max_in_flight

    def room(self, free_slots: int, free_small_slots: int = 0) -> tuple[int, int]:
        """(tokens, items) of the queue to plan at once (packing a whole long queue on every
        dispatch would cost more than it gains): what `free_slots` full batches hold, and while
        the small lane has room, `max_in_flight` full batches more, to find small items queued
        behind large ones."""
        largest = self.largest
        slots = free_slots + (self.max_in_flight if free_small_slots > 0 else 0)
        return slots * largest.num_tokens, slots * largest.max_items

    def cost(self, batch: Batch) -> float:
        """A batch's estimated cost: a graph computes its whole budget, padding included."""
        tokens = batch.budget.num_tokens if batch.budget is not None else batch.num_tokens
        return batch_cost(tokens, batch.need(SEQUENCES) or len(batch.item_indices))

    def free_slots(self, loads: Mapping[int, ActorLoad]) -> int:
        """Batches of any size the accepting actors can take now."""
        return sum(self.max_in_flight - _large_in_flight(load) for load in loads.values() if load.accepting)

    def free_small_slots(self, loads: Mapping[int, ActorLoad]) -> int:
        """Small batches the accepting actors' small lanes can take now (0 without small first)."""
        return sum(self.small_lane_slots - load.small_in_flight for load in loads.values() if load.accepting)

    def has_idle_actor(self, loads: Mapping[int, ActorLoad]) -> bool:
        """Whether an accepting actor has nothing in flight (items then go at once, unbatched)."""
        return any(load.accepting and load.in_flight == 0 for load in loads.values())

    def choose_actor(self, loads: Mapping[int, ActorLoad], small: bool = False) -> int | None:
        """The accepting actor with a free slot and the least outstanding cost, or None when none
        has room. A `small` batch looks in the small lanes first. Among actors of equal cost the
        one sent a batch least recently wins (then `tie_seed`'s order): a caller whose calls come
        one at a time, each finding every actor idle, spreads them over all actors, so an actor
        that joined (a standby that took over, a scale-up) gets work at once."""
        lanes = [True, False] if small and self.small_tokens is not None else [False]
        for small_lane in lanes:
            candidates = [
                (load.outstanding_cost, load.last_sent, self._tie_rank(index), index)
                for index, load in loads.items()
                if load.accepting and self._lane_has_room(load, small_lane)
            ]
            if candidates:
                return min(candidates)[-1]
        return None

    def _tie_rank(self, index: int) -> int:
        return index if self.tie_seed is None else hash((self.tie_seed, index))

    def takes_in_small_lane(self, load: ActorLoad, small: bool) -> bool:
        """Whether a batch (`small` or not) sent to this actor goes in its small lane."""
        return small and self.small_tokens is not None and self._lane_has_room(load, True)

    def _lane_has_room(self, load: ActorLoad, small_lane: bool) -> bool:
        if small_lane:
            return load.small_in_flight < self.small_lane_slots
        return _large_in_flight(load) < self.max_in_flight


def _large_in_flight(load: ActorLoad) -> int:
    """Batches in flight in the lane for any batch."""
    return load.in_flight - load.small_in_flight
