"""DeepSeek-OCR-2 (DeepseekOcr2VisionModel + multi_modal_projector + view_separator, two paths)
under the adapter conformance suite, and the tiny model its own tests share.

The tiny model keeps the release's tile sizes (1024² global views, 768² crops, 16-pixel patches):
the tower sizes its position table from them and picks its query table (256 or 144 queries) by
the SAM token count, so smaller tiles would change the family's shape. It is small in width and
depth instead. Hugging Face's SAM initialises to about 1e-10, which makes every image token alike
(any attention mask then gives the same answer), so the vision weights are randomized.

The suite checks parts: an item built for a crops spec carries a fixed global view beside its
crops, and the reference gives that item's crops' outputs alone (Hugging Face's vision tower and
projector on the crops, as `get_image_features` runs them); for a global spec the item is the
global view alone and the reference is `get_image_features` (its 256 tokens and the separator).
Whole items, crops and global view joined, are checked against `get_image_features` in
test_family_deepseek_ocr2.py.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from family_cases.common import randomize

from vitpool import GraphEncoder, Image

GLOBAL_SIZE = 1024  # 64 x 64 patches of 16 pixels, 16 x 16 = 256 SAM tokens: the 256 queries
LOCAL_SIZE = 768  # 48 x 48 patches, 12 x 12 = 144 SAM tokens: the 144 queries
TOKENS_PER_GLOBAL = 257  # 256 queries and the view separator
TOKENS_PER_CROP = 144
TEXT_WIDTH = 48
TINY_SAM = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "global_attn_indexes": [1],  # layer 0 windowed (14 x 14), layer 1 global
    "output_channels": 16,
    "downsample_channels": [16, 64],  # the last is the encoder's width
    "mlp_ratio": 2.0,
}
TINY_ENCODER = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped-query attention, as the release's 14 / 2
    "intermediate_size": 128,
    "vocab_size": 1,
    "max_position_embeddings": 512,
}
TINY_TEXT = {
    "hidden_size": TEXT_WIDTH,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "vocab_size": 32,
    "n_routed_experts": 2,
    "num_experts_per_tok": 1,
    "moe_intermediate_size": 16,
    "n_shared_experts": 1,
    "mlp_layer_types": ["dense"],
}
GLOBAL_ROW_SHAPE = (3, GLOBAL_SIZE, GLOBAL_SIZE)
LOCAL_ROW_SHAPE = (3, LOCAL_SIZE, LOCAL_SIZE)
# the global view beside the crops of an item built for a crops spec (see the module's opening)
FIXED_GLOBAL = torch.randn(1, *GLOBAL_ROW_SHAPE, generator=torch.Generator().manual_seed(99))


def hf_model(seed: int = 0) -> torch.nn.Module:
    """The full model with unit-scale random vision, projector and separator weights."""
    from transformers import DeepseekOcr2Config, DeepseekOcr2ForConditionalGeneration

    config = DeepseekOcr2Config(
        vision_config={"sam_config": dict(TINY_SAM), "encoder_config": dict(TINY_ENCODER)},
        text_config=dict(TINY_TEXT),
    )
    config._attn_implementation = "sdpa"
    model = DeepseekOcr2ForConditionalGeneration(config)
    randomize(model.model.vision_tower, seed)
    randomize(model.model.multi_modal_projector, seed + 1)
    generator = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        sam = model.model.vision_tower.sam_encoder
        # randomize scales a 4-D table by its size (to ~0); positions must matter
        sam.pos_embed.copy_(torch.randn(sam.pos_embed.shape, generator=generator))
        model.model.view_separator.copy_(torch.randn(TEXT_WIDTH, generator=generator))
    return model.eval().requires_grad_(False)


def encoder_of(model: torch.nn.Module, budgets: list[int]) -> GraphEncoder:
    from vitpool.models.deepseek_ocr2 import DeepseekOcr2Adapter, DeepseekOcr2Encoder

    module = DeepseekOcr2Encoder(
        copy.deepcopy(model.model.vision_tower),
        copy.deepcopy(model.model.multi_modal_projector),
        model.model.view_separator,
        LOCAL_SIZE,
    )
    return GraphEncoder(DeepseekOcr2Adapter(module), budgets=budgets, device="cpu", dtype=torch.float32)


def image_features(model: torch.nn.Module, item: Any) -> torch.Tensor:
    """What the model hands its LLM for one image: its crops' tokens, its global view's, then the
    view separator."""
    crops = (item.inputs or {}).get("pixel_values_local")
    with torch.no_grad():
        output = model.model.get_image_features(
            pixel_values=torch.as_tensor(item.pixel_values),
            pixel_values_local=None if crops is None else torch.as_tensor(crops),
            num_local_patches=None if crops is None else [crops.shape[0]],
        )
    return output.pooler_output[0]


def crops_features(model: torch.nn.Module, crops: torch.Tensor) -> torch.Tensor:
    """The crops' part alone: the vision tower and the projector on them, flattened."""
    with torch.no_grad():
        features = model.model.multi_modal_projector(model.model.vision_tower(crops).last_hidden_state)
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
        # a grid is for patch families
        (Image(torch.randn(1, *GLOBAL_ROW_SHAPE), (1, 2, 2)), "no grid"),
        # crops of the global view's size
        (Image(torch.randn(1, *GLOBAL_ROW_SHAPE),
               inputs={"pixel_values_local": torch.randn(2, *GLOBAL_ROW_SHAPE)}),
         "pixel_values_local: pixel_values must be tiles"),
        # two global views in one item: one image an item
        (Image(torch.randn(2, *GLOBAL_ROW_SHAPE)), "an item has at most 1"),
        # an input the model does not take
        (Image(torch.randn(1, *GLOBAL_ROW_SHAPE), inputs={"crops": torch.randn(2, *LOCAL_ROW_SHAPE)}),
         "unknown inputs ['crops']"),
        # crops without their global view
        (Image(None, inputs={"pixel_values_local": torch.randn(2, *LOCAL_ROW_SHAPE)}),
         "has no ['pixel_values']"),
        # integer crops
        (Image(torch.randn(1, *GLOBAL_ROW_SHAPE),
               inputs={"pixel_values_local": torch.ones(2, *LOCAL_ROW_SHAPE, dtype=torch.int64)}),
         "pixel_values_local have dtype torch.int64"),
    ),
    # local budgets of 1 and 3 crops, global budgets of 1 and 2 views
    "budgets": (TOKENS_PER_GLOBAL, 2 * TOKENS_PER_GLOBAL),
}
