"""VideoLLaMA 3 (video_llama_3): Hugging Face's `VideoLlama3VisionModel` and `VideoLlama3Projector`
on all of a call's items in one tower call per modality, as `VideoLlama3Model.get_image_features`
and `get_video_features` run them (the tower's `pixel_unshuffle` and the projector included: what
the LLM receives before the video token compression, which the model applies afterwards), against
vitpool's graphs of the same modules: images at merge size 1 on one path, clips at merge size 2 on
the other.
"""

from __future__ import annotations

import torch
from common import hugging_face_forwards

from vitpool import Image, Video

VISION_MODEL_TYPE = "video_llama_3_vision"
# VideoLLaMA3-7B (the json's "extra"): Qwen2.5-7B's width, which the projector projects into
PROJECTOR_FIELDS = {"text_hidden_size": 3584}


def workloads(vision_config: dict) -> dict[str, list]:
    """One ~224² image, four, one ~1024² image (merge size 1: a token a patch, as the image
    processor gives them) and a clip of 8 frames of ~224² (merge size 2, the video processor's):
    flattened patch rows [t*h*w, C*P*P] and a grid (t, h, w, merge size)."""
    patch = vision_config["patch_size"]
    row_width = vision_config.get("num_channels", 3) * patch * patch

    def side(pixels: int, merge: int) -> int:
        return max(merge, round(pixels / (patch * merge)) * merge)

    def image(pixels: int) -> Image:
        s = side(pixels, 1)
        return Image(torch.randn(s * s, row_width), (1, s, s, 1))

    s = side(224, 2)
    video = Video(torch.randn(8 * s * s, row_width), (8, s, s, 2))
    return {
        "1x224": [image(224)],
        "4x224": [image(224) for _ in range(4)],
        "1x1024": [image(1024)],
        "video 8x224": [video],
    }


def hugging_face(module: torch.nn.Module, items: list) -> torch.Tensor:
    """The tower on every image of the call at once, then on every clip at once (the model's two
    calls), each followed by the projector; the tokens in item order [N, LLM width]."""
    hugging_face_forwards(module)
    weight = next(module.parameters())
    outputs = []
    for kind in (Image, Video):
        group = [item for item in items if isinstance(item, kind)]
        if not group:
            continue
        pixels = torch.cat([item.pixel_values for item in group]).to(weight.device, weight.dtype)
        grid = torch.tensor([list(item.grid_thw[:3]) for item in group], device=weight.device)
        merges = torch.tensor([item.grid_thw[3] for item in group], device=weight.device)
        hidden = module.vision_model(pixels, grid_thw=grid, merge_sizes=merges).last_hidden_state
        outputs.append(module.projector(hidden))
    return torch.cat(outputs)
