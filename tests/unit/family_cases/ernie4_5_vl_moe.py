"""ERNIE-4.5-VL (tower + resampler) under the adapter conformance suite, and the tiny models its own
tests share. The reference is Hugging Face's own tower (SDPA) and resampler on one item alone, as
`Ernie4_5_VLMoeModel.get_image_features` / `get_video_features` run them (the resampler's own
host-side frame pairing included)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from family_cases.common import item_for, randomize, save_tower_and_projector
from family_cases.qwen2_vl import spatial_merge_bad_items
from vitpool import GraphEncoder, Video

PATCH = 2
ROW_WIDTH = 3 * PATCH * PATCH  # C * P * P: one frame per patch row
LLM_WIDTH = 48
TOWER_TYPE = "ernie4_5_vl_moe_vision"

# head_dim 16: 4 rotary frequencies per axis. hidden_size and intermediate_size differ, and both
# from the LLM's width, so that a mix-up of widths fails.
TINY_VISION = {
    "depth": 2,
    "hidden_size": 32,
    "num_heads": 2,
    "intermediate_size": 40,
    "in_channels": 3,
    "patch_size": PATCH,
    "spatial_merge_size": 2,
    "temporal_merge_size": 2,
}
# The MoE text model as small as its config allows: a dense layer and a sparse one of 2 experts
# (head_dim 24: mrope_section sums to 12).
TINY_TEXT = {
    "hidden_size": LLM_WIDTH,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 128,
    "moe_intermediate_size": [32, 16],
    "moe_k": 1,
    "moe_num_experts": 2,
    "moe_num_shared_experts": 1,
    "mlp_layer_types": ["dense", "sparse"],
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [4, 4, 4]},
}


def full_config() -> Any:
    from transformers import Ernie4_5_VLMoeConfig

    return Ernie4_5_VLMoeConfig(vision_config=dict(TINY_VISION), text_config=dict(TINY_TEXT))


def full_model() -> torch.nn.Module:
    """A tiny full ERNIE-4.5-VL (tower and resampler with unit-scale random weights, MoE LLM), SDPA."""
    from transformers import Ernie4_5_VLMoeForConditionalGeneration

    config = full_config()
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Ernie4_5_VLMoeForConditionalGeneration(config)
    randomize(model.model.vision_tower, seed=1)
    randomize(model.model.resampler_model, seed=2)
    model.model.vision_tower.config._attn_implementation = "sdpa"
    return model.eval().requires_grad_(False)


def tiny_encoder_module(seed: int = 0) -> torch.nn.Module:
    from vitpool.families.ernie4_5_vl_moe.adapter import build_encoder

    return randomize(build_encoder(full_config()), seed).eval().requires_grad_(False)


def save_tower(directory: Path) -> Path:
    return save_tower_and_projector("ernie4_5_vl_moe", full_config(), tiny_encoder_module(), directory)


def tower_tokens(module: torch.nn.Module, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """HF's tower on one item's pixels, then its resampler (what get_image/video_features run)."""
    grid = grid_thw.reshape(1, 3).long()
    return module.resampler_model(module.vision_tower(pixels, grid).last_hidden_state, grid)


def reference_tokens(module: torch.nn.Module, item: Any) -> torch.Tensor:
    """HF's tower on one item alone, then its resampler (`tower_tokens`), fp32."""
    with torch.no_grad():
        pixels = torch.as_tensor(item.pixel_values).to(torch.float32)
        return tower_tokens(module, pixels, torch.as_tensor(item.grid_thw))


def reference(encoder: GraphEncoder) -> Callable[[Any], list[torch.Tensor]]:
    module = copy.deepcopy(encoder.adapter.tower)
    module.vision_tower.config._attn_implementation = "sdpa"  # Hugging Face's own path
    return lambda item: [reference_tokens(module, item)]


def make_encoder(budgets: list[int]) -> GraphEncoder:
    from vitpool.families.ernie4_5_vl_moe import RECORD

    adapter = RECORD.towers[TOWER_TYPE].adapter(tiny_encoder_module())  # the registry's own path
    return GraphEncoder(adapter, budgets=budgets, device="cpu", dtype=torch.float32)


BAD_ITEMS = (
    *spatial_merge_bad_items(ROW_WIDTH),
    # frame pairs: a video's t is even
    (Video(torch.randn(48, ROW_WIDTH), (3, 4, 4)), "multiple of the temporal merge size 2"),
    (Video(torch.randn(16, ROW_WIDTH), (1, 4, 4)), "use Image for a single frame"),
)

BUDGETS = (16, 32, 64)
CASE_FIELDS = {
    "make_encoder": make_encoder,
    "reference": reference,
    "item_for": item_for,
    "bad_items": BAD_ITEMS,
    "budgets": BUDGETS,
}
