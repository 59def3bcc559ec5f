"""PaliGemma (SigLIP + multi_modal_projector) under the adapter conformance suite, and the tiny model
its own tests share. The reference is Hugging Face's full model's `get_image_features` on one item's
views alone (the tower, then the projector's Linear, no scaling): its `pooler_output`, what the model
scatters into its image tokens, flattened to rows."""

from __future__ import annotations

import copy
from typing import Any

import torch

from family_cases.common import randomize, tiled_case_fields
from vitpool import GraphEncoder

VIEW = 32  # pixels per view side; patches of 4 pixels: 8 x 8 patches, one token each
TOKENS_PER_VIEW = (VIEW // 4) ** 2
TINY_VISION = {
    "model_type": "siglip_vision_model",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": VIEW,
    "patch_size": 4,
    "vision_use_head": False,  # as in every PaliGemma release
}
TEXT_WIDTH = 48  # the LLM's width, which the projector maps into (projection_dim)
# PaliGemma's LLM is Gemma; PaliGemma 2's is Gemma 2 (the vision path is the same)
TINY_TEXT = {
    "gemma": {
        "model_type": "gemma",
        "hidden_size": TEXT_WIDTH,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 24,
        "vocab_size": 128,
    },
}
TINY_TEXT["gemma2"] = {**TINY_TEXT["gemma"], "model_type": "gemma2", "sliding_window": 16}
IMAGE_TOKEN_ID = 127  # the tiny vocabulary's last token
ROW_SHAPE = (3, VIEW, VIEW)


def full_config(text: str = "gemma") -> Any:
    """The full model's config: PaliGemma's (`text="gemma"`) or PaliGemma 2's (`"gemma2"`)."""
    from transformers import PaliGemmaConfig

    config = PaliGemmaConfig(
        vision_config=dict(TINY_VISION),
        text_config=dict(TINY_TEXT[text]),
        projection_dim=TEXT_WIDTH,
        image_token_index=IMAGE_TOKEN_ID,
        vocab_size=TINY_TEXT[text]["vocab_size"],
    )
    # the tower as the encoder runs it; the LLM keeps its own default (Gemma 2 has no SDPA path)
    config.vision_config._attn_implementation = "sdpa"
    return config


def hf_model(seed: int = 0, text: str = "gemma") -> torch.nn.Module:
    """The full model with unit-scale random vision and projector weights."""
    from transformers import PaliGemmaForConditionalGeneration

    model = PaliGemmaForConditionalGeneration(full_config(text))
    randomize(model.model.vision_tower, seed)
    randomize(model.model.multi_modal_projector, seed + 1)
    return model.eval().requires_grad_(False)


def encoder_of(model: torch.nn.Module, budgets: list[int]) -> GraphEncoder:
    from vitpool.families.paligemma.adapter import PaliGemmaAdapter, PaliGemmaEncoder

    module = PaliGemmaEncoder(
        copy.deepcopy(model.model.vision_tower), copy.deepcopy(model.model.multi_modal_projector)
    )
    return GraphEncoder(PaliGemmaAdapter(module), budgets=budgets, device="cpu", dtype=torch.float32)


def image_features(model: torch.nn.Module, item: Any) -> torch.Tensor:
    """What the model hands its LLM for one item: [views * tokens a view, LLM width]."""
    with torch.no_grad():
        tokens = model.model.get_image_features(pixel_values=torch.as_tensor(item.pixel_values)).pooler_output
    return tokens.reshape(-1, tokens.shape[-1])


TOKENS_PER_TILE = TOKENS_PER_VIEW  # a tile: a view
TILE_SHAPE = ROW_SHAPE
CASE_FIELDS = tiled_case_fields(hf_model, encoder_of, image_features, ROW_SHAPE, (64, 128, 256))
