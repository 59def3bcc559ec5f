"""One encoder actor as the pool's controller keeps it: its handle, its state and, for a warm standby
that took over, the hold of its GPU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray

from vitpool.actors.reports import ActorInfo

STARTING, ACTIVE, RETIRING = "starting", "active", "retiring"


@dataclass
class Member:
    handle: Any  # ray.actor.ActorHandle
    state: str
    info: ActorInfo | None = None
    bundle: int | None = None  # its bundle of the placement group, for a colocated pool
    hold: Any = None  # for a standby that took over a GPU: the actor holding that GPU in Ray's accounting


def stop_member(member: Member) -> None:
    """Kill a member's actor, and the hold of the GPU it took over as a standby."""
    ray.kill(member.handle, no_restart=True)
    if member.hold is not None:
        ray.kill(member.hold, no_restart=True)
