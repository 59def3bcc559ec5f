"""The `get_image_features` stand-in of Mistral 3's Hugging Face model (the transformers drop-in,
`vitpool.integrations.transformers`; why one step above the tower: `vitpool.models.stand_in`).
The model reads a chosen hidden state of its tower and runs its projector with the images' sizes,
not a tower output a tower stand-in could give."""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from vitpool.errors import ConfigError

# Image and Item through the stand-ins' base, which holds the one known arrow from models/ up to
# items.py (tests/unit/test_import_flow.py): a stand-in builds items
from vitpool.models.stand_in import Encoder, Image, Item, PooledImageFeatures


class Mistral3Features(PooledImageFeatures):
    """`Mistral3Model.get_image_features`: the padded batch [B, C, H, W] and `image_sizes` [B, 2]
    in; `pooler_output` one tensor an image out. Items `Image(pixels[i, :, :H, :W], (H, W))`."""

    family = "Mistral 3"
    tower = "vision_tower"
    projectors = ("multi_modal_projector",)

    def __init__(self, encoder: Encoder, dtype: torch.dtype, device: torch.device, config: Any) -> None:
        super().__init__(encoder, dtype, device, config)
        self.vision_feature_layer = config.vision_feature_layer

    def get_image_features(
        self,
        pixel_values: torch.Tensor,
        image_sizes: torch.Tensor,
        vision_feature_layer: Any = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPooling:
        if vision_feature_layer is not None and vision_feature_layer != self.vision_feature_layer:
            raise ConfigError(
                f"{self.family}: the encoder runs vision_feature_layer {self.vision_feature_layer} (the "
                f"model's config); got {vision_feature_layer}"
            )
        sizes = [(int(h), int(w)) for h, w in torch.as_tensor(image_sizes).tolist()]
        pixels = pixel_values.detach().cpu()
        items: list[Item] = [Image(pixels[index, :, :h, :w], (h, w)) for index, (h, w) in enumerate(sizes)]
        return BaseModelOutputWithPooling(pooler_output=tuple(self._encode(items)))

    @staticmethod
    def encoder_module(inner: torch.nn.Module, tower: torch.nn.Module) -> torch.nn.Module:
        from vitpool.families.mistral3.adapter import Mistral3Encoder

        return Mistral3Encoder(
            copy.deepcopy(tower),
            copy.deepcopy(inner.multi_modal_projector),
            inner.config.vision_feature_layer,
        )
