"""Molmo 2's processor output cut into items (`vitpool.items_from`).

`Molmo2ImageProcessor` returns, for a batch of images,

- `pixel_values` [crops, side², P*P*C]: every image's global view and crops, image after image
  (the model also takes them as [images, crops, side², P*P*C], which it flattens the same way);
- `image_token_pooling` [tokens, pool_h * pool_w]: each token's window of patch indices into the
  whole batch's patches (-1: a padding slot);
- `image_grids` [images, 4]: the global view's pooled rows and columns, then the canvas's; an
  image's tokens are rows * cols + rows' * cols';
- `image_num_crops` [images] (which the model does not read: an image's crops are also the last
  one its windows reach).

`Molmo2VideoProcessor` returns `pixel_values_videos` [frames, side², P*P*C], `video_token_pooling`
and `video_grids` [videos, 3] (frames, rows, cols). An item is one image's crops (one video's
frames) and its layout (`rules.py`), which the processor's geometry (tiling, pooling size, overlap
margins) determines: the cutter finds the one whose windows are exactly the item's rows of the
token pooling, so an item encodes as the model pools it, or it is refused with what differs.

No torch here: NumPy reads torch tensors and arrays alike.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from vitpool.families.molmo2.rules import item_windows
from vitpool.models.processor_items import (
    IMAGE,
    VIDEO,
    ProcessorItem,
    check_array,
    int_rows,
    required,
    whole_numbers,
)

HINT = "pass what Molmo2Processor (or its image and video processors) returned, as it is"


def items(batch: Mapping[str, Any]) -> list[ProcessorItem]:
    """One item per image, in the processor's order, then one per video.

    Raises:
        ValueError: a key missing, pixel values of another shape, grids, crop counts or pooling rows
            that do not add up, or windows no geometry of the processor gives (naming the item).
    """
    cut = _cut(batch, IMAGE) if "pixel_values" in batch else []
    return cut + _cut(batch, VIDEO) if "pixel_values_videos" in batch else cut


def _cut(batch: Mapping[str, Any], modality: str) -> list[ProcessorItem]:
    prefix = "image" if modality == IMAGE else "video"
    pixels_key = "pixel_values" if modality == IMAGE else "pixel_values_videos"
    pooling_key, grids_key = f"{prefix}_token_pooling", f"{prefix}_grids"
    pixels = _crops(required(batch, pixels_key, ""), pixels_key)
    side = math.isqrt(pixels.shape[1])
    if side * side != pixels.shape[1]:
        raise ValueError(f"{pixels_key} has {pixels.shape[1]} patches a crop; a crop is side x side patches")
    pooling = np.asarray(required(batch, pooling_key, HINT))
    if pooling.ndim != 2 or pooling.dtype.kind not in "iu":
        raise ValueError(
            f"{pooling_key} must be integer rows [tokens, slots]; got {pooling.dtype} {pooling.shape}"
        )
    width = 4 if modality == IMAGE else 3
    grids = int_rows(required(batch, grids_key, HINT), grids_key)
    for index, grid in enumerate(grids):
        if len(grid) != width or min(grid) < 1:
            raise ValueError(f"{grids_key} row {index} is {grid}; expected {width} positive integers")
    counts = [g[0] * g[1] + g[2] * g[3] if modality == IMAGE else g[0] * g[1] * g[2] for g in grids]
    if sum(counts) != len(pooling):
        raise ValueError(
            f"{pooling_key} has {len(pooling)} rows; {grids_key} accounts for {sum(counts)} {counts}"
        )
    rows = list(_split(pooling, counts))
    crops = [grid[0] for grid in grids] if modality == VIDEO else _image_crops(batch, rows, side, len(pixels))
    if sum(crops) != len(pixels):
        raise ValueError(
            f"{pixels_key} has {len(pixels)} crops; the {prefix}s account for {sum(crops)} {crops}"
        )
    cut, start = [], 0
    for index, (grid, windows, count) in enumerate(zip(grids, rows, crops)):
        local = np.where(windows >= 0, windows - start * side * side, -1)
        layout = find_layout(modality, side, count, grid, local)
        if layout is None:
            raise ValueError(
                f"{prefix} {index}: its {pooling_key} rows are not the windows Molmo 2's processor gives any "
                f"geometry of {count} crops and grid {grid}; {HINT}"
            )
        cut.append(ProcessorItem(modality, pixels[start : start + count], layout))
        start += count
    return cut


def _crops(pixels: Any, key: str) -> Any:
    check_array(pixels, key)
    if len(pixels.shape) == 4:  # [images, crops, patches, width]: the model flattens it so too
        pixels = pixels.reshape(-1, *pixels.shape[2:])
    if len(pixels.shape) != 3:
        raise ValueError(
            f"{key} has shape {tuple(pixels.shape)}; Molmo 2's processors give [crops, patches, width]"
        )
    return pixels


def _split(values: np.ndarray, counts: list[int]) -> Iterator[np.ndarray]:
    start = 0
    for count in counts:
        yield values[start : start + count]
        start += count


def _image_crops(batch: Mapping[str, Any], rows: list[np.ndarray], side: int, total: int) -> list[int]:
    """Each image's crops: `image_num_crops` where the batch has it, else up to the last crop its
    windows reach (an image's bottom-right patch is always in a window)."""
    if batch.get("image_num_crops") is not None:
        crops = whole_numbers(batch["image_num_crops"], "image_num_crops")
        if len(crops) != len(rows):
            raise ValueError(f"image_num_crops has {len(crops)} counts for {len(rows)} images")
        return crops
    crops, start = [], 0
    for windows in rows:
        last = int(windows.max()) if windows.size else -1
        crops.append(max(0, last // (side * side) + 1 - start))
        start += crops[-1]
    return crops


def find_layout(
    modality: str, side: int, num_crops: int, grid: list[int], windows: np.ndarray
) -> tuple[int, ...] | None:
    """The layout (`rules.py`) whose windows are `windows` (the item's own rows of the token pooling,
    indices from its first crop), among those that give this grid; None where none does."""
    slots = windows.shape[1]
    rows, cols = grid[:2] if modality == IMAGE else grid[1:]
    pools = [
        (pool_h, slots // pool_h)
        for pool_h in range(1, slots + 1)
        if slots % pool_h == 0 and -(-side // pool_h) == rows and -(-side // (slots // pool_h)) == cols
    ]
    for layout in _candidates(modality, side, num_crops, grid, pools):
        expected = item_windows(side, modality, num_crops, layout)
        if expected.shape == windows.shape and np.array_equal(expected, windows):
            return layout
    return None


def _candidates(
    modality: str, side: int, num_crops: int, grid: list[int], pools: list[tuple[int, int]]
) -> Iterator[tuple[int, ...]]:
    if modality == VIDEO:
        yield from pools
        return
    canvas_rows, canvas_cols = grid[2:]
    tilings = [(h, (num_crops - 1) // h) for h in range(1, num_crops) if (num_crops - 1) % h == 0]
    for pool_h, pool_w in pools:
        for tiling_h, tiling_w in tilings:
            if tiling_h == tiling_w == 1:  # one crop: no neighbour overlaps it, the margins change nothing
                yield (1, 1, pool_h, pool_w, 0, 0)
                continue
            for margins in range(side):  # left + right, where the canvas gives the grid
                height = tiling_h * (side - margins) + margins
                width = tiling_w * (side - margins) + margins
                if -(-height // pool_h) == canvas_rows and -(-width // pool_w) == canvas_cols:
                    for left in range(margins + 1):
                        yield (tiling_h, tiling_w, pool_h, pool_w, left, margins - left)
