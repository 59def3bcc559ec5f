"""Mistral 3 (the Pixtral tower + Mistral 3's projector) under the adapter conformance suite, and the
tiny models its own tests share. The reference is the Hugging Face model's own
`get_image_features` (SDPA) on each image alone, as a padded batch of one with its `image_sizes`;
an image of one token goes beside a second image, since `get_image_features` fails on a batch of
one token in all (`vitpool.families.mistral3.adapter`, "One-token images")."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from family_cases.common import randomize
from vitpool import GraphEncoder, Image, Video
from vitpool.specs import ItemSpec

PATCH = 2
MERGE = 2
TINY_VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "head_dim": 16,
    "image_size": 32,
    "patch_size": PATCH,
    "hidden_act": "silu",
}
TINY_TEXT = {
    "model_type": "mistral",
    "hidden_size": 48,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 24,
    "vocab_size": 128,
    "rms_norm_eps": 1e-5,
}
ROW_SHAPE = (3, PATCH, PATCH)
TEXT_WIDTH = TINY_TEXT["hidden_size"]
# The image a one-token image is encoded beside in the reference (4 x 6 patches, 6 tokens)
COMPANION = torch.randn(3, 8, 12, generator=torch.Generator().manual_seed(77))


def full_config(**settings: Any) -> Any:
    from transformers import Mistral3Config

    return Mistral3Config(
        vision_config=dict(TINY_VISION), text_config=dict(TINY_TEXT), spatial_merge_size=MERGE, **settings
    )


def hf_model(seed: int = 0, **settings: Any) -> torch.nn.Module:
    """The full tiny Hugging Face model, its vision weights random at unit scale, SDPA."""
    from transformers import Mistral3ForConditionalGeneration

    model = Mistral3ForConditionalGeneration(full_config(**settings))
    randomize(model.model.vision_tower, seed)
    randomize(model.model.multi_modal_projector, seed + 1)
    model.config.vision_config._attn_implementation = "sdpa"
    return model.eval().requires_grad_(False)


def encoder_module(model: torch.nn.Module) -> torch.nn.Module:
    """vitpool's module over copies of the model's tower and projector (the adapter changes the
    tower's attention)."""
    from vitpool.families.mistral3.adapter import Mistral3Encoder

    return Mistral3Encoder(
        copy.deepcopy(model.model.vision_tower),
        copy.deepcopy(model.model.multi_modal_projector),
        model.config.vision_feature_layer,
    )


def encoder_of(model: torch.nn.Module, budgets: list[int]) -> GraphEncoder:
    from vitpool.families.mistral3.adapter import Mistral3Adapter

    return GraphEncoder(
        Mistral3Adapter(encoder_module(model)), budgets=budgets, device="cpu", dtype=torch.float32
    )


def image_of_rows(rows: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Patch rows [h*w, C, P, P] (row-major) as the image [C, h*P, w*P] they were cut from."""
    channels, patch = rows.shape[1], rows.shape[2]
    return (
        rows.reshape(h, w, channels, patch, patch)
        .permute(2, 0, 3, 1, 4)
        .reshape(channels, h * patch, w * patch)
    )


def as_image(item: Any) -> torch.Tensor:
    """An item's image [C, H, W], whether it holds the image or its patch rows with a grid."""
    from vitpool.families.mistral3.rules import Mistral3Rules

    rules = Mistral3Rules(3, PATCH, MERGE, TEXT_WIDTH)
    _, h, w = rules.grid_of(item.grid_thw)
    return image_of_rows(torch.as_tensor(rules.pixel_rows(torch.as_tensor(item.pixel_values))), h, w).float()


def padded_batch(images: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Images [C, H, W] as the processor lays out a batch: zero-padded to the largest height and
    width, with their `image_sizes`."""
    height, width = max(i.shape[1] for i in images), max(i.shape[2] for i in images)
    batch = torch.zeros(len(images), images[0].shape[0], height, width)
    for index, image in enumerate(images):
        batch[index, :, : image.shape[1], : image.shape[2]] = image
    return batch, torch.tensor([list(image.shape[1:]) for image in images])


def image_features(model: torch.nn.Module, item: Any) -> torch.Tensor:
    """What `get_image_features` gives the LLM for this image alone (beside COMPANION where the
    image gives one token)."""
    image = as_image(item)
    one_token = image.shape[1] * image.shape[2] == (PATCH * MERGE) ** 2
    pixels, sizes = padded_batch([image, COMPANION] if one_token else [image])
    with torch.no_grad():
        return model.model.get_image_features(pixels, sizes).pooler_output[0]


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
    """The item a caller builds: the image the patch rows were cut from, and its size in pixels."""
    _, h, w = spec.layout
    return Image(image_of_rows(pixels, h, w), (h * PATCH, w * PATCH))


BAD_ITEMS = (
    (Image(torch.randn(3, 8, 8)), "an image needs its size"),
    (Image(torch.randn(3, 8, 8), (8, 12)), "crop an image of a padded batch"),  # the size of another image
    (Image(torch.randn(3, 8, 8), (4, 8)), "crop an image of a padded batch"),  # a padded image
    (Image(torch.randn(3, 6, 8), (6, 8)), "multiples of patch_size x spatial_merge_size = 4"),
    (Image(torch.randn(3, 2, 2), (2, 2)), "multiples of patch_size x spatial_merge_size = 4"),  # no token
    (Image(torch.randn(3, 7, 8), (8, 8)), "multiples of the patch size 2"),
    (Image(torch.randn(4, 8, 8), (8, 8)), "an image [C, H, W] of 3 channels"),
    (Image(torch.randn(6, *ROW_SHAPE), (1, 2, 3)), "multiples of the spatial merge size 2"),
    (Image(torch.randn(0, *ROW_SHAPE), (1, 0, 4)), "zero or negative"),
    (Video(torch.randn(3, 8, 8), (8, 8)), "images only"),
)

CASE_FIELDS = {
    "make_encoder": make_encoder,
    "reference": reference,
    "item_for": item_for,
    "bad_items": BAD_ITEMS,
    "budgets": (16, 32, 64),
}
