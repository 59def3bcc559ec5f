"""Molmo 2 (its ViT, attention pooling and projector) under the adapter conformance suite, and the tiny
model its own tests share. The reference is the Hugging Face model's own `get_image_features` on one
image alone (`get_video_features` on one video), fed the windows `rules.item_windows` gives the
item's layout; the processor's own windows are checked against them in test_molmo2_family.py.

The tiny model: 12-pixel crops of 2-pixel patches (6 x 6 patches a crop), three layers, features of
the last layer and the first side by side."""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from family_cases.common import randomize
from vitpool import GraphEncoder, Image, Video
from vitpool.specs import VIDEO, ItemSpec

# Why the family's tests skip here (None: they run): transformers 5.17 (the GPU machine's, the
# range's lower bound) has no Molmo 2; 5.24 has it
TOO_OLD = (
    None
    if importlib.util.find_spec("transformers.models.molmo2") is not None
    else "Molmo 2 needs a transformers with transformers.models.molmo2 (5.24 has it; 5.17 does not)"
)

CROP, PATCH = 12, 2
SIDE = CROP // PATCH
ROW_SHAPE = (SIDE * SIDE, 3 * PATCH * PATCH)
TEXT_WIDTH = 48
TINY_VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "image_size": [CROP, CROP],
    "patch_size": PATCH,
}
TINY_ADAPTER = {
    "vision_feature_layer": [-1, 0],
    "hidden_size": 32,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 64,
    "text_hidden_size": TEXT_WIDTH,
}
TINY_TEXT = {
    "hidden_size": TEXT_WIDTH,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "vocab_size": 128,
    "additional_vocab_size": 8,
    "num_hidden_layers": 1,
    "intermediate_size": 64,
}
TOKENS_PER_CROP = 9  # ceil(6 / 2)²
BUDGETS = tuple(TOKENS_PER_CROP * crops for crops in (2, 5, 10, 20))
IMAGE_POOL, VIDEO_POOL = (2, 2), (3, 3)


def full_config(**adapter: Any) -> Any:
    from transformers.models.molmo2.configuration_molmo2 import Molmo2Config

    config = Molmo2Config(
        vision_config=dict(TINY_VISION),
        adapter_config={**TINY_ADAPTER, **adapter},
        text_config=dict(TINY_TEXT),
    )
    config._attn_implementation = "sdpa"
    return config


def hf_model(seed: int = 0, **adapter: Any) -> torch.nn.Module:
    """The full model with unit-scale random tower and adapter weights."""
    from transformers.models.molmo2.modeling_molmo2 import Molmo2ForConditionalGeneration

    model = Molmo2ForConditionalGeneration(full_config(**adapter))
    randomize(model.model.vision_tower, seed)
    randomize(model.model.multi_modal_projector, seed + 1)
    return model.eval().requires_grad_(False)


def encoder_of(model: torch.nn.Module, budgets: list[int]) -> GraphEncoder:
    from vitpool.families.molmo2.adapter import Molmo2Adapter, Molmo2Encoder

    module = Molmo2Encoder(model.model.vision_tower, model.model.multi_modal_projector)
    return GraphEncoder(Molmo2Adapter(module), budgets=budgets, device="cpu", dtype=torch.float32)


def image_layout(tiling_h: int, tiling_w: int, margins: tuple[int, int] = (1, 1)) -> tuple[int, ...]:
    return (tiling_h, tiling_w, *IMAGE_POOL, *margins)


def image(tiling_h: int, tiling_w: int, seed: int, margins: tuple[int, int] = (1, 1)) -> Image:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randn(tiling_h * tiling_w + 1, *ROW_SHAPE, generator=generator)
    return Image(pixels, image_layout(tiling_h, tiling_w, margins))


def video(frames: int, seed: int) -> Video:
    generator = torch.Generator().manual_seed(seed)
    return Video(torch.randn(frames, *ROW_SHAPE, generator=generator), VIDEO_POOL)


def features(model: torch.nn.Module, item: Any) -> torch.Tensor:
    """What the model hands its LLM for one image or video: [tokens, text width]."""
    from vitpool.families.molmo2.rules import item_windows

    pixels = torch.as_tensor(item.pixel_values).to(torch.float32)
    layout = tuple(item.grid_thw)
    modality = "video" if isinstance(item, Video) else "image"
    windows = torch.from_numpy(item_windows(SIDE, modality, len(pixels), layout).copy())
    with torch.no_grad():
        if modality == "video":
            rows = -(-SIDE // layout[0])
            grids = torch.tensor([[len(pixels), rows, -(-SIDE // layout[1])]])
            [tokens] = model.model.get_video_features(pixels, windows, grids).pooler_output
        else:
            tokens_all = windows.shape[0]
            global_rows, global_cols = -(-SIDE // layout[2]), -(-SIDE // layout[3])
            rest = tokens_all - global_rows * global_cols
            grids = torch.tensor([[global_rows, global_cols, rest, 1]])
            [tokens] = model.model.get_image_features(pixels, windows, grids).pooler_output
    return tokens


def item_for(spec: ItemSpec, pixels: torch.Tensor) -> Any:
    return (Video if spec.modality == VIDEO else Image)(pixels, spec.layout)


_shared: dict[str, torch.nn.Module] = {}


def _model() -> torch.nn.Module:
    if "model" not in _shared:
        _shared["model"] = hf_model()
    return _shared["model"]


CASE_FIELDS = {
    "make_encoder": lambda budgets: encoder_of(_model(), budgets),
    "reference": lambda encoder: lambda item: [features(_model(), item)],
    "item_for": item_for,
    "bad_items": (
        # no layout: the windows depend on it
        (Image(torch.randn(5, *ROW_SHAPE)), "needs its layout"),
        # a 2 x 2 tiling is 5 crops with the global view
        (Image(torch.randn(4, *ROW_SHAPE), image_layout(2, 2)), "has 5 crops"),
        # crops of another size
        (
            Image(torch.randn(5, SIDE * SIDE + 1, ROW_SHAPE[1]), image_layout(2, 2)),
            "pixel_values must be crops",
        ),
        # the processor's 4-D form: pass one image's crops
        (Image(torch.randn(1, 5, *ROW_SHAPE), image_layout(2, 2)), "pixel_values must be crops"),
        (Video(torch.randn(2, *ROW_SHAPE), image_layout(1, 1)), "(pool_h, pool_w)"),
        (Video(torch.randn(2, *ROW_SHAPE), (4, 4)), "over the encoder's 9 slots"),
        (Image(torch.randn(0, *ROW_SHAPE), image_layout(1, 1)), "no crops"),
    ),
    "budgets": BUDGETS,
}
