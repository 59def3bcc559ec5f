"""MiniCPM-V 4.7 (MiniCPMV4_7VisionModel + MiniCPMV4_7Merger, run by 4.6's adapter) under the
adapter conformance suite, and the tiny model its own tests share. The reference is Hugging Face's
own `MiniCPMV4_7Model.get_image_features` (SDPA) on one image alone, its per-slice outputs
concatenated: what the LLM receives.

The tiny model differs from 4.6's case in every size (width, heads, layers, where the window
merger sits, the position table, the LLM's width), so the two cases do not test one shape twice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from family_cases.common import randomize
from family_cases.minicpmv4_6 import TINY_TEXT as TINY_TEXT_4_6
from family_cases.minicpmv4_6 import (  # 4.6's encoder module runs 4.7's parts
    adapter_of,  # noqa: F401 - the case's, for the GPU tests: 4.6's adapter
    encoder_module,
    strip_of,
)
from vitpool import GraphEncoder, Image, Video
from vitpool.families.minicpmv4_7.adapter import missing_transformers_model
from vitpool.specs import ItemSpec

# Why the family's tests skip here (None: they run): a transformers without MiniCPM-V 4.7 (the
# reference, and what the family builds), such as the range's lower bound, 5.17.
TOO_OLD = missing_transformers_model()
PATCH = 14  # the processor's patch size
ROW_SHAPE = (3, PATCH, PATCH)
TEXT_HIDDEN = 40  # the Merger's output width: the LLM's width
TINY_VISION = {
    "hidden_size": 48,
    "intermediate_size": 80,
    "num_hidden_layers": 4,
    "num_attention_heads": 3,
    "image_size": 6 * PATCH,
    "patch_size": PATCH,  # a 6 x 6 position table
}
TINY_TEXT = {**TINY_TEXT_4_6, "hidden_size": TEXT_HIDDEN}  # 4.6's one-layer Qwen3.5 text model, another width
# the window merger after block 2 of 4: blocks run at full and at merged resolution
INSERT_LAYER_ID = 2


def full_config(**overrides: Any) -> Any:
    from transformers import MiniCPMV4_7Config

    return MiniCPMV4_7Config(
        vision_config=dict(TINY_VISION),
        text_config=dict(TINY_TEXT),
        insert_layer_id=INSERT_LAYER_ID,
        **overrides,
    )


def tiny_model(seed: int = 0) -> torch.nn.Module:
    """The full Hugging Face model (a one-layer LLM) with unit-scale random vision weights, SDPA."""
    from transformers import MiniCPMV4_7Model

    model = MiniCPMV4_7Model(full_config())
    randomize(model.vision_tower, seed)
    randomize(model.merger, seed + 1)
    model.config.vision_config._attn_implementation = "sdpa"
    return model.eval().requires_grad_(False)


def image_features(model: torch.nn.Module, item: Any) -> torch.Tensor:
    """get_image_features on one image alone (patch rows or the strip), its slices' tokens concatenated."""
    from vitpool.families.minicpmv4_6.rules import patch_rows

    pixels = torch.as_tensor(item.pixel_values).to(torch.float32)
    rows = patch_rows(pixels, PATCH) if pixels.shape[0] == 1 and pixels.shape[2] == PATCH else pixels
    target_sizes = torch.as_tensor(item.grid_thw, dtype=torch.int32).reshape(-1, 2)
    with torch.no_grad():
        return torch.cat(model.get_image_features(strip_of(rows), target_sizes).pooler_output)


def item_for(spec: ItemSpec, pixels: torch.Tensor) -> Any:
    layout = spec.layout
    return Image(pixels, [list(layout[i : i + 2]) for i in range(0, len(layout), 2)])


_SHARED: dict[str, torch.nn.Module] = {}


def shared_model() -> torch.nn.Module:
    if "model" not in _SHARED:
        _SHARED["model"] = tiny_model()
    return _SHARED["model"]


def make_encoder(budgets: list[int]) -> GraphEncoder:
    if TOO_OLD:  # every conformance test needs the encoder: they all skip
        pytest.skip(TOO_OLD)
    from vitpool.families.minicpmv4_7.adapter import MiniCPMV4_7Adapter

    adapter = MiniCPMV4_7Adapter(encoder_module(shared_model()))
    return GraphEncoder(adapter, budgets=budgets, device="cpu", dtype=torch.float32)


def reference(encoder: GraphEncoder) -> Callable[[Any], list[torch.Tensor]]:
    model = shared_model()
    return lambda item: [image_features(model, item)]


BAD_ITEMS = (
    (Image(torch.randn(1, 3, PATCH, 12 * PATCH), [[4, 4]]), "have 12 patch rows"),  # a strip too short
    (Image(torch.randn(16, 3, 7, 7), [[4, 4]]), "patches of shape (3, 7, 7)"),
    (Image(torch.randn(16, 3 * PATCH * PATCH), [[4, 4]]), "must be 4-D"),
    (Image(torch.randn(16, *ROW_SHAPE)), "target_sizes must be"),
    (Image(torch.randn(16, *ROW_SHAPE), [[4, 4, 1]]), "target_sizes must be"),
    (Image(torch.randn(12, *ROW_SHAPE), [[4, 4]]), "need sum of h*w = 16"),
    (Image(torch.randn(48, *ROW_SHAPE), [[4, 4], [4, 4]]), "need sum of h*w = 32"),
    (Image(torch.randn(12, *ROW_SHAPE), [[2, 6]]), "multiples of 4"),
    (Image(torch.randn(0, *ROW_SHAPE), [[0, 4]]), "zero or negative"),
    (Video(torch.randn(16, *ROW_SHAPE), [[4, 4]]), "MiniCPM-V 4.7 takes images only"),
)

CASE_FIELDS = {
    "make_encoder": make_encoder,
    "reference": reference,
    "item_for": item_for,
    "bad_items": BAD_ITEMS,
    "budgets": (8, 16, 32),
}
