"""Qwen2-VL under the adapter conformance suite and the grid families' tests: a tiny tower with
random weights, Hugging Face's own tower (SDPA, one item at a time) as the reference, a tiny full
model, and the bad items of `SpatialMergeRules` (the rules Qwen2.5-VL, Qwen3.5 and GLM-4V share)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from family_cases.common import item_for, save_tower_only, tower_reference
from vitpool import GraphEncoder, Image, Video

# 14-pixel patches, two frames per temporal patch, three channels
ROW_WIDTH = 3 * 2 * 14 * 14
HIDDEN = 48  # the merger's output width: the LLM's width

TINY_VISION_CONFIG = {
    "depth": 2,
    "embed_dim": 32,
    "hidden_size": HIDDEN,
    "num_heads": 2,
    "mlp_ratio": 2,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "in_channels": 3,
}
TINY_TEXT_CONFIG = {
    "hidden_size": HIDDEN,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 128,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
}


def tiny_tower(seed: int = 0) -> torch.nn.Module:
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    torch.manual_seed(seed)
    config = Qwen2VLVisionConfig(**TINY_VISION_CONFIG)
    return Qwen2VisionTransformerPretrainedModel._from_config(config, dtype=torch.float32).eval()


def save_tower(directory: Path) -> Path:
    return save_tower_only(tiny_tower(), directory)


def tiny_encoder(budgets: list[int], seed: int = 0) -> GraphEncoder:
    from vitpool.families.qwen2_vl.adapter import Qwen2VLAdapter

    adapter = Qwen2VLAdapter(tiny_tower(seed).requires_grad_(False))
    return GraphEncoder(adapter, budgets=budgets, device="cpu", dtype=torch.float32)


def full_model() -> torch.nn.Module:
    """A tiny full Qwen2-VL (tower and LLM) with random weights, run by Hugging Face with SDPA."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(0)
    config = Qwen2VLConfig(vision_config=TINY_VISION_CONFIG, text_config=TINY_TEXT_CONFIG)
    config._attn_implementation = "sdpa"
    return Qwen2VLForConditionalGeneration(config).eval()


def spatial_merge_bad_items(row_width: int) -> tuple[tuple[Any, str], ...]:
    """Items `SpatialMergeRules` (merge size 2) refuses for rows `row_width` wide, each with words
    of its message."""
    return (
        (Image(torch.randn(16, row_width + 1), (1, 4, 4)), f"{row_width + 1} features per row"),
        (Image(torch.randn(1, 16, row_width), (1, 4, 4)), "must be 2-D"),
        (Image(torch.randn(16, row_width)), "three integers"),  # no grid
        (Image(torch.randn(16, row_width), (1, 4)), "three integers"),  # a grid of two
        (Image(torch.randn(12, row_width), (1, 4, 4)), "needs t*h*w = 16"),
        (Image(torch.randn(32, row_width), (2, 4, 4)), "use Video for clips"),
        (Image(torch.randn(12, row_width), (1, 3, 4)), "multiples of the spatial merge size 2"),  # h
        (Image(torch.randn(12, row_width), (1, 4, 3)), "multiples of the spatial merge size 2"),  # w
        (Video(torch.randn(0, row_width), (0, 4, 4)), "zero or negative"),
    )


def spatial_merge_case_fields(
    make_encoder: Callable[[list[int]], GraphEncoder],
    reference: Callable[[GraphEncoder], Callable[[Any], list[torch.Tensor]]],
    row_width: int,
    budgets: tuple[int, ...],
) -> dict[str, Any]:
    """A grid family's conformance case (the suite's FamilyCase fields; this module does not import
    the suite, which imports it): items an Image or a Video of flattened patch rows and their grid,
    and the bad items of `SpatialMergeRules`."""
    return {
        "make_encoder": make_encoder,
        "reference": reference,
        "item_for": item_for,
        "bad_items": spatial_merge_bad_items(row_width),
        "budgets": budgets,
    }


BUDGETS = (16, 32, 64)
CASE_FIELDS = spatial_merge_case_fields(tiny_encoder, tower_reference, ROW_WIDTH, BUDGETS)
