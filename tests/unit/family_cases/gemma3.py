"""Gemma 3 (SigLIP + multi_modal_projector) under the adapter conformance suite, and the tiny model
its own tests share. The reference is Hugging Face's full model's `get_image_features` on one item's
views alone (tower, then average pooling, RMSNorm and projection): its `pooler_output`, what the
model scatters into its image tokens, flattened to rows."""

from __future__ import annotations

import copy
from typing import Any

import torch

from family_cases.common import randomize, tiled_case_fields
from vitpool import GraphEncoder

VIEW = 32  # pixels per view side; patches of 4 pixels: 8 x 8 patches, pooled 4 x 4 into 2 x 2 tokens
TOKENS_PER_VIEW = 4
TINY_VISION = {
    "model_type": "siglip_vision_model",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": VIEW,
    "patch_size": 4,
    "vision_use_head": False,  # as in every Gemma 3 release
}
TINY_TEXT = {
    "hidden_size": 48,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 24,
    "vocab_size": 128,
    "sliding_window": 16,
}
ROW_SHAPE = (3, VIEW, VIEW)


def full_config() -> Any:
    from transformers import Gemma3Config

    config = Gemma3Config(
        vision_config=dict(TINY_VISION), text_config=dict(TINY_TEXT), mm_tokens_per_image=TOKENS_PER_VIEW
    )
    config._attn_implementation = "sdpa"
    return config


def hf_model(seed: int = 0) -> torch.nn.Module:
    """The full model with unit-scale random vision and projector weights."""
    from transformers import Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration(full_config())
    randomize(model.model.vision_tower, seed)
    randomize(model.model.multi_modal_projector, seed + 1)
    return model.eval().requires_grad_(False)


def encoder_of(model: torch.nn.Module, budgets: list[int]) -> GraphEncoder:
    from vitpool.families.gemma3.adapter import Gemma3Adapter, Gemma3Encoder

    module = Gemma3Encoder(
        copy.deepcopy(model.model.vision_tower), copy.deepcopy(model.model.multi_modal_projector)
    )
    return GraphEncoder(Gemma3Adapter(module), budgets=budgets, device="cpu", dtype=torch.float32)


def image_features(model: torch.nn.Module, item: Any) -> torch.Tensor:
    """What the model hands its LLM for one image: [views * tokens a view, text width]."""
    with torch.no_grad():
        tokens = model.model.get_image_features(pixel_values=torch.as_tensor(item.pixel_values)).pooler_output
    return tokens.reshape(-1, tokens.shape[-1])


TOKENS_PER_TILE = TOKENS_PER_VIEW  # a tile: a view
TILE_SHAPE = ROW_SHAPE
CASE_FIELDS = tiled_case_fields(hf_model, encoder_of, image_features, ROW_SHAPE, (4, 8, 16))
