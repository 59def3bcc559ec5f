"""GPU: Llama 4's tiles through captured graphs (bf16), every budget checked against eager at
capture, encodes against Hugging Face's path (get_image_features, then the projector). Skipped
without CUDA."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import relative_error

from vitpool import GraphEncoder, Image

pytestmark = pytest.mark.gpu

TOLERANCE = 1.5e-2  # bf16 against Hugging Face's own path, as for the other families


def test_every_budget_is_captured_and_encodes_match_the_model():
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    from vitpool.families.llama4.adapter import Llama4Adapter, Llama4Encoder

    vision = {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "image_size": 56,
        "patch_size": 14,
        "vision_output_dim": 64,
        "projector_input_dim": 64,
        "projector_output_dim": 64,
        "pixel_shuffle_ratio": 0.5,
    }
    text = {
        "hidden_size": 64,
        "intermediate_size": 64,
        "intermediate_size_mlp": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 128,
        "num_local_experts": 2,
    }
    config = Llama4Config(vision_config=vision, text_config=text)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Llama4ForConditionalGeneration(config).to("cuda", torch.bfloat16).eval()
    module = Llama4Encoder(copy.deepcopy(model.vision_model), copy.deepcopy(model.multi_modal_projector))
    budgets = [4, 8, 16]  # 4 tokens a tile: (56 / 14)² patches, shuffled by 0.5
    encoder = GraphEncoder(Llama4Adapter(module), budgets=budgets, device="cuda")
    stats = encoder.stats()
    assert sorted(tokens for tokens, _ in stats.captured_budgets) == budgets and stats.disabled_budgets == []
    generator = torch.Generator().manual_seed(1)
    items = [Image(torch.randn(count, 3, 56, 56, generator=generator)) for count in (1, 3, 2, 4, 1)]
    for item, embedding in zip(items, encoder.encode(items), strict=True):
        with torch.no_grad():
            # the tower get_image_features runs (its signature differs between transformers releases)
            hidden = model.vision_model(
                pixel_values=item.pixel_values.to("cuda", torch.bfloat16)
            ).last_hidden_state
            want = model.multi_modal_projector(hidden.reshape(-1, hidden.shape[-1]))
        assert torch.isfinite(embedding.tokens).all()
        assert relative_error(embedding.tokens, want) <= TOLERANCE
    assert encoder.stats().graph_items == len(items)
