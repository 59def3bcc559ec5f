"""DeepSeek-OCR-2's checkpoint keys: the prefixes of a full checkpoint's that belong to the module,
and the release's names (what `save_pretrained` writes) renamed to transformers', as transformers'
conversion_mapping.py renames them on loading."""

from __future__ import annotations

import re
from typing import Any

import torch

# Keys of a full checkpoint that belong to the module: transformers' layout, then the release's.
CHECKPOINT_PREFIXES = (
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "model.view_separator",
    "model.sam_model.",
    "model.qwen2_model.",
    "model.projector.",
    "model.view_seperator",
)
# The release's key -> transformers' (conversion_mapping.py's "deepseek_ocr2", the vision part),
# after `model.`; the first pattern that matches applies.
RELEASE_RENAMES = (
    (r"^sam_model\.blocks\.(\d+)\.norm([12])\.", r"vision_tower.sam_encoder.layers.\1.layer_norm\2."),
    (r"^sam_model\.blocks\.", "vision_tower.sam_encoder.layers."),
    (r"^sam_model\.patch_embed\.proj\.", "vision_tower.sam_encoder.patch_embed.projection."),
    (r"^sam_model\.neck\.0\.", "vision_tower.sam_encoder.neck.conv1."),
    (r"^sam_model\.neck\.1\.", "vision_tower.sam_encoder.neck.layer_norm1."),
    (r"^sam_model\.neck\.2\.", "vision_tower.sam_encoder.neck.conv2."),
    (r"^sam_model\.neck\.3\.", "vision_tower.sam_encoder.neck.layer_norm2."),
    (r"^sam_model\.net_2\.", "vision_tower.sam_encoder.proj.conv1."),
    (r"^sam_model\.net_3\.", "vision_tower.sam_encoder.proj.conv2."),
    (r"^sam_model\.pos_embed$", "vision_tower.sam_encoder.pos_embed"),
    (r"^qwen2_model\.model\.model\.", "vision_tower.vision_encoder."),
    (r"^qwen2_model\.query_(768|1024)\.", r"vision_tower.query_\1_resolution."),
    (r"^projector\.layers\.", "multi_modal_projector."),
    (r"^view_seperator$", "view_separator"),
)


def encoder_state(checkpoint: dict[str, torch.Tensor], config: Any = None) -> dict[str, torch.Tensor]:
    """The loader's hook (`DeepseekOcr2Adapter.convert_checkpoint`): a full checkpoint's keys less
    their `model.`, the release's names renamed to transformers' (the first of RELEASE_RENAMES that
    matches; a tower-only save's keys are the module's own already)."""
    state = {}
    for key, tensor in checkpoint.items():
        key = key.removeprefix("model.")
        for pattern, replacement in RELEASE_RENAMES:
            key, count = re.subn(pattern, replacement, key)
            if count:
                break
        state[key] = tensor
    return state
