"""The Ray actor: owns one GraphEncoder on one GPU, serves batches (through Ray or the same-node
channel), reports health and stats.

Names load on first use: a pool's callers import `vitpool.actors.reports` (what an actor reports)
without loading the encoder, torch's model code or transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vitpool._lazy import lazy_exports

if TYPE_CHECKING:
    from vitpool.actors.delivering_actor import DeliveringEncoderActor
    from vitpool.actors.encoder_actor import EncoderActor
    from vitpool.actors.reports import ActorInfo, ActorStats

_NAMES = {
    "ActorInfo": "vitpool.actors.reports",
    "ActorStats": "vitpool.actors.reports",
    "DeliveringEncoderActor": "vitpool.actors.delivering_actor",
    "EncoderActor": "vitpool.actors.encoder_actor",
}

__all__ = ["ActorInfo", "ActorStats", "DeliveringEncoderActor", "EncoderActor"]
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)
