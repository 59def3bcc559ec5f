"""Gemma 4 (gemma-4-31B-it): the vision tower (`Gemma4VisionModel`) and `embed_vision`, what
`Gemma4Model.get_image_features` hands the LLM, timed from the processor's float32 patch rows on
the host to the tokens. The processor resizes every image to fill its soft-token budget, so the
workloads are images as it gives them: a 224² image at the default budget (max_soft_tokens 280:
resized to 768², 48 x 48 patches, 256 tokens), four of them, and a 1024² image at the largest
budget (1120: resized to 1584², 99 x 99 patches, 1089 tokens). vitpool takes each image's real
rows; Hugging Face takes the processor's layout, every image padded to the budget's
max_soft_tokens * k² rows (2520 or 10080) at positions (-1, -1), all images of a call in one
batch. The padding (zero rows) is laid out on the device, so only the real rows cross from the host
on either side. No video: vitpool takes Gemma 4's frames as images.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from vitpool import Image

VISION_MODEL_TYPE = "gemma4_vision"
# gemma-4-31B-it: its LLM's width (the json's "extra"); embed_vision needs nothing else
PROJECTOR_FIELDS = {"text_hidden_size": 5376}
DEFAULT_SOFT_TOKENS = 280  # the image processor's max_soft_tokens and the config's default_output_length
LARGEST_SOFT_TOKENS = 1120
PADDING = -1


def _grid(size: int, max_soft_tokens: int, vision_config: dict) -> tuple[int, int]:
    """Patches (h, w) of a size² image as Gemma 4's image processor resizes it for a budget."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import get_aspect_ratio_preserving_size

    patch, k = vision_config["patch_size"], vision_config["pooling_kernel_size"]
    height, width = get_aspect_ratio_preserving_size(size, size, patch, max_soft_tokens * k * k, k)
    return height // patch, width // patch


def workloads(vision_config: dict) -> dict[str, list]:
    row_width = 3 * vision_config["patch_size"] ** 2

    def image(size: int, max_soft_tokens: int) -> Image:
        h, w = _grid(size, max_soft_tokens, vision_config)
        return Image(torch.rand(h * w, row_width), (1, h, w))  # rescaled to [0, 1], as the processor does

    return {
        "1x224": [image(224, DEFAULT_SOFT_TOKENS)],
        "4x224": [image(224, DEFAULT_SOFT_TOKENS) for _ in range(4)],
        "1x1024": [image(1024, LARGEST_SOFT_TOKENS)],
    }


def _positions(h: int, w: int) -> torch.Tensor:
    """(x, y) of an h x w grid's patches, row-major, as the image processor writes them."""
    grid = torch.meshgrid(torch.arange(w), torch.arange(h), indexing="xy")
    return torch.stack(grid, dim=-1).reshape(h * w, 2)


def hugging_face(module: torch.nn.Module, items: list) -> torch.Tensor:
    """`Gemma4Model.get_image_features` on the processor's batch: pixel_values [images, rows,
    3*P*P] and image_position_ids [images, rows, 2], rows = max_soft_tokens * k² for the smallest
    supported max_soft_tokens that holds the call's largest image (what the processor pads to
    for the budget the images were resized for); the tokens of every image, concatenated."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import _SUPPORTED_SOFT_TOKENS
    from transformers.models.gemma4.modeling_gemma4 import Gemma4Model

    parameter = next(module.parameters())
    device = parameter.device
    k = int(module.config.pooling_kernel_size)
    grids = [tuple(int(v) for v in item.grid_thw)[1:] for item in items]
    most = max(h * w // (k * k) for h, w in grids)
    max_soft_tokens = min(tokens for tokens in _SUPPORTED_SOFT_TOKENS if tokens >= most)
    num_rows = max_soft_tokens * k * k
    host = torch.cat([torch.as_tensor(item.pixel_values) for item in items]).to(device, parameter.dtype)
    pixel_values = host.new_zeros(len(items), num_rows, host.shape[-1])
    positions = torch.full((len(items), num_rows, 2), PADDING, dtype=torch.long)
    start = 0
    for index, (h, w) in enumerate(grids):
        pixel_values[index, : h * w] = host[start : start + h * w]
        positions[index, : h * w] = _positions(h, w)
        start += h * w
    model = SimpleNamespace(  # what get_image_features reads of the model
        config=SimpleNamespace(vision_config=module.config, return_dict=True),
        vision_tower=module.vision_tower,
        embed_vision=module.embed_vision,
    )
    output = Gemma4Model.get_image_features(model, pixel_values, positions.to(device))
    return torch.cat(output.pooler_output)
