"""The `get_image_features` stand-in of LLaVA-NeXT's Hugging Face model (the transformers drop-in,
`vitpool.integrations.transformers`; why one step above the tower: `vitpool.models.stand_in`). The
model selects a hidden state, drops the class token and packs each image's features after its
projector (the unpadding, the newlines), which a tower stand-in could not do for it."""

from __future__ import annotations

from typing import Any

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from vitpool.families.llava_next.rules import LlavaNextRules
from vitpool.families.llava_onevision.features import TileTableFeatures
from vitpool.models.stand_in import Encoder


class LlavaNextFeatures(TileTableFeatures):
    """`LlavaNextModel.get_image_features`: pixel values [images, tiles, 3, S, S] padded with zero
    tiles (or the images' tiles stacked, [tiles, 3, S, S]) and `image_sizes` [images, 2] in;
    `pooler_output` one tensor an image out. An image is its grid's tiles, as the model counts them
    from its size (`image_grid_pinpoints`): the item `Image(tiles, image_sizes[i])`."""

    family = "LLaVA-NeXT"
    ENCODER = "vitpool.families.llava_next.adapter:LlavaNextEncoder"

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
        self.check_settings(asked)
        sizes = [(int(h), int(w)) for h, w in torch.as_tensor(image_sizes).tolist()]
        counts = [self.rules.packed_grid(*size).num_crops + 1 for size in sizes]  # as the model counts
        return BaseModelOutputWithPooling(
            pooler_output=self._encode(self.images(pixel_values, counts, sizes))
        )
