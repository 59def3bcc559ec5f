"""An encoder actor's failed start, as the caller who launched or scaled the pool sees it.

Ray reports an exception raised in an actor's constructor as ActorDiedError, whose message is
"The actor died because of an error raised in its creation task" and the whole remote
traceback, with the exception's type lost. So an encoder actor that fails to start keeps its
exception and raises it from `info()` (`vitpool.actors.encoder_actor`): Ray then hands the
exception itself over (`RayTaskError.cause`), and the launcher raises a ConfigError or
CheckpointError as what it is, with its one-line message.
"""

from __future__ import annotations

from vitpool.errors import VitpoolError


def start_error(error: BaseException) -> BaseException:
    """The exception an actor's start raised, where Ray carried it (a task error's cause);
    else `error` itself (the actor's process died, it was never placed, ...)."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else error


def one_line(error: BaseException) -> str:
    """The error's type and the first line of its message."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def start_failure(failures: list[tuple[int, BaseException]], num_started: int) -> BaseException:
    """What to raise for the actors of one launch or scale that failed to start (`failures`:
    index and `start_error`, at least one). vitpool's own errors (a bad setting or checkpoint:
    every actor meets the same) are raised as they are, with a note naming the actor; any other
    becomes a VitpoolError carrying its one line (the full error is its cause)."""
    index, error = failures[0]
    if num_started == 1:
        what = f"encoder actor {index} failed to start"
    else:
        what = f"{len(failures)} of {num_started} encoder actors failed to start (the first, actor {index})"
    if isinstance(error, VitpoolError):
        error.add_note(what)
        return error
    failure = VitpoolError(f"{what}: {one_line(error)}")
    failure.__cause__ = error
    return failure
