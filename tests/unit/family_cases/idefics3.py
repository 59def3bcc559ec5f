"""Idefics3 and SmolVLM (SigLIP tower + connector) under the adapter conformance suite (Idefics3's
tiny model), and the tiny models the family's own tests share. The reference is Hugging Face's full
model's `get_image_features` on one item's splits alone, as one sample (tower, pixel shuffle,
projection: what its LLM receives for that image)."""

from __future__ import annotations

import copy
from typing import Any

import torch

from family_cases.common import randomize, tiled_case_fields
from vitpool import GraphEncoder

TOKENS_PER_TILE = 4
TINY_TEXT = {
    "model_type": "llama",
    "hidden_size": 48,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "vocab_size": 128,
}
_TINY_TOWER = {"hidden_size": 32, "num_attention_heads": 2, "num_hidden_layers": 2, "intermediate_size": 64}
# per kind: its model class, config class, vision config and connector scale factor. Idefics3:
# 8-pixel splits of 2-pixel patches (4 x 4), shuffled by 2; SmolVLM: 12-pixel splits (6 x 6),
# shuffled by 3. Both give 4 tokens a split.
KINDS = {
    "idefics3": (
        "Idefics3ForConditionalGeneration",
        "Idefics3Config",
        {**_TINY_TOWER, "image_size": 8, "patch_size": 2},
        2,
    ),
    "smolvlm": (
        "SmolVLMForConditionalGeneration",
        "SmolVLMConfig",
        {**_TINY_TOWER, "image_size": 12, "patch_size": 2},
        3,
    ),
}


def row_shape(kind: str) -> tuple[int, int, int]:
    side = KINDS[kind][2]["image_size"]
    return (3, side, side)


def full_config(kind: str = "idefics3") -> Any:
    import transformers

    _, config_class, vision, scale = KINDS[kind]
    config = getattr(transformers, config_class)(
        vision_config=dict(vision), text_config=dict(TINY_TEXT), scale_factor=scale
    )
    config._attn_implementation = "sdpa"
    return config


def hf_model(seed: int = 0, kind: str = "idefics3") -> torch.nn.Module:
    """The full model with unit-scale random tower and connector weights."""
    import transformers

    model = getattr(transformers, KINDS[kind][0])(full_config(kind))
    randomize(model.model.vision_model, seed)
    randomize(model.model.connector, seed + 1)
    return model.eval().requires_grad_(False)


def encoder_of(model: torch.nn.Module, budgets: list[int]) -> GraphEncoder:
    from vitpool.families.idefics3.adapter import Idefics3Adapter, Idefics3VisionEncoder

    module = Idefics3VisionEncoder(
        copy.deepcopy(model.model.vision_model), copy.deepcopy(model.model.connector)
    )
    return GraphEncoder(Idefics3Adapter(module), budgets=budgets, device="cpu", dtype=torch.float32)


def image_features(model: torch.nn.Module, item: Any) -> torch.Tensor:
    """What the model hands its LLM for one image: [splits * tokens a split, text width]."""
    with torch.no_grad():
        pixels = torch.as_tensor(item.pixel_values)[None]  # one sample: [1, splits, 3, S, S]
        features = model.model.get_image_features(pixel_values=pixels).pooler_output
    # one sample's splits: a list of one [splits * tokens, width] in newer transformers, one
    # [splits, tokens, width] in 5.17 (the GPU machine's); the same rows either way
    if isinstance(features, (list, tuple)):
        [features] = features
    return features.reshape(-1, features.shape[-1])


TILE_SHAPE = row_shape("idefics3")
CASE_FIELDS = tiled_case_fields(hf_model, encoder_of, image_features, row_shape("idefics3"), (4, 8, 16))
