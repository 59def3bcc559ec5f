"""The coordinator: launch or connect a pool on Ray, accept calls, pack, dispatch, gather, scale."""

from vitpool.pool.encoder_pool import EncoderPool
from vitpool.pool.settings import PoolSettings
from vitpool.pool.stats import PoolStats

__all__ = ["EncoderPool", "PoolSettings", "PoolStats"]
