"""Model adapters: one file per family, all seen by graphs/ through `VisionAdapter`."""

from vitpool.models.item_rules import SpatialMergeRules
from vitpool.models.loading import FAMILIES, SHIPPED_CHECKPOINT, load_adapter
from vitpool.models.protocol import Grid, ItemRules, ItemSize, TensorSpec, VisionAdapter
from vitpool.models.qwen3_vl import Qwen3VLAdapter

__all__ = [
    "FAMILIES",
    "SHIPPED_CHECKPOINT",
    "Grid",
    "ItemRules",
    "ItemSize",
    "Qwen3VLAdapter",
    "SpatialMergeRules",
    "TensorSpec",
    "VisionAdapter",
    "load_adapter",
]
