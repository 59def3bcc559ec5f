"""LFM3-VL (Lfm3VlVisionModel and its projector) under the adapter conformance suite, and the tiny
models its own tests share. The reference is the Hugging Face model's own `get_image_features`
(SDPA) on each item alone (its `get_video_features` is the same call): the projector's tokens, as
the LLM receives them."""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from family_cases.common import item_for, randomize
from vitpool import GraphEncoder, Image, Video

# Why the family's tests skip here (None: they run): transformers 5.17 (the GPU machine's, the
# range's lower bound) has no LFM3-VL; 5.24 has it
TOO_OLD = (
    None
    if importlib.util.find_spec("transformers.models.lfm3_vl") is not None
    else "LFM3-VL needs a transformers with transformers.models.lfm3_vl (5.24 has it; 5.17 does not)"
)

PATCH = 2
MERGE = 2
ROW_WIDTH = 3 * 2 * PATCH * PATCH  # channels * temporal patch * patch * patch
# four layers: the config's default pattern, conv, conv, attention, conv; grouped-query attention
TINY_VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "patch_size": PATCH,
    "temporal_patch_size": 2,
    "in_channels": 3,
    "spatial_merge_size": MERGE,
}
TINY_TEXT = {
    "hidden_size": 48,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 24,
    "vocab_size": 128,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
TEXT_WIDTH = TINY_TEXT["hidden_size"]
PROJECTOR_WIDTH = 40


def full_config(**vision_settings: Any) -> Any:
    from transformers import Lfm3VlConfig

    return Lfm3VlConfig(
        vision_config={**TINY_VISION, **vision_settings},
        text_config=dict(TINY_TEXT),
        projector_hidden_size=PROJECTOR_WIDTH,
        image_token_id=120,
        video_token_id=121,
        vision_start_token_id=122,
        vision_end_token_id=123,
    )


def hf_model(seed: int = 0, **vision_settings: Any) -> torch.nn.Module:
    """The full tiny Hugging Face model, its tower and projector random at unit scale, SDPA."""
    from transformers import Lfm3VlForConditionalGeneration

    model = Lfm3VlForConditionalGeneration(full_config(**vision_settings))
    randomize(model.model.vision_tower, seed)
    randomize(model.model.multi_modal_projector, seed + 1)
    model.config.vision_config._attn_implementation = "sdpa"
    return model.eval().requires_grad_(False)


def encoder_module(model: torch.nn.Module) -> torch.nn.Module:
    from vitpool.families.lfm3_vl.adapter import Lfm3VlEncoder

    # copies: the adapter switches the tower's attention to vitpool's packed hook
    inner = model.model
    return Lfm3VlEncoder(copy.deepcopy(inner.vision_tower), copy.deepcopy(inner.multi_modal_projector))


def encoder_of(model: torch.nn.Module, budgets: list[int]) -> GraphEncoder:
    from vitpool.families.lfm3_vl.adapter import Lfm3VlAdapter

    return GraphEncoder(
        Lfm3VlAdapter(encoder_module(model)), budgets=budgets, device="cpu", dtype=torch.float32
    )


def image_features(model: torch.nn.Module, item: Any) -> torch.Tensor:
    """What `get_image_features` (or `get_video_features`) gives the LLM for this item alone."""
    grid = torch.as_tensor(item.grid_thw).reshape(1, 3).long()
    pixels = torch.as_tensor(item.pixel_values).float()
    with torch.no_grad():
        return model.model.get_image_features(pixels, grid).pooler_output[0]


_SHARED: dict[str, torch.nn.Module] = {}


def shared_model() -> torch.nn.Module:
    if "model" not in _SHARED:
        _SHARED["model"] = hf_model()
    return _SHARED["model"]


def make_encoder(budgets: list[int]) -> GraphEncoder:
    return encoder_of(shared_model(), budgets)


def reference(encoder: GraphEncoder) -> Callable[[Any], list[torch.Tensor]]:
    return lambda item: [image_features(shared_model(), item)]


BAD_ITEMS = (
    (Image(torch.randn(16, ROW_WIDTH + 1), (1, 4, 4)), f"{ROW_WIDTH + 1} features per row"),
    (Image(torch.randn(16, 3, 2, PATCH, PATCH), (1, 4, 4)), "must be 2-D"),
    (Image(torch.randn(16, ROW_WIDTH)), "three integers"),
    (Image(torch.randn(12, ROW_WIDTH), (1, 4, 4)), "needs t*h*w = 16"),
    (Image(torch.randn(12, ROW_WIDTH), (1, 3, 4)), "multiples of the spatial merge size"),
    (Video(torch.randn(24, ROW_WIDTH), (2, 4, 4)), "needs t*h*w = 32"),
    (Image(torch.zeros(16, ROW_WIDTH, dtype=torch.int64), (1, 4, 4)), "expected a floating-point dtype"),
    (Image(torch.randn(0, ROW_WIDTH), (1, 0, 4)), "zero or negative"),
)

CASE_FIELDS = {
    "make_encoder": make_encoder,
    "reference": reference,
    "item_for": item_for,
    "bad_items": BAD_ITEMS,
    "budgets": (16, 32, 64),
}
