"""The `get_image_features` stand-in of Molmo 2's Hugging Face model (the transformers drop-in,
`vitpool.integrations.transformers`; why one step above the tower: `vitpool.models.stand_in`). The
model pools the tower's features in windows and projects them before the LLM, which a tower
stand-in could not skip. Its `get_video_features` calls `get_image_features` with the frames as
crops and grid rows (frames * rows, cols, 0, 0), which the stand-in answers as the videos they are.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from vitpool.families.molmo2.processor import items as cut_items
from vitpool.items import Video
from vitpool.models.stand_in import Encoder, Image, Item, PooledImageFeatures
from vitpool.specs import VIDEO


class Molmo2Features(PooledImageFeatures):
    """`Molmo2Model.get_image_features`: crops [crops, side², P*P*C] (or [images, crops, ...]),
    `image_token_pooling` and `image_grids` in; `pooler_output` one tensor an image (a video) out."""

    family = "Molmo 2"
    tower = "vision_tower"
    projectors = ("multi_modal_projector",)

    def __init__(self, encoder: Encoder, dtype: torch.dtype, device: torch.device, config: Any) -> None:
        super().__init__(encoder, dtype, device, config)

    def get_image_features(
        self,
        pixel_values: torch.Tensor,
        image_token_pooling: torch.Tensor,
        image_grids: torch.Tensor,
        **kwargs: Any,
    ) -> BaseModelOutputWithPooling:
        pixels = pixel_values.detach().cpu()
        if pixels.dim() == 4:
            pixels = pixels.reshape(-1, *pixels.shape[2:])
        pooling = image_token_pooling.detach().cpu()
        grids = [[int(v) for v in row] for row in torch.as_tensor(image_grids).tolist()]
        if grids and all(row[2] == row[3] == 0 for row in grids):  # get_video_features' frames
            batch = {
                "pixel_values_videos": pixels,
                "video_token_pooling": pooling,
                "video_grids": _video_grids(pooling.numpy(), grids, pixels.shape[1]),
            }
        else:
            batch = {"pixel_values": pixels, "image_token_pooling": pooling, "image_grids": grids}
        items: list[Item] = [
            (Video if item.modality == VIDEO else Image)(item.pixel_values, item.grid)
            for item in cut_items(batch)
        ]
        return BaseModelOutputWithPooling(pooler_output=tuple(self._encode(items)))

    @staticmethod
    def encoder_module(inner: torch.nn.Module, tower: torch.nn.Module) -> torch.nn.Module:
        from vitpool.families.molmo2.adapter import Molmo2Encoder

        return Molmo2Encoder(copy.deepcopy(tower), copy.deepcopy(inner.multi_modal_projector))


def _video_grids(pooling: np.ndarray, grids: list[list[int]], patches_per_frame: int) -> list[list[int]]:
    """The video processor's (frames, rows, cols) of `get_video_features`' (frames * rows, cols, 0, 0):
    a video's frames are up to the last one its windows reach."""
    video_grids, token, frame = [], 0, 0
    for rows_of_frames, cols, *_ in grids:
        windows = pooling[token : token + rows_of_frames * cols]
        frames = int(windows.max()) // patches_per_frame + 1 - frame if windows.size else 0
        video_grids.append([frames, rows_of_frames // max(frames, 1), cols])
        token += rows_of_frames * cols
        frame += frames
    return video_grids
