"""Molmo 2 (allenai/Molmo2-8B): its ViT on an image's crops, the hidden states of two of its layers
side by side, the attention pooling of patches in 2 x 2 windows and the projector, what
`Molmo2Model.get_image_features` hands the LLM, timed from the processor's float32 crops on the host
to those tokens.

`Molmo2ImageProcessor` at its defaults (378² crops of 27² patches, `max_crops` 8, `overlap_margins`
(4, 4), `pooling_size` (2, 2)) cuts an image into a global view (the image resized to one crop) and
tiling_h x tiling_w overlapping crops. Workloads, each an image's crops and its layout as vitpool's
items are (`vitpool.items_from` gives the same):

- "1x224": a ~224² image. The smallest tiling, 1 x 1, already holds it (select_tiling takes the
  least upscaling), so 2 crops: 14² + 14² = 392 tokens, the fewest an image gives;
- "4x224": four of them in one call (8 crops, 1568 tokens), as a multi-image prompt hands them over;
- "1x1024x2048": a 1024 x 2048 image, which the processor tiles 2 x 4: max_crops' 8 crops and the
  global view, 9 crops (`MAX_GRAPH_CROPS`, the most an image has in the default budgets), 14² +
  23 * 42 = 1162 tokens. No image gives more crops at the defaults; a square ~1024² one is 2 x 2.

Hugging Face runs every image of a call in one `get_image_features` call, on the processor's batch:
the crops concatenated, each image's pooling windows offset to its first crop's patches (the
processor's `image_token_pooling`; `rules.item_windows`, which test_molmo2_family.py checks against
Molmo2ImageProcessor's own) and `image_grids`.

A tower-only config of type `molmo2_vision` with PROJECTOR_FIELDS added (the adapter's config whole,
as a tower-only save writes it) builds the encoder.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from common import hugging_face_forwards

from vitpool import Image, Video

VISION_MODEL_TYPE = "molmo2_vision"
# Molmo2-8B's adapter (the json's "extra" holds transformers' Molmo2AdapterConfig defaults): its LLM is
# Qwen3-8B (the model card), so the projector maps into 4096, not the defaults' 3584 (Qwen2-7B's, the
# first Molmo's). Molmo2-4B's published config.json sizes the projector's hidden layer as its LLM's
# MLP (intermediate_size 9728, Qwen3-4B's) with text_hidden_size 2560; by that rule 8B's is Qwen3-8B's
# 12288 (inferred, its config.json not read). vision_feature_layer [24, 18] is the release's
# vit_layers [-3, -9] of its 27 layers.
PROJECTOR_FIELDS = {
    "adapter_config": {
        "vision_feature_layer": [24, 18],
        "hidden_size": 1152,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "head_dim": 72,
        "intermediate_size": 12288,
        "text_hidden_size": 4096,
        "hidden_act": "silu",
    }
}
# Molmo2ImageProcessor's defaults (the releases' preprocessor_config.json)
POOL = (2, 2)
OVERLAP_MARGINS = (4, 4)
# the processor's tilings at those defaults: a ~224² image, a 1024 x 2048 one
SMALL_TILING, LARGE_TILING = (1, 1), (2, 4)


def workloads(vision_config: dict) -> dict[str, list]:
    """The three image workloads above, random crops [n, side², P*P*C] of the tower's crop size.
    A crop too small for the processor's margins (a cut-down test tower's) gets each margin cut to
    under a quarter of its side (1 of a 6-patch crop, as the test case's processor uses)."""
    patch = vision_config["patch_size"]
    side = vision_config.get("image_size", [378, 378])[0] // patch
    row_width = vision_config.get("num_channels", 3) * patch * patch
    margins = tuple(min(margin, (side - 1) // 4) for margin in OVERLAP_MARGINS)

    def image(tiling: tuple[int, int]) -> Image:
        tiling_h, tiling_w = tiling
        # one crop: no neighbour overlaps it, and items_from writes its margins as 0
        left, right = margins if tiling_h * tiling_w > 1 else (0, 0)
        crops = tiling_h * tiling_w + 1
        return Image(torch.randn(crops, side * side, row_width), (tiling_h, tiling_w, *POOL, left, right))

    return {
        "1x224": [image(SMALL_TILING)],
        "4x224": [image(SMALL_TILING) for _ in range(4)],
        "1x1024x2048": [image(LARGE_TILING)],
    }


def processor_batch(items: list, side: int) -> dict[str, torch.Tensor]:
    """What Molmo2ImageProcessor returns for these images, on the host: `pixel_values` [crops, side²,
    P*P*C], `image_token_pooling` [tokens, pool_h * pool_w] (indices into the whole batch's patches,
    -1: padding) and `image_grids` [images, 4] (the global view's pooled rows and columns, then the
    canvas's).

    Raises:
        TypeError: a video among the items (this path times images).
    """
    from vitpool.families.molmo2.rules import item_windows

    pixels, pooling, grids, offset = [], [], [], 0
    for number, item in enumerate(items):
        if isinstance(item, Video):
            raise TypeError(f"item {number} is a video; the Molmo 2 benchmark path runs images only")
        crops = torch.as_tensor(item.pixel_values)
        tiling_h, tiling_w, pool_h, pool_w, left, right = item.grid_thw
        windows = item_windows(side, "image", len(crops), tuple(item.grid_thw))
        pooling.append(np.where(windows >= 0, windows + offset, -1))
        offset += len(crops) * side * side
        pixels.append(crops)
        canvas_h, canvas_w = (tiles * (side - left - right) + left + right for tiles in (tiling_h, tiling_w))
        grids.append([-(-side // pool_h), -(-side // pool_w), -(-canvas_h // pool_h), -(-canvas_w // pool_w)])
    return {
        "pixel_values": torch.cat(pixels),
        "image_token_pooling": torch.from_numpy(np.concatenate(pooling)),
        "image_grids": torch.tensor(grids),
    }


def hugging_face(module: torch.nn.Module, items: list) -> torch.Tensor:
    """`Molmo2Model.get_image_features` itself, on `module`'s tower and adapter, over every image of the
    call in one batch (the processor's, copied to the device); the images' tokens in item order
    [N, LLM width].

    Raises:
        TypeError: a video among the items.
    """
    from transformers.models.molmo2.modeling_molmo2 import Molmo2Model

    hugging_face_forwards(module)
    parameter = next(module.parameters())
    side = int(module.vision_tower.config.image_size[0]) // int(module.vision_tower.config.patch_size)
    batch = processor_batch(items, side)
    # what get_image_features reads of `self`: the modules and the adapter's config (its layers)
    model = SimpleNamespace(
        vision_tower=module.vision_tower,
        multi_modal_projector=module.multi_modal_projector,
        config=SimpleNamespace(
            adapter_config=module.multi_modal_projector.config, return_dict=True, output_hidden_states=False
        ),
    )
    features = Molmo2Model.get_image_features(
        model,
        batch["pixel_values"].to(parameter.device, parameter.dtype),
        batch["image_token_pooling"].to(parameter.device),
        batch["image_grids"].to(parameter.device),
    )
    return torch.cat(features.pooler_output)
