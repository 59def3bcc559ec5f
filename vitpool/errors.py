"""vitpool's exception classes. Each message says what was wrong and what to change."""


class VitpoolError(Exception):
    """Base class of every error vitpool raises on purpose."""


class ConfigError(VitpoolError, ValueError):
    """An invalid setting (budgets, batch limits, device, dtype); the message names the field."""


class CheckpointError(VitpoolError, ValueError):
    """A checkpoint directory that cannot be loaded: missing files, or missing/unexpected weights."""


class InvalidItemError(VitpoolError, ValueError):
    """One input item is malformed. `index` is its position in the list passed to `encode`."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(f"item {index}: {reason}")
        self.index = index
        self.reason = reason

    def __reduce__(self) -> tuple:
        return InvalidItemError, (self.index, self.reason)


class PoolUnavailableError(VitpoolError):
    """The pool cannot take work: it has no encoder actor left (none started, or all have died),
    or this handle can no longer reach it (closed by `close`/`shutdown`, its controller gone, or
    this process no longer connected to Ray). The message says which."""


class PoolNotFoundError(PoolUnavailableError):
    """No pool of that name runs in the cluster looked in (or no cluster runs to look in); the
    message names the cluster and why it was the one looked in. `where`: that cluster, as the
    message names it ("" where there was none to look in)."""

    def __init__(self, message: str, where: str = "") -> None:
        super().__init__(message)
        self.where = where


class EncodeError(VitpoolError):
    """An encoder actor failed on a batch for a reason other than the caller's items."""


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """`count` and `noun` for a message, in the plural unless the count is one: "1 actor",
    "2 actors", "3 batches" (nouns ending in s, x, ch or sh take "es"; pass `plural` otherwise)."""
    if count == 1:
        return f"{count} {noun}"
    if plural is None:
        plural = f"{noun}es" if noun.endswith(("s", "x", "ch", "sh")) else f"{noun}s"
    return f"{count} {plural}"
