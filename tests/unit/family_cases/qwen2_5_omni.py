"""Qwen2.5-Omni under the adapter conformance suite and its own tests: a tiny vision encoder with
random weights of unit scale (Qwen2.5-VL's tiny sizes: window attention with 2 x 2-token windows,
so that small items have several windows, and full attention in one block), Hugging Face's own
encoder (SDPA, one item at a time) as the reference, and a tiny full Qwen2.5-Omni (thinker with
its LLM and audio tower, no talker) whose thinker's `get_image_features` / `get_video_features`
the family's tests match."""

from __future__ import annotations

from pathlib import Path

import torch

from family_cases.common import randomize, save_tower_only, tower_reference
from family_cases.qwen2_5_vl import HIDDEN, ROW_WIDTH, TINY_VISION_CONFIG
from family_cases.qwen2_vl import spatial_merge_case_fields
from vitpool import GraphEncoder

# Qwen2.5-VL's tiny tower, as Omni's vision encoder config: 14-pixel patches (rows of
# 3 * 2 * 14 * 14 = 1176 features), windows of 56 pixels (2 merged tokens a side), full attention
# in block 1, merged tokens HIDDEN wide
TINY_VISION = dict(TINY_VISION_CONFIG)
# the thinker's LLM and audio tower, as small as their configs allow
TINY_TEXT = {
    "vocab_size": 128,
    "hidden_size": HIDDEN,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
}
TINY_AUDIO = {
    "num_mel_bins": 16,
    "encoder_layers": 1,
    "encoder_attention_heads": 2,
    "encoder_ffn_dim": 32,
    "d_model": 16,
    "output_dim": HIDDEN,
    "max_source_positions": 32,
    "n_window": 4,
}
BUDGETS = (16, 32, 64)
# Qwen2.5-VL's window attention: a second set of boundaries, so no dense graph (the FA2 fallback)
NO_DENSE_GRAPH = True


def tiny_tower(seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen2_5OmniVisionEncoderConfig
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniVisionEncoder

    config = Qwen2_5OmniVisionEncoderConfig(**TINY_VISION)
    tower = Qwen2_5OmniVisionEncoder._from_config(config, dtype=torch.float32)
    return randomize(tower, seed).eval().requires_grad_(False)


def save_tower(directory: Path) -> Path:
    return save_tower_only(tiny_tower(), directory)


def make_encoder(budgets: list[int]) -> GraphEncoder:
    from vitpool.families.qwen2_5_omni.adapter import Qwen2_5OmniAdapter

    return GraphEncoder(Qwen2_5OmniAdapter(tiny_tower()), budgets=budgets, device="cpu", dtype=torch.float32)


def full_model(seed: int = 0) -> torch.nn.Module:
    """A tiny full Qwen2.5-Omni (thinker: vision encoder, audio tower, LLM; no talker), the vision
    encoder's weights of unit scale, run by Hugging Face with SDPA."""
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration

    torch.manual_seed(seed)
    thinker = {"vision_config": TINY_VISION, "text_config": TINY_TEXT, "audio_config": TINY_AUDIO}
    config = Qwen2_5OmniConfig(thinker_config=thinker, enable_audio_output=False)
    config.thinker_config._attn_implementation = "sdpa"
    config.thinker_config.vision_config._attn_implementation = "sdpa"
    model = Qwen2_5OmniForConditionalGeneration(config).eval()
    randomize(model.thinker.model.visual, seed)
    return model


CASE_FIELDS = spatial_merge_case_fields(make_encoder, tower_reference, ROW_WIDTH, BUDGETS)
