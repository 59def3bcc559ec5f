"""MiniCPM-V 4.6 (MiniCPMV4_6VisionModel + MiniCPMV4_6Merger) under the adapter conformance suite,
and the tiny model its own tests share. The reference is Hugging Face's own
`MiniCPMV4_6Model.get_image_features` (SDPA) on one image alone, its per-slice outputs
concatenated: what the LLM receives."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from family_cases.common import randomize
from vitpool import GraphEncoder, Image, Video
from vitpool.specs import ItemSpec


def _older_than_minimum() -> str | None:
    """Why the family's tests skip here (None: they run): transformers before the release whose
    MiniCPM-V 4.6 takes slices of unlike sizes (the reference, and what vitpool requires)."""
    import transformers
    from packaging.version import Version

    from vitpool.families.minicpmv4_6.adapter import MINIMUM_TRANSFORMERS

    if Version(transformers.__version__) < Version(MINIMUM_TRANSFORMERS):
        return (
            f"MiniCPM-V 4.6 needs transformers>={MINIMUM_TRANSFORMERS}; "
            f"{transformers.__version__} is installed"
        )
    return None


TOO_OLD = _older_than_minimum()
PATCH = 14  # the processor's patch size
ROW_SHAPE = (3, PATCH, PATCH)
TEXT_HIDDEN = 48  # the Merger's output width: the LLM's width
TINY_VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "image_size": 8 * PATCH,
    "patch_size": PATCH,  # an 8 x 8 position table
}
TINY_TEXT = {
    "model_type": "qwen3_5_text",
    "vocab_size": 64,
    "hidden_size": TEXT_HIDDEN,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "layer_types": ["full_attention"],
}
# the window merger after block 1 of 3: blocks run at full and at merged resolution
INSERT_LAYER_ID = 1


def full_config(**overrides: Any) -> Any:
    from transformers import MiniCPMV4_6Config

    return MiniCPMV4_6Config(
        vision_config=dict(TINY_VISION),
        text_config=dict(TINY_TEXT),
        insert_layer_id=INSERT_LAYER_ID,
        **overrides,
    )


def tiny_model(seed: int = 0) -> torch.nn.Module:
    """The full Hugging Face model (a one-layer LLM) with unit-scale random vision weights, SDPA."""
    from transformers import MiniCPMV4_6Model

    model = MiniCPMV4_6Model(full_config())
    randomize(model.vision_tower, seed)
    randomize(model.merger, seed + 1)
    model.config.vision_config._attn_implementation = "sdpa"
    return model.eval().requires_grad_(False)


def encoder_module(model: torch.nn.Module) -> torch.nn.Module:
    """vitpool's encoder module over copies of the model's tower and Merger."""
    from vitpool.families.minicpmv4_6.adapter import MiniCPMV4_6Encoder

    return MiniCPMV4_6Encoder(copy.deepcopy(model.vision_tower), copy.deepcopy(model.merger))


def adapter_of(model: torch.nn.Module) -> Any:
    """vitpool's adapter over `encoder_module(model)` (what the GPU tests capture)."""
    from vitpool.families.minicpmv4_6.adapter import MiniCPMV4_6Adapter

    return MiniCPMV4_6Adapter(encoder_module(model))


def strip_of(rows: torch.Tensor) -> torch.Tensor:
    """Patch rows [N, C, P, P] back to the processor's strip [1, C, P, N*P]."""
    return rows.permute(1, 2, 0, 3).reshape(1, rows.shape[1], rows.shape[2], -1)


def image_features(model: torch.nn.Module, item: Any) -> torch.Tensor:
    """get_image_features on one image alone, its slices' tokens concatenated."""
    rows = torch.as_tensor(item.pixel_values).to(torch.float32)
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
    from vitpool.families.minicpmv4_6.adapter import MiniCPMV4_6Adapter

    adapter = MiniCPMV4_6Adapter(encoder_module(shared_model()))
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
    (Video(torch.randn(16, *ROW_SHAPE), [[4, 4]]), "images only"),
)

CASE_FIELDS = {
    "make_encoder": make_encoder,
    "reference": reference,
    "item_for": item_for,
    "bad_items": BAD_ITEMS,
    "budgets": (8, 16, 32),
}
