"""PaliGemma 2 (paligemma2-3b-pt-448): the SigLIP tower and the projector's Linear, what
`PaliGemmaModel.get_image_features` hands the LLM, timed from the processor's float32 views on the
host to the tokens. `SiglipImageProcessor` resizes every image to the checkpoint's one square (448²
here: 32 x 32 patches, 1024 tokens), so the workloads are counts of images: one, four, and sixteen
(the largest default budget at 448²); Hugging Face runs every image of a call in one
`get_image_features`, as the model does.

A tower-only config of type `paligemma_vision` (vitpool's own; SigLIP's `siglip_vision_model` would
resolve to Gemma 3) with PROJECTOR_FIELDS added builds the encoder.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from common import hugging_face_forwards

from vitpool import Image

VISION_MODEL_TYPE = "paligemma_vision"
# paligemma2-3b: Gemma 2 2B's width, which PaliGemmaConfig's projection_dim is (the json's "extra")
PROJECTOR_FIELDS = {"projection_dim": 2304}


def workloads(vision_config: dict) -> dict[str, list]:
    size = vision_config["image_size"]

    def views(count: int) -> list[Image]:
        return [Image(torch.randn(1, vision_config.get("num_channels", 3), size, size)) for _ in range(count)]

    return {"1 view": views(1), "4x1 view": views(4), "16x1 view": views(16)}


def hugging_face(module: torch.nn.Module, items: list) -> torch.Tensor:
    """Hugging Face's own `PaliGemmaModel.get_image_features` on `module`'s `vision_tower` and
    `multi_modal_projector`, every image of the call in one batch [images, 3, S, S] (copied to the
    device as the model receives a processor output); the tokens in item order [N, LLM width]."""
    from transformers.models.paligemma.modeling_paligemma import PaliGemmaModel

    hugging_face_forwards(module)
    parameter = next(module.parameters())
    pixels = torch.cat([torch.as_tensor(item.pixel_values) for item in items])
    pixels = pixels.to(parameter.device, parameter.dtype)
    # the model's method on its own modules: what it reads of the model besides them is return_dict
    model = SimpleNamespace(
        vision_tower=module.vision_tower,
        multi_modal_projector=module.multi_modal_projector,
        config=SimpleNamespace(return_dict=True),
    )
    features = PaliGemmaModel.get_image_features(model, pixels).pooler_output
    return features.reshape(-1, features.shape[-1])
