"""Llama 3.2 Vision (Llama-3.2-11B-Vision-Instruct): `MllamaVisionModel` and its
`multi_modal_projector`, what `MllamaModel.forward` computes from `pixel_values` to the projected
cross-attention states, timed from the processor's float32 tiles on the host to those states.
`MllamaImageProcessor` cuts an image into 1 to 4 tiles of 560² (40 x 40 patches and a class token:
1601 tokens a tile) and pads it to 4; the model runs all 4 whatever the image holds. Workloads: one
one-tile image, four of them, and one image of 2 x 2 tiles (a ~1120² image). Hugging Face runs every
image of a call in one vision-model call, each image padded to 4 tiles as the processor pads it;
its tokens here are the real tiles' rows, as vitpool gives them.

A tower-only config of type `mllama_vision_model` with PROJECTOR_FIELDS added builds the encoder.
"""

from __future__ import annotations

import torch
from common import hugging_face_forwards

from vitpool import Image

VISION_MODEL_TYPE = "mllama_vision_model"
PROJECTOR_FIELDS = {"text_hidden_size": 4096}  # Llama-3.2-11B-Vision's LLM width (the json's "extra")


def workloads(vision_config: dict) -> dict[str, list]:
    size = vision_config["image_size"]

    def image(canvas: tuple[int, int]) -> Image:
        return Image(
            torch.randn(canvas[0] * canvas[1], vision_config.get("num_channels", 3), size, size), canvas
        )

    return {
        "1 tile": [image((1, 1))],
        "4x1 tile": [image((1, 1)) for _ in range(4)],
        "1x4 tiles": [image((2, 2))],
    }


def hugging_face(module: torch.nn.Module, items: list) -> torch.Tensor:
    """Hugging Face's own vision model and projector on `module`'s copies, every image of the call in
    one batch [images, 1, 4 tiles, 3, S, S] with zero padding tiles, its aspect ratio ids and mask (as
    the model receives a processor output, copied to the device); the real tiles' rows in item order
    [N, LLM width]."""
    hugging_face_forwards(module)
    parameter = next(module.parameters())
    config = module.vision_model.config
    ratios = [tuple(canvas) for canvas in config.supported_aspect_ratios]
    max_tiles = int(config.max_num_tiles)
    first = torch.as_tensor(items[0].pixel_values)
    pixels = torch.zeros((len(items), 1, max_tiles, *first.shape[1:]))
    mask = torch.zeros((len(items), 1, max_tiles), dtype=torch.int64)
    ids = torch.zeros((len(items), 1), dtype=torch.int64)
    for number, item in enumerate(items):
        tiles = len(item.pixel_values)
        pixels[number, 0, :tiles] = torch.as_tensor(item.pixel_values)
        mask[number, 0, :tiles] = 1
        ids[number, 0] = ratios.index(tuple(item.grid_thw)) + 1
    states = module.vision_model(
        pixel_values=pixels.to(parameter.device, parameter.dtype),
        aspect_ratio_ids=ids.to(parameter.device),
        aspect_ratio_mask=mask.to(parameter.device),
    ).last_hidden_state  # [images, 1, tiles, tokens a tile, vision_output_dim]
    projected = module.multi_modal_projector(states[:, 0])
    real = [projected[number, : len(item.pixel_values)] for number, item in enumerate(items)]
    return torch.cat(real).reshape(-1, projected.shape[-1])
