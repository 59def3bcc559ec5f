"""The `get_image_features` stand-in of LFM2-VL's Hugging Face model (the transformers drop-in,
`vitpool.integrations.transformers`; why one step above the tower: `vitpool.models.stand_in`).
The model's projector unshuffles each entry by its `spatial_shapes` row, which a tower stand-in
could not give it."""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

# Image and Item through the stand-ins' base, which holds the one known arrow from models/ up to
# items.py (tests/unit/test_import_flow.py): a stand-in builds items
from vitpool.models.stand_in import Image, Item, PooledImageFeatures


class Lfm2VlFeatures(PooledImageFeatures):
    """`Lfm2VlModel.get_image_features`: every entry padded, [N, max_patches, C*P*P], with
    `spatial_shapes` [N, 2] and `pixel_attention_mask` in; `pooler_output` one tensor an entry out,
    as Hugging Face gives it. The model does not say which entries make one image (a tile attends
    within itself), so each entry is one item: `Image(pixel_values[i, :h*w], (h, w))`."""

    family = "LFM2-VL"
    tower = "vision_tower"
    projectors = ("multi_modal_projector",)

    def get_image_features(
        self,
        pixel_values: torch.Tensor,
        spatial_shapes: torch.Tensor,
        pixel_attention_mask: Any = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPooling:
        shapes = [(int(h), int(w)) for h, w in torch.as_tensor(spatial_shapes).tolist()]
        pixels = pixel_values.detach().cpu()
        items: list[Item] = [Image(pixels[index, : h * w], (h, w)) for index, (h, w) in enumerate(shapes)]
        return BaseModelOutputWithPooling(pooler_output=list(self._encode(items)))

    @staticmethod
    def encoder_module(inner: torch.nn.Module, tower: torch.nn.Module) -> torch.nn.Module:
        from vitpool.families.lfm2_vl.adapter import Lfm2VlEncoder

        return Lfm2VlEncoder(copy.deepcopy(tower), copy.deepcopy(inner.multi_modal_projector))
