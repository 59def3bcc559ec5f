"""ERNIE-4.5-VL (ernie4_5_vl_moe): Hugging Face's vision tower
(`Ernie4_5_VLMoeVisionTransformerPretrainedModel`) and its resampler
(`Ernie4_5_VLMoeVariableResolutionResamplerModel`) on all of a call's images in one call, and all of
its videos in another, as `Ernie4_5_VLMoeModel.get_image_features` / `get_video_features` run them
(the resampler's host-side frame pairing included), against vitpool's one graph of both: the tokens
in the LLM's width.
"""

from __future__ import annotations

import torch

from vitpool import Image, Video

VISION_MODEL_TYPE = "ernie4_5_vl_moe_vision"
# ERNIE-4.5-VL-28B-A3B: its LLM's width and RMSNorm eps, which the resampler's last Linear and
# after_norm take (text_config.hidden_size / rms_norm_eps; the 424B-A47B's LLM is 8192 wide)
PROJECTOR_FIELDS = {"text_hidden_size": 2560, "text_rms_norm_eps": 1e-5}


def workloads(vision_config: dict) -> dict[str, list]:
    """One ~224² image, four, one ~1024² image, and a video of 8 frames of 224²: flattened patch
    rows [frames*h*w, C*P*P] (one frame a row; the resampler pairs frames 2k and 2k+1 into one token)
    and a (t, h, w) grid, h and w multiples of the merge size."""
    patch, merge = vision_config["patch_size"], vision_config["spatial_merge_size"]
    row_width = vision_config.get("in_channels", 3) * patch * patch

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


def _features(module: torch.nn.Module, items: list) -> torch.Tensor:
    """get_image_features / get_video_features on these items at once: the tower, then the resampler."""
    weight = next(module.parameters())
    pixels = torch.cat([item.pixel_values for item in items]).to(weight.device, weight.dtype)
    grid = torch.tensor([list(item.grid_thw) for item in items], dtype=torch.long, device=weight.device)
    hidden = module.vision_tower(pixels, grid).last_hidden_state
    return module.resampler_model(hidden, grid)


def hugging_face(module: torch.nn.Module, items: list) -> torch.Tensor:
    """All images in one call and all videos in another (as the model's forward does), the tokens
    back in item order. `module` is vitpool's `Ernie4_5_VLMoeEncoder`: HF's `vision_tower` and
    `resampler_model` side by side."""
    images = [index for index, item in enumerate(items) if not isinstance(item, Video)]
    videos = [index for index, item in enumerate(items) if isinstance(item, Video)]
    if not videos or not images:  # one kind: one call, already in item order
        return _features(module, items)
    merge_unit = module.resampler_model.spatial_merge_size**2
    per_item: dict[int, torch.Tensor] = {}
    for indices, frames_per_token in ((images, 1), (videos, module.resampler_model.temporal_merge_size)):
        tokens = _features(module, [items[index] for index in indices])
        sizes = [items[index].pixel_values.shape[0] // merge_unit // frames_per_token for index in indices]
        per_item.update(zip(indices, torch.split(tokens, sizes)))
    return torch.cat([per_item[index] for index in range(len(items))])
