"""Model adapters: one file per family, all seen by graphs/ through `VisionAdapter`.

Names load on first use: a pool's callers unpickle item rules from `vitpool.rules.grids`
without importing transformers or any modeling code.
"""

from __future__ import annotations

from vitpool._lazy import lazy_exports

_NAMES = {
    "FAMILIES": "vitpool.models.registry",
    "Family": "vitpool.models.registry",
    "CheckpointLayout": "vitpool.models.registry",
    "register_family": "vitpool.models.registry",
    "SHIPPED_CHECKPOINT": "vitpool.models.loading",
    "load_adapter": "vitpool.models.loading",
    "SpatialMergeRules": "vitpool.rules.grids",
    "VisionAdapter": "vitpool.models.protocol",
    "TensorSpec": "vitpool.models.protocol",
}

__all__ = [
    "FAMILIES",
    "SHIPPED_CHECKPOINT",
    "CheckpointLayout",
    "Family",
    "SpatialMergeRules",
    "TensorSpec",
    "VisionAdapter",
    "load_adapter",
    "register_family",
]
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)
