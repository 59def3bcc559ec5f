"""Phi-4-multimodal's image path (`Phi4MultimodalImageEmbedding`, no audio) at Phi-4-multimodal-instruct's
size: what the LLM receives for a call's images, from the processor's crops (float32 on the host) to
the projected tokens on the device. Hugging Face runs `embed_tokens_extend.image_embed` itself on the
call's images as one batch (tower over every crop, 2 x 2 pooling, HD assembly with sub_GN / glb_GN,
projection, written at the image placeholders), its tower's attention "eager": the bidirectional one
(its "sdpa" runs calls without padded crops causally, see vitpool/families/phi4_multimodal/adapter.py).

The tower-only config.json the loader takes is the flagship's vision_config (model_type
"phi4_multimodal_vision") plus `text_hidden_size` (PROJECTOR_FIELDS): the family's `tower_only_config`
form, which builds the whole `Phi4MultimodalImageEmbedding`; no `config()` is needed.
"""

from __future__ import annotations

import torch

from vitpool import Image

VISION_MODEL_TYPE = "phi4_multimodal_vision"
# Phi-4-multimodal-instruct: its LLM's width (Phi4MultimodalConfig.hidden_size), the projection's output
PROJECTOR_FIELDS = {"text_hidden_size": 3072}


def _image(crop: int, patches: int, rows: int, cols: int) -> Image:
    """An unpadded canvas of rows x cols crops: the global crop, then the canvas' crops row by row,
    laid out as (height, width, valid_rows, valid_cols)."""
    pixels = torch.randn(1 + rows * cols, 3, crop, crop)
    return Image(pixels, (rows * crop, cols * crop, rows * patches, cols * patches))


def workloads(vision_config: dict) -> dict[str, list]:
    """The smallest image the processor emits (a <= 448² image: its global crop and one canvas crop;
    there is no item of the global crop alone), four of them, and a 1024² image as the dynamic HD
    cuts it (ceil(1024 / 448) = 3 a side: a 1344² canvas of 3 x 3 crops, no padding, and the global crop)."""
    crop = int(vision_config["crop_size"])
    patches = crop // int(vision_config["patch_size"])
    return {
        "1 view": [_image(crop, patches, 1, 1)],
        "4x1 view": [_image(crop, patches, 1, 1) for _ in range(4)],
        "1 view + 9 crops": [_image(crop, patches, 3, 3)],
    }


def _num_tokens(layout: tuple[int, ...], crop: int, patches: int) -> int:
    """The image's placeholders: the processor's num_img_tokens for this canvas."""
    height, width, valid_rows, valid_cols = (int(v) for v in layout)
    rows, cols, pooled = height // crop, width // crop, (patches + 1) // 2
    useful_rows = pooled * (rows - 1) + (valid_rows - patches * (rows - 1) + 1) // 2
    useful_cols = pooled * (cols - 1) + (valid_cols - patches * (cols - 1) + 1) // 2
    return useful_rows * (useful_cols + 1) + 1 + pooled * (pooled + 1)


def hugging_face(module: torch.nn.Module, items: list) -> torch.Tensor:
    """`Phi4MultimodalImageEmbedding.forward` on all the call's images as the processor batches them
    (crops padded to the most with zero crops, all-ones masks), over a prompt of only their
    placeholders: its output rows are the images' tokens in item order."""
    parameter = next(module.parameters())
    device, dtype = parameter.device, parameter.dtype
    vision = module.img_processor.config
    for sub in module.img_processor.modules():  # the bidirectional attention (see the docstring)
        if getattr(sub, "config", None) is not None:
            sub.config._attn_implementation = "eager"
    crop, patches = int(vision.image_size), int(vision.image_size) // int(vision.patch_size)
    layouts = [tuple(int(v) for v in item.grid_thw) for item in items]
    most = max(item.pixel_values.shape[0] for item in items)
    pixels = torch.zeros(len(items), most, 3, crop, crop)
    masks = torch.ones(len(items), most, patches, patches)
    for index, (item, (height, width, valid_rows, valid_cols)) in enumerate(zip(items, layouts)):
        pixels[index, : item.pixel_values.shape[0]] = item.pixel_values
        rows, cols = height // crop, width // crop
        canvas = torch.zeros(rows * patches, cols * patches)
        canvas[:valid_rows, :valid_cols] = 1
        masks[index, 1 : 1 + rows * cols] = (
            canvas.reshape(rows, patches, cols, patches)
            .transpose(1, 2)
            .reshape(rows * cols, patches, patches)
        )
    tokens = sum(_num_tokens(layout, crop, patches) for layout in layouts)
    input_ids = torch.full((1, tokens), int(vision.image_token_id), device=device)
    embeds = torch.zeros(1, tokens, module.img_projection_down.out_features, device=device, dtype=dtype)
    written = module(
        input_ids,
        embeds,
        image_pixel_values=pixels.to(device, dtype),
        image_sizes=torch.tensor([layout[:2] for layout in layouts], device=device),
        image_attention_mask=masks.to(device),
    )
    return written[0]
