"""MiniMax-M3-VL (MiniMaxM3VLVisionModel + multi_modal_projector) under the adapter conformance
suite, and the tiny models its own tests share. The reference is Hugging Face's own tower (SDPA)
on one item alone, followed by the model's projector, as `MiniMaxM3VLModel.get_image_features`
runs them (its videos go the same way: `get_video_features` calls it)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from family_cases.common import item_for, randomize, save_tower_and_projector
from vitpool import GraphEncoder, Image, Video
from vitpool.families.minimax_m3_vl.adapter import attends_per_item

# Why the family's tests skip here (None: they run): 5.17's and 5.18's tower attends a call's rows as
# one sequence, so no per-item reference exists there (the GPU machine has 5.17)
TOO_OLD = None if attends_per_item() else "MiniMax-M3-VL's tower attends one sequence per item from 5.24 on"

PATCH = 2
TEMPORAL_PATCH = 2
TINY_VISION = {
    "hidden_size": 32,  # head 16: rotary over 12 channels (4 per axis), 4 passed through
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "patch_size": PATCH,
    "temporal_patch_size": TEMPORAL_PATCH,
    "spatial_merge_size": 2,
}
TINY_TEXT = {
    "hidden_size": 48,
    "intermediate_size": 64,
    "dense_intermediate_size": 64,
    "shared_intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 24,
    "vocab_size": 128,
    "num_local_experts": 2,
    "num_experts_per_tok": 1,
    "rotary_dim": 8,
    "index_n_heads": 1,
    "index_head_dim": 8,
    "mlp_layer_types": ["dense"],
    "bos_token_id": 1,
    "eos_token_id": 2,
}
PROJECTOR_HIDDEN = 40
ROW_WIDTH = 3 * TEMPORAL_PATCH * PATCH * PATCH


def full_config() -> Any:
    from transformers import MiniMaxM3VLConfig

    return MiniMaxM3VLConfig(
        vision_config=dict(TINY_VISION),
        text_config=dict(TINY_TEXT),
        projector_hidden_size=PROJECTOR_HIDDEN,
        image_token_index=3,
        video_token_index=4,
    )


def tiny_encoder_module(seed: int = 0) -> torch.nn.Module:
    from vitpool.families.minimax_m3_vl.adapter import build_encoder

    return randomize(build_encoder(full_config()), seed).eval().requires_grad_(False)


def save_tower(directory: Path) -> Path:
    return save_tower_and_projector("minimax_m3_vl", full_config(), tiny_encoder_module(), directory)


def tower_tokens(module: torch.nn.Module, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """HF's tower on one item's pixels, then its projector (what get_image_features runs)."""
    hidden = module.vision_tower(pixels, grid_thw=grid_thw.reshape(1, 3).long()).last_hidden_state
    return module.multi_modal_projector(hidden.squeeze(0))


def reference_tokens(module: torch.nn.Module, item: Any) -> torch.Tensor:
    """HF's tower on one item alone, then its projector (`tower_tokens`), on the module's device
    and in its dtype."""
    parameter = next(module.parameters())
    grid = torch.as_tensor(item.grid_thw).to(parameter.device)
    with torch.no_grad():
        pixels = torch.as_tensor(item.pixel_values).to(parameter.device, parameter.dtype)
        return tower_tokens(module, pixels, grid)


def reference(encoder: GraphEncoder) -> Callable[[Any], list[torch.Tensor]]:
    module = copy.deepcopy(encoder.adapter.tower)
    module.vision_tower.config._attn_implementation = "sdpa"  # Hugging Face's own path
    return lambda item: [reference_tokens(module, item)]


def make_encoder(budgets: list[int]) -> GraphEncoder:
    from vitpool.families.minimax_m3_vl.adapter import MiniMaxM3VLAdapter

    return GraphEncoder(
        MiniMaxM3VLAdapter(tiny_encoder_module()), budgets=budgets, device="cpu", dtype=torch.float32
    )


BAD_ITEMS = (
    (Image(torch.randn(16, ROW_WIDTH + 1), (1, 4, 4)), f"the model takes {ROW_WIDTH}"),
    (Image(torch.randn(16, 3, PATCH, PATCH), (1, 4, 4)), "must be 2-D"),
    (Image(torch.randn(16, ROW_WIDTH)), "three integers"),
    (Image(torch.randn(12, ROW_WIDTH), (1, 4, 4)), "needs t*h*w = 16"),
    (Image(torch.randn(32, ROW_WIDTH), (2, 4, 4)), "use Video"),
    (Image(torch.randn(12, ROW_WIDTH), (1, 3, 4)), "multiples of the spatial merge size"),
    (Video(torch.randn(0, ROW_WIDTH), (0, 4, 4)), "zero or negative"),
)

CASE_FIELDS = {
    "make_encoder": make_encoder,
    "reference": reference,
    "item_for": item_for,
    "bad_items": BAD_ITEMS,
    "budgets": (16, 32, 64),
}
