"""LLaVA-NeXT (CLIP + feature selection + projector + anyres packing) under the adapter conformance
suite, and the tiny model its own tests share. The reference is Hugging Face's full model's
`get_image_features` on one image alone (its base tile and crops, with its size): the one tensor of
its `pooler_output`, what the model scatters into its image tokens.

The tiny model: 8-pixel tiles of 2-pixel patches (4 x 4 features a tile, 17 positions with the class
token), three layers (the default -2 reads layer 2: layer 3 is cut), and the releases' five pinpoint
shapes at that tile: 1 x 2, 2 x 1, 2 x 2, 1 x 3 and 3 x 1 crops.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from family_cases.common import randomize
from vitpool import GraphEncoder, Image

TILE = 8
PATCH = 2
SIDE = TILE // PATCH
# (height, width), as LlavaNextConfig's default [[336, 672], [672, 336], [672, 672], [1008, 336],
# [336, 1008]] at 8-pixel tiles
PINPOINTS = [[8, 16], [16, 8], [16, 16], [24, 8], [8, 24]]
# the most tokens a tile gives: a 2 x 1 grid (or 3 x 1) unpadded nothing, (16 + 8 * 5) / 3 tiles, up
TOKENS_PER_TILE = 19
MIN_ITEM_TILES, MAX_ITEM_TILES = 3, 5  # 1 x 2 crops and 2 x 2, each with the base tile
TINY_VISION = {
    "model_type": "clip_vision_model",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "image_size": TILE,
    "patch_size": PATCH,
    "projection_dim": 16,
}
TINY_TEXT = {
    "model_type": "llama",
    "hidden_size": 48,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 128,
}
IMAGE_TOKEN_ID = 127  # the tiny vocabulary's last token
ROW_SHAPE = (3, TILE, TILE)
BUDGETS = tuple(TOKENS_PER_TILE * tiles for tiles in (3, 5, 10))
TOO_OLD = None  # transformers 5.17 has llava_next (and every release the pyproject allows)


def full_config(**settings: Any) -> Any:
    """The full model's config (LlavaNextConfig's defaults: layer -2, "default", GELU, biases) at
    the tiny sizes, with `settings` replacing them."""
    from transformers import LlavaNextConfig

    config = LlavaNextConfig(
        vision_config=dict(TINY_VISION),
        text_config=dict(TINY_TEXT),
        image_grid_pinpoints=PINPOINTS,
        image_token_index=IMAGE_TOKEN_ID,
        **settings,
    )
    config.vision_config._attn_implementation = "sdpa"
    return config


def hf_model(seed: int = 0, **settings: Any) -> torch.nn.Module:
    """The full model with unit-scale random tower, projector and newline weights (the class
    embedding too, so that the class token every patch attends to matters)."""
    from transformers import LlavaNextForConditionalGeneration

    model = LlavaNextForConditionalGeneration(full_config(**settings))
    randomize(model.model.vision_tower, seed)
    randomize(model.model.multi_modal_projector, seed + 1)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(seed + 2)
        embedding = model.model.vision_tower.embeddings.class_embedding
        embedding.copy_(torch.randn(embedding.shape, generator=generator))
        model.model.image_newline.copy_(torch.randn(TINY_TEXT["hidden_size"], generator=generator))
    return model.eval().requires_grad_(False)


def encoder_module(model: torch.nn.Module) -> torch.nn.Module:
    from vitpool.families.llava_next.adapter import LlavaNextEncoder

    inner = model.model
    return LlavaNextEncoder(
        copy.deepcopy(inner.vision_tower),
        copy.deepcopy(inner.multi_modal_projector),
        inner.image_newline,
        model.config,
    )


def encoder_of(model: torch.nn.Module, budgets: list[int]) -> GraphEncoder:
    from vitpool.families.llava_next.adapter import LlavaNextAdapter

    adapter = LlavaNextAdapter(encoder_module(model))
    return GraphEncoder(adapter, budgets=budgets, device="cpu", dtype=torch.float32)


def features(model: torch.nn.Module, item: Any) -> torch.Tensor:
    """What the model hands its LLM for one image: [tokens, text width]."""
    pixels = torch.as_tensor(item.pixel_values)
    with torch.no_grad():
        output = model.model.get_image_features(
            pixel_values=pixels[None], image_sizes=torch.tensor([item.grid_thw])
        )
    [tokens] = output.pooler_output
    return tokens


def item_for(spec: Any, pixels: torch.Tensor) -> Any:
    return Image(pixels, spec.layout)


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
        # the base tile alone: the model has no such image
        (Image(torch.randn(1, *ROW_SHAPE), (13, 14)), "5 tiles"),
        # tiles of another size
        (Image(torch.randn(5, 3, TILE, TILE + 2), (13, 14)), "pixel_values must be tiles"),
        # the processor's batch form: pass one image's tiles
        (Image(torch.randn(1, 5, *ROW_SHAPE), (13, 14)), "pixel_values must be tiles"),
        (Image(torch.randn(0, *ROW_SHAPE), (13, 14)), "pixel_values must be tiles"),
    ),
    "budgets": BUDGETS,
}
