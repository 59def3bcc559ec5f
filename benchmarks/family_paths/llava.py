"""LLaVA 1.5 (llava-1.5-7b-hf): the CLIP ViT-L/14-336 tower, the hidden state before its last layer
less the class token, and the projector, what `LlavaModel.get_image_features` hands the LLM, timed
from the processor's float32 views on the host to the tokens. `CLIPImageProcessor` resizes and
crops every image to 336² (24 x 24 patches, 576 tokens), so the workloads are counts of images: one,
four, and eight (the largest default budget); Hugging Face runs every image of a call in one
`get_image_features`, as the model does (all 24 layers: its tower runs them even though the last
one's output is not read; vitpool runs 23).

A tower-only config of CLIP's own type (`clip_vision_model`, which only this family lists) with
PROJECTOR_FIELDS added builds the encoder.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from common import hugging_face_forwards

from vitpool import Image

VISION_MODEL_TYPE = "clip_vision_model"
# llava-1.5-7b-hf (the json's "extra"): Vicuna-7B's width (LlamaConfig's default), LlavaConfig's
# projector and feature selection, which the release's config keeps at their defaults
PROJECTOR_FIELDS = {
    "text_hidden_size": 4096,
    "projector_hidden_act": "gelu",
    "multimodal_projector_bias": True,
    "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default",
}


def workloads(vision_config: dict) -> dict[str, list]:
    size = vision_config["image_size"]

    def views(count: int) -> list[Image]:
        return [Image(torch.randn(1, vision_config.get("num_channels", 3), size, size)) for _ in range(count)]

    return {"1 view": views(1), "4x1 view": views(4), "8x1 view": views(8)}


def hugging_face(module: torch.nn.Module, items: list) -> torch.Tensor:
    """Hugging Face's own `LlavaModel.get_image_features` on `module`'s `vision_tower` and
    `multi_modal_projector`, every image of the call in one batch [images, 3, S, S] (copied to the
    device as the model receives a processor output); the tokens in item order [N, LLM width]."""
    from transformers.models.llava.modeling_llava import LlavaModel

    hugging_face_forwards(module)
    parameter = next(module.parameters())
    pixels = torch.cat([torch.as_tensor(item.pixel_values) for item in items])
    pixels = pixels.to(parameter.device, parameter.dtype)
    # the model's method on its own modules: what it reads of the model besides them is its config's
    # feature selection (and return_dict, through its decorators)
    model = SimpleNamespace(
        vision_tower=module.vision_tower,
        multi_modal_projector=module.multi_modal_projector,
        config=SimpleNamespace(
            vision_feature_layer=module.vision_feature_layer,
            vision_feature_select_strategy=module.vision_feature_select_strategy,
            return_dict=True,
        ),
    )
    features = LlavaModel.get_image_features(model, pixels).pooler_output
    return torch.cat(list(features))
