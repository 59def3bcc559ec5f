"""Qwen2.5-VL under the adapter conformance suite, the grid families' tests and its own: a tiny
tower with random weights (window attention with 2 x 2-token windows, so that small items have
several windows, and full attention in one block), Hugging Face's own tower (SDPA, one item at a
time) as the reference, and a tiny full model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from family_cases.common import save_tower_only, tower_reference
from family_cases.qwen2_vl import spatial_merge_case_fields
from vitpool import GraphEncoder

# 14-pixel patches, two frames per temporal patch, three channels
ROW_WIDTH = 3 * 2 * 14 * 14
HIDDEN = 48  # the merger's output width: the LLM's width

TINY_VISION_CONFIG = {
    "depth": 3,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": HIDDEN,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "in_channels": 3,
    "window_size": 56,  # 56 / 2 / 14 = 2 merged tokens a side
    "fullatt_block_indexes": [1],
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
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    torch.manual_seed(seed)
    config = Qwen2_5_VLVisionConfig(**TINY_VISION_CONFIG)
    return Qwen2_5_VisionTransformerPretrainedModel._from_config(config, dtype=torch.float32).eval()


def save_tower(directory: Path) -> Path:
    return save_tower_only(tiny_tower(), directory)


def tiny_encoder(budgets: list[int], seed: int = 0, **kwargs: Any) -> GraphEncoder:
    from vitpool.families.qwen2_5_vl.adapter import Qwen2_5_VLAdapter

    adapter = Qwen2_5_VLAdapter(tiny_tower(seed).requires_grad_(False))
    return GraphEncoder(adapter, budgets=budgets, device="cpu", dtype=torch.float32, **kwargs)


def full_model() -> torch.nn.Module:
    """A tiny full Qwen2.5-VL (tower and LLM) with random weights, run by Hugging Face with SDPA."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(vision_config=TINY_VISION_CONFIG, text_config=TINY_TEXT_CONFIG)
    config._attn_implementation = "sdpa"
    return Qwen2_5_VLForConditionalGeneration(config).eval()


BUDGETS = (16, 32, 64)
# window attention: a second set of boundaries, so no dense graph (the FA2 fallback)
NO_DENSE_GRAPH = True
CASE_FIELDS = spatial_merge_case_fields(tiny_encoder, tower_reference, ROW_WIDTH, BUDGETS)
