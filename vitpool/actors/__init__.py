"""The Ray actor: owns one GraphEncoder on one GPU, serves batches (through Ray or the same-node
channel), reports health and stats.

Names load on first use: a pool's callers import `vitpool.actors.reports` (what an actor reports)
without loading the encoder, torch's model code or transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module 'vitpool.actors' has no attribute {name!r}")
    return getattr(importlib.import_module(_NAMES[name]), name)
