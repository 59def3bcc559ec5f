"""The `get_image_features` stand-in of Gemma 4's Hugging Face model (the transformers drop-in,
`vitpool.integrations.transformers`; why one step above the tower: `vitpool.models.stand_in`).
The model pools inside its tower and projects with `embed_vision` outside it, then splits the
tokens by each image's real patch count: vitpool runs both and answers per image.

Images only: the model's `get_video_features` calls the tower and `embed_vision` itself, by
keyword, which the drop-in's pass-through projector does not take; restore the original modules
(`restore_vision_tower`) to run videos, or encode their frames as images."""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from vitpool.errors import ConfigError

# Image and Item through the stand-ins' base, which holds the one known arrow from models/ up to
# items.py (tests/unit/test_import_flow.py): a stand-in builds items
from vitpool.models.stand_in import Image, Item, PooledImageFeatures


class Gemma4Features(PooledImageFeatures):
    """`Gemma4Model.get_image_features`: the processor's padded patch rows [B, max_patches, 3*P*P]
    and `image_position_ids` [B, max_patches, 2] in; `pooler_output` one tensor an image out.
    Items: each image's real rows with their grid (`vitpool.families.gemma4.processor`)."""

    family = "Gemma 4"
    tower = "vision_tower"
    projectors = ("embed_vision",)

    def forward(self, *args: Any, **kwargs: Any) -> BaseModelOutputWithPooling:
        # only get_video_features calls the tower itself
        raise ConfigError(
            f"{self.family}: the drop-in answers get_image_features; get_video_features is not run through "
            "it (restore_vision_tower first, or encode the frames as images)"
        )

    def get_image_features(
        self, pixel_values: torch.Tensor, image_position_ids: torch.Tensor | None = None, **kwargs: Any
    ) -> BaseModelOutputWithPooling:
        from vitpool.families.gemma4.processor import items

        if image_position_ids is None:
            raise ValueError(
                f"{self.family}'s get_image_features needs image_position_ids (the processor gives them)"
            )
        batch = {
            "pixel_values": pixel_values.detach().cpu(),
            "image_position_ids": image_position_ids.detach().cpu(),
        }
        images: list[Item] = [Image(part.pixel_values, part.grid) for part in items(batch)]
        return BaseModelOutputWithPooling(pooler_output=tuple(self._encode(images)))

    @staticmethod
    def encoder_module(inner: torch.nn.Module, tower: torch.nn.Module) -> torch.nn.Module:
        from vitpool.families.gemma4.adapter import Gemma4Encoder

        return Gemma4Encoder(copy.deepcopy(tower), copy.deepcopy(inner.embed_vision))
