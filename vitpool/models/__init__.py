"""Model adapters: one file per family, all seen by graphs/ through `VisionAdapter`."""

from vitpool.models.loading import FAMILIES, SHIPPED_CHECKPOINT, load_adapter
from vitpool.models.protocol import Grid, ItemSize, TensorSpec, VisionAdapter
from vitpool.models.qwen3_vl import Qwen3VLAdapter

__all__ = [
    "FAMILIES",
    "SHIPPED_CHECKPOINT",
    "Grid",
    "ItemSize",
    "Qwen3VLAdapter",
    "TensorSpec",
    "VisionAdapter",
    "load_adapter",
]
