"""The `get_image_features` stand-in of the family's Hugging Face model (the transformers drop-in,
`vitpool.integrations.transformers`; why one step above the tower: `vitpool.models.stand_in`)."""

from __future__ import annotations

import copy

import torch

from vitpool.families.step3p7.features import Step3p7Features


class DeepseekOcr2Features(Step3p7Features):
    """`DeepseekOcr2Model.get_image_features`: Step-3.7's arguments and answer; vitpool's global
    path appends the `view_separator` to each image's tokens, as the model does."""

    family = "DeepSeek-OCR-2"
    tower = "vision_tower"

    @staticmethod
    def encoder_module(inner: torch.nn.Module, tower: torch.nn.Module) -> torch.nn.Module:
        from vitpool.families.deepseek_ocr2.adapter import LOCAL_IMAGE_SIZE
        from vitpool.families.deepseek_ocr2.tower import DeepseekOcr2Encoder

        local = int(getattr(tower.config, "local_image_size", None) or LOCAL_IMAGE_SIZE)
        return DeepseekOcr2Encoder(
            copy.deepcopy(tower), copy.deepcopy(inner.multi_modal_projector), inner.view_separator, local
        )
