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


def start_failure(
    failures: list[tuple[int, BaseException]], num_started: int, cluster: str = "", hint: str = ""
) -> BaseException:
    """What to raise for the actors of one launch or scale that failed to start (`failures`:
    index and `start_error`, at least one). vitpool's own errors (a bad setting or checkpoint:
    every actor meets the same) are raised as they are, with a note naming the actor; any other
    (the actor's process died, it was never placed) becomes a VitpoolError carrying its one line
    (the full error is its cause), and, where given, the Ray `cluster` it was started in and a
    `hint` on choosing another."""
    index, error = failures[0]
    if num_started == 1:
        what = f"encoder actor {index} failed to start"
    else:
        what = f"{len(failures)} of {num_started} encoder actors failed to start (the first, actor {index})"
    if isinstance(error, VitpoolError):
        error.add_note(what)
        return error
    line = one_line(error)
    if cluster:
        what = f"{what} in the {cluster}"
    if hint:
        line = f"{line.rstrip('.')}; {hint}"
    failure = VitpoolError(f"{what}: {line}")
    failure.__cause__ = error
    return failure


def died_at_start(what: str, error: BaseException, cluster: str, hint: str) -> VitpoolError:
    """What to raise for an actor that died, or never started, while a pool started (Ray's
    ActorDiedError: several lines that name neither the cluster nor why it was the one joined).
    The caller chains `error` as the cause."""
    return VitpoolError(
        f"{what} died before the pool was ready, in the {cluster}: {one_line(error).rstrip('.')}; {hint}"
    )
