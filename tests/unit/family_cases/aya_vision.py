"""Aya Vision (SigLIP + multi_modal_projector) under the adapter conformance suite, and the tiny model
its own tests share. The reference is Hugging Face's full model's `get_image_features` on one item's
tiles alone (the tower's `vision_feature_layer` hidden state, pixel shuffle, LayerNorm, SwiGLU MLP):
its `pooler_output`, what the model scatters into its image tokens, flattened to rows.

The tiny model: 8-pixel tiles of 2-pixel patches (4 x 4 patches, shuffled by 2 into 2 x 2 = 4 tokens
a tile) and three layers, so that a `vision_feature_layer` short of the last one leaves layers out.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from family_cases.common import randomize, tiled_case_fields
from vitpool import GraphEncoder

TILE = 8
TOKENS_PER_TILE = 4
TINY_VISION = {
    "model_type": "siglip_vision_model",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "image_size": TILE,
    "patch_size": 2,
    "vision_use_head": False,  # as the releases
}
TINY_TEXT = {
    "model_type": "cohere2",
    "hidden_size": 48,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 128,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
# unlike the LLM's width, so that a projector built from the wrong one fails to load
ALIGNMENT_INTERMEDIATE_SIZE = 40
ROW_SHAPE = (3, TILE, TILE)
TILE_SHAPE = ROW_SHAPE  # the tiled families' pool test loads the full model's save


def full_config(**changes: Any) -> Any:
    from transformers import AyaVisionConfig

    settings = {
        "alignment_intermediate_size": ALIGNMENT_INTERMEDIATE_SIZE,
        "adapter_layer_norm_eps": 1e-5,
        "image_token_index": 3,
        **changes,
    }
    config = AyaVisionConfig(vision_config=dict(TINY_VISION), text_config=dict(TINY_TEXT), **settings)
    config._attn_implementation = "sdpa"
    return config


def hf_model(seed: int = 0, **changes: Any) -> torch.nn.Module:
    """The full model with unit-scale random tower and projector weights."""
    from transformers import AyaVisionForConditionalGeneration

    model = AyaVisionForConditionalGeneration(full_config(**changes))
    randomize(model.model.vision_tower, seed)
    randomize(model.model.multi_modal_projector, seed + 1)
    return model.eval().requires_grad_(False)


def encoder_module(model: torch.nn.Module) -> Any:
    from vitpool.families.aya_vision.adapter import AyaVisionEncoder

    return AyaVisionEncoder(
        copy.deepcopy(model.model.vision_tower),
        copy.deepcopy(model.model.multi_modal_projector),
        model.config,
    )


def encoder_of(model: torch.nn.Module, budgets: list[int]) -> GraphEncoder:
    from vitpool.families.aya_vision.adapter import AyaVisionAdapter

    adapter = AyaVisionAdapter(encoder_module(model))
    return GraphEncoder(adapter, budgets=budgets, device="cpu", dtype=torch.float32)


def image_features(model: torch.nn.Module, item: Any) -> torch.Tensor:
    """What the model hands its LLM for one image: [tiles * tokens a tile, text width]."""
    with torch.no_grad():
        tokens = model.model.get_image_features(pixel_values=torch.as_tensor(item.pixel_values)).pooler_output
    return tokens.reshape(-1, tokens.shape[-1])


CASE_FIELDS = tiled_case_fields(hf_model, encoder_of, image_features, ROW_SHAPE, (4, 8, 16))
