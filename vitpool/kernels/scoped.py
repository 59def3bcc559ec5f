"""One context manager for the per-forward switches (attention backend, fused ops, compiled blocks)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def scoped_value(variable: contextvars.ContextVar[T], value: T) -> Iterator[None]:
    """`variable` holds `value` inside the block and its previous value after it."""
    token = variable.set(value)
    try:
        yield
    finally:
        variable.reset(token)
