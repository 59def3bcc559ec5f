"""Qwen4-Exp (Qwen3.5's tower under its own name, run by Qwen3.5's adapter) under the adapter
conformance suite and the tests that load a tower-only checkpoint: a tiny tower with unit-scale
random weights, Hugging Face's own tower (SDPA, one item at a time) as the reference, the bad items
of `SpatialMergeRules`, and a tiny full model (tower and LLM) for the family's own tests.

The tiny tower differs from Qwen3.5's case in its width, heads, depth, position table and output
width, so the two cases do not test one shape twice.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from family_cases.common import randomize, save_tower_only, tower_reference
from family_cases.qwen2_vl import spatial_merge_case_fields
from vitpool import GraphEncoder
from vitpool.families.qwen4_exp.adapter import missing_transformers_model

# Why the family's tests skip here (None: they run): a transformers without Qwen4-Exp (the
# reference, and what the family builds), such as the range's lower bound may be.
TOO_OLD = missing_transformers_model()
TOWER_TYPE = "qwen4_exp_vision"
PATCH = 4
ROW_WIDTH = 3 * 2 * PATCH * PATCH  # channels * temporal patch * patch * patch
TEXT_HIDDEN = 40  # the merger's output width: the LLM's width
# 3 heads of 16 (the 2D rotary splits a head in quarters); a 6 x 6 position table, resampled
TINY_VISION = {
    "depth": 3,
    "hidden_size": 48,
    "num_heads": 3,
    "intermediate_size": 96,
    "patch_size": PATCH,
    "temporal_patch_size": 2,
    "in_channels": 3,
    "spatial_merge_size": 2,
    "out_hidden_size": TEXT_HIDDEN,
    "num_position_embeddings": 36,
}
# One linear-attention layer and one sparse-attention (QSA indexer) layer, four experts, no
# per-layer n-gram embeddings; token ids inside the tiny vocabulary are set on the full config
TINY_TEXT = {
    "hidden_size": TEXT_HIDDEN,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "vocab_size": 128,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "layer_types": ["linear_attention", "indexed_attention"],
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "hc_lowrank": 8,
    "indexer_n_heads": 2,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 16,
    "indexer_budget": 8,
    "indexer_compress_ratio": 4,
}
TOKEN_IDS = {
    "image_token_id": 100,
    "video_token_id": 101,
    "vision_start_token_id": 102,
    "vision_end_token_id": 103,
}


def tiny_tower(seed: int = 0) -> torch.nn.Module:
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpVisionConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpVisionModel

    tower = Qwen4ExpVisionModel._from_config(Qwen4ExpVisionConfig(**TINY_VISION), dtype=torch.float32)
    return randomize(tower, seed).eval().requires_grad_(False)


def save_tower(directory: Path) -> Path:
    return save_tower_only(tiny_tower(), directory)


def make_encoder(budgets: list[int]) -> GraphEncoder:
    if TOO_OLD:  # every conformance test needs the encoder: they all skip
        pytest.skip(TOO_OLD)
    from vitpool.families.qwen4_exp.adapter import Qwen4ExpAdapter

    return GraphEncoder(Qwen4ExpAdapter(tiny_tower()), budgets=budgets, device="cpu", dtype=torch.float32)


def full_model(seed: int = 0) -> Any:
    """A tiny full Qwen4-Exp (tower and LLM) with random weights (the tower's of unit scale), run by
    Hugging Face with SDPA."""
    from transformers import Qwen4ExpConfig, Qwen4ExpForConditionalGeneration

    torch.manual_seed(seed)
    config = Qwen4ExpConfig(vision_config=dict(TINY_VISION), text_config=dict(TINY_TEXT), **TOKEN_IDS)
    config._attn_implementation = "sdpa"
    model = Qwen4ExpForConditionalGeneration(config).eval().requires_grad_(False)
    randomize(model.model.visual, seed)
    return model


BUDGETS = (8, 16, 32)
TANH_GELU_MLP = True  # the blocks' MLP is gelu_pytorch_tanh
CASE_FIELDS = spatial_merge_case_fields(make_encoder, tower_reference, ROW_WIDTH, BUDGETS)
