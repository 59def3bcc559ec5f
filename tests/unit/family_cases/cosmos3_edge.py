"""Cosmos-3 Edge (tower + projector) under the adapter conformance suite, and the tiny models its own
tests share. The reference is Hugging Face's own tower (SDPA) and projector on one item alone, as
`Cosmos3EdgeModel.get_image_features` / `get_video_features` run them (the position table's resize
by `F.interpolate` per grid included)."""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from family_cases.common import item_for, randomize
from family_cases.qwen2_vl import spatial_merge_bad_items
from vitpool import GraphEncoder, Image, Video

# Why the family's tests skip here (None: they run): the range's lower bound, 5.17, has the model
TOO_OLD = (
    None
    if importlib.util.find_spec("transformers.models.cosmos3_edge") is not None
    else "Cosmos-3 Edge needs a transformers with transformers.models.cosmos3_edge (5.17 and 5.24 have it)"
)

PATCH = 2
MERGE = 2
ROW_WIDTH = PATCH * PATCH * 3  # P * P * C: one frame per patch row (temporal patch 1)
EDGE = 4  # the position table's side (num_patches 16): items smaller and larger than it
LLM_WIDTH = 48
TOWER_TYPE = "cosmos3_edge_vision"

# hidden_size, intermediate_size, the projector's width and the LLM's all differ, so that a mix-up
# of widths fails
TINY_VISION = {
    "hidden_size": 32,
    "intermediate_size": 40,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_channels": 3,
    "patch_size": PATCH,
    "num_patches": EDGE * EDGE,
    "spatial_merge_size": MERGE,
}
# head_dim 24: the three M-RoPE sections sum to 12
TINY_TEXT = {
    "hidden_size": LLM_WIDTH,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 24,
    "vocab_size": 128,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 4, 4]},
}
PROJECTOR_HIDDEN = 56


def full_config() -> Any:
    from transformers import Cosmos3EdgeConfig

    return Cosmos3EdgeConfig(
        vision_config=dict(TINY_VISION), text_config=dict(TINY_TEXT), projector_hidden_size=PROJECTOR_HIDDEN
    )


def full_model() -> torch.nn.Module:
    """A tiny full Cosmos-3 Edge (tower and projector with unit-scale random weights), SDPA."""
    from transformers import Cosmos3EdgeForConditionalGeneration

    config = full_config()
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Cosmos3EdgeForConditionalGeneration(config)
    randomize(model.model.visual, seed=1)
    randomize(model.model.projector, seed=2)
    model.model.visual.config._attn_implementation = "sdpa"
    return model.eval().requires_grad_(False)


def tiny_encoder_module(seed: int = 0) -> torch.nn.Module:
    from vitpool.families.cosmos3_edge.adapter import build_encoder

    return randomize(build_encoder(full_config()), seed).eval().requires_grad_(False)


def tower_tokens(module: torch.nn.Module, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """HF's tower on one item's pixels, then its projector (what get_image/video_features run)."""
    grid = grid_thw.reshape(1, 3).long()
    return module.projector(module.visual(pixels, grid_thw=grid).last_hidden_state)


def reference_tokens(module: torch.nn.Module, item: Any) -> torch.Tensor:
    """HF's tower and projector on one item alone (`tower_tokens`), fp32."""
    with torch.no_grad():
        pixels = torch.as_tensor(item.pixel_values).to(torch.float32)
        return tower_tokens(module, pixels, torch.as_tensor(item.grid_thw))


def reference(encoder: GraphEncoder) -> Callable[[Any], list[torch.Tensor]]:
    module = copy.deepcopy(encoder.adapter.tower)
    module.visual.config._attn_implementation = "sdpa"  # Hugging Face's own path
    return lambda item: [reference_tokens(module, item)]


def make_encoder(budgets: list[int]) -> GraphEncoder:
    from vitpool.families.cosmos3_edge import RECORD

    adapter = RECORD.towers[TOWER_TYPE].adapter(tiny_encoder_module())  # the registry's own path
    return GraphEncoder(adapter, budgets=budgets, device="cpu", dtype=torch.float32)


BAD_ITEMS = (
    *spatial_merge_bad_items(ROW_WIDTH),
    # a temporal patch of 2 (an image processor set so): rows twice as wide, which the patch Linear refuses
    (Image(torch.randn(16, 2 * ROW_WIDTH), (1, 4, 4)), f"{2 * ROW_WIDTH} features per row"),
    (Video(torch.randn(24, ROW_WIDTH), (2, 4, 4)), "needs t*h*w = 32"),
    (Image(torch.zeros(16, ROW_WIDTH, dtype=torch.int64), (1, 4, 4)), "floating-point dtype"),
)

BUDGETS = (16, 32, 64)
CASE_FIELDS = {
    "make_encoder": make_encoder,
    "reference": reference,
    "item_for": item_for,
    "bad_items": BAD_ITEMS,
    "budgets": BUDGETS,
}
