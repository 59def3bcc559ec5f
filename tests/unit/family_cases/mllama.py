"""Llama 3.2 Vision (MllamaVisionModel + multi_modal_projector) under the adapter conformance suite,
and the tiny model its own tests share. Items are an image's real tiles and its canvas (h, w); the
reference is what Hugging Face's full model computes from that image alone, laid out as its
processor lays it out (padding tiles of zeros, its aspect ratio id and mask): the vision model, the
projector, the image's real tiles' rows of the cross-attention states."""

from __future__ import annotations

import copy
from typing import Any

import torch

from family_cases.common import randomize
from vitpool import GraphEncoder, Image

TILE = 16  # pixels per tile side; patches of 2 pixels: 64 patches and a class token a tile
TOKENS_PER_TILE = 65
MAX_NUM_TILES = 4
TINY_VISION = {
    "hidden_size": 32,
    "attention_heads": 2,
    "num_hidden_layers": 3,
    "num_global_layers": 2,
    "intermediate_size": 64,
    "image_size": TILE,
    "patch_size": 2,
    "max_num_tiles": MAX_NUM_TILES,
    "intermediate_layers_indices": [0, 2],
    "vision_output_dim": 32 * 3,  # the last state and two intermediate layers
}
TINY_TEXT = {
    "hidden_size": 48,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "cross_attention_layers": [1],
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
ROW_SHAPE = (3, TILE, TILE)
# (h, w) canvases in the order of their aspect ratio ids, as the config's default for four tiles
ASPECT_RATIOS = ((1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (2, 2), (3, 1), (4, 1))


def full_config() -> Any:
    from transformers import MllamaConfig

    config = MllamaConfig(vision_config=dict(TINY_VISION), text_config=dict(TINY_TEXT))
    config._attn_implementation = "sdpa"
    return config


def hf_model(seed: int = 0) -> torch.nn.Module:
    """The full model with unit-scale random vision and projector weights (gates included)."""
    from transformers import MllamaForConditionalGeneration

    model = MllamaForConditionalGeneration(full_config())
    randomize(model.model.vision_model, seed)
    randomize(model.model.multi_modal_projector, seed + 1)
    return model.eval().requires_grad_(False)


def encoder_of(model: torch.nn.Module, budgets: list[int], **kwargs: Any) -> GraphEncoder:
    from vitpool.families.mllama.adapter import MllamaAdapter, MllamaEncoder

    inner = model.model
    module = MllamaEncoder(copy.deepcopy(inner.vision_model), copy.deepcopy(inner.multi_modal_projector))
    return GraphEncoder(MllamaAdapter(module), budgets=budgets, device="cpu", dtype=torch.float32, **kwargs)


def processor_layout(item: Any) -> dict[str, torch.Tensor]:
    """One image as MllamaImageProcessor hands it to the model: [1, 1, 4, C, S, S] with zero
    padding tiles, its aspect ratio id and mask."""
    tiles = torch.as_tensor(item.pixel_values)
    canvas = tuple(int(n) for n in item.grid_thw)
    pixels = torch.zeros((1, 1, MAX_NUM_TILES, *ROW_SHAPE), dtype=tiles.dtype)
    pixels[0, 0, : len(tiles)] = tiles
    mask = torch.zeros((1, 1, MAX_NUM_TILES), dtype=torch.int64)
    mask[0, 0, : len(tiles)] = 1
    ratio_id = torch.tensor([[ASPECT_RATIOS.index(canvas) + 1]])
    return {"pixel_values": pixels, "aspect_ratio_ids": ratio_id, "aspect_ratio_mask": mask}


def image_features(model: torch.nn.Module, item: Any) -> torch.Tensor:
    """What the model computes for one image alone, the rows of its real tiles: [tiles * tokens a
    tile, text width] (MllamaModel.forward's cross_attention_states)."""
    inner = model.model
    inputs = processor_layout(item)
    with torch.no_grad():
        states = inner.vision_model(**inputs).last_hidden_state
        projected = inner.multi_modal_projector(states).reshape(-1, states.shape[-2], inner.hidden_size)
    return projected[: len(item.pixel_values)].reshape(-1, inner.hidden_size)


def _case_fields() -> dict[str, Any]:
    shared: dict[str, torch.nn.Module] = {}

    def model() -> torch.nn.Module:
        if "model" not in shared:
            shared["model"] = hf_model()
        return shared["model"]

    channels, side, _ = ROW_SHAPE
    bad_items = (
        (Image(torch.randn(2, *ROW_SHAPE), (1, 2, 2)), "canvas (h, w) in tiles"),
        (Image(torch.randn(2, *ROW_SHAPE)), "needs its canvas"),
        (Image(torch.randn(2, channels, side, side + 2), (1, 2)), "must be tiles"),
        (Image(torch.randn(4, channels * side * side), (2, 2)), "must be tiles"),
        (Image(torch.randn(0, *ROW_SHAPE), (1, 1)), "no tiles"),
        (Image(torch.randn(3, *ROW_SHAPE), (2, 2)), "canvas (2, 2) has 4"),
        (Image(torch.randn(5, *ROW_SHAPE), (5, 1)), "not one of the model's aspect ratios"),
    )
    return {
        "make_encoder": lambda budget_list: encoder_of(model(), budget_list),
        "reference": lambda encoder: lambda item: [image_features(model(), item)],
        "item_for": lambda spec, pixels: Image(pixels, spec.layout),
        "bad_items": bad_items,
        # 1, 4 and 8 tiles: one, one and two image slots
        "budgets": (TOKENS_PER_TILE, 4 * TOKENS_PER_TILE, 8 * TOKENS_PER_TILE),
    }


CASE_FIELDS = _case_fields()
