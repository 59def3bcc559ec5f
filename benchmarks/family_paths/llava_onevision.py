"""LLaVA-OneVision (llava-onevision-qwen2-7b-ov): the SigLIP tower, the projector and the packing
(unpadding, pooling, `image_newline`) that `LlavaOnevisionModel.get_image_features` /
`get_video_features` do before the LLM, timed from the processor's float32 tiles on the host to
what the LLM receives. Workloads: one 384² image of one tile (the base tile alone, as the model runs
each image of a multi-image prompt), four of them, one 1024² image (the default pinpoints pick
1152²: a base tile and 3 x 3 crops, 10 tiles, 729 + 81 * 82 = 7371 tokens, not pooled) and a video
of 8 frames of 384² (8 * 14² + 1 = 1569 tokens). Hugging Face runs every image of a call in one
tower call and every video in another, as the model does.

A tower-only config of type `llava_onevision_vision` (vitpool's own; SigLIP's
`siglip_vision_model` would resolve to Gemma 3) with PROJECTOR_FIELDS added builds the encoder.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from vitpool import Image, Video

VISION_MODEL_TYPE = "llava_onevision_vision"
TILE = 384
# llava-onevision-qwen2-7b-ov-hf: Qwen2-7B's width; the rest are transformers 5.24's
# LlavaOnevisionConfig defaults, which its docstring names this release for (the json's "extra"
# holds the width, the feature layer and strategy and the aspect ratio): the 6 x 6 anyres grid of
# 384-pixel pinpoints, (height, width), rows outer, as the default lists them
PROJECTOR_FIELDS = {
    "text_hidden_size": 3584,
    "projector_hidden_act": "gelu",
    "multimodal_projector_bias": True,
    "vision_feature_layer": -1,
    "vision_feature_select_strategy": "full",
    "vision_aspect_ratio": "anyres_max_9",
    "image_grid_pinpoints": [[TILE * rows, TILE * cols] for rows in range(1, 7) for cols in range(1, 7)],
}
# a ~1024² image: 1152² (3 x 3 crops) is the pinpoint that keeps all of it and wastes least
LARGE_SIZE, LARGE_TILES = (1024, 1024), 3 * 3 + 1
VIDEO_FRAMES = 8


def workloads(vision_config: dict) -> dict[str, list]:
    size = vision_config["image_size"]

    def image(tiles: int, image_size: tuple[int, int]) -> Image:
        return Image(torch.randn(tiles, 3, size, size), image_size)

    return {
        "1 view": [image(1, (size, size))],
        "4x1 view": [image(1, (size, size)) for _ in range(4)],
        "1x1024": [image(LARGE_TILES, LARGE_SIZE)],
        f"video {VIDEO_FRAMES}x{size}": [Video(torch.randn(VIDEO_FRAMES, 3, size, size))],
    }


def _model(module: torch.nn.Module) -> SimpleNamespace:
    """What `LlavaOnevisionModel`'s methods read of `self`: its config's packing settings and the
    modules `module` holds (Hugging Face's own tower, projector and newline)."""
    config = SimpleNamespace(
        vision_config=module.vision_tower.config,
        image_grid_pinpoints=[list(pin) for pin in module.image_grid_pinpoints],  # HF wants a list
    )
    return SimpleNamespace(config=config)


def _selected(module: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """The tower and the feature selection of get_image_features / get_video_features."""
    layer = module.vision_feature_layer
    # as @select_hidden_states passes it: the layers the model reads
    outputs = module.vision_tower(pixels, output_hidden_states=layer, return_dict=True)
    if isinstance(layer, int):
        selected = outputs.hidden_states[layer]
    else:
        selected = torch.cat([outputs.hidden_states[index] for index in layer], dim=-1)
    if module.vision_feature_select_strategy == "default":
        selected = selected[:, 1:]
    return selected


def _images(
    module: torch.nn.Module, items: list, device: torch.device, dtype: torch.dtype
) -> list[torch.Tensor]:
    """`LlavaOnevisionModel.get_image_features` on the processor's batch: pixel_values [images,
    tiles, 3, S, S] (zero tiles after each image's own), image_sizes, and the tiles per image the
    model reads off batch_num_images (an image of one tile is one of a multi-image sample: its base
    tile alone; any other runs its base tile and its grid's crops)."""
    from transformers.models.llava_onevision.modeling_llava_onevision import (
        LlavaOnevisionModel,
        image_size_to_num_patches,
    )

    model = _model(module)
    counts = [int(item.pixel_values.shape[0]) for item in items]
    host = torch.cat([torch.as_tensor(item.pixel_values) for item in items]).to(device, dtype)
    if len(set(counts)) == 1:
        batch = host.view(len(items), counts[0], *host.shape[1:])
    else:  # the processor pads every image to the batch's most tiles with zero tiles
        batch = host.new_zeros(len(items), max(counts), *host.shape[1:])
        for index, (start, count) in enumerate(zip([0, *torch.tensor(counts).cumsum(0).tolist()], counts)):
            batch[index, :count] = host[start : start + count]
    image_sizes = torch.tensor([list(item.grid_thw) for item in items], device=device)
    pinpoints = model.config.image_grid_pinpoints
    image_num_patches = [
        image_size_to_num_patches(
            image_size=size, grid_pinpoints=pinpoints, patch_size=module.config.image_size
        )
        if count > 1
        else 1
        for size, count in zip(image_sizes, counts)
    ]
    pixel_values = torch.cat(
        [pix_val[:num_patch] for pix_val, num_patch in zip(batch, image_num_patches)], dim=0
    )
    image_features = module.multi_modal_projector(_selected(module, pixel_values))
    image_features = torch.split(image_features, image_num_patches, dim=0)
    packed, _ = LlavaOnevisionModel.pack_image_features(
        model,
        image_features,
        image_sizes,
        image_newline=module.image_newline,
        vision_aspect_ratio=module.vision_aspect_ratio,
    )
    return list(packed)


def _videos(
    module: torch.nn.Module, items: list, device: torch.device, dtype: torch.dtype
) -> list[torch.Tensor]:
    """`LlavaOnevisionModel.get_video_features` on pixel_values_videos [videos, frames, 3, S, S]
    (the video processor samples as many frames from every video)."""
    from transformers.models.llava_onevision.modeling_llava_onevision import LlavaOnevisionModel

    videos = torch.stack([torch.as_tensor(item.pixel_values) for item in items]).to(device, dtype)
    batch_size, frames, channels, height, width = videos.shape
    features = module.multi_modal_projector(
        _selected(module, videos.view(batch_size * frames, channels, height, width))
    )
    features = LlavaOnevisionModel.apply_pooling(_model(module), features)
    features = features.reshape(batch_size, frames * features.shape[1], -1)
    newline = module.image_newline[None, None, :].repeat(batch_size, 1, 1).to(features.device)
    return list(torch.cat((features, newline), dim=1))


def hugging_face(module: torch.nn.Module, items: list) -> torch.Tensor:
    """Every image of the call in one get_image_features, every video in one get_video_features,
    each item's tokens in item order: [tokens, LLM width]."""
    parameter = next(module.parameters())
    images = [index for index, item in enumerate(items) if not isinstance(item, Video)]
    videos = [index for index, item in enumerate(items) if isinstance(item, Video)]
    tokens: dict[int, torch.Tensor] = {}
    if images:
        tokens.update(
            zip(images, _images(module, [items[i] for i in images], parameter.device, parameter.dtype))
        )
    if videos:
        tokens.update(
            zip(videos, _videos(module, [items[i] for i in videos], parameter.device, parameter.dtype))
        )
    return torch.cat([tokens[index] for index in range(len(items))])
