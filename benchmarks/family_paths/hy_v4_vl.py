"""HunYuan V4 VL (hy_v4_vl): Hugging Face's `HYV4VLVisionModel`, its patch merger included, on all of a
call's items in one tower call, as `HYV4VLModel.get_image_features` (and `get_video_features`) runs it
(the merger's blocks and newline tokens: what the LLM receives), against vitpool's graph of the same
tower. The tower's `pooler_output` keeps a batch axis of one, so the generic grid path does not fit.
"""

from __future__ import annotations

import torch

from vitpool import Image, Video

VISION_MODEL_TYPE = "hy_v4_vl_vision"
# Nothing to add: the vision config's out_hidden_size is the LLM's width, which the merger projects into.
PROJECTOR_FIELDS: dict = {}


def workloads(vision_config: dict) -> dict[str, list]:
    """One ~224² image, four, one ~1024² image, and an 8-frame ~224² clip: flattened patch rows
    [t*h*w, C*P*P] (temporal_patch_size 1) and a (t, h, w) grid, h and w multiples of the merge."""
    patch, merge = vision_config["patch_size"], vision_config["spatial_merge_size"]
    row_width = vision_config.get("num_channels", 3) * patch * patch

    def side_of(pixels: int) -> int:
        return max(merge, round(pixels / (patch * merge)) * merge)

    def image(pixels: int) -> Image:
        side = side_of(pixels)
        return Image(torch.randn(side * side, row_width), (1, side, side))

    def video(frames: int, pixels: int) -> Video:
        side = side_of(pixels)
        return Video(torch.randn(frames * side * side, row_width), (frames, side, side))

    return {
        "1x224": [image(224)],
        "4x224": [image(224) for _ in range(4)],
        "1x1024": [image(1024)],
        "video 8x224": [video(8, 224)],
    }


def hugging_face(module: torch.nn.Module, items: list) -> torch.Tensor:
    """`get_image_features` on every item at once: the tower's `pooler_output` [1, tokens, width]
    holds all items' merged tokens in order; get_image_features splits its [0] per item and the
    model concatenates them again, so [0] is what the LLM receives."""
    weight = next(module.parameters())
    pixels = torch.cat([item.pixel_values for item in items]).to(weight.device, weight.dtype)
    grid = torch.tensor([list(item.grid_thw) for item in items], dtype=torch.long, device=weight.device)
    return module(pixels, grid_thw=grid).pooler_output[0]
