"""Kimi-K2.5 (MoonViT + mm_projector) under the adapter conformance suite, and the tiny models its
own tests share. The reference is Hugging Face's own tower (SDPA) on one item alone, followed by
the model's `mm_projector`, as `Kimi_K25Model.get_image_features` runs them. (For clips, HF's
`get_video_features` cannot be the reference in transformers 5.23: it splits its output by
t*h*w/4 after pooling the frames, which fails for t > 1.)"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from family_cases.common import item_for, randomize, save_tower_and_projector
from vitpool import GraphEncoder, Image, Video

PATCH = 2
TINY_VISION = {
    "patch_size": PATCH,
    "pos_emb_height": 8,
    "pos_emb_width": 8,
    "pos_emb_time": 4,
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
}
TINY_TEXT = {
    "model_type": "deepseek_v3",
    "hidden_size": 48,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 512,
    "n_routed_experts": 2,
    "n_shared_experts": 1,
    "num_experts_per_tok": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    "n_group": 1,
    "topk_group": 1,
}
ROW_SHAPE = (3, PATCH, PATCH)
TANH_GELU_MLP = True


def full_config() -> Any:
    from transformers import Kimi_K25Config

    return Kimi_K25Config(
        vision_config=dict(TINY_VISION), text_config=dict(TINY_TEXT), projection_hidden_size=32
    )


def tiny_encoder_module(seed: int = 0) -> torch.nn.Module:
    from vitpool.families.kimi_k25.adapter import build_encoder

    return randomize(build_encoder(full_config()), seed).eval().requires_grad_(False)


def save_tower(directory: Path) -> Path:
    return save_tower_and_projector("kimi_k25", full_config(), tiny_encoder_module(), directory)


def tower_tokens(module: torch.nn.Module, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """HF's tower on one item's pixels, then its projector (what get_image_features runs)."""
    pooled = module.vision_tower(pixels, grid_thw=grid_thw.reshape(1, 3).long()).pooler_output
    return module.mm_projector(pooled).squeeze(1)


def reference_tokens(module: torch.nn.Module, item: Any) -> torch.Tensor:
    """HF's tower on one item alone, then its projector (`tower_tokens`), fp32."""
    with torch.no_grad():
        pixels = torch.as_tensor(item.pixel_values).to(torch.float32)
        return tower_tokens(module, pixels, torch.as_tensor(item.grid_thw))


def reference(encoder: GraphEncoder) -> Callable[[Any], list[torch.Tensor]]:
    module = copy.deepcopy(encoder.adapter.tower)
    module.vision_tower.config._attn_implementation = "sdpa"  # Hugging Face's own path
    return lambda item: [reference_tokens(module, item)]


def make_encoder(budgets: list[int], clip_frames: int | None = None) -> GraphEncoder:
    """A CPU fp32 encoder of the tiny model; `clip_frames` as for `KimiK25Adapter` (None: its clip
    path holds 4 frames' rows per token; 1: no clip path)."""
    from vitpool.families.kimi_k25.adapter import KimiK25Adapter

    adapter = KimiK25Adapter(tiny_encoder_module(), clip_frames=clip_frames)
    return GraphEncoder(adapter, budgets=budgets, device="cpu", dtype=torch.float32)


def make_suite_encoder(budgets: list[int]) -> GraphEncoder:
    """Both paths (images, and clips on a path of their own): the suite samples each budget's."""
    return make_encoder(budgets, None)


BAD_ITEMS = (
    (Image(torch.randn(16, 3, 4, 4), (1, 4, 4)), "patches of shape (3, 4, 4)"),
    (Image(torch.randn(16, 12), (1, 4, 4)), "must be 4-D"),
    (Image(torch.randn(16, *ROW_SHAPE)), "three integers"),
    (Image(torch.randn(12, *ROW_SHAPE), (1, 4, 4)), "needs t*h*w = 16"),
    (Image(torch.randn(32, *ROW_SHAPE), (2, 4, 4)), "use Video"),
    (Image(torch.randn(12, *ROW_SHAPE), (1, 3, 4)), "multiples of the merge kernel"),
    (Video(torch.randn(80, *ROW_SHAPE), (5, 4, 4)), "at most 4 frames"),
    (Video(torch.randn(0, *ROW_SHAPE), (0, 4, 4)), "zero or negative"),
)

CASE_FIELDS = {
    "make_encoder": make_suite_encoder,
    "reference": reference,
    "item_for": item_for,
    "bad_items": BAD_ITEMS,
    "budgets": (16, 32, 64),
}
