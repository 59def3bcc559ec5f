"""InternVL (InternViT + multi_modal_projector) under the adapter conformance suite, and the tiny
models its own tests share. The reference is Hugging Face's full model's `get_image_features` on
one item's tiles alone (tower, class token dropped, pixel shuffle, projector)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from family_cases.common import randomize, tiled_case_fields

from vitpool import GraphEncoder

TILE = 8  # pixels per tile side; patches of 2 pixels: 16 patches, 4 tokens a tile after the shuffle
TOKENS_PER_TILE = 4
TINY_VISION = {
    "hidden_size": 32,
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "intermediate_size": 64,
    "image_size": TILE,
    "patch_size": 2,
}
TINY_TEXT = {
    "model_type": "qwen2",
    "hidden_size": 48,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "vocab_size": 128,
}
ROW_SHAPE = (3, TILE, TILE)


def full_config() -> Any:
    from transformers import InternVLConfig

    config = InternVLConfig(vision_config=dict(TINY_VISION), text_config=dict(TINY_TEXT))
    config._attn_implementation = "sdpa"
    return config


def hf_model(seed: int = 0) -> torch.nn.Module:
    """The full model with unit-scale random vision and projector weights."""
    from transformers import InternVLForConditionalGeneration

    model = InternVLForConditionalGeneration(full_config())
    randomize(model.model.vision_tower, seed)
    randomize(model.model.multi_modal_projector, seed + 1)
    return model.eval().requires_grad_(False)


def encoder_of(model: torch.nn.Module, budgets: list[int]) -> GraphEncoder:
    from vitpool.models.internvl import InternVLAdapter, InternVLEncoder

    module = InternVLEncoder(
        copy.deepcopy(model.model.vision_tower),
        copy.deepcopy(model.model.multi_modal_projector),
        model.config,
    )
    return GraphEncoder(InternVLAdapter(module), budgets=budgets, device="cpu", dtype=torch.float32)


def image_features(model: torch.nn.Module, item: Any) -> torch.Tensor:
    """What the model hands its LLM for one image: [tiles * tokens per tile, text width]."""
    with torch.no_grad():
        tokens = model.model.get_image_features(pixel_values=torch.as_tensor(item.pixel_values)).pooler_output
    return tokens.reshape(-1, tokens.shape[-1])


CASE_FIELDS = tiled_case_fields(hf_model, encoder_of, image_features, ROW_SHAPE, (4, 8, 16))
