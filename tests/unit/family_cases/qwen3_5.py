"""Qwen3.5 under the adapter conformance suite: tiny configs with random weights.

`CASE_FIELDS` are the fields of the suite's `FamilyCase` (kept as a dict so that this module
does not import the suite, which imports it). The tiny configs serve tests/unit/test_family_qwen3_5.py too.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from family_cases.common import item_for

from vitpool import GraphEncoder, Image

# patch 4: rows of 3 * 2 * 4 * 4 = 96 features; an 8 x 8 position table; 2 x 2 merge
TINY_VISION = dict(
    depth=2, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=4, temporal_patch_size=2,
    in_channels=3, spatial_merge_size=2, out_hidden_size=32, num_position_embeddings=64,
)
ROW_WIDTH = 3 * 2 * 4 * 4
TINY_TEXT = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
    head_dim=16, vocab_size=128, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
    linear_num_value_heads=2, layer_types=["linear_attention", "full_attention"],
)
TINY_MOE_TEXT = dict(TINY_TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                     shared_expert_intermediate_size=16)


def tiny_tower(seed: int = 0) -> torch.nn.Module:
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    torch.manual_seed(seed)
    tower = Qwen3_5VisionModel._from_config(Qwen3_5VisionConfig(**TINY_VISION), dtype=torch.float32)
    return tower.eval().requires_grad_(False)


def make_encoder(budgets: list[int]) -> GraphEncoder:
    from vitpool.models.qwen3_5 import Qwen3_5Adapter

    return GraphEncoder(Qwen3_5Adapter(tiny_tower()), budgets=budgets, device="cpu", dtype=torch.float32)


def reference(encoder: GraphEncoder) -> Callable[[Any], list[torch.Tensor]]:
    tower = copy.deepcopy(encoder.adapter.tower)
    tower.config._attn_implementation = "sdpa"  # Hugging Face's own path, one item at a time

    def outputs(item: Any) -> list[torch.Tensor]:
        pixels = torch.as_tensor(item.pixel_values, dtype=torch.float32)
        return [tower(pixels, grid_thw=torch.tensor([item.grid_thw])).pooler_output]

    return outputs


CASE_FIELDS = dict(
    make_encoder=make_encoder,
    reference=reference,
    item_for=item_for,
    bad_items=(
        (Image(torch.randn(16, 1536), (1, 4, 4)), "1536 features per row"),
        (Image(torch.randn(1, 16, ROW_WIDTH), (1, 4, 4)), "must be 2-D"),
        (Image(torch.randn(16, ROW_WIDTH)), "three integers"),
        (Image(torch.randn(12, ROW_WIDTH), (1, 4, 3)), "multiples of the spatial merge size 2"),
    ),
    budgets=(8, 16, 32),
)
