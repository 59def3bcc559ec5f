"""Tiny random towers of every family vitpool serves, saved as tower-only checkpoints, and items
shaped for them: what the pool and GPU tests run on every family."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch

from vitpool import Image, Video

sys.path.insert(0, str(Path(__file__).parent / "unit"))  # family_cases/ lives beside the unit tests

# family -> its case module in tests/unit/family_cases (tiny tower, row shape)
FAMILY_CASES = {
    "qwen2_vl": "family_cases.qwen2_vl",
    "qwen2_5_vl": "family_cases.qwen2_5_vl",
    "qwen3_5": "family_cases.qwen3_5",
    "glm4v": "family_cases.glm4v",
    "kimi_k25": "family_cases.kimi_k25",
    "paddleocr_vl": "family_cases.paddleocr_vl",
}
# families whose vitpool module holds the tower and a projector (saved with its own config)
WITH_PROJECTOR = {"kimi_k25", "paddleocr_vl"}
IMAGES_ONLY = {"paddleocr_vl"}


def case_module(family: str):
    return importlib.import_module(FAMILY_CASES[family])


def row_shape(family: str) -> tuple[int, ...]:
    case = case_module(family)
    return tuple(case.ROW_SHAPE) if hasattr(case, "ROW_SHAPE") else (case.ROW_WIDTH,)


def save_tiny_tower(family: str, directory: Path) -> Path:
    """A tower-only checkpoint (config.json and safetensors) of the family's tiny tower (and
    projector, for a family whose module holds one)."""
    case = case_module(family)
    if family not in WITH_PROJECTOR:
        case.tiny_tower().save_pretrained(directory)
        return directory
    from safetensors.torch import save_file

    module = importlib.import_module(f"vitpool.families.{family}.adapter")
    module.tower_only_config(case.full_config()).save_pretrained(directory)
    state = {key: value.contiguous() for key, value in case.tiny_encoder_module().state_dict().items()}
    save_file(state, str(directory / "model.safetensors"))
    return directory


def mixed_items(family: str, seed: int = 0) -> list:
    """Images of several sizes and (where the family takes video) a video, as the family's
    processor shapes them."""
    shape = row_shape(family)
    generator = torch.Generator().manual_seed(seed)

    def pixels(rows: int) -> torch.Tensor:
        return torch.randn(rows, *shape, generator=generator)

    items = [Image(pixels(16), (1, 4, 4)), Image(pixels(48), (1, 8, 6))]
    if family not in IMAGES_ONLY:
        items.append(Video(pixels(32), (2, 4, 4)))
    return [*items, Image(pixels(4), (1, 2, 2))]


def reference_tokens(
    family: str, module: torch.nn.Module, item, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """Hugging Face's own modules (SDPA) on one item alone, as the model's get_*_features calls them."""
    t, h, w = item.grid_thw
    pixels = torch.as_tensor(item.pixel_values).to(device, dtype)
    with torch.no_grad():
        if family == "kimi_k25":
            grid = torch.tensor([[t, h, w]], device=device)
            return module.mm_projector(module.vision_tower(pixels, grid_thw=grid).pooler_output).squeeze(1)
        if family == "paddleocr_vl":
            grid = torch.tensor([[t, h, w]], device=device)
            return module.projector(module.visual(pixels.unsqueeze(0), grid_thw=grid).last_hidden_state, grid)
        # GLM's tower takes a video as one (1, h, w) row per temporal patch, as get_video_features does
        grid = [[1, h, w]] * t if module.config.model_type.startswith("glm4v") else [[t, h, w]]
        return module(pixels, grid_thw=torch.tensor(grid, device=device)).pooler_output


def use_sdpa(module: torch.nn.Module) -> torch.nn.Module:
    """`module` with Hugging Face's SDPA attention (the adapters install their own)."""
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = "sdpa"
    return module
