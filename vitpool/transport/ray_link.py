"""The Ray call to an encoder actor, as an `ActorLink`: works from any node.

The batch is one actor call, `encode_batch(plan, *pixels)`, with one return value per item (a
reference to its Embedding, or to None for a failed item) and a last one for the receipt. Only
the small receipt is watched (its future's callback); the values stay references, for the caller
to fetch or to pass on. The link puts nothing itself: pixels given as NumPy arrays go into the
object store with the call, references are passed as they are.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any

import ray

from vitpool.specs import BatchPlan
from vitpool.transport.link import (
    OK,
    RETIRED,
    ActorGone,
    BatchFailed,
    Done,
    Outcome,
    OutcomeCallback,
    Refused,
)

logger = logging.getLogger(__name__)

# Errors that mean the actor is gone (or going), not that the batch was bad: send it elsewhere.
ACTOR_GONE_ERRORS = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


class RayLink:
    """Batches to one actor as Ray calls.

    Args:
        handle: the actor's Ray handle (its class has `encode_batch(plan, *pixels)`).
        name: the actor in messages, e.g. "encoder actor 3".
    """

    is_local = False  # pixels may be references: nothing here needs them as arrays

    def __init__(self, handle: Any, name: str = "the encoder actor") -> None:
        self._handle = handle
        self._name = name

    def send(self, plan: BatchPlan, pixels: list[Any], on_outcome: OutcomeCallback) -> None:
        """Call the actor; `on_outcome` gets the outcome from Ray's callback thread.

        When the call is over before its callback is added (the actor was already known dead),
        Ray runs the callback at once: `on_outcome` then runs inside this `send`, in the caller's
        thread. A caller that holds a lock while sending must expect that.
        """
        try:
            refs = self._handle.encode_batch.options(num_returns=len(plan.specs) + 1).remote(plan, *pixels)
            receipt_future: Future = refs[-1].future()
        except Exception as error:  # noqa: BLE001 - failing to call is the batch's outcome
            on_outcome(self._outcome_of_error(error))
            return
        values = list(refs[:-1])
        receipt_future.add_done_callback(lambda future: on_outcome(self._outcome_of(values, future)))

    def exchange(self, plan: BatchPlan, pixels: list[Any], on_outcome: OutcomeCallback) -> None:
        """A Ray call has nothing for the calling thread to carry (None): use `send`."""

    def close(self) -> None:
        """Nothing to close: calls in flight finish on their own."""

    def _outcome_of(self, values: list[Any], future: Future) -> Outcome:
        try:
            receipt = future.result()
        except Exception as error:  # noqa: BLE001 - handed on as the batch's outcome
            return self._outcome_of_error(error)
        status = getattr(receipt, "status", None)
        if status == OK:
            return Done(values, receipt)
        if status == RETIRED:
            return Refused(f"{self._name} is leaving the pool")
        return BatchFailed(RuntimeError(f"{self._name} answered a batch with {receipt!r}, not a receipt"))

    def _outcome_of_error(self, error: Exception) -> Outcome:
        if isinstance(error, ACTOR_GONE_ERRORS):
            return ActorGone(f"{self._name} is gone: {error}")
        return BatchFailed(error)
