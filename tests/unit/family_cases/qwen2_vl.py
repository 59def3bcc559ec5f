"""Qwen2-VL under the adapter conformance suite and its own tests: a tiny tower with random
weights, and Hugging Face's own tower (SDPA, one item at a time) as the reference."""

from __future__ import annotations

import torch
from family_cases.common import item_for, tower_reference

from vitpool import GraphEncoder, Image, Video

# 14-pixel patches, two frames per temporal patch, three channels
ROW_WIDTH = 3 * 2 * 14 * 14
HIDDEN = 48  # the merger's output width: the LLM's width

TINY_VISION_CONFIG = {
    "depth": 2, "embed_dim": 32, "hidden_size": HIDDEN, "num_heads": 2, "mlp_ratio": 2,
    "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3,
}
TINY_TEXT_CONFIG = {
    "hidden_size": HIDDEN, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
    "num_key_value_heads": 1, "vocab_size": 128, "bos_token_id": 0, "eos_token_id": 1,
    "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
}


def tiny_tower(seed: int = 0) -> torch.nn.Module:
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    torch.manual_seed(seed)
    config = Qwen2VLVisionConfig(**TINY_VISION_CONFIG)
    return Qwen2VisionTransformerPretrainedModel._from_config(config, dtype=torch.float32).eval()


def tiny_encoder(budgets: list[int], seed: int = 0) -> GraphEncoder:
    from vitpool.models.qwen2_vl import Qwen2VLAdapter

    adapter = Qwen2VLAdapter(tiny_tower(seed).requires_grad_(False))
    return GraphEncoder(adapter, budgets=budgets, device="cpu", dtype=torch.float32)


BAD_ITEMS = (
    (Image(torch.randn(16, 1000), (1, 4, 4)), "1000 features per row"),
    (Image(torch.randn(1, 16, ROW_WIDTH), (1, 4, 4)), "must be 2-D"),
    (Image(torch.randn(16, ROW_WIDTH)), "three integers"),
    (Image(torch.randn(12, ROW_WIDTH), (1, 4, 4)), "needs t*h*w = 16"),
    (Image(torch.randn(32, ROW_WIDTH), (2, 4, 4)), "use Video for clips"),
    (Image(torch.randn(12, ROW_WIDTH), (1, 3, 4)), "multiples of the spatial merge size 2"),
    (Video(torch.randn(0, ROW_WIDTH), (0, 4, 4)), "zero or negative"),
)

BUDGETS = (16, 32, 64)


# The conformance suite's FamilyCase fields (its module defines the class and builds the case).
CASE_FIELDS = {
    "make_encoder": tiny_encoder,
    "reference": tower_reference,
    "item_for": item_for,
    "bad_items": BAD_ITEMS,
    "budgets": BUDGETS,
}
