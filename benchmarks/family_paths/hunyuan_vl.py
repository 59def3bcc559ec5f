"""HunYuan-VL / HunyuanOCR (hunyuan_vl): Hugging Face's `HunYuanVLVisionTransformer`, its patch
merger included, on all of a call's images in one tower call, as `HunYuanVLModel.get_image_features`
runs it (the merger's blocks, newline, begin and end tokens: what the LLM receives), against
vitpool's graph of the same tower. Images only: the family takes no video.
"""

from __future__ import annotations

import torch

from vitpool import Image

VISION_MODEL_TYPE = "hunyuan_vl_vision"
# Nothing to add: HunyuanOCR's vision_config itself carries the LLM's width (text_hidden_size 1024),
# which the tower's merger projects into.
PROJECTOR_FIELDS: dict = {}


def workloads(vision_config: dict) -> dict[str, list]:
    """One ~224² image, four, and one ~1024² image: flattened patch rows [h*w, C*P*P] (one frame a
    row, temporal_patch_size 1) and a (1, h, w) grid, h and w multiples of the merge size.

    HunyuanOCR's processor resizes anything under min_pixels (512²) up to it, so a real 224² picture
    reaches the tower as 32x32 patches; "1x224" is the small end of the size range, not its floor."""
    patch, merge = vision_config["patch_size"], vision_config["spatial_merge_size"]
    row_width = vision_config.get("num_channels", 3) * patch * patch

    def image(pixels: int) -> Image:
        side = max(merge, round(pixels / (patch * merge)) * merge)
        return Image(torch.randn(side * side, row_width), (1, side, side))

    return {"1x224": [image(224)], "4x224": [image(224) for _ in range(4)], "1x1024": [image(1024)]}


def hugging_face(module: torch.nn.Module, items: list) -> torch.Tensor:
    """`get_image_features` on every image at once: the tower's `pooler_output` [1, tokens, width]
    holds all images' merged tokens in order; get_image_features splits its [0] per image and the
    model concatenates them again, so [0] is what the LLM receives."""
    weight = next(module.parameters())
    pixels = torch.cat([item.pixel_values for item in items]).to(weight.device, weight.dtype)
    grid = torch.tensor([list(item.grid_thw) for item in items], dtype=torch.long, device=weight.device)
    return module(pixels, grid_thw=grid).pooler_output[0]
