"""Checks of the caller's items, done before any work so that an error names the item."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vitpool.errors import InvalidItemError
from vitpool.items import Image, Video
from vitpool.models.protocol import Grid, ItemRules, ItemSize

_NUMPY_FLOATS = (np.float16, np.float32, np.float64)


@dataclass(frozen=True)
class PreparedItem:
    """An item that passed every check: its grid, sizes and pixels as a torch tensor (not copied)."""

    grid: Grid
    size: ItemSize
    pixels: torch.Tensor  # [num_rows, row_width]


def prepare_items(items: Sequence[Any], rules: ItemRules) -> list[PreparedItem]:
    """Check every item against the model's rules (an adapter, or its `item_rules`).

    Raises InvalidItemError naming the first bad item. Non-finite pixels are found later, on the
    device, once the pixels are there (see `nonfinite_items`): scanning them on the host would
    cost as much as a small encode.
    """
    return [prepare_item(index, item, rules) for index, item in enumerate(items)]


def nonfinite_items(checks: list[tuple[Sequence[int], list[PreparedItem], torch.Tensor]]) -> list[int]:
    """checks: (item indices, items, finite flag per row of their concatenated pixels) per batch.

    Returns the indices of the items with a NaN or infinite pixel, ascending. Waits for the device.
    """
    bad = []
    for indices, members, finite_rows in checks:
        flags = finite_rows.cpu()  # the first one waits for the GPU; the rest are ready
        row = 0
        for index, member in zip(indices, members):
            end = row + member.size.num_rows
            if not bool(flags[row:end].all()):
                bad.append(index)
            row = end
    return sorted(bad)


NONFINITE_MESSAGE = "pixel_values contain NaN or infinity (or values too large for the model's dtype)"


def prepare_item(index: int, item: Any, rules: ItemRules) -> PreparedItem:
    """Check one item; `index` is its position in the caller's list, for the error message."""
    if not isinstance(item, (Image, Video)):
        raise InvalidItemError(index, f"expected vitpool.Image or vitpool.Video, got {type(item).__name__}")
    grid = _grid(index, item.grid_thw)
    if isinstance(item, Image) and grid[0] != 1:
        raise InvalidItemError(index, f"an Image has grid t == 1, got grid_thw {grid}; use Video for clips")
    try:
        size = rules.item_size(grid)
    except ValueError as error:
        raise InvalidItemError(index, str(error)) from None
    pixels = _pixels(index, item.pixel_values)
    if pixels.shape[1] != rules.row_width:
        raise InvalidItemError(
            index,
            f"pixel_values have {pixels.shape[1]} features per row; the model takes "
            f"{rules.row_width} (channels * temporal patch * patch * patch)",
        )
    if pixels.shape[0] != size.num_rows:
        raise InvalidItemError(
            index,
            f"pixel_values have {pixels.shape[0]} rows but grid_thw {grid} needs t*h*w = {size.num_rows}",
        )
    return PreparedItem(grid, size, pixels)


def _grid(index: int, grid_thw: Any) -> Grid:
    values = grid_thw.tolist() if isinstance(grid_thw, (torch.Tensor, np.ndarray)) else grid_thw
    # A processor's grid_thw for one item is often [[t, h, w]].
    if isinstance(values, (list, tuple)) and len(values) == 1 and isinstance(values[0], (list, tuple)):
        values = values[0]
    if (
        not isinstance(values, (list, tuple))
        or len(values) != 3
        or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values)
    ):
        raise InvalidItemError(index, f"grid_thw must be three integers (t, h, w); got {grid_thw!r}")
    return (int(values[0]), int(values[1]), int(values[2]))


def _pixels(index: int, pixel_values: Any) -> torch.Tensor:
    if isinstance(pixel_values, np.ndarray):
        if pixel_values.dtype.type not in _NUMPY_FLOATS:
            raise InvalidItemError(
                index, f"pixel_values have dtype {pixel_values.dtype}; expected a floating-point dtype"
            )
        pixel_values = torch.from_numpy(pixel_values)
    elif not isinstance(pixel_values, torch.Tensor):
        raise InvalidItemError(
            index, f"pixel_values must be a torch tensor or NumPy array, got {type(pixel_values).__name__}"
        )
    if not pixel_values.is_floating_point():
        raise InvalidItemError(
            index, f"pixel_values have dtype {pixel_values.dtype}; expected a floating-point dtype"
        )
    if pixel_values.ndim != 2:
        raise InvalidItemError(
            index,
            f"pixel_values must be 2-D [t*h*w, C*T*P*P] (flattened patches); got shape "
            f"{tuple(pixel_values.shape)}",
        )
    return pixel_values
