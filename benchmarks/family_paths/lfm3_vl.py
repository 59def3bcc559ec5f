"""LFM3-VL (lfm3_vl): Hugging Face's `Lfm3VlVisionModel` and `Lfm3VlMultiModalProjector` on all of a
call's items in one tower call, as `Lfm3VlModel.get_image_features` (and `get_video_features`) runs
them (the projector's tokens: what the LLM receives), against vitpool's graph of the same modules.
"""

from __future__ import annotations

import torch

from vitpool import Image, Video

VISION_MODEL_TYPE = "lfm3_vl_vision"
# Lfm3VlConfig's defaults (the flagship json's "extra"): the projector's GELU MLP of 4096 with biases
# into Lfm3Config's default width, 2048.
PROJECTOR_FIELDS = {
    "text_hidden_size": 2048,
    "projector_hidden_size": 4096,
    "projector_hidden_act": "gelu",
    "projector_bias": True,
}


def workloads(vision_config: dict) -> dict[str, list]:
    """One ~224² image, four, one ~1024² image, and an 8-frame ~224² clip (4 temporal patches):
    flattened patch rows [t*h*w, C*T*P*P] and a (t, h, w) grid, h and w multiples of the merge."""
    patch, merge = vision_config["patch_size"], vision_config["spatial_merge_size"]
    temporal = vision_config.get("temporal_patch_size", 2)
    row_width = vision_config.get("in_channels", 3) * temporal * patch * patch

    def side_of(pixels: int) -> int:
        return max(merge, round(pixels / (patch * merge)) * merge)

    def image(pixels: int) -> Image:
        side = side_of(pixels)
        return Image(torch.randn(side * side, row_width), (1, side, side))

    def video(frames: int, pixels: int) -> Video:
        side, t = side_of(pixels), max(1, frames // temporal)
        return Video(torch.randn(t * side * side, row_width), (t, side, side))

    return {
        "1x224": [image(224)],
        "4x224": [image(224) for _ in range(4)],
        "1x1024": [image(1024)],
        "video 8x224": [video(8, 224)],
    }


def hugging_face(module: torch.nn.Module, items: list) -> torch.Tensor:
    """`get_image_features` on every item at once: the tower's `last_hidden_state` over all rows,
    then the projector; get_image_features splits it per item and the model joins it again."""
    weight = next(module.parameters())
    pixels = torch.cat([item.pixel_values for item in items]).to(weight.device, weight.dtype)
    grid = torch.tensor([list(item.grid_thw) for item in items], dtype=torch.long, device=weight.device)
    hidden = module.vision_tower(pixels, grid_thw=grid).last_hidden_state
    return module.multi_modal_projector(hidden)
