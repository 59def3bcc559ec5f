"""The `get_image_features` stand-in of the family's Hugging Face model (the transformers drop-in,
`vitpool.integrations.transformers`; why one step above the tower: `vitpool.models.stand_in`)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from vitpool.errors import ConfigError
from vitpool.models.stand_in import Encoder, PooledImageFeatures


class AyaVisionFeatures(PooledImageFeatures):
    """`AyaVisionModel.get_image_features`: tiles in, `pooler_output` [tiles, tokens a tile, LLM
    width], the projector's output (what the model scatters into its image tokens). Each tile is one
    item: a tile attends within itself, so results do not depend on where an image ends."""

    family = "Aya Vision"
    tower = "vision_tower"

    def __init__(self, encoder: Encoder, dtype: torch.dtype, device: torch.device, config: Any) -> None:
        super().__init__(encoder, dtype, device, config)
        # the encoder runs the model's own selection; another one asked for per call cannot be honoured
        self._selection = (config.vision_feature_layer, config.vision_feature_select_strategy)

    def get_image_features(
        self,
        pixel_values: torch.Tensor,
        vision_feature_layer: Any = None,
        vision_feature_select_strategy: str | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPooling:
        layer, strategy = self._selection
        if vision_feature_layer not in (None, layer) or vision_feature_select_strategy not in (
            None,
            strategy,
        ):
            raise ConfigError(
                f"vitpool runs Aya Vision with the model's vision_feature_layer={layer!r} and "
                f"vision_feature_select_strategy={strategy!r}; got {vision_feature_layer!r}, "
                f"{vision_feature_select_strategy!r}: leave them unset"
            )
        return BaseModelOutputWithPooling(pooler_output=self._encode_tiles(pixel_values))

    @staticmethod
    def encoder_module(inner: torch.nn.Module, tower: torch.nn.Module) -> torch.nn.Module:
        from vitpool.families.aya_vision.adapter import AyaVisionEncoder

        return AyaVisionEncoder(
            copy.deepcopy(tower), copy.deepcopy(inner.multi_modal_projector), inner.config
        )
