"""The `get_image_features` stand-in of the family's Hugging Face models (the transformers drop-in,
`vitpool.integrations.transformers`; why one step above the tower: `vitpool.models.stand_in`)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from vitpool.models.stand_in import Encoder, PooledImageFeatures


class Idefics3Features(PooledImageFeatures):
    """`Idefics3Model.get_image_features` (and SmolVLM's): pixel values [samples, frames, 3, S, S]
    padded with all-zero frames, which it drops, in; `pooler_output` out, one tensor per sample
    [its real frames * tokens a frame, LLM width]. Each real frame is one item (a split attends
    within itself, so results do not depend on where an image ends)."""

    family = "Idefics3"
    tower = "vision_model"
    projectors = ("connector",)

    def __init__(self, encoder: Encoder, dtype: torch.dtype, device: torch.device, config: Any) -> None:
        super().__init__(encoder, dtype, device, config)
        # SmolVLM keeps the first frame where a batch has no real one (a text-only batch's dummy image)
        self._keep_a_frame = getattr(config, "model_type", None) == "smolvlm"
        self._width = int(config.text_config.hidden_size)

    def get_image_features(
        self, pixel_values: torch.Tensor, pixel_attention_mask: torch.Tensor | None = None, **kwargs: Any
    ) -> BaseModelOutputWithPooling:
        num_samples, num_frames = pixel_values.shape[:2]
        frames = pixel_values.detach().cpu().reshape(num_samples * num_frames, *pixel_values.shape[2:])
        real = (frames != 0).flatten(1).any(dim=1)
        if self._keep_a_frame and not bool(real.any()):
            real[0] = True
        if pixel_attention_mask is not None:
            masks = pixel_attention_mask.detach().cpu().reshape(num_samples * num_frames, -1)
            partial = [int(i) for i in real.nonzero().flatten() if not bool(masks[i].all())]
            if partial:
                raise ValueError(
                    f"pixel_attention_mask marks padding inside real frames {partial}: vitpool runs whole "
                    "splits only, as the image processor cuts them"
                )
        counts = real.view(num_samples, num_frames).sum(dim=1).tolist()
        if not sum(counts):
            empty = torch.empty(0, self._width, dtype=self._dtype, device=self._device)
            return BaseModelOutputWithPooling(pooler_output=[empty] * num_samples)
        tokens = self._encode_tiles(frames[real])  # [real frames, tokens a frame, LLM width]
        return BaseModelOutputWithPooling(
            pooler_output=[part.reshape(-1, self._width) for part in tokens.split(counts)]
        )

    @staticmethod
    def encoder_module(inner: torch.nn.Module, tower: torch.nn.Module) -> torch.nn.Module:
        from vitpool.families.idefics3.adapter import Idefics3VisionEncoder

        return Idefics3VisionEncoder(copy.deepcopy(tower), copy.deepcopy(inner.connector))
