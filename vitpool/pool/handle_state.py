"""Whether an `EncoderPool` handle can still be used, and if not, why: the one message that every
method then raises as PoolUnavailableError, before any Ray call (in a process that left Ray, a Ray
call would start a new local Ray instance).

A handle stops being usable once closed (`close()` or `shutdown()`), once its pool's controller is
gone (its launcher ended or shut it down, or it was killed), or once its process left Ray.
"""

from __future__ import annotations

import threading

import ray

from vitpool.errors import PoolUnavailableError


class HandleState:
    """One handle's state; `name` is its pool's."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.closed = threading.Event()
        self.closed_by: str | None = None  # "close()" or "shutdown()"
        self.lost: str | None = None  # why the pool cannot be reached (the controller is gone)

    def close(self, closed_by: str) -> bool:
        """Mark the handle closed by `closed_by`; False if it was closed before."""
        if self.closed.is_set():
            return False
        self.closed_by = closed_by
        self.closed.set()
        return True

    def lose(self) -> str | None:
        """The pool's controller is gone, or this process left Ray: the reason from now on, or None
        where the handle was already lost or closed."""
        if self.lost is not None or self.closed.is_set():
            return None
        if ray.is_initialized():
            self.lost = (
                f"pool {self.name!r}: its controller is gone (the process that launched the pool ended "
                "or shut it down, or the controller was killed), and its encoder actors with it; launch "
                "the pool again (with detached=True, or `vitpool serve`, it outlives its launcher)"
            )
        else:
            self.lost = _left_ray(self.name)
        return self.lost

    def unusable_reason(self) -> str | None:
        """Why this handle cannot be used, or None."""
        if self.closed_by is not None:
            return (
                f"pool {self.name!r}: this handle was closed by {self.closed_by}; launch a pool or "
                "connect to one for a new handle"
            )
        if self.lost is not None:
            return self.lost
        if not ray.is_initialized():
            return _left_ray(self.name)
        return None

    def check_usable(self) -> None:
        """Raise PoolUnavailableError where this handle cannot be used; called before any Ray call."""
        reason = self.unusable_reason()
        if reason is not None:
            raise PoolUnavailableError(reason)


def _left_ray(name: str) -> str:
    return (
        f"pool {name!r}: this process is no longer connected to Ray (ray.shutdown() was called); "
        "connect to the pool again"
    )
