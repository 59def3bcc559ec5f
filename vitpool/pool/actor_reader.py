"""The controller's one reader of its actors' stats (`ActorReader`): each consumer (its own
bookkeeping and liveness check, the metrics, the autoscaler) gets readings at its own interval,
all from one thread that asks each actor once per reading.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vitpool.actors.reports import ActorStats

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ActorReading:
    """One reading of the pool's active actors, each asked for its stats once."""

    actors: tuple[int, ...]  # the active actors asked, by index
    stats: dict[int, ActorStats]  # by index, of those that answered in time
    dead: tuple[int, ...] = ()  # those that Ray says have died


@dataclass(eq=False)  # identity: the consumers due are picked from the list
class _Consumer:
    name: str
    interval_s: float
    timeout_s: float
    take: Callable[[ActorReading], None]
    every_reading: bool
    next_due_s: float
    failed_before: bool = False


class ActorReader:
    """The controller's one reader of its actors' stats, for each consumer at its own interval.

    A reading asks each active actor for its stats once and waits for the answers up to the
    longest `timeout_s` of the consumers it serves; an actor that answers later is neither asked nor
    waited for again until it has (a hung actor holds up one reading, not each), and its answer goes
    into the reading after it came. A reading is taken when the soonest
    consumer is due, and serves every consumer due within half the shortest interval: readings
    come at the shortest interval, and a consumer with a longer one takes the reading nearest each
    of its due times (its own interval on average, each one within half the shortest of it). With N
    active actors that is at most N Ray calls per shortest interval, however many consumers.
    Consumers run on the reader's thread, one after another.

    Args:
        actors: the active actors' handles by index.
        name: the thread's name.
        clock: seconds, for the consumers' due times (a test's own clock).
    """

    def __init__(
        self,
        actors: Callable[[], dict[int, Any]],
        name: str = "vitpool-actor-reader",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._actors, self._clock = actors, clock
        self._consumers: list[_Consumer] = []
        self._unanswered: dict[int, Any] = {}  # actor index -> its stats call, not answered yet
        self._lock = threading.Lock()  # guards the list of consumers
        self._wake = threading.Event()
        self._closed = False
        self._failed_before = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def add(
        self,
        name: str,
        interval_s: float,
        take: Callable[[ActorReading], None],
        timeout_s: float | None = None,
        every_reading: bool = False,
    ) -> None:
        """Hand `take` a reading every `interval_s`, the first one interval from now, with the
        actors' answers waited for up to `timeout_s` (default `interval_s`); with `every_reading`,
        the readings taken for other consumers in between too."""
        with self._lock:
            self._consumers.append(
                _Consumer(
                    name,
                    interval_s,
                    interval_s if timeout_s is None else timeout_s,
                    take,
                    every_reading,
                    self._clock() + interval_s,
                )
            )
        self._wake.set()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop, after the reading under way (waiting at most `timeout_s` for it)."""
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=timeout_s)

    def read(self, timeout_s: float) -> ActorReading:
        """Ask every active actor for its stats, but those still to answer the last asking, and
        wait up to `timeout_s` for the answers to this asking."""
        import ray

        actors = self._actors()
        self._unanswered = {index: ref for index, ref in self._unanswered.items() if index in actors}
        asked = []
        for index, handle in actors.items():
            if index not in self._unanswered:
                self._unanswered[index] = handle.stats.remote()
                asked.append(self._unanswered[index])
        if asked:
            ray.wait(asked, num_returns=len(asked), timeout=timeout_s)
        refs = list(self._unanswered.values())
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) if refs else set()
        stats, dead = {}, []
        for index, ref in list(self._unanswered.items()):
            if ref not in ready:
                continue
            del self._unanswered[index]
            try:
                stats[index] = ray.get(ref)
            except ray.exceptions.ActorUnavailableError:
                continue  # unreachable for now, maybe back soon
            except ray.exceptions.RayActorError:
                dead.append(index)
            except ray.exceptions.RayError:
                continue  # its stats failed: asked again at the next reading
        return ActorReading(tuple(actors), stats, tuple(dead))

    def soonest_due_s(self) -> float | None:
        """When the next reading is due (on the reader's clock); None without consumers."""
        with self._lock:
            return min((consumer.next_due_s for consumer in self._consumers), default=None)

    def _run(self) -> None:
        while not self._closed:
            soonest = self.soonest_due_s()
            self._wake.wait(None if soonest is None else max(0.0, soonest - self._clock()))
            self._wake.clear()  # an `add` after this is seen by the next loop's look at the list
            if not self._closed:
                self._serve_due()

    def _serve_due(self) -> None:
        now = self._clock()
        with self._lock:
            consumers = list(self._consumers)
        slack_s = min((consumer.interval_s for consumer in consumers), default=0.0) / 2
        due = [consumer for consumer in consumers if consumer.next_due_s <= now + slack_s]
        if not due:
            return
        try:
            reading = self.read(max(consumer.timeout_s for consumer in due))
        except Exception:  # a reading that fails must never take the pool down
            # said once as a warning (a reader that always fails would otherwise go unseen)
            logger.log(
                logging.DEBUG if self._failed_before else logging.WARNING,
                "reading the encoder actors' stats failed",
                exc_info=True,
            )
            self._failed_before = True
            reading = None
        for consumer in consumers:
            if reading is not None and (consumer in due or consumer.every_reading):
                _hand(consumer, reading)
        finished = self._clock()
        for consumer in due:
            consumer.next_due_s += consumer.interval_s
            if (
                consumer.next_due_s <= finished
            ):  # the reading and its use outlasted an interval: a whole one from now
                consumer.next_due_s = finished + consumer.interval_s


def _hand(consumer: _Consumer, reading: ActorReading) -> None:
    try:
        consumer.take(reading)
    except Exception:  # a consumer that fails must never stop the others, or the reader
        level = logging.DEBUG if consumer.failed_before else logging.WARNING  # said once as a warning
        logger.log(level, "the %s failed on a reading of the encoder actors", consumer.name, exc_info=True)
        consumer.failed_before = True
