"""LLaVA 1.5 (CLIP + feature selection + multi_modal_projector) under the adapter conformance suite,
and the tiny model its own tests share. The reference is Hugging Face's full model's
`get_image_features` on one item's views alone (the tower's hidden state -2, the class token dropped,
the projector): its `pooler_output`, one tensor a view, what the model scatters into its image
tokens, joined to rows."""

from __future__ import annotations

import copy
from typing import Any

import torch

from family_cases.common import randomize, tiled_case_fields
from vitpool import GraphEncoder

VIEW = 16  # pixels per view side; patches of 4 pixels: 4 x 4 patches and the class token
PATCH = 4
TOKENS_PER_VIEW = (VIEW // PATCH) ** 2  # "default": the class token dropped
TINY_VISION = {
    "model_type": "clip_vision_model",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,  # -2 reads layer 2's output: layer 3 is cut
    "num_attention_heads": 2,
    "image_size": VIEW,
    "patch_size": PATCH,
    "projection_dim": 16,
}
TINY_TEXT = {
    "model_type": "llama",
    "hidden_size": 48,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 128,
}
IMAGE_TOKEN_ID = 127  # the tiny vocabulary's last token
ROW_SHAPE = (3, VIEW, VIEW)


def full_config(vision: dict | None = None, **settings: Any) -> Any:
    """The full model's config (LlavaConfig's defaults: layer -2, "default", GELU, biases), with
    `settings` (vision_feature_layer, vision_feature_select_strategy, ...) replacing them and
    `vision` replacing fields of the tiny vision config (a view's size)."""
    from transformers import LlavaConfig

    vision = {**TINY_VISION, **(vision or {})}
    side = vision["image_size"] // vision["patch_size"]
    config = LlavaConfig(
        vision_config=vision,
        text_config=dict(TINY_TEXT),
        image_token_index=IMAGE_TOKEN_ID,
        # the placeholders a view takes in the prompt: its patches, and the class token under "full"
        image_seq_length=side * side + (settings.get("vision_feature_select_strategy") == "full"),
        **settings,
    )
    config.vision_config._attn_implementation = "sdpa"
    return config


def hf_model(seed: int = 0, vision: dict | None = None, **settings: Any) -> torch.nn.Module:
    """The full model (`full_config`) with unit-scale random vision and projector weights (the class
    embedding too, so that the class token every patch attends to matters)."""
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration(full_config(vision, **settings))
    randomize(model.model.vision_tower, seed)
    randomize(model.model.multi_modal_projector, seed + 1)
    with torch.no_grad():
        embedding = model.model.vision_tower.embeddings.class_embedding
        embedding.copy_(torch.randn(embedding.shape, generator=torch.Generator().manual_seed(seed + 2)))
    return model.eval().requires_grad_(False)


def encoder_of(model: torch.nn.Module, budgets: list[int]) -> GraphEncoder:
    from vitpool.families.llava.adapter import LlavaAdapter, LlavaEncoder

    module = LlavaEncoder(
        copy.deepcopy(model.model.vision_tower),
        copy.deepcopy(model.model.multi_modal_projector),
        model.config,
    )
    return GraphEncoder(LlavaAdapter(module), budgets=budgets, device="cpu", dtype=torch.float32)


def image_features(model: torch.nn.Module, item: Any) -> torch.Tensor:
    """What the model hands its LLM for one item's views: [views * tokens a view, text width]."""
    with torch.no_grad():
        tokens = model.model.get_image_features(pixel_values=torch.as_tensor(item.pixel_values)).pooler_output
    return torch.cat(list(tokens))


TOKENS_PER_TILE = TOKENS_PER_VIEW  # a tile: a view
TILE_SHAPE = ROW_SHAPE
CASE_FIELDS = tiled_case_fields(hf_model, encoder_of, image_features, ROW_SHAPE, (16, 32, 64))
