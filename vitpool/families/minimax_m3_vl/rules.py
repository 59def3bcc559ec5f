"""Item rules of MiniMax-M3-VL: Qwen-style patch rows and grids, one attention sequence per item.

Pixels are the processor's flattened patches [t*h*w, C*T*P*P] with a grid (t, h, w), each 2x2
merge block's rows consecutive (the processor lays them out so: the projector merges every four
consecutive rows). The tower attends over a whole item at once, a video chunk's frames together
(`merge_temporal=True` in Hugging Face's forward), and nothing pools over time: an item gives
t*h*w / 4 tokens from t*h*w rows. So the sequences of a batch are its items and no capacity
besides tokens and items bounds a batch (Qwen's rules count one sequence per temporal patch).

Plain Python: imports neither torch nor transformers (a pool's callers unpickle these rules).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from vitpool.rules.grids import SpatialMergeRules
from vitpool.specs import ItemSpec


@dataclass(frozen=True)
class MiniMaxM3VLRules(SpatialMergeRules):
    """`SpatialMergeRules` whose items are one attention sequence each: an item needs no
    capacity but its tokens (and its place among the batch's items)."""

    capacities: tuple[str, ...] = ()

    def item_spec(
        self, modality: str, pixel_shape: tuple[int, ...], pixel_dtype: str, layout: Any
    ) -> ItemSpec:
        spec = super().item_spec(modality, pixel_shape, pixel_dtype, layout)
        return dataclasses.replace(spec, needs=())
