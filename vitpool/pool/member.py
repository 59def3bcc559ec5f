"""One encoder actor as the pool's controller keeps it: its handle, its state and, for a warm standby
that took over, the hold of its GPU, or the actor that takes its place on the GPU the dead one freed
(`vitpool.pool.replacement`)."""

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
    # A standby that serves from the GPU it built on, shared with another actor, until the actor
    # started on the freed GPU is ready and it retires: not counted as one of the pool's actors.
    stand_in: bool = False
    replaces: int | None = None  # for that actor: the stand-in's index


def stop_member(member: Member) -> None:
    """Kill a member's actor, and the hold of the GPU it took over as a standby."""
    ray.kill(member.handle, no_restart=True)
    if member.hold is not None:
        ray.kill(member.hold, no_restart=True)
