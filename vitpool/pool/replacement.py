"""How the pool's controller replaces an encoder actor: a failed one by its node's warm standby or a
fresh actor, and a standby's take-over of a new actor's place, with the GPU a hold gets for it on
its node (`vitpool.pool.warm_standbys`). A take-over has failure paths of its own (no GPU comes
free on the node, or the standby cannot take over): a fresh actor takes the place either way.

A standby that built its encoder ahead serves first and asks for the GPU after: where the hold gets
the GPU it built on (one GPU per node, or the dead actor's was that one), it keeps the hold and
stays. Otherwise it serves as a stand-in from the GPU it shares with that GPU's actor, the hold
goes, a fresh actor starts on the GPU the dead one freed, and the stand-in retires once that actor
is ready: no wait at the kill, full strength again after a fresh actor's start.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import ray

from vitpool.pool.member import ACTIVE, RETIRING, Member, stop_member
from vitpool.pool.start_errors import one_line, start_error
from vitpool.pool.warm_standbys import HOLD_TIMEOUT_S, Standby, Standbys, hold_gpu

if TYPE_CHECKING:
    from vitpool.pool.settings import PoolSettings
    from vitpool.pool.stats import PoolCounters

logger = logging.getLogger(__name__)


class ActorReplacement:
    """The replacement of actors, part of `PoolController` (`vitpool.pool.controller`): the
    controller keeps the members (the attributes below) and starts and activates actors
    (`_start_actor`, `_new_member`, `_activate_when_ready`, `activate`, `_actor_spec`), and
    records departures and changes (`_depart`, `_bump`)."""

    _lock: threading.Lock
    _members: dict[int, Member]
    _counters: PoolCounters
    _settings: PoolSettings
    _actor_options: dict
    _standbys: Standbys | None

    def report_failure(self, index: int) -> bool:
        """A caller saw this actor die or go silent: stop it and start a replacement while restarts
        are left. Several callers may report the same actor; the first report counts. Returns
        whether a replacement was started."""
        with self._lock:
            member = self._members.get(index)
            if member is None or member.state != ACTIVE:
                return False
            del self._members[index]
            self._depart(index)
            self._bump()
            self._counters.actor_failures += 1
            # a stand-in's place is being taken already, by the actor started on the freed GPU
            replace = (
                self._counters.actor_restarts < self._settings.max_actor_restarts and not member.stand_in
            )
            node = member.info.node_id if member.info is not None else None
            standby = self._standbys.take(node) if replace and self._standbys is not None else None
            if replace:
                self._counters.actor_restarts += 1
                started = self._start_actor() if standby is None else self._new_member(standby.handle)
        how = "its node's warm standby takes over" if standby is not None else "starting a fresh actor"
        unreplaced = "it stood in for an actor that is starting" if member.stand_in else "no restarts left"
        logger.warning(
            "encoder actor %d failed; %s",
            index,
            f"actor {started[0]} in its place: {how}" if replace else f"{unreplaced}, not replaced",
        )
        stop_member(member)  # a silent one may still run
        if standby is not None:
            threading.Thread(target=self._take_over, args=(started[0], standby, node), daemon=True).start()
        elif replace:
            threading.Thread(target=self._activate_when_ready, args=started, daemon=True).start()
        return replace

    def _take_over(
        self, index: int, standby: Standby, node_id: str, hold_timeout_s: float = HOLD_TIMEOUT_S
    ) -> None:
        """Give actor `index`'s place to `standby`, with the GPU a hold gets on its node; failing
        that, to a fresh actor (and the standby stays one, if it was only the GPU that failed)."""
        if standby.builds_ahead:
            self._switch_to(index, standby, node_id, hold_timeout_s)
            return
        began = time.monotonic()
        try:
            hold, gpu_ids = hold_gpu(node_id, self._actor_options, hold_timeout_s)
        except (ray.exceptions.RayError, TimeoutError) as error:
            logger.info(
                "no GPU came free on node %s for its warm standby (%s); starting a fresh actor",
                node_id[:12],
                one_line(start_error(error)),
            )
            if self._standbys is not None:
                self._standbys.give_back(node_id, standby)
            self._start_fresh_instead(index)
            return
        try:
            with self._lock:
                member = self._members.get(index)
                if member is None:  # shut down meanwhile
                    ray.kill(hold, no_restart=True)
                    return
                member.hold = hold
            info = ray.get(
                standby.handle.take_over.remote(index, self._actor_spec(), gpu_ids),
                timeout=self._settings.startup_timeout_s,
            )
        except (ray.exceptions.RayError, TimeoutError, RuntimeError) as error:
            logger.warning(
                "the warm standby on node %s could not take over as actor %d (%s); starting a fresh actor",
                node_id[:12],
                index,
                one_line(start_error(error)),
            )
            ray.kill(standby.handle, no_restart=True)
            self._start_fresh_instead(index)
            return
        with self._lock:
            self._counters.standby_takeovers += 1
        self.activate(index, info)
        logger.info(
            "encoder actor %d (a warm standby) ready on %s, %.1f s after it was asked",
            index,
            info.device,
            time.monotonic() - began,
        )

    def _switch_to(self, index: int, standby: Standby, node_id: str, hold_timeout_s: float) -> None:
        """Actor `index`'s place to a standby that built its encoder ahead: it serves at once, then
        keeps the GPU a hold gets where that is the GPU it built on, or stands in (the module's
        opening)."""
        began = time.monotonic()
        try:
            info = ray.get(
                standby.handle.take_over.remote(index, self._actor_spec(), standby.gpu_ids),
                timeout=self._settings.startup_timeout_s,
            )
        except (ray.exceptions.RayError, TimeoutError, RuntimeError) as error:
            logger.warning(
                "the warm standby on node %s could not take over as actor %d (%s); starting a fresh actor",
                node_id[:12],
                index,
                one_line(start_error(error)),
            )
            ray.kill(standby.handle, no_restart=True)
            self._start_fresh_instead(index)
            return
        with self._lock:
            self._counters.standby_takeovers += 1
        self.activate(index, info)
        logger.info(
            "encoder actor %d (a warm standby, graphs captured ahead) serves on %s %.2f s after it was asked",
            index,
            info.device,
            time.monotonic() - began,
        )
        try:
            hold, gpu_ids = hold_gpu(node_id, self._actor_options, hold_timeout_s)
        except (ray.exceptions.RayError, TimeoutError):
            hold, gpu_ids = None, []
        stays = hold is not None and stays_on_its_gpu(info.device, info.gpu_ids, gpu_ids)
        with self._lock:
            member = self._members.get(index)
            if member is not None and member.state == ACTIVE and stays:
                member.hold, hold = hold, None
                started = None
            elif member is not None and member.state == ACTIVE:
                member.stand_in = True
                started = self._start_actor()
                self._members[started[0]].replaces = index
            else:  # retired or failed meanwhile
                started = None
        if hold is not None:
            ray.kill(hold, no_restart=True)
        if started is not None:
            logger.info(
                "encoder actor %d serves from GPU %s, beside that GPU's actor, until actor %d is ready "
                "on the GPU Ray frees on node %s",
                index,
                ",".join(info.gpu_ids) or "-",
                started[0],
                node_id[:12],
            )
            self._activate_when_ready(*started)

    def _end_stand_in(self, member: Member) -> None:
        """`member` (an actor started in a stand-in's place) is active: the stand-in retires
        (lock held)."""
        replaced, member.replaces = member.replaces, None
        stand_in = self._members.get(replaced) if replaced is not None else None
        if stand_in is None or not stand_in.stand_in or stand_in.state != ACTIVE:
            return
        stand_in.state = RETIRING
        self._bump()
        threading.Thread(target=self._retire, args=(replaced,), daemon=True).start()

    def _keep_stand_in(self, member: Member) -> None:
        """`member` (started in a stand-in's place) will not serve: the stand-in stays as one of
        the pool's actors, on the GPU it shares (lock held)."""
        replaced, member.replaces = member.replaces, None
        stand_in = self._members.get(replaced) if replaced is not None else None
        if stand_in is not None and stand_in.stand_in:
            stand_in.stand_in = False
            logger.warning(
                "the actor started in a stand-in's place will not serve; the stand-in stays, sharing its GPU"
            )

    def _start_fresh_instead(self, index: int) -> None:
        """A fresh actor in the place of starting member `index` (whose actor and hold stop)."""
        with self._lock:
            member = self._members.pop(index, None)
            started = self._start_actor() if member is not None else None  # None: shut down meanwhile
        if member is not None and member.hold is not None:
            ray.kill(member.hold, no_restart=True)
        if started is not None:
            self._activate_when_ready(*started)


def stays_on_its_gpu(device: str, own_gpu_ids: list[str], held_gpu_ids: list[str]) -> bool:
    """Whether a standby that built ahead on `own_gpu_ids` can keep the place whose hold got
    `held_gpu_ids`: they are the same GPUs, or it does not run on a GPU at all."""
    return not device.startswith("cuda") or sorted(own_gpu_ids) == sorted(held_gpu_ids)
