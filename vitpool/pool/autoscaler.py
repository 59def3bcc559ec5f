"""Autoscaling (`autoscale=(min_actors, max_actors)`): the controller adds an actor while its
actors stay busy and retires one while they stay idle, through the same `scale` that users call
(a retired actor finishes its batches first, so no item is lost or run twice).

The signal is each actor's busy fraction over the last interval (the share of it with a batch
running, `ActorStats.busy_fraction_since`), from the readings of the controller's one reader of
its actors (`vitpool.pool.actor_reader.ActorReader`), one every `autoscale_interval_s`: a pool whose
callers queue work keeps every actor busy, so the callers' queues need not be read. Hysteresis: up after
`UP_READINGS` readings in a row with the mean at or above `UP_BUSY`, down after `DOWN_READINGS`
in a row at or below `DOWN_BUSY`, and the count starts again after every change and while an
actor is starting. On a cluster with Ray's autoscaler, the pool asks for the resources of the
actors it wants (`ray.autoscaler.sdk.request_resources`), so that nodes come up for them; an
actor is started only where the cluster has room for it now.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vitpool.actors.reports import ActorStats
from vitpool.errors import ConfigError
from vitpool.pool.actor_reader import ActorReading

logger = logging.getLogger(__name__)

UP_BUSY, UP_READINGS = 0.75, 3
DOWN_BUSY, DOWN_READINGS = 0.25, 12
# How many intervals a reading waits for the actors' stats: a busy actor may answer late, and a
# reading without any answer starts the hysteresis' count again.
READING_TIMEOUT_INTERVALS = 4


def checked_bounds(autoscale: Any) -> tuple[int, int] | None:
    """`autoscale` as (min_actors, max_actors), or None.

    Raises:
        ConfigError: not two integers with 1 <= min <= max.
    """
    if autoscale is None:
        return None
    try:
        low, high = autoscale
    except (TypeError, ValueError):
        raise ConfigError(f"autoscale must be (min_actors, max_actors); got {autoscale!r}") from None
    for value in (low, high):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"autoscale must be two integers (min_actors, max_actors); got {autoscale!r}")
    if not 1 <= low <= high:
        raise ConfigError(f"autoscale needs 1 <= min_actors <= max_actors; got {autoscale!r}")
    return low, high


@dataclass
class AutoscalePolicy:
    """The decision, apart from Ray: fed one reading per interval, it says +1, -1 or 0."""

    min_actors: int
    max_actors: int
    high_readings: int = field(default=0, init=False)
    low_readings: int = field(default=0, init=False)

    def decide(self, busy_fractions: Sequence[float], num_actors: int, starting: int) -> int:
        """How many actors to add (1) or retire (-1) after this reading of the active actors'
        busy fractions, with `starting` actors on their way."""
        if num_actors < self.min_actors and starting == 0:
            return self._changed(1)
        if starting or not busy_fractions:
            self.high_readings = self.low_readings = 0
            return 0
        mean = sum(busy_fractions) / len(busy_fractions)
        self.high_readings = self.high_readings + 1 if mean >= UP_BUSY else 0
        self.low_readings = self.low_readings + 1 if mean <= DOWN_BUSY else 0
        if self.high_readings >= UP_READINGS and num_actors < self.max_actors:
            return self._changed(1)
        if self.low_readings >= DOWN_READINGS and num_actors > self.min_actors:
            return self._changed(-1)
        return 0

    def _changed(self, step: int) -> int:
        self.high_readings = self.low_readings = 0
        return step


class Autoscaler:
    """The controller's autoscaling, one decision per reading of the actors it is handed (every
    `autoscale_interval_s`, by the controller's `ActorReader`).

    Args:
        policy: the decision.
        starting: how many actors are starting.
        scale: the controller's `scale_to(n)`: start or retire actors.
        actor_resources: one actor's Ray resources (e.g. {"GPU": 1, "CPU": 1}).
    """

    def __init__(
        self,
        policy: AutoscalePolicy,
        starting: Callable[[], int],
        scale: Callable[[int], None],
        actor_resources: dict[str, float],
    ) -> None:
        self.policy, self._starting, self._scale = policy, starting, scale
        self._resources = {name: amount for name, amount in actor_resources.items() if amount}
        self._seen: dict[int, ActorStats] = {}  # index -> its stats at the last reading
        self._waiting_for_room = False
        self.scale_ups = self.scale_downs = 0

    def take(self, reading: ActorReading) -> None:
        """Decide on one reading: an actor's busy fraction counts from its second reading on (the
        first would span its start)."""
        busy = []
        for index, stats in reading.stats.items():
            fraction = stats.busy_fraction_since(self._seen[index]) if index in self._seen else None
            if fraction is not None:
                busy.append(fraction)
            self._seen[index] = stats
        self._seen = {index: seen for index, seen in self._seen.items() if index in reading.actors}
        num_actors = len(reading.actors)
        step = self.policy.decide(busy, num_actors, self._starting())
        if step > 0:
            self._grow(num_actors)
        elif step < 0:
            self.scale_downs += 1
            logger.info(
                "autoscaling: actors idle (%s busy); %d -> %d", _fractions(busy), num_actors, num_actors - 1
            )
            self._request(num_actors - 1)
            self._scale(num_actors - 1)

    def _grow(self, current: int) -> None:
        import ray

        wanted = current + 1
        self._request(wanted)
        free = ray.available_resources()
        if any(free.get(name, 0.0) + 1e-9 < amount for name, amount in self._resources.items()):
            if not self._waiting_for_room:
                logger.warning(
                    "autoscaling: actors busy, but the cluster has no room for another (%s free)", free
                )
            self._waiting_for_room = True
            return
        self._waiting_for_room = False
        self.scale_ups += 1
        logger.info("autoscaling: actors busy; %d -> %d", current, wanted)
        self._scale(wanted)

    def _request(self, num_actors: int) -> None:
        """Ask Ray's autoscaler, where the cluster has one, for room for `num_actors` actors (the
        request replaces the last; elsewhere it changes nothing)."""
        try:
            from ray.autoscaler.sdk import request_resources

            request_resources(bundles=[dict(self._resources) for _ in range(num_actors)])
        except Exception as error:  # noqa: BLE001 - no autoscaler API here: the room check decides
            logger.debug("request_resources failed: %s", error)


def _fractions(values: Sequence[float]) -> str:
    return ", ".join(f"{value:.0%}" for value in values) or "none"
