"""InternVL's processor output cut into items (`vitpool.items_from`).

`GotOcr2ImageProcessor(crop_to_patches=True)` stacks every image's tiles (its crops, then a
thumbnail) into one `pixel_values` [total tiles, 3, S, S] and says how many each image has in
`num_patches`; an item is one image's tiles. `InternVLProcessor` drops `num_patches` (and joins
videos' frames into `pixel_values`, in the prompt's order): named with `family="internvl"`, its
output is cut one item per tile (a frame is a tile), as `get_image_features` encodes every tile
alone and returns its tokens tile by tile; the items' tokens joined are its output.

No torch here: slicing works on torch tensors and NumPy arrays alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vitpool.models.processor_items import (
    IMAGE,
    ProcessorItem,
    cut_by_counts,
    required,
    tile_items,
    whole_numbers,
)

TILES_KEY = "num_patches"


def items(batch: Mapping[str, Any]) -> list[ProcessorItem]:
    """One item per image: its `num_patches` consecutive tiles of `pixel_values`; without
    `num_patches` (InternVLProcessor's output, `items_from` with the family named), one item per
    tile (`tile_items`).

    Raises:
        ValueError: pixel values that are not tiles, or counts that do not add up to the tiles.
    """
    pixels = required(batch, "pixel_values", "")
    if batch.get(TILES_KEY) is None:
        return tile_items(pixels, "pixel_values")
    counts = whole_numbers(batch[TILES_KEY], TILES_KEY)
    return [ProcessorItem(IMAGE, tiles) for tiles in cut_by_counts(pixels, "pixel_values", counts, TILES_KEY)]
