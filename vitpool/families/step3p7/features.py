"""The `get_image_features` stand-in of the family's Hugging Face model (the transformers drop-in,
`vitpool.integrations.transformers`; why one step above the tower: `vitpool.models.stand_in`)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from vitpool.items import Image, Item
from vitpool.models.stand_in import PooledImageFeatures


class Step3p7Features(PooledImageFeatures):
    """`Step3p7Model.get_image_features`: a global view per image (`pixel_values` [images, C, S, S]),
    the crops of all images (`pixel_values_local`) and each image's crop count
    (`num_local_patches`) in; `pooler_output` one tensor an image (crops' tokens, then the global
    view's) out. Items `Image(view, inputs={"pixel_values_local": its crops})`."""

    family = "Step-3.7"
    tower = "vision_model"

    def get_image_features(
        self,
        pixel_values: torch.Tensor,
        pixel_values_local: torch.Tensor | None = None,
        num_local_patches: Any = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPooling:
        views = pixel_values.detach().cpu()
        counts = [0] * len(views) if num_local_patches is None else [int(n) for n in num_local_patches]
        num_crops = 0 if pixel_values_local is None else pixel_values_local.shape[0]
        if len(counts) != len(views) or sum(counts) != num_crops:
            raise ValueError(
                f"{self.family}: num_local_patches {counts} must give each of the {len(views)} images its "
                f"crops and add up to the {num_crops} crops of pixel_values_local"
            )
        crops = torch.split(pixel_values_local.detach().cpu(), counts) if num_crops else [None] * len(views)
        items: list[Item] = [
            Image(view[None], inputs={"pixel_values_local": local} if count else None)
            for view, local, count in zip(views, crops, counts)
        ]
        return BaseModelOutputWithPooling(pooler_output=self._encode(items))

    @staticmethod
    def encoder_module(inner: torch.nn.Module, tower: torch.nn.Module) -> torch.nn.Module:
        from vitpool.families.step3p7.adapter import LOCAL_IMAGE_SIZE, Step3p7Encoder

        local = int(getattr(tower.config, "local_image_size", None) or LOCAL_IMAGE_SIZE)
        return Step3p7Encoder(copy.deepcopy(tower), copy.deepcopy(inner.multi_modal_projector), local)
