"""Llama 4 (Llama4VisionModel + multi_modal_projector) under the adapter conformance suite, and the
tiny models its own tests share. The reference is Hugging Face's full model on one item's tiles
alone: its vision model (what `get_image_features` runs), flattened and projected as its forward
hands the LLM."""

from __future__ import annotations

import copy
from typing import Any

import torch

from family_cases.common import randomize, tiled_case_fields
from vitpool import GraphEncoder

TILE = 16  # pixels per tile side; patches of 2 pixels: 64 patches, 16 tokens a tile after the shuffle
TOKENS_PER_TILE = 16
TINY_VISION = {
    "hidden_size": 32,
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "image_size": TILE,
    "patch_size": 2,
    "vision_output_dim": 32,
    "projector_input_dim": 32,
    "projector_output_dim": 32,
    "pixel_shuffle_ratio": 0.5,
}
TINY_TEXT = {
    "hidden_size": 48,
    "intermediate_size": 64,
    "intermediate_size_mlp": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "vocab_size": 128,
    "num_local_experts": 2,
}
ROW_SHAPE = (3, TILE, TILE)


def hf_model(seed: int = 0) -> torch.nn.Module:
    """The full model with unit-scale random vision and projector weights."""
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    config = Llama4Config(vision_config=dict(TINY_VISION), text_config=dict(TINY_TEXT))
    config._attn_implementation = "sdpa"
    model = Llama4ForConditionalGeneration(config)
    randomize(model.vision_model, seed)
    randomize(model.multi_modal_projector, seed + 1)
    return model.eval().requires_grad_(False)


def encoder_of(model: torch.nn.Module, budgets: list[int]) -> GraphEncoder:
    from vitpool.families.llama4.adapter import Llama4Adapter, Llama4Encoder

    module = Llama4Encoder(copy.deepcopy(model.vision_model), copy.deepcopy(model.multi_modal_projector))
    return GraphEncoder(Llama4Adapter(module), budgets=budgets, device="cpu", dtype=torch.float32)


def image_features(model: torch.nn.Module, item: Any) -> torch.Tensor:
    """What the model hands its LLM for one image: [tiles * tokens per tile, text width]."""
    with torch.no_grad():
        # the tower get_image_features runs (its signature differs between transformers releases)
        # the model's dtype: torchvision's Llama 4 processor gives bfloat16 pixels
        pixels = torch.as_tensor(item.pixel_values).to(model.vision_model.dtype)
        features = model.vision_model(pixel_values=pixels).last_hidden_state
        return model.multi_modal_projector(features.reshape(-1, features.shape[-1]))


TILE_SHAPE = ROW_SHAPE
CASE_FIELDS = tiled_case_fields(hf_model, encoder_of, image_features, ROW_SHAPE, (16, 32, 64))
