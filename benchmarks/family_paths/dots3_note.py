"""dots.3 Note (dots3_note): Hugging Face's `Dots3NoteVisionModel`, its merger and mixture-of-experts
blocks included, on all of a call's items at once, as `Dots3NoteModel.get_image_features` runs it
(videos go the same way), against vitpool's one graph of it: the merger's tokens in the LLM's width.
"""

from __future__ import annotations

import torch

from vitpool import Image, Video

VISION_MODEL_TYPE = "dots3_note_vision_encoder"
# The merger projects into the LLM's width itself (adapter_out_dim): the tower-only config adds nothing
PROJECTOR_FIELDS: dict[str, int] = {}


def workloads(vision_config: dict) -> dict[str, list]:
    """One ~224² image, four, one ~1024² image, and a video of 8 frames of 224² (no temporal patch:
    8 frames, 8 attention sequences): flattened patch rows [t*h*w, C*P*P] and a (t, h, w) grid, h
    and w multiples of the merge size."""
    patch, merge = vision_config["patch_size"], vision_config["spatial_merge_size"]
    row_width = vision_config.get("num_channels", 3) * patch * patch

    def side(pixels: int) -> int:  # patches a side, a multiple of the merge size
        return max(merge, round(pixels / (patch * merge)) * merge)

    def image(pixels: int) -> Image:
        s = side(pixels)
        return Image(torch.randn(s * s, row_width), (1, s, s))

    def video(frames: int, pixels: int) -> Video:
        s = side(pixels)
        return Video(torch.randn(frames * s * s, row_width), (frames, s, s))

    return {
        "1x224": [image(224)],
        "4x224": [image(224) for _ in range(4)],
        "1x1024": [image(1024)],
        "video 8x224": [video(8, 224)],
    }


def hugging_face(module: torch.nn.Module, items: list) -> torch.Tensor:
    """All items in one call, the tokens in item order. `module` is a copy of vitpool's tower, the
    Hugging Face `Dots3NoteVisionModel` (its experts on transformers' default "grouped_mm")."""
    weight = next(module.parameters())
    pixels = torch.cat([item.pixel_values for item in items]).to(weight.device, weight.dtype)
    grid = torch.tensor([list(item.grid_thw) for item in items], dtype=torch.long, device=weight.device)
    return module(pixels, grid_thw=grid).pooler_output
