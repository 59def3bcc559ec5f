"""A handle's view of who is in the pool, kept current by the controller's answers rather than
by polling: one long poll is always open (`PoolController.wait_for_change`), answered the
moment the membership changes, and asked again after it times out. The same thread reports the
actors this handle saw die, so that the dispatcher's callbacks never make Ray calls.

Ray's calls start a new local Ray instance where this process is not connected, so the thread
makes none once Ray is shut down here: it reports the pool lost and stops.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import ray

from vitpool.pool.controller import Membership

logger = logging.getLogger(__name__)

LONG_POLL_S = 10.0  # how long one poll waits for a change before it is asked again
# how often the thread looks whether this process is still connected to Ray, when no answer wakes it
RAY_CHECK_S = 1.0
REPORT_TIMEOUT_S = 30.0


class MembershipWatcher:
    """Calls `on_change(membership)` with every newer membership, in version order, from its
    thread (or from `refresh`'s caller); `report_failure(index)` tells the controller of a dead or
    silent actor, from any thread, without blocking; `on_lost(error)` runs once if the controller
    goes, or this process leaves Ray.
    """

    def __init__(
        self,
        controller: Any,
        membership: Membership,
        on_change: Callable[[Membership], None],
        on_lost: Callable[[BaseException], None],
    ) -> None:
        self._controller = controller
        self._on_change = on_change
        self._on_lost = on_lost
        self._version = membership.version
        self._lock = threading.Lock()  # orders the memberships handed to on_change
        self._wake = threading.Event()
        self._closed = False
        self._failed: list[int] = []
        self._thread = threading.Thread(target=self._run, name="vitpool-membership", daemon=True)
        self._thread.start()

    def report_failure(self, actor_index: int) -> None:
        """Tell the controller (from this watcher's thread) that an actor died or went silent."""
        self._failed.append(actor_index)
        self._wake.set()

    def refresh(self) -> None:
        """Bring the view up to date now (after scaling, before picking an actor)."""
        self._apply(ray.get(self._controller.membership.remote()))

    def close(self) -> None:
        """Stop watching; an open long poll is left to time out on the controller."""
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=5)

    def _apply(self, membership: Membership | None) -> None:
        with self._lock:
            if membership is None or membership.version <= self._version:
                return
            self._version = membership.version
            self._on_change(membership)

    def _run(self) -> None:
        poll = None
        while not self._closed:
            if not ray.is_initialized():  # ray.shutdown() here: a Ray call would start a new instance
                self._on_lost(RuntimeError("this process is no longer connected to Ray"))
                return
            try:
                while self._failed:
                    self._report(self._failed[0])
                    self._failed.pop(0)
                if poll is None:
                    poll = self._controller.wait_for_change.remote(self._version, LONG_POLL_S)
                    poll.future().add_done_callback(lambda _: self._wake.set())
                if not self._wake.wait(RAY_CHECK_S):
                    continue  # nothing happened: look at Ray again
                self._wake.clear()
                ready, _ = ray.wait([poll], timeout=0)
                if ready:
                    poll, answered = None, poll
                    self._apply(ray.get(answered))
            except ray.exceptions.GetTimeoutError:
                logger.warning("the pool's controller is slow to answer; trying again")
            except ray.exceptions.RayActorError as error:  # the controller itself is gone
                if not self._closed:
                    first_line = str(error).strip().split("\n")[0]
                    logger.warning("the pool's controller is gone (%s); calls will fail", first_line)
                    self._on_lost(error)
                return
            except Exception:  # a failed update must not stop the watching
                logger.exception("updating the pool's membership failed; watching on")
                poll = None

    def _report(self, actor_index: int) -> None:
        ray.get(self._controller.report_failure.remote(actor_index), timeout=REPORT_TIMEOUT_S)
