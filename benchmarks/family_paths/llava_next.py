"""LLaVA-NeXT (llava-v1.6-mistral-7b-hf): the CLIP ViT-L/14-336 tower on an image's anyres tiles,
the hidden state before its last layer less the class token, the projector and the packing
(unpadding, `image_newline`) that `LlavaNextModel.get_image_features` does before the LLM, timed
from the processor's float32 tiles on the host to what the LLM receives. Workloads: one 336² image
(the default pinpoints pick 336 x 672: a base tile and 1 x 2 crops, 3 tiles, 576 + 24 * 25 = 1176
tokens), four of them, and one 1024² image (672²: a base tile and 2 x 2 crops, 5 tiles, 576 + 48 *
49 = 2928 tokens). Hugging Face runs every image of a call in one tower call, as the model does (all
24 layers; vitpool runs 23).

A tower-only config of type `llava_next_vision` (vitpool's own; CLIP's `clip_vision_model` would
resolve to LLaVA 1.5) with PROJECTOR_FIELDS added builds the encoder.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from vitpool import Image
from vitpool.families.llava_next.rules import LlavaNextRules

VISION_MODEL_TYPE = "llava_next_vision"
# llava-v1.6-mistral-7b-hf (the json's "extra"): Mistral-7B's width, LlavaNextConfig's projector,
# feature selection and default pinpoints, which its docstring names this release for
PROJECTOR_FIELDS = {
    "text_hidden_size": 4096,
    "projector_hidden_act": "gelu",
    "multimodal_projector_bias": True,
    "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default",
    "image_grid_pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
}
SMALL_SIZE, LARGE_SIZE = (336, 336), (1024, 1024)


def workloads(vision_config: dict) -> dict[str, list]:
    size = vision_config["image_size"]
    rules = LlavaNextRules.of(
        3,
        size,
        vision_config["patch_size"],
        tuple(map(tuple, PROJECTOR_FIELDS["image_grid_pinpoints"])),
        PROJECTOR_FIELDS["text_hidden_size"],
    )

    def image(image_size: tuple[int, int]) -> Image:
        tiles = rules.packed_grid(*image_size).num_crops + 1
        return Image(torch.randn(tiles, 3, size, size), image_size)

    return {
        "1 image 336": [image(SMALL_SIZE)],
        "4x image 336": [image(SMALL_SIZE) for _ in range(4)],
        "1x1024": [image(LARGE_SIZE)],
    }


def hugging_face(module: torch.nn.Module, items: list) -> torch.Tensor:
    """`LlavaNextModel.get_image_features` on `module`'s tower, projector and newline: every image's
    tiles stacked in one tower call, the feature selection, the projector, then the model's own
    `pack_image_features`; the tokens in item order [N, LLM width]."""
    from transformers.models.llava_next.modeling_llava_next import LlavaNextModel

    parameter = next(module.parameters())
    pixels = torch.cat([torch.as_tensor(item.pixel_values) for item in items])
    pixels = pixels.to(parameter.device, parameter.dtype)
    layer = module.vision_feature_layer
    outputs = module.vision_tower(pixels, output_hidden_states=True, return_dict=True)
    if isinstance(layer, int):
        selected = outputs.hidden_states[layer]
    else:
        selected = torch.cat([outputs.hidden_states[index] for index in layer], dim=-1)
    features = module.multi_modal_projector(selected[:, 1:])  # "default": the class token dropped
    features = torch.split(features, [int(item.pixel_values.shape[0]) for item in items])
    model = SimpleNamespace(
        config=SimpleNamespace(
            vision_config=module.vision_tower.config,
            image_grid_pinpoints=[list(pin) for pin in module.image_grid_pinpoints],  # HF wants a list
        )
    )
    sizes = torch.tensor([list(item.grid_thw) for item in items], device=parameter.device)
    packed, _ = LlavaNextModel.pack_image_features(
        model, features, sizes, "default", image_newline=module.image_newline
    )
    return torch.cat(list(packed))
