"""Aya Vision (aya-vision-8b): the SigLIP tower and the `multi_modal_projector` (pixel shuffle,
LayerNorm, SwiGLU MLP) that `AyaVisionModel.get_image_features` runs before the LLM, timed from the
processor's float32 tiles on the host to the projector's tokens on the device. Workloads: one image
of one 364² tile (any image up to 364², as `GotOcr2ImageProcessor(crop_to_patches=True)` cuts it),
four of them, a 1024² image (3 x 3 crops and the thumbnail: 10 tiles, 1690 tokens) and a 1024 x 768
one (4 x 3 crops and the thumbnail: 13 tiles, the most at max_patches=12). Hugging Face runs every
tile of a call in one tower call, as the model does.

A tower-only config of type `aya_vision_vision` (vitpool's own; SigLIP's `siglip_vision_model` would
resolve to Gemma 3) with PROJECTOR_FIELDS added builds the encoder.
"""

from __future__ import annotations

import torch
from common import hugging_face_forwards

from vitpool import Image

VISION_MODEL_TYPE = "aya_vision_vision"
# aya-vision-8b: its LLM's width (Command R7B's 4096), the 2 x 2 pixel shuffle and the last layer's
# features of every patch (transformers' AyaVisionConfig defaults, as stored descriptions of the
# release give them too); adapter_layer_norm_eps is the class default. alignment_intermediate_size
# (the SwiGLU's width) is not in transformers' config class: 28672 is the release's config.json as
# remembered, not read here (the flagship json's entry says so); without it the projector would be
# built 4096 wide, a smaller model than the release.
PROJECTOR_FIELDS = {
    "text_hidden_size": 4096,
    "downsample_factor": 2,
    "adapter_layer_norm_eps": 1e-6,
    "alignment_intermediate_size": 28672,
    "vision_feature_layer": -1,
    "vision_feature_select_strategy": "full",
}
# tiles of one image as the image processor cuts it at its defaults (max_patches=12): crops and a thumbnail
LARGE_TILES = {"1x1024 (10 tiles)": 3 * 3 + 1, "1024x768 (13 tiles)": 4 * 3 + 1}


def workloads(vision_config: dict) -> dict[str, list]:
    size = vision_config["image_size"]

    def image(tiles: int) -> Image:
        return Image(torch.randn(tiles, vision_config.get("num_channels", 3), size, size))

    loads = {"1 view": [image(1)], "4x1 view": [image(1) for _ in range(4)]}
    loads.update({name: [image(tiles)] for name, tiles in LARGE_TILES.items()})
    return loads


def hugging_face(module: torch.nn.Module, items: list) -> torch.Tensor:
    """`AyaVisionModel.get_image_features` on every tile of the call at once: the tower asked for
    the hidden state of `vision_feature_layer` only (as `@select_hidden_states` asks), that state
    (every patch: strategy "full"), the projector; the tokens [tiles * tokens a tile, LLM width]."""
    hugging_face_forwards(module)
    parameter = next(module.parameters())
    pixels = torch.cat([torch.as_tensor(item.pixel_values) for item in items]).to(
        parameter.device, parameter.dtype
    )
    layer = module.vision_feature_layer
    outputs = module.vision_tower(pixels, output_hidden_states=layer, return_dict=True)
    tokens = module.multi_modal_projector(outputs.hidden_states[layer])
    return tokens.reshape(-1, tokens.shape[-1])
