"""The coordinator: launch or connect a pool on Ray, accept calls, pack, dispatch, gather, scale.

Names load on first use, so that `vitpool.pool.policy` and friends import without Ray."""

from __future__ import annotations

from vitpool._lazy import lazy_exports

_NAMES = {
    "CacheStats": "vitpool.pool.stats",
    "EncoderPool": "vitpool.pool.encoder_pool",
    "PoolSettings": "vitpool.pool.settings",
    "PoolStats": "vitpool.pool.stats",
}

__all__ = ["CacheStats", "EncoderPool", "PoolSettings", "PoolStats"]
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)
