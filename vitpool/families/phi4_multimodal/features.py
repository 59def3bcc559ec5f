"""A stand-in for Phi-4-multimodal's image path (`Phi4MultimodalImageEmbedding`), answered through
vitpool; why one step above the tower: `vitpool.models.stand_in`.

The model has no `get_image_features`: `Phi4MultimodalModel.forward` calls
`embed_tokens_extend(input_ids, inputs_embeds, image_pixel_values=..., ...)`, which calls
`embed_tokens_extend.image_embed(input_ids, inputs_embeds, image_pixel_values=..., image_sizes=...,
image_attention_mask=...)` and takes the embeddings it returns, with the image rows written at the
image token's positions (audio goes through `embed_tokens_extend.audio_embed` beside it). This
stand-in takes `image_embed`'s place with that call's signature, so audio keeps its own module.

`vitpool.integrations.transformers.replace_vision_tower` cannot install it yet: it sets a plain
attribute of `model.model` and looks the tower's family up by the module's config `model_type`,
while `image_embed` sits one level down and its config is the full model's ("phi4_multimodal").
Installed by hand it serves the model:

    image_embed = model.model.embed_tokens_extend.image_embed
    model.model.embed_tokens_extend.image_embed = Phi4MultimodalFeatures(
        encoder, image_embed.img_projection_up.weight.dtype, image_embed.img_projection_up.weight.device,
        model.config)
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from vitpool.families.phi4_multimodal.processor import items as cut_items

# The name comes through the stand-ins' base: families sit below vitpool.items in the import flow
# (tests/unit/test_import_flow.py), and a stand-in builds items.
from vitpool.models.stand_in import Encoder, Image, PooledImageFeatures


class Phi4MultimodalFeatures(PooledImageFeatures):
    """Stands in for `model.model.embed_tokens_extend.image_embed`: each image of
    `image_pixel_values` [images, max crops, 3, S, S] is one item (its crops cut as
    `vitpool.items_from` cuts the processor's output), its tokens written at the image token's
    positions in order. `get_image_features` gives each image's tokens apart."""

    family = "Phi-4-multimodal"
    tower = "embed_tokens_extend.image_embed"
    projectors = ()

    def __init__(self, encoder: Encoder, dtype: torch.dtype, device: torch.device, config: Any) -> None:
        super().__init__(encoder, dtype, device, config)
        self._image_token_id = int(config.vision_config.image_token_id)

    def forward(
        self,
        input_ids: torch.LongTensor,
        inputs_embeds: torch.Tensor,
        image_pixel_values: torch.Tensor,
        image_sizes: torch.Tensor | None = None,
        image_attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        tokens = self.get_image_features(image_pixel_values, image_sizes, image_attention_mask).pooler_output
        positions = torch.nonzero(input_ids == self._image_token_id, as_tuple=True)
        rows = torch.cat(tokens).to(inputs_embeds.device, inputs_embeds.dtype)
        if rows.shape[0] != positions[0].numel():
            raise ValueError(
                f"the prompt holds {positions[0].numel()} image tokens; its images give {rows.shape[0]}"
            )
        return inputs_embeds.index_put(positions, rows)

    def get_image_features(
        self,
        image_pixel_values: torch.Tensor,
        image_sizes: torch.Tensor | None = None,
        image_attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPooling:
        """Each image's tokens [its placeholders, LLM width], as `image_embed` writes them."""
        if image_sizes is None or image_attention_mask is None:
            raise ValueError(
                "Phi-4-multimodal's images need image_sizes and image_attention_mask beside the pixels"
            )
        batch = {
            "image_pixel_values": image_pixel_values.detach().cpu(),
            "image_sizes": image_sizes.detach().cpu().reshape(-1, 2),
            "image_attention_mask": image_attention_mask.detach().cpu(),
        }
        images = [Image(part.pixel_values, part.grid) for part in cut_items(batch)]
        return BaseModelOutputWithPooling(pooler_output=self._encode(images))

    @staticmethod
    def encoder_module(inner: torch.nn.Module, tower: torch.nn.Module) -> torch.nn.Module:
        return copy.deepcopy(tower)
