"""The `get_image_features` stand-in of LLaVA's Hugging Face model (the transformers drop-in,
`vitpool.integrations.transformers`; why one step above the tower: `vitpool.models.stand_in`). The
model selects a hidden state of its tower and drops the class token before its projector, which a
tower stand-in could not do for it."""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from vitpool.errors import ConfigError
from vitpool.models.stand_in import Encoder, PooledImageFeatures


class LlavaFeatures(PooledImageFeatures):
    """`LlavaModel.get_image_features`: views [images, 3, S, S] in, `pooler_output` one tensor an
    image [tokens a view, LLM width] out, the projector's output (what the model scatters into its
    image tokens). The tower's hidden states, which the model does not read, are not given."""

    family = "LLaVA"
    tower = "vision_tower"

    def __init__(self, encoder: Encoder, dtype: torch.dtype, device: torch.device, config: Any) -> None:
        super().__init__(encoder, dtype, device, config)
        self.settings = {
            "vision_feature_layer": config.vision_feature_layer,
            "vision_feature_select_strategy": config.vision_feature_select_strategy,
        }

    def get_image_features(
        self,
        pixel_values: torch.Tensor,
        vision_feature_layer: Any = None,
        vision_feature_select_strategy: str | None = None,
        image_sizes: torch.Tensor | None = None,
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
        if image_sizes is not None:
            # only Pixtral-towered LLaVA checkpoints pass sizes; their family is Mistral 3's layout
            raise ConfigError(
                f"{self.family}: views of one fixed size take no image_sizes (a CLIP tower's model gets none)"
            )
        return BaseModelOutputWithPooling(pooler_output=list(self._encode_tiles(pixel_values)))

    @staticmethod
    def encoder_module(inner: torch.nn.Module, tower: torch.nn.Module) -> torch.nn.Module:
        from vitpool.families.llava.adapter import LlavaEncoder

        return LlavaEncoder(copy.deepcopy(tower), copy.deepcopy(inner.multi_modal_projector), inner.config)
