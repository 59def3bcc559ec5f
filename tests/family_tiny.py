"""Tiny random towers of the families vitpool serves, saved as tower-only checkpoints, and items
shaped for them: what the pool and GPU tests that load a checkpoint run on each family.

The families are the registry's (`family_cases.FAMILIES`); these tests take the ones whose case
offers a tower-only checkpoint (`TOWER_FAMILIES`). What a case offers is described in
tests/unit/family_cases/__init__.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from vitpool import Image, Video

sys.path.insert(0, str(Path(__file__).parent / "unit"))  # family_cases/ lives beside the unit tests

from family_cases import RECORD_OF, case_of, families_offering

# Only these: the tests here load a tower-only checkpoint and encode patch rows with a grid
# (`mixed_items`); the other families' cases build full models or tiles (their GPU test:
# test_sampled_items_gpu.py).
TOWER_FAMILIES = families_offering("save_tower")


def case_module(family: str):
    return case_of(family)


def row_shape(family: str) -> tuple[int, ...]:
    case = case_module(family)
    return tuple(case.ROW_SHAPE) if hasattr(case, "ROW_SHAPE") else (case.ROW_WIDTH,)


def takes_video(family: str) -> bool:
    """The family's processor gives videos (its record's processor output has video keys)."""
    output = RECORD_OF[family].processor_output
    return output is not None and bool(output.video_keys)


def save_tiny_tower(family: str, directory: Path) -> Path:
    """A tower-only checkpoint (config.json and safetensors) of the family's tiny tower (and
    projector, for a family whose module holds one)."""
    case = case_module(family)
    if getattr(case, "TOO_OLD", None):  # the installed transformers cannot build this family's tower
        pytest.skip(case.TOO_OLD)
    directory.mkdir(parents=True, exist_ok=True)
    return case.save_tower(directory)


def mixed_items(family: str, seed: int = 0) -> list:
    """Images of several sizes and (where the family takes video) a video, as the family's
    processor shapes them."""
    shape = row_shape(family)
    generator = torch.Generator().manual_seed(seed)

    def pixels(rows: int) -> torch.Tensor:
        return torch.randn(rows, *shape, generator=generator)

    items = [Image(pixels(16), (1, 4, 4)), Image(pixels(48), (1, 8, 6))]
    if takes_video(family):
        items.append(Video(pixels(32), (2, 4, 4)))
    return [*items, Image(pixels(4), (1, 2, 2))]


def default_tower_tokens(
    module: torch.nn.Module, pixels: torch.Tensor, grid_thw: torch.Tensor
) -> torch.Tensor:
    return module(pixels, grid_thw=grid_thw).pooler_output


def reference_tokens(
    family: str, module: torch.nn.Module, item, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """Hugging Face's own modules (SDPA) on one item alone, as the model's get_*_features calls them
    (the case's `tower_tokens`, else the tower's pooler_output)."""
    tower_tokens = getattr(case_module(family), "tower_tokens", default_tower_tokens)
    pixels = torch.as_tensor(item.pixel_values).to(device, dtype)
    grid = torch.tensor([[int(v) for v in item.grid_thw]], device=device)
    with torch.no_grad():
        return tower_tokens(module, pixels, grid)


def use_sdpa(module: torch.nn.Module) -> torch.nn.Module:
    """`module` with Hugging Face's SDPA attention (the adapters install their own)."""
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = "sdpa"
    return module
