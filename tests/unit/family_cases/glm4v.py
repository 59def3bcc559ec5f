"""The GLM-4.1V / 4.5V / 4.6V family under the adapter conformance suite and the grid families'
tests: a Glm4vVisionModel with random weights, its Hugging Face reference (its own tower with
SDPA, one item alone, a video's grid flattened per frame as `get_video_features` does), and tiny
full models of the three releases."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from family_cases.common import randomize, save_tower_only
from family_cases.qwen2_vl import spatial_merge_case_fields
from vitpool import GraphEncoder

# C * T * P * P = 3 * 2 * 2 * 2; an 8x8 learned position table (image_size / patch_size)
TINY_VISION = {
    "depth": 2,
    "hidden_size": 32,
    "num_heads": 2,
    "in_channels": 3,
    "image_size": 16,
    "patch_size": 2,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": 48,
    "intermediate_size": 64,
}
ROW_WIDTH = 3 * 2 * 2 * 2
TINY_TEXT = {
    "hidden_size": 48,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 128,
    "max_position_embeddings": 512,
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


def tower_tokens(tower: torch.nn.Module, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """HF's own tower on one item's pixels, with grid_thw as `get_image_features` /
    `get_video_features` pass it (a video: one (1, h, w) row per temporal patch)."""
    t, h, w = (int(v) for v in grid_thw.reshape(3))
    return tower(pixels, grid_thw=torch.tensor([[1, h, w]] * t, device=grid_thw.device)).pooler_output


def reference_tokens(tower: torch.nn.Module, item: Any) -> torch.Tensor:
    """HF's own tower on one item alone (`tower_tokens`), fp32."""
    with torch.no_grad():
        pixels = torch.as_tensor(item.pixel_values).to(torch.float32)
        return tower_tokens(tower, pixels, torch.as_tensor(item.grid_thw))


def reference(encoder: GraphEncoder) -> Callable[[Any], list[torch.Tensor]]:
    tower = copy.deepcopy(encoder.adapter.tower)
    tower.config._attn_implementation = "sdpa"  # Hugging Face's own path, one item at a time
    return lambda item: [reference_tokens(tower, item)]


def save_tower(directory: Path) -> Path:
    return save_tower_only(tiny_tower(), directory)


def make_encoder(budgets: list[int]) -> GraphEncoder:
    from vitpool.families.glm4v.adapter import Glm4vAdapter

    return GraphEncoder(Glm4vAdapter(tiny_tower()), budgets=budgets, device="cpu", dtype=torch.float32)


def full_model(release: str = "glm4v") -> torch.nn.Module:
    """A tiny full model (tower with unit-scale random weights, and LLM) of one release, run with
    SDPA: "glm4v" (GLM-4.1V), "glm4v_moe" (GLM-4.5V: a `glm4v_moe_vision` tower) or "glm46v"
    (GLM-4.6V: nests a `glm4v_vision` config)."""
    import transformers

    if release == "glm4v_moe":
        text = dict(
            TINY_TEXT,
            n_routed_experts=2,
            num_experts_per_tok=1,
            n_shared_experts=1,
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        )
        config = transformers.Glm4vMoeConfig(vision_config=TINY_VISION, text_config=text)
        model_class = transformers.Glm4vMoeForConditionalGeneration
    elif release == "glm46v":
        config = transformers.Glm46VConfig(
            vision_config=dict(TINY_VISION, model_type="glm4v_vision"),
            text_config=dict(TINY_TEXT, model_type="glm4v_text"),
        )
        model_class = transformers.Glm46VForConditionalGeneration
    else:
        config = transformers.Glm4vConfig(vision_config=TINY_VISION, text_config=TINY_TEXT)
        model_class = transformers.Glm4vForConditionalGeneration
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = model_class(config)
    randomize(model.model.visual, seed=1)
    model.model.visual.config._attn_implementation = "sdpa"
    return model.eval()


BUDGETS = (16, 32, 64)
CASE_FIELDS = spatial_merge_case_fields(make_encoder, reference, ROW_WIDTH, BUDGETS)
