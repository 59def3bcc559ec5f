"""Step-3.7 (Step3p7VisionModel + multi_modal_projector, two paths) under the adapter conformance
suite, and the tiny model its own tests share.

The suite checks parts: an item built for a crops spec carries a fixed global view beside its
crops, and the reference gives that item's crops' outputs alone (Hugging Face's vision model and
projector on the crops, as `get_image_features` runs them); for a global spec the item is the
global view alone and the reference is `get_image_features`. Whole items, crops and global view
joined, are checked against `get_image_features` in test_path_families.py.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from family_cases.common import randomize

from vitpool import GraphEncoder, Image

GLOBAL_SIZE = 56  # 8 x 8 patches of 7 pixels, 2 x 2 = 4 tokens after the 4x downsampling
LOCAL_SIZE = 28  # 4 x 4 patches, 1 token
TOKENS_PER_GLOBAL = 4
TOKENS_PER_CROP = 1
TINY_VISION = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": GLOBAL_SIZE,
    "patch_size": 7,
    "mlp_ratio": 2.0,
    "max_position_embeddings": 64,
}
TINY_TEXT = {
    "hidden_size": 48,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "head_dim": 24,
    "vocab_size": 128,
    "moe_num_experts": 2,
    "moe_top_k": 1,
}
GLOBAL_ROW_SHAPE = (3, GLOBAL_SIZE, GLOBAL_SIZE)
LOCAL_ROW_SHAPE = (3, LOCAL_SIZE, LOCAL_SIZE)
# the global view beside the crops of an item built for a crops spec (see the module's opening)
FIXED_GLOBAL = torch.randn(1, *GLOBAL_ROW_SHAPE, generator=torch.Generator().manual_seed(99))


def hf_model(seed: int = 0) -> torch.nn.Module:
    """The full model with unit-scale random vision and projector weights."""
    from transformers import Step3p7Config, Step3p7ForConditionalGeneration

    config = Step3p7Config(vision_config=dict(TINY_VISION), text_config=dict(TINY_TEXT))
    config._attn_implementation = "sdpa"
    model = Step3p7ForConditionalGeneration(config)
    randomize(model.model.vision_model, seed)
    randomize(model.model.multi_modal_projector, seed + 1)
    return model.eval().requires_grad_(False)


def encoder_of(model: torch.nn.Module, budgets: list[int]) -> GraphEncoder:
    from vitpool.models.step3p7 import Step3p7Adapter, Step3p7Encoder

    module = Step3p7Encoder(
        copy.deepcopy(model.model.vision_model), copy.deepcopy(model.model.multi_modal_projector), LOCAL_SIZE
    )
    return GraphEncoder(Step3p7Adapter(module), budgets=budgets, device="cpu", dtype=torch.float32)


def image_features(model: torch.nn.Module, item: Any) -> torch.Tensor:
    """What the model hands its LLM for one image: its crops' tokens, then its global view's."""
    crops = (item.inputs or {}).get("pixel_values_local")
    with torch.no_grad():
        output = model.model.get_image_features(
            pixel_values=torch.as_tensor(item.pixel_values),
            pixel_values_local=None if crops is None else torch.as_tensor(crops),
            num_local_patches=None if crops is None else [crops.shape[0]],
        )
    return output.pooler_output[0]


def crops_features(model: torch.nn.Module, crops: torch.Tensor) -> torch.Tensor:
    """The crops' part alone: the vision model and the projector on them, flattened."""
    with torch.no_grad():
        features = model.model.multi_modal_projector(model.model.vision_model(crops).last_hidden_state)
    return features.reshape(-1, features.shape[-1])


def part_item(spec: Any, pixels: torch.Tensor) -> Image:
    if spec.path == "pixel_values_local":
        return Image(FIXED_GLOBAL, inputs={"pixel_values_local": pixels})
    return Image(pixels)


def part_reference(model: torch.nn.Module, item: Image) -> list[torch.Tensor]:
    if item.inputs:
        return [crops_features(model, item.inputs["pixel_values_local"])]
    return [image_features(model, item)]


_shared: dict[str, torch.nn.Module] = {}


def _model() -> torch.nn.Module:
    if "model" not in _shared:
        _shared["model"] = hf_model()
    return _shared["model"]


CASE_FIELDS = {
    "make_encoder": lambda budget_list: encoder_of(_model(), budget_list),
    "reference": lambda encoder: lambda item: part_reference(_model(), item),
    "item_for": part_item,
    "bad_items": (
        (Image(torch.randn(1, *GLOBAL_ROW_SHAPE), (1, 2, 2)), "no grid"),
        (Image(torch.randn(1, *GLOBAL_ROW_SHAPE), inputs={"pixel_values_local": torch.randn(2, 3, 28, 30)}),
         "pixel_values_local: pixel_values must be tiles"),
        (Image(torch.randn(1, *GLOBAL_ROW_SHAPE), inputs={"crops": torch.randn(2, *LOCAL_ROW_SHAPE)}),
         "unknown inputs ['crops']"),
        (Image(None, inputs={"pixel_values_local": torch.randn(2, *LOCAL_ROW_SHAPE)}), "has no ['pixel_values']"),
        (Image(torch.randn(1, *GLOBAL_ROW_SHAPE), inputs={"pixel_values_local": torch.ones(2, 3, 28, 28, dtype=torch.int64)}),
         "pixel_values_local have dtype torch.int64"),
    ),
    "budgets": (4, 8, 16),
}
