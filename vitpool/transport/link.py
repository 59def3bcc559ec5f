"""The seam between the dispatcher and an encoder actor: one `ActorLink` per actor, and the
outcomes a batch can have.

A link sends one planned batch (its `BatchPlan` and one pixel array, or object reference, per
item) and reports exactly one outcome for it:

- `Done`: the actor ran the batch; `values` holds per item an `Embedding` (same-node channel),
  a Ray reference to one (Ray call), or None where `receipt.item_errors` names the item's error.
- `Refused`: the actor is leaving the pool and ran nothing; send the items elsewhere.
- `ActorGone`: the actor died (or its process is unreachable); send the items elsewhere.
- `BatchFailed`: the actor failed on the batch as a whole; fail its calls.

Timing out is the dispatcher's business. How the batch travels (shared memory on the same
node, a Ray call otherwise, and the fallback from the first to the second when a channel
breaks) is the link's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from vitpool.specs import BatchPlan

# a batch's status in its receipt
OK = "ok"
RETIRED = "retired"  # the actor is leaving the pool: nothing was encoded, send the items elsewhere


@dataclass(frozen=True)
class BatchReceipt:
    """What the actor says of a batch, small so that the pool can watch it cheaply."""

    status: str
    item_errors: dict[int, str] = field(default_factory=dict)  # position in the batch -> reason
    busy_seconds: float = 0.0


@dataclass(frozen=True)
class Done:
    """The actor ran the batch: per item its value (or None where the receipt names an error)."""

    values: list[Any]
    receipt: BatchReceipt
    through_channel: bool = False  # came over the same-node channel (values are Embeddings)


@dataclass(frozen=True)
class Refused:
    """The actor is leaving the pool and ran nothing."""

    reason: str


@dataclass(frozen=True)
class ActorGone:
    """The actor died or cannot be reached; the batch may not have run."""

    reason: str


@dataclass(frozen=True)
class BatchFailed:
    """The actor failed on the batch as a whole (not on one bad item)."""

    error: BaseException


Outcome = Done | Refused | ActorGone | BatchFailed
OutcomeCallback = Callable[[Outcome], None]


class InlineExchange(Protocol):
    """A batch the calling thread carries itself: `send`, then `finish` (which waits for the
    reply and calls the outcome callback in this thread). Neither raises."""

    def send(self) -> None: ...

    def finish(self) -> None: ...


class ActorLink(Protocol):
    """How the dispatcher reaches one encoder actor."""

    @property
    def is_local(self) -> bool:
        """Whether batches go through the same-node channel (pixels should stay arrays)."""
        ...

    def send(self, plan: BatchPlan, pixels: list[Any], on_outcome: OutcomeCallback) -> None:
        """Send a batch without waiting for it; `on_outcome` gets its one outcome, from another
        thread, or from this one before `send` returns when the actor is already known gone.
        Never raises for the batch's sake: failures are outcomes."""
        ...

    def exchange(
        self, plan: BatchPlan, pixels: list[Any], on_outcome: OutcomeCallback
    ) -> InlineExchange | None:
        """A batch for the calling thread to carry (no I/O here), or None where this link cannot
        (then use `send`)."""
        ...

    def close(self) -> None:
        """Stop using the actor: idle connections close now, busy ones when their batch is done."""
        ...
