"""LFM2-VL (the SigLIP2 NaFlex tower + LFM2-VL's pixel-unshuffle projector) under the adapter
conformance suite, and the tiny models its own tests share. The reference is the Hugging Face
model's own `get_image_features` (SDPA) on one item's entries alone, laid out as the processor lays
them (each entry padded to the most patches, `spatial_shapes`, `pixel_attention_mask`), its
per-entry outputs concatenated in entry order: what the LLM receives for that image."""

from __future__ import annotations

import copy
from collections.abc import Callable
from itertools import accumulate
from typing import Any

import torch

from family_cases.common import randomize
from vitpool import GraphEncoder, Image, Video
from vitpool.specs import ItemSpec

PATCH = 2
FACTOR = 2  # the projector's downsample factor
GRID = 4  # the position table's side: num_patches = GRID²
TINY_VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_channels": 3,
    "patch_size": PATCH,
    "num_patches": GRID * GRID,
    "vision_use_head": False,
}
TINY_TEXT = {
    "hidden_size": 48,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 128,
    "layer_types": ["conv", "full_attention"],
}
ROW_WIDTH = 3 * PATCH * PATCH
TEXT_WIDTH = TINY_TEXT["hidden_size"]


def full_config(**settings: Any) -> Any:
    from transformers import Lfm2VlConfig

    settings.setdefault("projector_hidden_size", 40)
    return Lfm2VlConfig(vision_config=dict(TINY_VISION), text_config=dict(TINY_TEXT), **settings)


def hf_model(seed: int = 0, **settings: Any) -> torch.nn.Module:
    """The full tiny Hugging Face model, its vision weights random at unit scale, SDPA."""
    from transformers import Lfm2VlForConditionalGeneration

    model = Lfm2VlForConditionalGeneration(full_config(**settings))
    randomize(model.model.vision_tower, seed)
    randomize(model.model.multi_modal_projector, seed + 1)
    model.config.vision_config._attn_implementation = "sdpa"
    return model.eval().requires_grad_(False)


def encoder_module(model: torch.nn.Module) -> torch.nn.Module:
    """vitpool's module over copies of the model's tower and projector (the adapter changes the
    tower's attention)."""
    from vitpool.families.lfm2_vl.adapter import Lfm2VlEncoder

    return Lfm2VlEncoder(
        copy.deepcopy(model.model.vision_tower), copy.deepcopy(model.model.multi_modal_projector)
    )


def encoder_of(model: torch.nn.Module, budgets: list[int]) -> GraphEncoder:
    from vitpool.families.lfm2_vl.adapter import Lfm2VlAdapter

    return GraphEncoder(
        Lfm2VlAdapter(encoder_module(model)), budgets=budgets, device="cpu", dtype=torch.float32
    )


def shapes_of(item: Any) -> list[tuple[int, int]]:
    from vitpool.families.lfm2_vl.rules import parse_spatial_shapes

    return list(parse_spatial_shapes(item.grid_thw))


def padded_entries(rows: torch.Tensor, shapes: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
    """Packed patch rows [sum h*w, C*P*P] of entries `shapes` as the processor lays them out: each
    entry zero-padded to the most patches, with `spatial_shapes` and `pixel_attention_mask`."""
    counts = [h * w for h, w in shapes]
    most = max(counts)
    pixels = torch.zeros(len(shapes), most, rows.shape[1])
    mask = torch.zeros(len(shapes), most, dtype=torch.int32)
    for entry, (start, count) in enumerate(zip([0, *accumulate(counts)], counts)):
        pixels[entry, :count] = rows[start : start + count]
        mask[entry, :count] = 1
    return {"pixel_values": pixels, "spatial_shapes": torch.tensor(shapes), "pixel_attention_mask": mask}


def image_features(model: torch.nn.Module, item: Any) -> torch.Tensor:
    """What `get_image_features` gives the LLM for this image's entries alone, concatenated."""
    batch = padded_entries(torch.as_tensor(item.pixel_values).float(), shapes_of(item))
    with torch.no_grad():
        return torch.cat(model.model.get_image_features(**batch).pooler_output)


_SHARED: dict[str, torch.nn.Module] = {}


def shared_model() -> torch.nn.Module:
    if "model" not in _SHARED:
        _SHARED["model"] = hf_model()
    return _SHARED["model"]


def make_encoder(budgets: list[int]) -> GraphEncoder:
    return encoder_of(shared_model(), budgets)


def reference(encoder: GraphEncoder) -> Callable[[Any], list[torch.Tensor]]:
    return lambda item: [image_features(shared_model(), item)]


def item_for(spec: ItemSpec, pixels: torch.Tensor) -> Image:
    """The item a caller builds: the image's packed patch rows and its `spatial_shapes` rows."""
    layout = spec.layout
    return Image(pixels, [list(layout[i : i + 2]) for i in range(0, len(layout), 2)])


BAD_ITEMS = (
    (Image(torch.randn(16, ROW_WIDTH)), "needs its spatial_shapes rows"),
    (Image(torch.randn(16, ROW_WIDTH), [[4, 2], [2, 2]]), "need sum of h*w = 12"),  # rows of another image
    (Image(torch.randn(2, 16, ROW_WIDTH), [[4, 4], [4, 4]]), "the processor's padded entries"),  # not cut
    (Image(torch.randn(12, ROW_WIDTH), [[4, 3]]), "multiples of the downsample factor 2"),
    (Image(torch.randn(16, 3, PATCH, PATCH), [[4, 4]]), "must be patch rows"),
    (Image(torch.randn(16, ROW_WIDTH), [[4, 0]]), "zero or negative"),
    (Video(torch.randn(16, ROW_WIDTH), [[4, 4]]), "images only"),
)

CASE_FIELDS = {
    "make_encoder": make_encoder,
    "reference": reference,
    "item_for": item_for,
    "bad_items": BAD_ITEMS,
    "budgets": (16, 32, 64),
}
