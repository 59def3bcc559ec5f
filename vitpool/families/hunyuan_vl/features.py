"""The `get_image_features` stand-in of HunYuan-VL's Hugging Face model (the transformers drop-in,
`vitpool.integrations.transformers`; why one step above the tower: `vitpool.models.stand_in`).
The tower's `pooler_output` keeps a batch axis of one that `get_image_features` takes off
(`pooler_output[0]`) before splitting it per image, which a tower stand-in answering [tokens, D]
would break; the whole vision path (merger, begin, end and newline tokens) is the tower's, so there
is no projector to pass through."""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

# Image and Item through the stand-ins' base, which holds the one known arrow from models/ up to
# items.py (tests/unit/test_import_flow.py): a stand-in builds items
from vitpool.models.stand_in import Image, Item, PooledImageFeatures


class HunYuanVLFeatures(PooledImageFeatures):
    """`HunYuanVLModel.get_image_features`: patch rows [rows, C*P*P] of all images and their
    `image_grid_thw` in; `pooler_output` one tensor an image out. Items `Image(rows, (1, h, w))`."""

    family = "HunYuan-VL"
    tower = "vision_tower"
    projectors = ()

    def get_image_features(
        self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor, **kwargs: Any
    ) -> BaseModelOutputWithPooling:
        grids = [tuple(int(n) for n in grid) for grid in torch.as_tensor(image_grid_thw).tolist()]
        rows = [t * h * w for t, h, w in grids]
        if sum(rows) != pixel_values.shape[0]:
            raise ValueError(
                f"pixel_values have {pixel_values.shape[0]} rows; image_grid_thw {grids} needs {sum(rows)}"
            )
        chunks = torch.split(pixel_values.detach().cpu(), rows)
        items: list[Item] = [Image(chunk, grid) for chunk, grid in zip(chunks, grids)]
        return BaseModelOutputWithPooling(pooler_output=tuple(self._encode(items)))

    @staticmethod
    def encoder_module(inner: torch.nn.Module, tower: torch.nn.Module) -> torch.nn.Module:
        return copy.deepcopy(tower)  # the adapter changes the tower's attention
