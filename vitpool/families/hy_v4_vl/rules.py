"""Item rules of HunYuan V4 VL (hy_v4_vl): checks and sizes of an item without the weights.

Importing neither torch nor transformers (a pool's callers unpickle these rules).

An item is an image or a video as the processors give it: flattened patches [t*h*w, C*P*P] in
raster order, frame after frame (`temporal_patch_size` is 1: a row is one frame's patch), with a
(t, h, w) grid row, as Qwen's processors emit them, so `vitpool.items_from` cuts a batch with the
shared grid cutter. h and w are multiples of the spatial merge m. Every frame is one attention
sequence (the tower's `cu_seqlens` per temporal patch), which the budgets bound as Qwen's do.

Tokens are not rows/m²: the merger appends a learned newline token after every row of blocks of
every frame, so a frame gives (h/m) * (w/m + 1) tokens and an item t times that (the processor's
`_num_frame_tokens`). There are no begin or end tokens (HunYuan-VL's merger has them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from vitpool.rules.grids import SpatialMergeRules
from vitpool.specs import ItemSpec


def frame_tokens(h: int, w: int, merge_size: int) -> int:
    """Tokens of one frame of h x w patches: each row of w/m blocks and its newline."""
    return (h // merge_size) * (w // merge_size + 1)


@dataclass(frozen=True)
class HYV4VLRules(SpatialMergeRules):
    """HunYuan V4 VL's items: Qwen-style patch rows and grids (images and videos, one attention
    sequence a frame), sized by the merger's tokens: blocks and a newline per row of blocks."""

    def item_spec(
        self, modality: str, pixel_shape: tuple[int, ...], pixel_dtype: str, layout: Any
    ) -> ItemSpec:
        spec = super().item_spec(modality, tuple(pixel_shape), pixel_dtype, layout)
        t, h, w = spec.layout
        return dataclasses.replace(spec, num_tokens=t * frame_tokens(h, w, self.merge_size))
