"""The GLM-4.1V / 4.5V / 4.6V family under the adapter conformance suite, and the tiny models its
own tests share: a Glm4vVisionModel with random weights, and its Hugging Face reference (its own
tower with SDPA, one item alone, a video's grid flattened per frame as `get_video_features` does)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from family_cases.common import item_for, randomize

from vitpool import GraphEncoder, Image, Video

# C * T * P * P = 3 * 2 * 2 * 2; an 8x8 learned position table (image_size / patch_size)
TINY_VISION = {
    "depth": 2, "hidden_size": 32, "num_heads": 2, "in_channels": 3, "image_size": 16, "patch_size": 2, "temporal_patch_size": 2,
    "spatial_merge_size": 2, "out_hidden_size": 48, "intermediate_size": 64,
}
ROW_WIDTH = 3 * 2 * 2 * 2
TINY_TEXT = {
    "hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
    "vocab_size": 128, "max_position_embeddings": 512,
}


def tiny_tower(seed: int = 0, model_type: str = "glm4v_vision") -> torch.nn.Module:
    if model_type == "glm4v_moe_vision":
        from transformers import Glm4vMoeVisionConfig
        from transformers.models.glm4v_moe.modeling_glm4v_moe import Glm4vMoeVisionModel

        tower = Glm4vMoeVisionModel(Glm4vMoeVisionConfig(**TINY_VISION))
    else:
        from transformers import Glm4vVisionConfig
        from transformers.models.glm4v.modeling_glm4v import Glm4vVisionModel

        tower = Glm4vVisionModel(Glm4vVisionConfig(**TINY_VISION))
    return randomize(tower, seed).eval().requires_grad_(False)


def reference_tokens(tower: torch.nn.Module, item: Any) -> torch.Tensor:
    """HF's own tower on one item alone, with grid_thw as `get_image_features` /
    `get_video_features` pass it (a video: one (1, h, w) row per temporal patch)."""
    t, h, w = (int(v) for v in torch.as_tensor(item.grid_thw).reshape(3))
    with torch.no_grad():
        pixels = torch.as_tensor(item.pixel_values).to(torch.float32)
        return tower(pixels, grid_thw=torch.tensor([[1, h, w]] * t)).pooler_output


def reference(encoder: GraphEncoder) -> Callable[[Any], list[torch.Tensor]]:
    tower = copy.deepcopy(encoder.adapter.tower)
    tower.config._attn_implementation = "sdpa"  # Hugging Face's own path, one item at a time
    return lambda item: [reference_tokens(tower, item)]


def make_encoder(budgets: list[int]) -> GraphEncoder:
    from vitpool.models.glm4v import Glm4vAdapter

    return GraphEncoder(Glm4vAdapter(tiny_tower()), budgets=budgets, device="cpu", dtype=torch.float32)


BAD_ITEMS = (
    (Image(torch.randn(16, 1000), (1, 4, 4)), "1000 features per row"),
    (Image(torch.randn(1, 16, ROW_WIDTH), (1, 4, 4)), "must be 2-D"),
    (Image(torch.randn(16, ROW_WIDTH)), "three integers"),
    (Image(torch.randn(12, ROW_WIDTH), (1, 4, 4)), "needs t*h*w = 16"),
    (Image(torch.randn(32, ROW_WIDTH), (2, 4, 4)), "use Video"),
    (Image(torch.randn(12, ROW_WIDTH), (1, 3, 4)), "multiples of the spatial merge size"),
    (Video(torch.randn(0, ROW_WIDTH), (0, 4, 4)), "zero or negative"),
)


# The suite's FamilyCase fields: `FamilyCase(**CASE_FIELDS)`.
CASE_FIELDS = {
    "make_encoder": make_encoder, "reference": reference, "item_for": item_for, "bad_items": BAD_ITEMS, "budgets": (16, 32, 64),
}
