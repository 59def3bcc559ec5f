"""Qwen3-Omni under the adapter conformance suite and its own tests: a tiny vision encoder with
random weights, Hugging Face's own encoder (SDPA, one item at a time: tokens and deepstack
features) as the reference, and a tiny full Qwen3-Omni (thinker with its LLM and audio tower, no
talker) whose thinker's `get_image_features` / `get_video_features` the family's tests match."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from family_cases.common import randomize, save_tower_only
from family_cases.qwen2_vl import spatial_merge_case_fields
from vitpool import GraphEncoder

# patch 4: rows of 3 * 2 * 4 * 4 = 96 features; an 8 x 8 position table; 2 x 2 merge; deepstack
# features after blocks 0 and 1, the tokens after block 2
ROW_WIDTH = 3 * 2 * 4 * 4
HIDDEN = 48  # the merger's output width: the LLM's width
TINY_VISION = {
    "depth": 3,
    "hidden_size": 32,
    "num_heads": 2,
    "intermediate_size": 64,
    "patch_size": 4,
    "temporal_patch_size": 2,
    "in_channels": 3,
    "spatial_merge_size": 2,
    "out_hidden_size": HIDDEN,
    "num_position_embeddings": 64,
    "deepstack_visual_indexes": [0, 1],
}
# the thinker's MoE LLM and audio tower, as small as their configs allow
TINY_TEXT = {
    "vocab_size": 128,
    "hidden_size": HIDDEN,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 24,
    "moe_intermediate_size": 16,
    "num_experts": 2,
    "num_experts_per_tok": 1,
    "rope_parameters": {"rope_type": "default", "mrope_section": [4, 4, 4], "rope_theta": 10000.0},
}
TINY_AUDIO = {
    "num_mel_bins": 16,
    "encoder_layers": 1,
    "encoder_attention_heads": 2,
    "encoder_ffn_dim": 32,
    "d_model": 16,
    "output_dim": HIDDEN,
    "downsample_hidden_size": 8,
    "max_source_positions": 32,
}
BUDGETS = (16, 32, 64)
TANH_GELU_MLP = True


def tiny_tower(seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen3OmniMoeVisionEncoderConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeVisionEncoder

    config = Qwen3OmniMoeVisionEncoderConfig(**TINY_VISION)
    tower = Qwen3OmniMoeVisionEncoder._from_config(config, dtype=torch.float32)
    return randomize(tower, seed).eval().requires_grad_(False)


def save_tower(directory: Path) -> Path:
    return save_tower_only(tiny_tower(), directory)


def make_encoder(budgets: list[int]) -> GraphEncoder:
    from vitpool.families.qwen3_omni_moe.adapter import Qwen3OmniMoeAdapter

    return GraphEncoder(Qwen3OmniMoeAdapter(tiny_tower()), budgets=budgets, device="cpu", dtype=torch.float32)


def full_model(seed: int = 0) -> torch.nn.Module:
    """A tiny full Qwen3-Omni (thinker: vision encoder, audio tower, MoE LLM; no talker), the
    vision encoder's weights of unit scale, run by Hugging Face with SDPA."""
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    torch.manual_seed(seed)
    thinker = {"vision_config": TINY_VISION, "text_config": TINY_TEXT, "audio_config": TINY_AUDIO}
    config = Qwen3OmniMoeConfig(thinker_config=thinker, enable_audio_output=False)
    config.thinker_config._attn_implementation = "sdpa"
    config.thinker_config.vision_config._attn_implementation = "sdpa"
    model = Qwen3OmniMoeForConditionalGeneration(config).eval()
    randomize(model.thinker.model.visual, seed)
    return model


def tower_reference(encoder: GraphEncoder) -> Callable[[Any], list[torch.Tensor]]:
    """Hugging Face's forward of the encoder's tower, SDPA, on one item alone: the tokens, then
    the deepstack features."""
    tower = copy.deepcopy(encoder.adapter.tower)
    tower.config._attn_implementation = "sdpa"

    def outputs(item: Any) -> list[torch.Tensor]:
        with torch.no_grad():
            pixels = torch.as_tensor(item.pixel_values).to(torch.float32)
            output = tower(pixels, grid_thw=torch.tensor([item.grid_thw]))
        return [output.pooler_output, *output.deepstack_features]

    return outputs


CASE_FIELDS = spatial_merge_case_fields(make_encoder, tower_reference, ROW_WIDTH, BUDGETS)
