"""The stand-in for Llama 3.2 Vision's vision modules (the transformers drop-in,
`vitpool.integrations.transformers`; why one step above the tower: `vitpool.models.stand_in`).

`MllamaModel` has no `get_image_features`: its forward calls `self.vision_model(pixel_values=...,
aspect_ratio_ids=..., aspect_ratio_mask=...)` and projects the last state with
`multi_modal_projector`. The stand-in takes the tower's place (the projector becomes a
pass-through) and answers with the projected states in the tower's shape."""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from vitpool.items import Image
from vitpool.models.stand_in import Encoder, PooledImageFeatures


class MllamaFeatures(PooledImageFeatures):
    """`MllamaVisionModel` and its projector: pixel values [batch, images, tiles, C, S, S] and aspect
    ratio ids in; `last_hidden_state` [batch, images, tiles, tokens a tile, LLM width] out, already
    projected. One item per real image (id above 0); the rows of padding tiles and images are
    zeros, which the LLM's cross-attention mask hides as it hides the model's own."""

    family = "Llama 3.2 Vision"
    tower = "vision_model"

    def __init__(self, encoder: Encoder, dtype: torch.dtype, device: torch.device, config: Any) -> None:
        super().__init__(encoder, dtype, device, config)
        vision = config.vision_config
        # the model reads it to expand its cross-attention mask
        self.num_patches = (int(vision.image_size) // int(vision.patch_size)) ** 2 + 1
        self.aspect_ratios = [tuple(canvas) for canvas in vision.supported_aspect_ratios]
        self.width = int(config.text_config.hidden_size)

    def get_image_features(
        self, pixel_values: torch.Tensor, aspect_ratio_ids: torch.Tensor, *args: Any, **kwargs: Any
    ) -> BaseModelOutputWithPooling:
        samples, images, tiles = pixel_values.shape[:3]
        places, items = [], []
        for sample, row in enumerate(aspect_ratio_ids.reshape(samples, images).tolist()):
            for image, ratio_id in enumerate(row):
                if ratio_id:
                    canvas = self.aspect_ratios[int(ratio_id) - 1]
                    count = canvas[0] * canvas[1]
                    places.append((sample, image, count))
                    items.append(Image(pixel_values[sample, image, :count].detach().cpu(), canvas))
        states = torch.zeros(
            (samples, images, tiles, self.num_patches, self.width), dtype=self._dtype, device=self._device
        )
        for (sample, image, count), tokens in zip(places, self._encode(items)):
            states[sample, image, :count] = tokens.reshape(count, self.num_patches, self.width)
        return BaseModelOutputWithPooling(last_hidden_state=states)

    @staticmethod
    def encoder_module(inner: torch.nn.Module, tower: torch.nn.Module) -> torch.nn.Module:
        from vitpool.families.mllama.adapter import MllamaEncoder

        return MllamaEncoder(copy.deepcopy(tower), copy.deepcopy(inner.multi_modal_projector))
