"""Llama 4's processor output cut into items (`vitpool.items_from`).

`Llama4ImageProcessor` stacks every image's tiles into one `pixel_values` [total tiles, 3, S, S]:
an image resized to an h x w canvas of tiles gives its h*w tiles, then, where h*w > 1, a global
tile of the whole image. `aspect_ratios` [images, 2] holds each image's (h, w); an item is one
image's tiles. `Llama4Processor` drops `aspect_ratios` (it is among its unused inputs): named with
`family="llama4"`, its output is cut one item per tile, as the vision model encodes every tile alone
(its class token, positions and pixel shuffle are a tile's) and `get_image_features` returns them
tile by tile; the items' tokens joined are its output.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vitpool.models.processor_items import (
    IMAGE,
    ProcessorItem,
    cut_by_counts,
    int_rows,
    required,
    tile_items,
)

CANVAS_KEY = "aspect_ratios"


def items(batch: Mapping[str, Any]) -> list[ProcessorItem]:
    """One item per image: its tiles of `pixel_values`, as many as its `aspect_ratios` row says;
    without `aspect_ratios` (Llama4Processor's output, `items_from` with the family named), one item
    per tile (`tile_items`).

    Raises:
        ValueError: pixel values that are not tiles, rows that are not (h, w), or tiles they do not
            account for.
    """
    pixels = required(batch, "pixel_values", "")
    if batch.get(CANVAS_KEY) is None:
        return tile_items(pixels, "pixel_values")
    counts = [tiles_of(row, index) for index, row in enumerate(int_rows(batch[CANVAS_KEY], CANVAS_KEY))]
    runs = cut_by_counts(pixels, "pixel_values", counts, "aspect_ratios' tile counts")
    return [ProcessorItem(IMAGE, tiles) for tiles in runs]


def tiles_of(canvas: list[int], index: int) -> int:
    """The tiles of an image on an h x w canvas: h*w, and a global tile where there are several."""
    if len(canvas) != 2 or min(canvas) < 1:
        raise ValueError(f"{CANVAS_KEY} row {index} is {canvas}; expected (h, w) tiles, positive integers")
    height, width = canvas
    return height * width + (1 if height * width > 1 else 0)
