"""The `get_image_features` stand-in of the family's Hugging Face model (the transformers drop-in,
`vitpool.integrations.transformers`; why one step above the tower: `vitpool.models.stand_in`)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from vitpool.errors import ConfigError
from vitpool.models.stand_in import PooledImageFeatures


class InternVLFeatures(PooledImageFeatures):
    """`InternVLModel.get_image_features`: tiles in, `pooler_output` [tiles, tokens a tile, width]."""

    family = "InternVL"
    tower = "vision_tower"

    def get_image_features(
        self,
        pixel_values: torch.Tensor,
        vision_feature_layer: Any = None,
        vision_feature_select_strategy: str | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPooling:
        if vision_feature_layer not in (None, -1) or vision_feature_select_strategy not in (None, "default"):
            raise ConfigError(
                "vitpool runs InternVL with vision_feature_layer=-1 and vision_feature_select_strategy="
                f"'default'; got {vision_feature_layer!r}, {vision_feature_select_strategy!r}: leave them "
                "unset"
            )
        return BaseModelOutputWithPooling(pooler_output=self._encode_tiles(pixel_values))

    @staticmethod
    def encoder_module(inner: torch.nn.Module, tower: torch.nn.Module) -> torch.nn.Module:
        from vitpool.families.internvl.adapter import InternVLEncoder

        return InternVLEncoder(copy.deepcopy(tower), copy.deepcopy(inner.multi_modal_projector), inner.config)
