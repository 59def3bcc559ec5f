"""Qwen3.5 (dense and MoE) under the adapter conformance suite and the grid families' tests: tiny
configs with random weights, Hugging Face's own tower (SDPA, one item at a time) as the reference,
and tiny full models."""

from __future__ import annotations

from pathlib import Path

import torch

from family_cases.common import save_tower_only, tower_reference
from family_cases.qwen2_vl import spatial_merge_case_fields
from vitpool import GraphEncoder

# patch 4: rows of 3 * 2 * 4 * 4 = 96 features; an 8 x 8 position table; 2 x 2 merge
TINY_VISION = {
    "depth": 2,
    "hidden_size": 32,
    "num_heads": 2,
    "intermediate_size": 64,
    "patch_size": 4,
    "temporal_patch_size": 2,
    "in_channels": 3,
    "spatial_merge_size": 2,
    "out_hidden_size": 32,
    "num_position_embeddings": 64,
}
ROW_WIDTH = 3 * 2 * 4 * 4
TINY_TEXT = {
    "hidden_size": 32,
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
    "layer_types": ["linear_attention", "full_attention"],
}
TINY_MOE_TEXT = dict(
    TINY_TEXT,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
)


def tiny_tower(seed: int = 0) -> torch.nn.Module:
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    torch.manual_seed(seed)
    tower = Qwen3_5VisionModel._from_config(Qwen3_5VisionConfig(**TINY_VISION), dtype=torch.float32)
    return tower.eval().requires_grad_(False)


def save_tower(directory: Path) -> Path:
    return save_tower_only(tiny_tower(), directory)


def make_encoder(budgets: list[int]) -> GraphEncoder:
    from vitpool.families.qwen3_5.adapter import Qwen3_5Adapter

    return GraphEncoder(Qwen3_5Adapter(tiny_tower()), budgets=budgets, device="cpu", dtype=torch.float32)


def full_model(moe: bool = False) -> torch.nn.Module:
    """A tiny full Qwen3.5 (tower and LLM, dense or MoE) with random weights, run with SDPA."""
    import transformers

    family, text = ("Qwen3_5Moe", TINY_MOE_TEXT) if moe else ("Qwen3_5", TINY_TEXT)
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(vision_config=TINY_VISION, text_config=text)
    config._attn_implementation = "sdpa"
    return getattr(transformers, f"{family}ForConditionalGeneration")(config).eval()


BUDGETS = (8, 16, 32)
TANH_GELU_MLP = True
CASE_FIELDS = spatial_merge_case_fields(make_encoder, tower_reference, ROW_WIDTH, BUDGETS)
