"""GLM-5 (glm5_next) under the adapter conformance suite and its own tests: a Glm5NextVisionModel
with random weights driven by the adapter its record names (GLM-4.1V's), its Hugging Face
reference (its own tower with SDPA, one item alone, a video's grid flattened per frame as
`get_video_features` does), and a tiny full Glm5NextForConditionalGeneration."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from family_cases.common import randomize, save_tower_only
from family_cases.glm4v import reference, tower_tokens  # noqa: F401 - GLM-4.1V's, this case's too
from family_cases.qwen2_vl import spatial_merge_case_fields
from vitpool import GraphEncoder

# C * T * P * P = 3 * 2 * 2 * 2. No learned position table (GLM-OCR dropped it, GLM-5 inherits
# that): image_size plays no part. The blocks' MLP is `intermediate_size` wide and the merger's
# SwiGLU `projection_intermediate_size`: both differ from the other widths so that a mix-up fails.
# The release clamps its SwiGLUs at 10; with unit-scale random weights few values reach that, so
# the tiny tower clamps at 1, where many do, and parity covers the clamp.
SWIGLU_LIMIT = 1.0
TINY_VISION = {
    "depth": 2,
    "hidden_size": 32,
    "num_heads": 2,
    "in_channels": 3,
    "patch_size": 2,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": 48,
    "intermediate_size": 40,
    "projection_intermediate_size": 56,
    "attention_bias": True,
    "swiglu_limit": SWIGLU_LIMIT,
}
ROW_WIDTH = 3 * 2 * 2 * 2
TOWER_TYPE = "glm5_next_vision"
# The LLM only has to build and save: one linear-attention (KDA) layer, a dense MLP, two heads. Its
# width is the merger's out_hidden_size (the model scatters the image tokens into its embeddings).
TINY_TEXT = {
    "vocab_size": 128,
    "hidden_size": 48,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 1,
    "mlp_layer_types": ["dense"],
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "n_routed_experts": 2,
    "num_experts_per_tok": 1,
    "q_lora_rank": 8,
    "kv_lora_rank": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    "index_topk": 16,
    "index_kpool": 4,
    "index_head_dim": 8,
    "index_n_heads": 2,
    "linear_head_dim": 8,
    "linear_num_heads": 2,
    "hc_mult": 2,
    "max_position_embeddings": 512,
    "pad_token_id": 0,
}


def tiny_tower(seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """The tiny tower with unit-scale random weights (`overrides` change its vision config)."""
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextVisionConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextVisionModel

    tower = Glm5NextVisionModel(Glm5NextVisionConfig(**{**TINY_VISION, **overrides}))
    return randomize(tower, seed).eval().requires_grad_(False)


def save_tower(directory: Path) -> Path:
    return save_tower_only(tiny_tower(), directory)


def adapter_of(tower: torch.nn.Module) -> Any:
    """The adapter the family's record builds for this tower (the registry's own path)."""
    from vitpool.families.glm5_next import RECORD

    return RECORD.towers[TOWER_TYPE].adapter(tower)


def make_encoder(budgets: list[int]) -> GraphEncoder:
    return GraphEncoder(adapter_of(tiny_tower()), budgets=budgets, device="cpu", dtype=torch.float32)


def full_model() -> torch.nn.Module:
    """A tiny full GLM-5 (tower with unit-scale random weights, and LLM), run with SDPA."""
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    config = Glm5NextConfig(vision_config=copy.deepcopy(TINY_VISION), text_config=dict(TINY_TEXT))
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Glm5NextForConditionalGeneration(config)
    randomize(model.model.visual, seed=1)
    model.model.visual.config._attn_implementation = "sdpa"
    return model.eval()


BUDGETS = (16, 32, 64)
CASE_FIELDS = spatial_merge_case_fields(make_encoder, reference, ROW_WIDTH, BUDGETS)
