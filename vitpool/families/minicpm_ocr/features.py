"""The `get_image_features` stand-in of MiniCPM-OCR's Hugging Face model (the transformers drop-in,
`vitpool.integrations.transformers`): 4.6's, whose arguments, outputs and modules (`vision_tower`,
`merger`) MiniCPM-OCR's model shares, in the mode of the model's config ("4x" by default)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from vitpool.errors import ConfigError
from vitpool.families.minicpm_ocr.rules import FAMILY, MERGE_SIDE
from vitpool.families.minicpmv4_6.features import MiniCPMV4_6Features


class MiniCPMOcrFeatures(MiniCPMV4_6Features):
    """`MiniCPMOcrModel.get_image_features`: the processor's strip [1, C, P, N*P] of every slice's
    patches and `target_sizes` [slices, 2] in; `pooler_output` one tensor a slice out. The
    encoder runs the config's mode; a call asking for the other is refused."""

    family = FAMILY

    def get_image_features(
        self,
        pixel_values: torch.Tensor,
        target_sizes: torch.Tensor,
        downsample_mode: str | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPooling:
        mode = downsample_mode or self.downsample_mode
        if mode != self.downsample_mode:
            raise ConfigError(
                f"{FAMILY}: vitpool's encoder runs the model's downsample_mode {self.downsample_mode!r}; "
                f"got {mode!r} for this call: set model.config.downsample_mode and build the encoder again"
            )
        # 4.6's cut of the strip; its check is of 4.6's one mode, the encoder's mode is checked above
        return super().get_image_features(pixel_values, target_sizes, "16x", **kwargs)

    @staticmethod
    def encoder_module(inner: torch.nn.Module, tower: torch.nn.Module) -> torch.nn.Module:
        from vitpool.families.minicpm_ocr.adapter import MiniCPMOcrEncoder

        mode = inner.config.downsample_mode
        if mode not in MERGE_SIDE:
            raise ConfigError(
                f"{FAMILY}: vitpool runs downsample_mode '4x' or '16x'; the model's config has {mode!r}"
            )
        return MiniCPMOcrEncoder(copy.deepcopy(tower), copy.deepcopy(inner.merger), mode)
