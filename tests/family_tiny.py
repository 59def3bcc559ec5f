"""Tiny random towers of every family vitpool serves, saved as tower-only checkpoints, and items
shaped for them: what the pool and GPU tests run on every family."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch

from vitpool import Image, Video

sys.path.insert(0, str(Path(__file__).parent / "unit"))  # family_cases/ lives beside the unit tests

# family -> its case module in tests/unit/family_cases (tiny tower, row width)
FAMILY_CASES = {
    "qwen2_vl": "family_cases.qwen2_vl",
    "qwen2_5_vl": "family_cases.qwen2_5_vl",
    "qwen3_5": "family_cases.qwen3_5",
    "glm4v": "family_cases.glm4v",
}


def case_module(family: str):
    return importlib.import_module(FAMILY_CASES[family])


def save_tiny_tower(family: str, directory: Path) -> Path:
    """A tower-only checkpoint (config.json and safetensors) of the family's tiny tower."""
    case_module(family).tiny_tower().save_pretrained(directory)
    return directory


def mixed_items(family: str, seed: int = 0) -> list:
    """Images of several sizes and a video, as the family's processor shapes them."""
    row_width = case_module(family).ROW_WIDTH
    generator = torch.Generator().manual_seed(seed)

    def pixels(rows: int) -> torch.Tensor:
        return torch.randn(rows, row_width, generator=generator)

    return [
        Image(pixels(16), (1, 4, 4)),
        Image(pixels(48), (1, 8, 6)),
        Video(pixels(32), (2, 4, 4)),
        Image(pixels(4), (1, 2, 2)),
    ]


def reference_tokens(tower: torch.nn.Module, item, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Hugging Face's own tower (SDPA) on one item alone, as the model's get_*_features calls it."""
    t, h, w = item.grid_thw
    # GLM's tower takes a video as one (1, h, w) row per temporal patch, as get_video_features does
    grid = [[1, h, w]] * t if tower.config.model_type.startswith("glm4v") else [[t, h, w]]
    with torch.no_grad():
        pixels = torch.as_tensor(item.pixel_values).to(device, dtype)
        return tower(pixels, grid_thw=torch.tensor(grid, device=device)).pooler_output
