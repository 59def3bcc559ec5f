"""LLaVA-OneVision (SigLIP + projector + packing) under the adapter conformance suite, and the tiny
model its own tests share. The reference is Hugging Face's full model on one item alone: an image's
`get_image_features` (its base tile and crops, with its size; a one-tile image as one image of a
two-image sample, the only way the model runs a base tile alone), a video's `get_video_features`.

The tiny model: 8-pixel tiles of 2-pixel patches (4 x 4 features a tile), grids of up to 3 x 3 crops,
and "anyres_max_2", so that grids of three crops or more are pooled and smaller ones are not.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch

from family_cases.common import randomize
from vitpool import GraphEncoder, Image, Video
from vitpool.specs import VIDEO, ItemSpec

TILE = 8
PINPOINTS = [[8, 8], [8, 16], [16, 8], [16, 16], [8, 24], [24, 8], [16, 24], [24, 16], [24, 24]]
VISION_ASPECT_RATIO = "anyres_max_2"
# the most tokens a tile gives: a 2 x 1 grid unpadded nothing, (16 + 8 * 5) / 3 tiles, rounded up
TOKENS_PER_TILE = 19
MAX_ITEM_TILES = 10  # 3 x 3 crops and the base tile
TINY_VISION = {
    "model_type": "siglip_vision_model",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": TILE,
    "patch_size": 2,
    "vision_use_head": False,  # as the releases
}
TINY_TEXT = {
    "model_type": "qwen2",
    "hidden_size": 48,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "vocab_size": 128,
}
ROW_SHAPE = (3, TILE, TILE)
BUDGETS = tuple(TOKENS_PER_TILE * tiles for tiles in (2, 5, 10))


def full_config(**changes: Any) -> Any:
    from transformers import LlavaOnevisionConfig

    config = LlavaOnevisionConfig(
        vision_config=dict(TINY_VISION),
        text_config=dict(TINY_TEXT),
        image_grid_pinpoints=PINPOINTS,
        vision_aspect_ratio=VISION_ASPECT_RATIO,
        **changes,
    )
    config._attn_implementation = "sdpa"
    return config


def hf_model(seed: int = 0, **changes: Any) -> torch.nn.Module:
    """The full model with unit-scale random tower, projector and newline weights."""
    from transformers import LlavaOnevisionForConditionalGeneration

    model = LlavaOnevisionForConditionalGeneration(full_config(**changes))
    randomize(model.model.vision_tower, seed)
    randomize(model.model.multi_modal_projector, seed + 1)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(seed + 2)
        model.model.image_newline.copy_(torch.randn(TINY_TEXT["hidden_size"], generator=generator))
    return model.eval().requires_grad_(False)


def encoder_module(model: torch.nn.Module) -> torch.nn.Module:
    from vitpool.families.llava_onevision.adapter import LlavaOnevisionEncoder

    inner = model.model
    return LlavaOnevisionEncoder(
        copy.deepcopy(inner.vision_tower),
        copy.deepcopy(inner.multi_modal_projector),
        inner.image_newline,
        model.config,
    )


def encoder_of(model: torch.nn.Module, budgets: list[int]) -> GraphEncoder:
    from vitpool.families.llava_onevision.adapter import LlavaOnevisionAdapter

    adapter = LlavaOnevisionAdapter(encoder_module(model))
    return GraphEncoder(adapter, budgets=budgets, device="cpu", dtype=torch.float32)


def features(model: torch.nn.Module, item: Any) -> torch.Tensor:
    """What the model hands its LLM for one image or video: [tokens, text width]."""
    pixels = torch.as_tensor(item.pixel_values)
    with torch.no_grad():
        if isinstance(item, Video):
            # positional: the argument is `pixel_values_videos` in newer transformers, `pixel_values` in 5.17
            [frames] = model.model.get_video_features(pixels[None]).pooler_output
            if not _video_features_end_with_newline(model):  # 5.17: its forward appends it
                frames = torch.cat([frames, model.model.image_newline[None].to(frames.dtype)])
            return frames
        sizes = torch.tensor([list(item.grid_thw)])
        if pixels.shape[0] == 1:  # the base tile alone: one image of a sample of two
            output = model.model.get_image_features(
                pixel_values=torch.stack([pixels, pixels]),
                image_sizes=sizes.repeat(2, 1),
                batch_num_images=torch.tensor([2]),
            )
        else:
            output = model.model.get_image_features(pixel_values=pixels[None], image_sizes=sizes)
    return output.pooler_output[0]


def _video_features_end_with_newline(model: torch.nn.Module) -> bool:
    """Whether this transformers' `get_video_features` appends the video's newline token itself
    (later releases) or leaves it to the model's forward (5.17)."""
    return "image_newline" in inspect.getsource(type(model.model).get_video_features)


def item_for(spec: ItemSpec, pixels: torch.Tensor) -> Any:
    return Video(pixels) if spec.modality == VIDEO else Image(pixels, spec.layout)


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
        # no size: the packing depends on it
        (Image(torch.randn(5, *ROW_SHAPE)), "original size (H, W)"),
        # a 13 x 14 image is cut into 2 x 2 crops and a base tile: 5 tiles, not the batch's padded 6
        (Image(torch.randn(6, *ROW_SHAPE), (13, 14)), "2 x 2 crops and a base tile, 5 tiles"),
        # tiles of another size
        (Image(torch.randn(5, 3, TILE, TILE + 2), (13, 14)), "pixel_values must be tiles"),
        # the processor's batch form: pass one image's tiles
        (Image(torch.randn(1, 5, *ROW_SHAPE), (13, 14)), "pixel_values must be tiles"),
        (Video(torch.randn(2, *ROW_SHAPE), (1, 2, 2)), "a video is its frames alone"),
        (Image(torch.randn(0, *ROW_SHAPE), (13, 14)), "no tiles"),
    ),
    "budgets": BUDGETS,
}
