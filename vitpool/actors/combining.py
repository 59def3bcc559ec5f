"""Batches that wait for the encoder run together, oldest first.

Every caller process packs its own batches, so an actor busy with one batch collects others,
one or two from each caller, on its connection threads and Ray's. Run one by one, they would
take the encoder in whatever order a lock grants it, each paying a full replay: under load a
small batch could wait behind many, and the p99 grows with the number of callers. Combined,
the batches that waited during one run go in the next, so an item waits for at most the run
in progress and its own, and the GPU does fewer, fuller replays.

No thread hand-off is added: the thread that finds the encoder free runs the waiting batches
itself (its own among them) and hands the others their outcomes (flat combining). A batch that
arrives at an idle encoder runs at once in its own thread, as it would without combining.

Runs overlap with the host work around them: a run is started (its work queued on the GPU) and
collected later, and the leading thread starts the next waiting group before it collects the
one in flight. So the GPU already has the next replay queued while the host turns one run's
results into outcomes and wakes its callers; a leader that leaves with a run in flight leaves it
for the next leader, one of that run's own callers, to collect.

Waiting threads are woken one by one, not all at once: each batch has its own event, set when
its outcome is in or when its thread is handed the lead. Under load an actor has dozens of
threads waiting here, and waking them all on every run makes each of them take the GIL in turn
while the leader, whose every torch call releases the GIL, waits in line behind them.

Small first (`small_tokens`): while batches of at most that many tokens wait, the next run takes
them first, oldest first, then the others strictly in order, as far as they fit; once a batch has
been passed over `max_passes` times (a run took a batch that came after it while it waited), the
run is the oldest batch and those right behind it that fit, as without small first. So a small
batch waits for the run in flight (and, with overlapping runs, the one already queued behind it)
but not for the large batches that came before it, and no batch waits for ever, however much
small work keeps coming. The run still fills up with large batches: small batches run alone pay a
replay's fixed cost each, which under load raised the medium and large calls' tails
(`benchmarks/HISTORY.md`, "Small calls under load — `benchmarks/pool_throughput.py --small-first`").

The combiner knows nothing of what it runs: in the actor, each batch is one (plan, pixels) group
and the start function is the encoder's `start_plans`, which decides which groups share a replay.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

# How often a batch may be passed over for smaller ones before it goes first.
MAX_PASSES = 4


@dataclass(eq=False)
class _Waiting:
    items: list[Any]
    tokens: int
    key: Hashable  # only batches with the same key run together (e.g. where outputs go)
    passes: int = 0  # runs that took a batch which came after this one, while this one waited
    outcomes: list[Any] | None = None
    error: BaseException | None = None
    done: bool = False
    woken: threading.Event = field(default_factory=threading.Event)  # done, or handed the lead


@dataclass
class CombiningCounters:
    runs: int = 0  # calls of the run function
    combined_batches: int = 0  # batches that shared a run with at least one other


# Collects a started run: its outcomes, one per item (may raise, for every batch of the run).
Collect = Callable[[], list[Any]]


def finished(run: Callable[[list[Any], Hashable], list[Any]]) -> Callable[[list[Any], Hashable], Collect]:
    """A start function for a run function that does all its work before it returns."""

    def start(items: list[Any], key: Hashable) -> Collect:
        outcomes = run(items, key)
        return lambda: outcomes

    return start


@dataclass
class BatchCombiner:
    """Runs batches through `start(items, key) -> collect` (collect() returns one outcome per
    item), one run started at a time, merging the batches that wait, oldest first, up to
    `max_tokens` output tokens per run. The next run is started before the last is collected.

    With `small_tokens`, batches of at most that many tokens go first, the others following in
    order, until some batch has been passed over `max_passes` times (see the module). None:
    strictly oldest first.

    A batch larger than `max_tokens` runs alone. Starting or collecting may raise: every batch of
    that run gets the error.
    """

    start: Callable[[list[Any], Hashable], Collect]
    max_tokens: int
    small_tokens: int | None = None
    max_passes: int = MAX_PASSES
    counters: CombiningCounters = field(default_factory=CombiningCounters)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: collections.deque[_Waiting] = collections.deque()
        self._running = False  # a thread leads (or has been handed the lead)
        self._in_flight: tuple[list[_Waiting], Collect] | None = None  # started, not yet collected

    def __call__(self, items: list[Any], tokens: int, key: Hashable = None) -> list[Any]:
        """The outcomes of `items` (`tokens` output tokens in all), once they have run."""
        mine = _Waiting(list(items), tokens, key)
        with self._lock:
            self._waiting.append(mine)
            leading, self._running = not self._running, True
        if not leading:
            mine.woken.wait()
        if not mine.done:  # this thread leads: the encoder was free, or the lead was handed to it
            try:
                while not mine.done:  # mine waits, or is in flight
                    with self._lock:
                        group = self._take_group() if self._waiting else None
                        in_flight, self._in_flight = self._in_flight, None
                    started = None if group is None else self._start_group(group)
                    if in_flight is not None:
                        self._collect(*in_flight)
                    with self._lock:
                        self._in_flight = started
            finally:
                self._hand_over_the_lead()
        if mine.error is not None:
            raise mine.error
        return mine.outcomes  # type: ignore[return-value]  # set with done

    def _hand_over_the_lead(self) -> None:
        """Wake one thread to lead next: the oldest waiting batch's, else one whose batch is in
        flight (it collects it); with neither, the encoder is free."""
        with self._lock:
            if self._waiting:
                successor: _Waiting | None = self._waiting[0]
            elif self._in_flight is not None:
                successor = self._in_flight[0][0]
            else:
                successor = None
            self._running = successor is not None
        if successor is not None:
            successor.woken.set()

    def _take_group(self) -> list[_Waiting]:
        """The batches of the next run, taken from those waiting: with `small_tokens`, small
        first; else the oldest and those right behind it that fit (strictly in order, so a large
        batch is never passed over for ever)."""
        if self.small_tokens is None:
            group = in_order_group(self._waiting, self.max_tokens)
        else:
            group = small_first_group(self._waiting, self.max_tokens, self.small_tokens, self.max_passes)
        taken = set(group)
        self._waiting = collections.deque(w for w in self._waiting if w not in taken)
        return group

    def _start_group(self, group: list[_Waiting]) -> tuple[list[_Waiting], Collect] | None:
        """Start the group's run; None if starting failed (its batches got the error)."""
        with self._lock:
            self.counters.runs += 1
            if len(group) > 1:
                self.counters.combined_batches += len(group)
        try:
            return group, self.start([item for waiting in group for item in waiting.items], group[0].key)
        except BaseException as raised:  # noqa: BLE001 - every batch of the run gets it; each thread raises its own
            self._settle(group, [], raised)
            return None

    def _collect(self, group: list[_Waiting], collect: Collect) -> None:
        try:
            outcomes = collect()
        except BaseException as raised:  # noqa: BLE001 - as in _start_group
            self._settle(group, [], raised)
            return
        self._settle(group, outcomes, None)

    def _settle(self, group: list[_Waiting], outcomes: list[Any], error: BaseException | None) -> None:
        with self._lock:
            offset = 0
            for waiting in group:
                if error is None:
                    waiting.outcomes = outcomes[offset : offset + len(waiting.items)]
                    offset += len(waiting.items)
                waiting.error = error
                waiting.done = True
        for waiting in group:
            waiting.woken.set()


