"""Mistral 3 (the Pixtral tower and Mistral 3's patch-merging projector, Mistral-Small-3.1-24B's sizes):
vitpool's encoder against Hugging Face's `Mistral3Model.get_image_features` on the same tower and
projector. Items are what `PixtralProcessor` gives: each image [3, H, W] at its size in pixels (sides
multiples of patch x merge = 28 pixels), with its `image_sizes` row; Hugging Face gets every image of
a call in one padded batch [B, 3, H_max, W_max] with `image_sizes`, as the processor lays a batch out,
and both paths end with the projector's tokens [N, 5120] on the device.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from common import hugging_face_forwards

from vitpool import Image

VISION_MODEL_TYPE = "pixtral"  # the family record's tower type: a tower-only save is Pixtral's config
# Mistral-Small-3.1-24B-Instruct-2503's config (the flagship json's "extra"): its LLM's width and
# RMSNorm eps (the projector's norm reads the text config's), the patch merger's 2 x 2, the
# projector's GELU without biases, the last layer's features.
PROJECTOR_FIELDS = {
    "text_hidden_size": 5120,
    "text_rms_norm_eps": 1e-5,
    "spatial_merge_size": 2,
    "projector_hidden_act": "gelu",
    "multimodal_projector_bias": False,
    "vision_feature_layer": -1,
}


def workloads(vision_config: dict) -> dict[str, list]:
    """One 224² image, four, and one ~1024² image at the size PixtralProcessor resizes it to: each
    side rounded up to a multiple of patch x merge (1036² at patch 14, merge 2: 74 x 74 patches,
    1369 tokens); under the processor's longest_edge (1540) nothing is scaled down."""
    unit = vision_config["patch_size"] * PROJECTOR_FIELDS["spatial_merge_size"]

    def image(pixels: int) -> Image:
        side = math.ceil(pixels / unit) * unit
        return Image(torch.randn(vision_config.get("num_channels", 3), side, side), (side, side))

    return {"1x224": [image(224)], "4x224": [image(224) for _ in range(4)], "1x1024": [image(1024)]}


def padded_batch(items: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The items' images as PixtralImageProcessor lays out a batch: zero-padded to the largest
    height and width [B, C, H_max, W_max], with `image_sizes` [B, 2] (height, width)."""
    images = [torch.as_tensor(item.pixel_values) for item in items]
    sizes = torch.tensor([list(image.shape[1:]) for image in images])
    if len({tuple(image.shape) for image in images}) == 1:
        return torch.stack(images), sizes
    height, width = (int(side) for side in sizes.max(0).values)
    batch = images[0].new_zeros(len(images), images[0].shape[0], height, width)
    for index, image in enumerate(images):
        batch[index, :, : image.shape[1], : image.shape[2]] = image
    return batch, sizes


def hugging_face(module: torch.nn.Module, items: list) -> torch.Tensor:
    """Hugging Face's own `Mistral3Model.get_image_features` (the Pixtral tower over the padded batch,
    the selected hidden state, the projector with `image_sizes`) on `module`'s `vision_tower` and
    `multi_modal_projector`, every image of the call in one batch; its per-image tokens joined in
    item order [N, text width]. The batch and `image_sizes` go to the device as the model receives
    them (a processor output moved with `.to(device)`)."""
    from transformers.models.mistral3.modeling_mistral3 import Mistral3Model

    hugging_face_forwards(module)
    parameter = next(module.parameters())
    pixels, sizes = padded_batch(items)
    pixels = pixels.to(parameter.device, parameter.dtype)
    sizes = sizes.to(parameter.device)
    # the model's method on its own modules: what it reads of the model besides them is its config's
    # vision_feature_layer and spatial_merge_size (and return_dict, through its decorators)
    layer = getattr(module.config, "vision_feature_layer", PROJECTOR_FIELDS["vision_feature_layer"])
    model = SimpleNamespace(
        vision_tower=module.vision_tower,
        multi_modal_projector=module.multi_modal_projector,
        config=SimpleNamespace(
            vision_feature_layer=layer,
            spatial_merge_size=module.multi_modal_projector.patch_merger.spatial_merge_size,
            return_dict=True,
        ),
    )
    features = Mistral3Model.get_image_features(model, pixels, sizes, vision_feature_layer=layer)
    features = getattr(features, "pooler_output", features)  # transformers 4 returned the tuple itself
    return torch.cat(list(features))
