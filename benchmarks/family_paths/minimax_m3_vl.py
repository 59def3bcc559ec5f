"""MiniMax-M3-VL (minimax_m3_vl): Hugging Face's vision tower (`MiniMaxM3VLVisionModel`) and its
`MiniMaxM3VLMultiModalProjector` on all of a call's items at once, as
`MiniMaxM3VLModel.get_image_features` runs them (videos go the same way), against vitpool's one
graph of both: the tokens in the LLM's width.
"""

from __future__ import annotations

import torch

from vitpool import Image, Video

VISION_MODEL_TYPE = "minimax_m3_vl_vision"
# MiniMax-M3: its LLM's width and the projector's, as transformers' MiniMaxM3VLConfig defaults give
# them (text_config.hidden_size, projector_hidden_size; merged_hidden_size = width * merge²)
PROJECTOR_FIELDS = {"text_hidden_size": 6144, "projector_hidden_size": 6144, "merged_hidden_size": 6144 * 4}


def workloads(vision_config: dict) -> dict[str, list]:
    """One ~224² image, four, one ~1024² image, and a video of 8 frames of 224² (4 temporal
    patches: one chunk of the video processor's): flattened patch rows [t*h*w, C*T*P*P] and a
    (t, h, w) grid, h and w multiples of the merge size."""
    patch, merge = vision_config["patch_size"], vision_config["spatial_merge_size"]
    temporal = vision_config.get("temporal_patch_size", 2)
    row_width = vision_config.get("num_channels", 3) * temporal * patch * patch

    def side(pixels: int) -> int:  # patches a side, a multiple of the merge size
        return max(merge, round(pixels / (patch * merge)) * merge)

    def image(pixels: int) -> Image:
        s = side(pixels)
        return Image(torch.randn(s * s, row_width), (1, s, s))

    def video(frames: int, pixels: int) -> Video:
        s, t = side(pixels), frames // temporal
        return Video(torch.randn(t * s * s, row_width), (t, s, s))

    return {
        "1x224": [image(224)],
        "4x224": [image(224) for _ in range(4)],
        "1x1024": [image(1024)],
        "video 8x224": [video(8, 224)],
    }


def hugging_face(module: torch.nn.Module, items: list) -> torch.Tensor:
    """All items in one call, the tokens in item order. `module` is vitpool's `MiniMaxM3VLEncoder`:
    HF's `vision_tower` and `multi_modal_projector` side by side."""
    weight = next(module.parameters())
    pixels = torch.cat([item.pixel_values for item in items]).to(weight.device, weight.dtype)
    grid = torch.tensor([list(item.grid_thw) for item in items], dtype=torch.long, device=weight.device)
    hidden = module.vision_tower(pixels, grid_thw=grid).last_hidden_state
    return module.multi_modal_projector(hidden.squeeze(0))
