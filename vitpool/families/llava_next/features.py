"""The `get_image_features` stand-in of LLaVA-NeXT's Hugging Face model (the transformers drop-in,
`vitpool.integrations.transformers`; why one step above the tower: `vitpool.models.stand_in`). The
model selects a hidden state, drops the class token and packs each image's features after its
projector (the unpadding, the newlines), which a tower stand-in could not do for it."""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from vitpool.errors import ConfigError
from vitpool.families.llava_next.rules import LlavaNextRules

# Image and Item through the stand-ins' base, which holds the one known arrow from models/ up to
# items.py (tests/unit/test_import_flow.py): a stand-in builds items
from vitpool.models.stand_in import Encoder, Image, Item, PooledImageFeatures


class LlavaNextFeatures(PooledImageFeatures):
    """`LlavaNextModel.get_image_features`: pixel values [images, tiles, 3, S, S] padded with zero
    tiles (or the images' tiles stacked, [tiles, 3, S, S]) and `image_sizes` [images, 2] in;
    `pooler_output` one tensor an image out. An image is its grid's tiles, as the model counts them
    from its size (`image_grid_pinpoints`): the item `Image(tiles, image_sizes[i])`."""

    family = "LLaVA-NeXT"
    tower = "vision_tower"
    projectors = ("multi_modal_projector",)

    def __init__(self, encoder: Encoder, dtype: torch.dtype, device: torch.device, config: Any) -> None:
        super().__init__(encoder, dtype, device, config)
        vision = config.vision_config
        self.settings = {
            "vision_feature_layer": config.vision_feature_layer,
            "vision_feature_select_strategy": config.vision_feature_select_strategy,
        }
        self.rules = LlavaNextRules.of(
            channels=int(vision.num_channels),
            tile_size=int(vision.image_size),
            patch_size=int(vision.patch_size),
            pinpoints=tuple(tuple(int(v) for v in pin) for pin in config.image_grid_pinpoints),
            output_width=int(config.text_config.hidden_size),
        )

    def get_image_features(
        self,
        pixel_values: torch.Tensor,
        image_sizes: torch.Tensor,
        vision_feature_layer: Any = None,
        vision_feature_select_strategy: str | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPooling:
        asked = {
            "vision_feature_layer": vision_feature_layer,
            "vision_feature_select_strategy": vision_feature_select_strategy,
        }
        for name, value in asked.items():
            if value is not None and value != self.settings[name]:
                raise ConfigError(
                    f"{self.family}: the encoder runs {name}={self.settings[name]!r} (the model's config); "
                    f"got {value!r}"
                )
        sizes = [(int(h), int(w)) for h, w in torch.as_tensor(image_sizes).tolist()]
        counts = [self.rules.packed_grid(*size).num_crops + 1 for size in sizes]  # as the model counts
        pixels = pixel_values.detach().cpu()
        if pixels.dim() == 5:  # padded per image
            tiles = [pixels[index, :count] for index, count in enumerate(counts)]
        elif pixels.dim() == 4 and pixels.shape[0] == sum(counts):  # the images' tiles, stacked
            tiles = list(pixels.split(counts))
        else:
            raise ConfigError(
                f"{self.family}: pixel_values of shape {tuple(pixels.shape)} are not [images, tiles, 3, S, "
                f"S] nor the {sum(counts)} tiles of images of sizes {sizes}, stacked"
            )
        items: list[Item] = [Image(image_tiles, size) for image_tiles, size in zip(tiles, sizes)]
        return BaseModelOutputWithPooling(pooler_output=self._encode(items))

    @staticmethod
    def encoder_module(inner: torch.nn.Module, tower: torch.nn.Module) -> torch.nn.Module:
        from vitpool.families.llava_next.adapter import LlavaNextEncoder

        return LlavaNextEncoder(
            copy.deepcopy(tower),
            copy.deepcopy(inner.multi_modal_projector),
            inner.image_newline,
            inner.config,
        )
