"""Cosmos-3 Edge (cosmos3_edge): Hugging Face's tower (`Cosmos3EdgeVisionModel`) and projector
(`Cosmos3EdgePatchMerger`) on all of a call's images in one call, and all of its videos in another,
as `Cosmos3EdgeModel.get_image_features` / `get_video_features` run them (the position table's
resize per grid and the per-sequence attention split on the host included), against vitpool's one
graph of both: the tokens in the LLM's width.
"""

from __future__ import annotations

import torch
from family_paths.ernie4_5_vl_moe import workloads as ernie_workloads

from vitpool import Video

VISION_MODEL_TYPE = "cosmos3_edge_vision"
# nvidia/Cosmos3-Edge (the json's "extra"): its LLM's width and the projector's hidden width
# (Cosmos3EdgeTextConfig.hidden_size, Cosmos3EdgeConfig.projector_hidden_size defaults)
PROJECTOR_FIELDS = {"text_hidden_size": 2048, "projector_hidden_size": 11520}


def workloads(vision_config: dict) -> dict[str, list]:
    """ERNIE-4.5-VL's workloads (one ~224² image, four, one ~1024² image, a video of 8 frames of
    224²), whose patch rows are this tower's too: one frame a row [frames*h*w, C*P*P] (the
    processors' temporal patch is 1) and a (t, h, w) grid; ERNIE names the channels `in_channels`."""
    channels = {"in_channels": vision_config.get("num_channels", 3)}
    return ernie_workloads({**vision_config, **channels})


def _features(module: torch.nn.Module, items: list) -> torch.Tensor:
    """get_image_features / get_video_features on these items at once: the tower, then the projector."""
    weight = next(module.parameters())
    pixels = torch.cat([item.pixel_values for item in items]).to(weight.device, weight.dtype)
    grid = torch.tensor([list(item.grid_thw) for item in items], dtype=torch.long, device=weight.device)
    return module.projector(module.visual(pixels, grid_thw=grid).last_hidden_state)


def hugging_face(module: torch.nn.Module, items: list) -> torch.Tensor:
    """All images in one call and all videos in another (as the model's forward does), the tokens
    back in item order. `module` is vitpool's `Cosmos3EdgeEncoder`: HF's `visual` and `projector`
    side by side."""
    images = [index for index, item in enumerate(items) if not isinstance(item, Video)]
    videos = [index for index, item in enumerate(items) if isinstance(item, Video)]
    if not videos or not images:  # one kind: one call, already in item order
        return _features(module, items)
    merge_unit = module.projector.spatial_merge_size**2
    per_item: dict[int, torch.Tensor] = {}
    for indices in (images, videos):
        tokens = _features(module, [items[index] for index in indices])
        sizes = [items[index].pixel_values.shape[0] // merge_unit for index in indices]
        per_item.update(zip(indices, torch.split(tokens, sizes)))
    return torch.cat([per_item[index] for index in range(len(items))])
