"""GLM-OCR under the adapter conformance suite and its own tests: a GlmOcrVisionModel with random
weights driven by the adapter its record names (GLM-4.1V's), its Hugging Face reference (its own
tower with SDPA, one item alone, a video's grid flattened per frame as `get_video_features` does),
and a tiny full GlmOcrForConditionalGeneration."""

from __future__ import annotations

from pathlib import Path

import torch

from family_cases.common import randomize, save_tower_only
from family_cases.glm4v import TINY_TEXT, reference, tower_tokens  # noqa: F401 - GLM-4.1V's, this case's too
from family_cases.qwen2_vl import spatial_merge_case_fields
from vitpool import GraphEncoder

# C * T * P * P = 3 * 2 * 2 * 2. No learned position table (GLM-OCR dropped it): image_size plays
# no part. The MLP is `intermediate_size` wide (GLM-4.1V's is out_hidden_size), the merger's
# out_hidden_size * in_channels: both differ from the other widths so that a mix-up fails.
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
    "attention_bias": True,
}
ROW_WIDTH = 3 * 2 * 2 * 2
TOWER_TYPE = "glm_ocr_vision"


def tiny_tower(seed: int = 0) -> torch.nn.Module:
    from transformers.models.glm_ocr.configuration_glm_ocr import GlmOcrVisionConfig
    from transformers.models.glm_ocr.modeling_glm_ocr import GlmOcrVisionModel

    tower = GlmOcrVisionModel(GlmOcrVisionConfig(**TINY_VISION))
    return randomize(tower, seed).eval().requires_grad_(False)


def save_tower(directory: Path) -> Path:
    return save_tower_only(tiny_tower(), directory)


def adapter_of(tower: torch.nn.Module):
    """The adapter the family's record builds for this tower (the registry's own path)."""
    from vitpool.families.glm_ocr import RECORD

    return RECORD.towers[TOWER_TYPE].adapter(tower)


def make_encoder(budgets: list[int]) -> GraphEncoder:
    return GraphEncoder(adapter_of(tiny_tower()), budgets=budgets, device="cpu", dtype=torch.float32)


def full_model() -> torch.nn.Module:
    """A tiny full GLM-OCR (tower with unit-scale random weights, and LLM), run with SDPA."""
    from transformers import GlmOcrConfig, GlmOcrForConditionalGeneration

    config = GlmOcrConfig(vision_config=TINY_VISION, text_config=TINY_TEXT)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = GlmOcrForConditionalGeneration(config)
    randomize(model.model.visual, seed=1)
    model.model.visual.config._attn_implementation = "sdpa"
    return model.eval()


BUDGETS = (16, 32, 64)
CASE_FIELDS = spatial_merge_case_fields(make_encoder, reference, ROW_WIDTH, BUDGETS)
