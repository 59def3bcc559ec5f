"""GPU: InternVL's tiles through captured graphs (bf16), every budget checked against eager at
capture, encodes against Hugging Face's `get_image_features`. Skipped without CUDA."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import relative_error

from vitpool import GraphEncoder, Image

pytestmark = pytest.mark.gpu

BUDGETS = [4, 8, 16]
TOLERANCE = 1.5e-2  # bf16 against Hugging Face's own path, as for the other families


def test_every_budget_is_captured_and_encodes_match_get_image_features():
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    from vitpool.families.internvl.adapter import InternVLAdapter, InternVLEncoder

    config = InternVLConfig(
        vision_config={
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "image_size": 56,
            "patch_size": 14,
        },
        text_config={
            "model_type": "qwen2",
            "hidden_size": 64,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "vocab_size": 128,
        },
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = InternVLForConditionalGeneration(config).to("cuda", torch.bfloat16).eval()
    module = InternVLEncoder(
        copy.deepcopy(model.model.vision_tower), copy.deepcopy(model.model.multi_modal_projector), config
    )
    encoder = GraphEncoder(InternVLAdapter(module), budgets=BUDGETS, device="cuda")
    stats = encoder.stats()
    assert sorted(tokens for tokens, _ in stats.captured_budgets) == BUDGETS and stats.disabled_budgets == []
    generator = torch.Generator().manual_seed(1)
    items = [Image(torch.randn(count, 3, 56, 56, generator=generator)) for count in (1, 3, 2, 4, 1)]
    for item, embedding in zip(items, encoder.encode(items), strict=True):
        with torch.no_grad():
            pixels = item.pixel_values.to("cuda", torch.bfloat16)
            want = model.model.get_image_features(pixel_values=pixels).pooler_output
        assert torch.isfinite(embedding.tokens).all()
        assert relative_error(embedding.tokens, want.reshape(-1, want.shape[-1])) <= TOLERANCE
    assert encoder.stats().graph_items == len(items)
