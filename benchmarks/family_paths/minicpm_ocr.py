"""MiniCPM-OCR (`MiniCPMOcrVisionModel` + `MiniCPMOcrMerger`: MiniCPM-V 4.6's vision path renamed,
read in "4x") at its flagship's size: from the processor's slices (one strip [1, 3, P, N*P] of
float32 patches on the host, with target_sizes) to the LLM's tokens on the device. Hugging Face runs
`MiniCPMOcrModel.get_image_features` (in "4x": every block at full resolution, no window merger, then
the Merger's 2 x 2 merge) on every slice of the call's images in one strip, as the model runs a batch.
"""

from __future__ import annotations

import torch

from vitpool import Image

VISION_MODEL_TYPE = "minicpm_ocr_vision"
# MiniCPMOcrConfig's merge settings (class defaults: "4x", insert_layer_id 6) and the LLM's width
# (1024, MiniCPM-V 4.6's Qwen3.5-0.8B, not verified for MiniCPM-OCR-1.0)
PROJECTOR_FIELDS = {
    "text_hidden_size": 1024,
    "downsample_mode": "4x",
    "merge_kernel_size": [2, 2],
    "merger_times": 1,
    "insert_layer_id": 6,
}
# slices (h, w in patches) of one image as the processor cuts them in "4x": a 448² overview alone
# (256 tokens), or the overview and 6 slices of a ~1024² page
SLICES = {"1 slice": [(32, 32)], "7 slices": [(32, 32)] + [(40, 24)] * 6}


def workloads(vision_config: dict) -> dict[str, list]:
    """One 448² overview, four images of one, and one image of an overview and 6 slices: the
    processor's strip [1, 3, P, N*P] and target_sizes per image."""
    patch = vision_config["patch_size"]

    def image(sizes: list) -> Image:
        rows = sum(h * w for h, w in sizes)
        return Image(torch.randn(1, 3, patch, rows * patch), [list(size) for size in sizes])

    return {
        "1 slice": [image(SLICES["1 slice"])],
        "4x1 slice": [image(SLICES["1 slice"]) for _ in range(4)],
        "7 slices": [image(SLICES["7 slices"])],
    }


def hugging_face(module: torch.nn.Module, items: list) -> torch.Tensor:
    """`MiniCPMOcrModel.get_image_features` on one strip of every slice of the call's items, in the
    module's mode; `module` (vitpool's holder of the tower and Merger, attributes `vision_tower` and
    `merger`) is what that method reads of the model."""
    from transformers.models.minicpm_ocr.modeling_minicpm_ocr import MiniCPMOcrModel

    parameter = next(module.parameters())
    strip = torch.cat([item.pixel_values for item in items], dim=-1).to(parameter.device, parameter.dtype)
    sizes = torch.tensor(
        [size for item in items for size in item.grid_thw], dtype=torch.int32, device=parameter.device
    )
    mode = getattr(module, "downsample_mode", PROJECTOR_FIELDS["downsample_mode"])
    output = MiniCPMOcrModel.get_image_features(module, strip, sizes, downsample_mode=mode)
    return torch.cat(output.pooler_output)
