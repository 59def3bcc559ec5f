"""The `get_image_features` stand-in of HunYuan V4 VL's Hugging Face model (the transformers drop-in,
`vitpool.integrations.transformers`). As HunYuan-VL's: the tower's `pooler_output` keeps a batch
axis of one that `get_image_features` takes off before splitting it per item, and the whole vision
path (the merger and its newline tokens) is the tower's. The model's `get_video_features` calls
`get_image_features` with the videos' patch rows and grids, so a grid of several frames is a Video.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from vitpool.families.hunyuan_vl.features import HunYuanVLFeatures
from vitpool.items import Image, Item, Video


class HYV4VLFeatures(HunYuanVLFeatures):
    """`HYV4VLModel.get_image_features` (and through it `get_video_features`): patch rows
    [rows, C*P*P] of all items and their grids in; `pooler_output` one tensor an item out. Items
    `Image(rows, (1, h, w))`, or `Video(rows, (t, h, w))` for t > 1."""

    family = "HunYuan V4 VL"

    def get_image_features(
        self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor, **kwargs: Any
    ) -> BaseModelOutputWithPooling:
        grids = [tuple(int(n) for n in grid) for grid in torch.as_tensor(image_grid_thw).tolist()]
        rows = [t * h * w for t, h, w in grids]
        if sum(rows) != pixel_values.shape[0]:
            raise ValueError(
                f"pixel_values have {pixel_values.shape[0]} rows; grid_thw {grids} needs {sum(rows)}"
            )
        chunks = torch.split(pixel_values.detach().cpu(), rows)
        items: list[Item] = [
            (Video if grid[0] > 1 else Image)(chunk, grid) for chunk, grid in zip(chunks, grids)
        ]
        return BaseModelOutputWithPooling(pooler_output=tuple(self._encode(items)))
