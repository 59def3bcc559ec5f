"""The `get_image_features` stand-in of PaliGemma's Hugging Face model (the transformers drop-in,
`vitpool.integrations.transformers`; why one step above the tower: `vitpool.models.stand_in`)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from vitpool.models.stand_in import PooledImageFeatures


class PaliGemmaFeatures(PooledImageFeatures):
    """`PaliGemmaModel.get_image_features`: views [images, 3, S, S] in, `pooler_output` [images,
    tokens a view, LLM width], the projector's output (what the model scatters into its image
    tokens), one item a view. The tower's own `last_hidden_state`, which the model does not read, is
    not given."""

    family = "PaliGemma"
    tower = "vision_tower"

    def get_image_features(self, pixel_values: torch.Tensor, **kwargs: Any) -> BaseModelOutputWithPooling:
        return BaseModelOutputWithPooling(pooler_output=self._encode_tiles(pixel_values))

    @staticmethod
    def encoder_module(inner: torch.nn.Module, tower: torch.nn.Module) -> torch.nn.Module:
        from vitpool.families.paligemma.adapter import PaliGemmaEncoder

        return PaliGemmaEncoder(copy.deepcopy(tower), copy.deepcopy(inner.multi_modal_projector))
