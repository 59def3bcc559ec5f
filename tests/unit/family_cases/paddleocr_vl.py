"""PaddleOCR-VL (PaddleOCRVisionModel + projector) under the adapter conformance suite, and the tiny
models its own tests share. The reference is Hugging Face's own tower (SDPA) on one image alone,
followed by the model's projector, as `PaddleOCRVLModel.get_image_features` runs them."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from family_cases.common import randomize, save_tower_and_projector
from vitpool import GraphEncoder, Image, Video
from vitpool.specs import ItemSpec

PATCH = 2
TINY_VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": 16,
    "patch_size": PATCH,  # an 8 x 8 position table
}
TINY_TEXT = {
    "hidden_size": 48,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 24,
    "vocab_size": 128,
}
ROW_SHAPE = (3, PATCH, PATCH)
TANH_GELU_MLP = True


def full_config() -> Any:
    from transformers import PaddleOCRVLConfig

    return PaddleOCRVLConfig(vision_config=dict(TINY_VISION), text_config=dict(TINY_TEXT))


def tiny_encoder_module(seed: int = 0) -> torch.nn.Module:
    from vitpool.families.paddleocr_vl.adapter import build_encoder

    return randomize(build_encoder(full_config()), seed).eval().requires_grad_(False)


def save_tower(directory: Path) -> Path:
    return save_tower_and_projector("paddleocr_vl", full_config(), tiny_encoder_module(), directory)


def tower_tokens(module: torch.nn.Module, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """HF's tower on one image's pixels, then its projector (what get_image_features runs)."""
    grid = grid_thw.reshape(1, 3).long()
    hidden = module.visual(pixels.unsqueeze(0), grid_thw=grid).last_hidden_state
    return module.projector(hidden, grid)


def reference_tokens(module: torch.nn.Module, item: Any) -> torch.Tensor:
    """HF's tower on one image alone, then its projector (`tower_tokens`), on the module's device
    and in its dtype."""
    parameter = next(module.parameters())
    grid = torch.as_tensor(item.grid_thw).to(parameter.device)
    with torch.no_grad():
        pixels = torch.as_tensor(item.pixel_values).to(parameter.device, parameter.dtype)
        return tower_tokens(module, pixels, grid)


def reference(encoder: GraphEncoder) -> Callable[[Any], list[torch.Tensor]]:
    module = copy.deepcopy(encoder.adapter.tower)
    module.visual.config._attn_implementation = "sdpa"  # Hugging Face's own path
    return lambda item: [reference_tokens(module, item)]


def make_encoder(budgets: list[int]) -> GraphEncoder:
    from vitpool.families.paddleocr_vl.adapter import PaddleOCRVLAdapter

    return GraphEncoder(
        PaddleOCRVLAdapter(tiny_encoder_module()), budgets=budgets, device="cpu", dtype=torch.float32
    )


def item_for(spec: ItemSpec, pixels: torch.Tensor) -> Any:
    return Image(pixels, spec.layout)


BAD_ITEMS = (
    (Image(torch.randn(16, 3, 4, 4), (1, 4, 4)), "patches of shape (3, 4, 4)"),
    (Image(torch.randn(16, 12), (1, 4, 4)), "must be 4-D"),
    (Image(torch.randn(16, *ROW_SHAPE)), "three integers"),
    (Image(torch.randn(12, *ROW_SHAPE), (1, 4, 4)), "needs h*w = 16"),
    (Image(torch.randn(32, *ROW_SHAPE), (2, 4, 4)), "t == 1"),
    (Image(torch.randn(12, *ROW_SHAPE), (1, 3, 4)), "multiples of the spatial merge size"),
    (Video(torch.randn(16, *ROW_SHAPE), (1, 4, 4)), "images only"),
    (Image(torch.randn(0, *ROW_SHAPE), (1, 0, 4)), "zero or negative"),
)

CASE_FIELDS = {
    "make_encoder": make_encoder,
    "reference": reference,
    "item_for": item_for,
    "bad_items": BAD_ITEMS,
    "budgets": (16, 32, 64),
}
