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
    """The pool has no encoder actor that can take work (none started, or all have died)."""


class EncodeError(VitpoolError):
    """An encoder actor failed on a batch for a reason other than the caller's items."""
