"""The coordinator: launch or connect a pool on Ray, accept calls, pack, dispatch, gather, scale.

Names load on first use, so that `vitpool.pool.policy` and friends import without Ray."""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {
    "CacheStats": "vitpool.pool.stats",
    "EncoderPool": "vitpool.pool.encoder_pool",
    "PoolSettings": "vitpool.pool.settings",
    "PoolStats": "vitpool.pool.stats",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module 'vitpool.pool' has no attribute {name!r}")
    return getattr(importlib.import_module(_NAMES[name]), name)
