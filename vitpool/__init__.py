"""vitpool: fast, scalable vision encoders for multimodal LLMs.

A vision tower runs as one captured CUDA graph per token budget (`GraphEncoder`); a Ray pool of
such encoders serves many callers (planned).
"""

from vitpool.errors import CheckpointError, ConfigError, InvalidItemError, VitpoolError
from vitpool.graphs import EncoderStats, GraphEncoder
from vitpool.items import Embedding, Image, Video

__all__ = [
    "CheckpointError",
    "ConfigError",
    "Embedding",
    "EncoderStats",
    "GraphEncoder",
    "Image",
    "InvalidItemError",
    "Video",
    "VitpoolError",
]

__version__ = "0.1.0"