def small_first_group(
    waiting: Sequence[_Waiting], max_tokens: int, small_tokens: int, max_passes: int
) -> list[_Waiting]:
    """The next run's batches of `waiting` (oldest first; not empty): the batches of at most
    `small_tokens` tokens, oldest first, then the others in order, as far as they fit `max_tokens`
    (those of the first one's key); or, where none is small or some batch has been passed over
    `max_passes` times, the oldest batch and those right behind it that fit. Counts a pass for
    every batch left behind that came before one taken."""
    small = [w for w in waiting if w.tokens <= small_tokens]
    if not small or any(w.passes >= max_passes for w in waiting):
        return in_order_group(waiting, max_tokens)
    group, tokens = [small[0]], small[0].tokens  # taken even if larger than max_tokens: it runs alone
    for candidate in small[1:]:
        if candidate.key != small[0].key or tokens + candidate.tokens > max_tokens:
            break  # in order: the next run takes it
        group.append(candidate)
        tokens += candidate.tokens
    for following in waiting:  # the others, strictly in order, as far as they fit
        if following.tokens <= small_tokens:
            continue
        if following.key != group[0].key or tokens + following.tokens > max_tokens:
            break
        group.append(following)
        tokens += following.tokens
    taken = set(group)  # _Waiting compares by identity
    last_taken = max(position for position, w in enumerate(waiting) if w in taken)
    for position, w in enumerate(waiting):
        if position < last_taken and w not in taken:
            w.passes += 1
    return group


def in_order_group(waiting: Sequence[_Waiting], max_tokens: int) -> list[_Waiting]:
    """The oldest waiting batch and those right after it that fit beside it, of its key."""
    group, tokens = [waiting[0]], waiting[0].tokens
    for following in list(waiting)[1:]:
        if following.key != group[0].key or tokens + following.tokens > max_tokens:
            break
        group.append(following)
        tokens += following.tokens
    return group
