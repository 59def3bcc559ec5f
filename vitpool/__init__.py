"""vitpool: fast, scalable vision encoders for multimodal LLMs.

A vision tower runs as one captured CUDA graph per token budget (`GraphEncoder`); a Ray pool of
such encoders (`EncoderPool`) serves many callers.

Public names load on first use, so that `vitpool.packing` stays importable without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vitpool._lazy import lazy_exports

if TYPE_CHECKING:
    from vitpool.codec import decode_request, decode_results, encode_request, encode_results
    from vitpool.errors import (
        CheckpointError,
        ConfigError,
        EncodeError,
        InvalidItemError,
        PoolNotFoundError,
        PoolUnavailableError,
        VitpoolError,
    )
    from vitpool.from_processor import items_from
    from vitpool.graphs import EncoderStats, GraphEncoder, PlansInFlight
    from vitpool.items import Embedding, Image, Video, shared_results
    from vitpool.pool import CacheStats, EncoderPool, PoolSettings, PoolStats
    from vitpool.pool.rank_delivery import DeliveryLayout, RankDelivery, received_embeddings

_PUBLIC = {
    "decode_request": "vitpool.codec",
    "decode_results": "vitpool.codec",
    "encode_request": "vitpool.codec",
    "encode_results": "vitpool.codec",
    "CheckpointError": "vitpool.errors",
    "ConfigError": "vitpool.errors",
    "EncodeError": "vitpool.errors",
    "InvalidItemError": "vitpool.errors",
    "PoolNotFoundError": "vitpool.errors",
    "PoolUnavailableError": "vitpool.errors",
    "VitpoolError": "vitpool.errors",
    "items_from": "vitpool.from_processor",
    "EncoderStats": "vitpool.graphs",
    "GraphEncoder": "vitpool.graphs",
    "PlansInFlight": "vitpool.graphs",
    "Embedding": "vitpool.items",
    "EncoderOptions": "vitpool.encoder_spec",
    "Image": "vitpool.items",
    "Video": "vitpool.items",
    "shared_results": "vitpool.items",
    "CacheStats": "vitpool.pool",
    "EncoderPool": "vitpool.pool",
    "PoolSettings": "vitpool.pool",
    "PoolStats": "vitpool.pool",
    "DeliveryLayout": "vitpool.pool.rank_delivery",
    "RankDelivery": "vitpool.pool.rank_delivery",
    "received_embeddings": "vitpool.pool.rank_delivery",
}

__all__ = [
    "CacheStats",
    "CheckpointError",
    "ConfigError",
    "DeliveryLayout",
    "Embedding",
    "EncodeError",
    "EncoderOptions",
    "EncoderPool",
    "EncoderStats",
    "GraphEncoder",
    "Image",
    "InvalidItemError",
    "PlansInFlight",
    "PoolNotFoundError",
    "PoolSettings",
    "PoolStats",
    "PoolUnavailableError",
    "RankDelivery",
    "Video",
    "VitpoolError",
    "decode_request",
    "decode_results",
    "encode_request",
    "encode_results",
    "items_from",
    "received_embeddings",
    "shared_results",
]
__version__ = "0.1.0"

__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC)
