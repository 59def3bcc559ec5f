"""A device running out of memory, once: what counts as it, what it asked for, why an item alone is
refused, and `or_out_of_memory`, the one place an encoder catches it (the halving of runs that
catches it lives in `lanes.py`)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from vitpool.specs import ItemSpec

T = TypeVar("T")


@dataclass(frozen=True)
class OutOfMemory:
    """A run the device's allocator refused; `asked`: the bytes it refused, where it said."""

    asked: int | None


def or_out_of_memory(run: Callable[[], T]) -> T | OutOfMemory:
    """`run()`, or its out-of-memory error as an `OutOfMemory`; other errors raise. It returns after
    the except clause has ended: the exception's traceback holds the failed run's tensors until
    then (PyTorch FAQ), and whoever retries needs them freed first."""
    try:
        return run()
    except RuntimeError as error:  # torch.OutOfMemoryError is one
        if not is_out_of_memory(error):
            raise
        asked = asked_bytes(error)
    return OutOfMemory(asked)


# How an allocator's refusal says what was asked: CUDA's caching allocator ("Tried to allocate
# 20.00 GiB"), the CPU's ("you tried to allocate 167772160000 bytes").
_ASKED = re.compile(r"[Tt]ried to allocate (\d+(?:\.\d+)?) ?(bytes|B|KiB|MiB|GiB|TiB)\b")
_UNIT_BYTES = {"bytes": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is a device's allocator refusing memory: a GPU's `torch.OutOfMemoryError`,
    or the CPU allocator's RuntimeError (torch raises no OutOfMemoryError on a CPU)."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and "DefaultCPUAllocator" in str(error)


def asked_bytes(error: BaseException) -> int | None:
    """The one allocation an out-of-memory error says was refused, in bytes; None where its
    message does not say."""
    found = _ASKED.search(str(error))
    return None if found is None else int(float(found.group(1)) * _UNIT_BYTES[found.group(2)])


def out_of_memory_reason(spec: ItemSpec, eager: bool, device: str, asked: int | None) -> str:
    """Why one item, run alone, is refused: the device's memory cannot hold its forward."""
    how = "eager: over every budget" if eager else "in a budget"
    needed = "its allocator refused it" if asked is None else f"it asked for {_readable_bytes(asked)} at once"
    return (
        f"{spec.num_tokens} output tokens ({spec.num_rows} pixel rows, {how}) ran out of {device} memory "
        f"encoding it alone: {needed}; resize it as the model's processor does (its max_pixels), or set "
        f"max_item_tokens below {spec.num_tokens} to refuse such items before they run"
    )


def _readable_bytes(num_bytes: int) -> str:
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if num_bytes >= _UNIT_BYTES[unit]:
            return f"{num_bytes / _UNIT_BYTES[unit]:.1f} {unit} ({num_bytes} bytes)"
    return f"{num_bytes} bytes"
