"""Gemma 4's processor output cut into items (`vitpool.items_from`).

`Gemma4ImageProcessor` (and `Gemma4Processor`) gives every image a fixed block of patch rows:
`pixel_values` [images, max_patches, 3*P*P] and `image_position_ids` [images, max_patches, 2],
each image's real patches first (row-major, at positions (x, y)), then padding rows at (-1, -1).
An item is one image's real patches, `pixel_values[i, :h*w]` (a view), and its grid (1, h, w),
read from those rows' positions. The positions must be exactly the row-major grid the processor
writes: vitpool rebuilds them from the grid (`adapter.py`), so a batch whose rows were reordered
is refused rather than encoded with other positions.

`Gemma4Processor` drops `num_soft_tokens_per_image`; nothing here needs it. No torch here:
slicing and `tolist` work on torch tensors and NumPy arrays alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vitpool.models.processor_items import IMAGE, ProcessorItem, check_array, required

POSITIONS_KEY = "image_position_ids"
PADDING_POSITION = -1


def items(batch: Mapping[str, Any]) -> list[ProcessorItem]:
    """One item per image, in the processor's order: its real patch rows and their grid.

    Raises:
        ValueError: no `pixel_values` or `image_position_ids`, shapes that do not pair up,
            or an image whose positions are not the processor's row-major grid followed by padding.
    """
    pixels = required(batch, "pixel_values", "")
    positions = required(
        batch,
        POSITIONS_KEY,
        "pass what Gemma 4's processor returned (its image_position_ids say which rows are each image's "
        "patches)",
    )
    check_array(pixels, "pixel_values")
    check_array(positions, POSITIONS_KEY)
    pixel_shape, position_shape = tuple(pixels.shape), tuple(positions.shape)
    if len(pixel_shape) != 3:
        raise ValueError(
            f"pixel_values has shape {pixel_shape}; Gemma 4's processor gives each image's patch rows, "
            "[images, max_patches, 3*P*P]"
        )
    if position_shape != (*pixel_shape[:2], 2):
        raise ValueError(
            f"{POSITIONS_KEY} has shape {position_shape}; pixel_values {pixel_shape} needs one (x, y) per "
            f"row, {(*pixel_shape[:2], 2)}"
        )
    cut = []
    for index in range(pixel_shape[0]):
        h, w = image_grid(positions[index].tolist(), index)
        cut.append(ProcessorItem(IMAGE, pixels[index, : h * w], (1, h, w)))
    return cut


def image_grid(rows: list[list[int]], index: int) -> tuple[int, int]:
    """(h, w) of one image from its rows' (x, y) positions: its real rows first, row-major from
    (0, 0), then only padding rows at (-1, -1). ValueError naming the image otherwise."""
    real = [row for row in rows if row != [PADDING_POSITION, PADDING_POSITION]]
    if not real:
        raise ValueError(
            f"{POSITIONS_KEY} of image {index} holds padding rows only; the image has no patches"
        )
    w = max(x for x, _ in real) + 1
    h = max(y for _, y in real) + 1
    expected = [[x, y] for y in range(h) for x in range(w)]
    if rows[: len(real)] != expected or len(real) != h * w:
        raise ValueError(
            f"{POSITIONS_KEY} of image {index} are not the processor's: its real patches must come first, "
            f"row-major over a {h} x {w} grid from (0, 0), then padding rows at (-1, -1)"
        )
    return h, w
