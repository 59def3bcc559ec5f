"""The `get_image_features` stand-in of the family's Hugging Face model (the transformers drop-in,
`vitpool.integrations.transformers`; why one step above the tower: `vitpool.models.stand_in`)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from vitpool.errors import ConfigError
from vitpool.items import Image, Item
from vitpool.models.stand_in import Encoder, PooledImageFeatures


class MiniCPMV4_6Features(PooledImageFeatures):
    """`MiniCPMV4_6Model.get_image_features`: the processor's strip [1, C, P, N*P] of every slice's
    patches and `target_sizes` [slices, 2] in; `pooler_output` one tensor a slice out. Items
    `Image(a slice's patch rows, [[h, w]])`."""

    family = "MiniCPM-V 4.6"
    tower = "vision_tower"
    projectors = ("merger",)

    def __init__(self, encoder: Encoder, dtype: torch.dtype, device: torch.device, config: Any) -> None:
        super().__init__(encoder, dtype, device, config)
        self.patch_size = int(config.vision_config.patch_size)
        self.downsample_mode = config.downsample_mode

    def get_image_features(
        self,
        pixel_values: torch.Tensor,
        target_sizes: torch.Tensor,
        downsample_mode: str | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPooling:
        from vitpool.families.minicpmv4_6.rules import patch_rows

        mode = downsample_mode or self.downsample_mode
        if mode != "16x":
            raise ConfigError(f"{self.family}: vitpool runs downsample_mode '16x' only; got {mode!r}")
        sizes = [(int(h), int(w)) for h, w in torch.as_tensor(target_sizes).tolist()]
        rows = patch_rows(pixel_values.detach().cpu(), self.patch_size)  # [N, C, P, P]
        if sum(h * w for h, w in sizes) != rows.shape[0]:
            raise ValueError(
                f"{self.family}: pixel_values hold {rows.shape[0]} patches; target_sizes {sizes} need "
                f"{sum(h * w for h, w in sizes)}"
            )
        chunks = torch.split(rows, [h * w for h, w in sizes])
        items: list[Item] = [Image(chunk, [[h, w]]) for chunk, (h, w) in zip(chunks, sizes)]
        return BaseModelOutputWithPooling(pooler_output=self._encode(items))

    @staticmethod
    def encoder_module(inner: torch.nn.Module, tower: torch.nn.Module) -> torch.nn.Module:
        from vitpool.families.minicpmv4_6.adapter import MiniCPMV4_6Encoder

        if inner.config.downsample_mode != "16x":
            raise ConfigError(
                f"MiniCPM-V 4.6: vitpool runs downsample_mode '16x' only; the model's config has "
                f"{inner.config.downsample_mode!r}"
            )
        return MiniCPMV4_6Encoder(copy.deepcopy(tower), copy.deepcopy(inner.merger))
