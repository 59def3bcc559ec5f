"""Mistral 3's processor output cut into items (`vitpool.items_from`).

`PixtralImageProcessor` (and `PixtralProcessor`, which sets its patch size to the tower's times the
spatial merge) pads every image of a batch with zeros to the batch's largest height and width:
`pixel_values` [B, C, H_max, W_max], with each image's real size in `image_sizes` [B, 2] (height,
width in pixels). An item is one image: its pixels cropped to its size, `pixel_values[i, :, :H,
:W]` (a view), and its `image_sizes` row, as the processor gives them for that image alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vitpool.models.processor_items import IMAGE, ProcessorItem, check_array, int_rows

SIZES_KEY = "image_sizes"


def items(batch: Mapping[str, Any]) -> list[ProcessorItem]:
    """One item per image, in the processor's order: its pixels cropped to its `image_sizes` row.

    Raises:
        ValueError: no `pixel_values` or `image_sizes`, pixels that are not [B, C, H, W], or sizes
            that do not match the images (their count, or a side beyond the padded batch's).
    """
    missing = [key for key in ("pixel_values", SIZES_KEY) if batch.get(key) is None]
    if missing:
        raise ValueError(
            f"the batch has no {' or '.join(missing)}: pass what Mistral 3's processor returned (its "
            f"{SIZES_KEY} give each padded image's real size)"
        )
    pixels, sizes = batch["pixel_values"], int_rows(batch[SIZES_KEY], SIZES_KEY)
    check_array(pixels, "pixel_values")
    shape = tuple(pixels.shape)
    if len(shape) != 4:
        raise ValueError(
            f"pixel_values has shape {shape}; Mistral 3's processor gives padded images [B, C, H, W]"
        )
    if len(sizes) != shape[0]:
        raise ValueError(f"pixel_values holds {shape[0]} images; {SIZES_KEY} has {len(sizes)} rows")
    cut = []
    for index, size in enumerate(sizes):
        if len(size) != 2 or min(size) < 1 or size[0] > shape[2] or size[1] > shape[3]:
            raise ValueError(
                f"{SIZES_KEY} row {index} is {size}; expected (height, width) of at least 1 and at most the "
                f"padded batch's ({shape[2]}, {shape[3]})"
            )
        height, width = size
        cut.append(ProcessorItem(IMAGE, pixels[index, :, :height, :width], (height, width)))
    return cut
