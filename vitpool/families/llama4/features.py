"""The `get_image_features` stand-in of the family's Hugging Face model (the transformers drop-in,
`vitpool.integrations.transformers`; why one step above the tower: `vitpool.models.stand_in`)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from vitpool.models.stand_in import PooledImageFeatures


class Llama4Features(PooledImageFeatures):
    """`Llama4ForConditionalGeneration.get_image_features`: tiles in, `last_hidden_state` [tiles,
    tokens a tile, LLM width], already projected (the model's projector is a pass-through)."""

    family = "Llama 4"
    tower = "vision_model"

    def get_image_features(self, pixel_values: torch.Tensor, **kwargs: Any) -> BaseModelOutputWithPooling:
        return BaseModelOutputWithPooling(last_hidden_state=self._encode_tiles(pixel_values))

    @staticmethod
    def encoder_module(inner: torch.nn.Module, tower: torch.nn.Module) -> torch.nn.Module:
        from vitpool.families.llama4.adapter import Llama4Encoder

        return Llama4Encoder(copy.deepcopy(tower), copy.deepcopy(inner.multi_modal_projector))
