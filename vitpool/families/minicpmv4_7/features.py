"""The `get_image_features` stand-in of MiniCPM-V 4.7's Hugging Face model (the transformers
drop-in, `vitpool.integrations.transformers`): 4.6's, whose arguments, outputs and modules
(`vision_tower`, `merger`) 4.7's model shares, naming 4.7."""

from __future__ import annotations

import torch

from vitpool.errors import ConfigError
from vitpool.families.minicpmv4_6.features import MiniCPMV4_6Features
from vitpool.families.minicpmv4_7.adapter import FAMILY, as_4_7


class MiniCPMV4_7Features(MiniCPMV4_6Features):
    """`MiniCPMV4_7Model.get_image_features` (4.6's): the processor's strip [1, C, P, N*P] of every
    slice's patches and `target_sizes` [slices, 2] in; `pooler_output` one tensor a slice out."""

    family = FAMILY

    @staticmethod
    def encoder_module(inner: torch.nn.Module, tower: torch.nn.Module) -> torch.nn.Module:
        try:
            return MiniCPMV4_6Features.encoder_module(inner, tower)
        except ConfigError as error:
            raise as_4_7(error) from None
